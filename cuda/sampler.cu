// The sampler's uniforms on the GPU: Philox4x32-10 keyed by (seed, output position, draw index),
// bit for bit what the CPU sampler kernel (folio/core/executor/kernels/csrc/sampler.c) and the torch
// reference (folio/core/executor/sampling/philox.py) compute. See cuda/LAYOUT.md.
//
// Plain integer arithmetic only (no intrinsics, no CUDA headers): the same code runs in the CPU
// emulation of tests/cuda.
#include "common.cuh"

namespace folio {

constexpr int PHILOX_THREADS = 128;

// Philox4x32-10 (Random123's constants) of counter (c0, c1, c2, c3) under key (k0, k1)
__device__ __forceinline__ void philox4x32_10(unsigned& c0, unsigned& c1, unsigned& c2, unsigned& c3, unsigned k0,
                                              unsigned k1) {
#pragma unroll
  for (int round = 0; round < 10; round++) {
    if (round) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const unsigned long long p0 = 0xD2511F53ull * c0, p1 = 0xCD9E8D57ull * c2;
    const unsigned n0 = (unsigned)(p1 >> 32) ^ c1 ^ k0, n2 = (unsigned)(p0 >> 32) ^ c3 ^ k1;
    c1 = (unsigned)p1;
    c3 = (unsigned)p0;
    c0 = n0;
    c2 = n2;
  }
}

// out[i * count + d] = the uniform in (0, 1] of draw first + d of row i: counter (draw, position
// low, position high, 0), key (seed low, seed high); ((x0 << 21 | x1 >> 11) + 1) * 2^-53.
// One thread per (row, draw), in a 1-D grid.
__global__ void __launch_bounds__(PHILOX_THREADS) philox_uniforms(
    const unsigned long long* __restrict__ seeds,  // [n] the rows' 64-bit keys
    const long long* __restrict__ positions,       // [n] the rows' output positions
    double* __restrict__ out,                      // [n, count]
    long long n, int first, int count) {
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n * count) return;
  const long long i = t / count;
  const int d = (int)(t % count);
  const unsigned long long seed = seeds[i], position = (unsigned long long)positions[i];
  unsigned c0 = (unsigned)(first + d), c1 = (unsigned)position, c2 = (unsigned)(position >> 32), c3 = 0u;
  philox4x32_10(c0, c1, c2, c3, (unsigned)seed, (unsigned)(seed >> 32));
  const unsigned long long bits = ((unsigned long long)c0 << 21) | (c1 >> 11);
  out[t] = (double)(bits + 1ull) * (1.0 / 9007199254740992.0);
}

}  // namespace folio
