// Batch-invariant dense GEMM on tensor cores (f16/bf16): y[M, N] = x[M, K] @ w[N, K]^T, the
// projections and the LM head of --batch-invariant on a GPU. See cuda/LAYOUT.md.
//
// One fixed tile shape and one K order for every M: a CTA takes GEMM_TILE_M rows of x and
// GEMM_TILE_N rows of w (output columns), and walks K from 0 to K in steps of GEMM_TILE_K (2 stages
// of 16-byte cp.async, zero-filled past M, N and K), each step two mma.sync m16n8k16 per 8 output
// columns, accumulating in fp32; no split-K. An output element is thus the same sequence of mma
// steps over the same operands whatever M is, which row of its tile it sits in, or which CTA holds
// it (cuBLAS picks tiles and split-K by shape, so its rows change with the batch). Each of the 4
// warps owns 16 rows and the 64 columns. Requirements (checked by kernels/gemm_kernels.py):
// K % 8 == 0, x and w contiguous and 16-byte aligned.
#include "mma.cuh"

namespace folio {

constexpr int DGEMM_THREADS = 128;
constexpr int DGEMM_TILE_M = 64;  // rows of x per CTA: 16 per warp
constexpr int DGEMM_TILE_N = 64;  // output columns per CTA
constexpr int DGEMM_TILE_K = 32;  // k per stage
constexpr int DGEMM_STAGES = 2;
constexpr int DGEMM_STRIDE = DGEMM_TILE_K + 8;  // shared row stride: 16 bytes of padding (ldmatrix banks)
constexpr int DGEMM_CHUNKS = DGEMM_TILE_K / 8;  // 16-byte vectors per tile row

// Rows [row0, row0 + 64) x k [k0, k0 + 32) of a row-major [rows, K] matrix into a [64][STRIDE]
// tile; rows past `rows` and k past K are zero-filled (no read).
template <typename T>
__device__ __forceinline__ void dgemm_load_tile(T* dst, const T* __restrict__ src, int row0, int rows, int k0, int K) {
  for (int c = threadIdx.x; c < DGEMM_TILE_M * DGEMM_CHUNKS; c += DGEMM_THREADS) {
    const int r = c / DGEMM_CHUNKS, col = (c % DGEMM_CHUNKS) * 8;
    const bool valid = row0 + r < rows && k0 + col < K;
    const T* from = valid ? src + (long long)(row0 + r) * K + k0 + col : src;
    cp_async16(dst + r * DGEMM_STRIDE + col, from, valid ? 16 : 0);
  }
}

// Grid (ceil(M / 64), ceil(N / 64)): row tiles along x (they grow with the batch), block 128.
template <typename T>
__global__ void __launch_bounds__(DGEMM_THREADS) dense_gemm(
    T* __restrict__ y,        // [M, N]
    const T* __restrict__ x,  // [M, K]
    const T* __restrict__ w,  // [N, K]
    int M, int N, int K) {
  alignas(16) __shared__ T x_s[DGEMM_STAGES][DGEMM_TILE_M * DGEMM_STRIDE];
  alignas(16) __shared__ T w_s[DGEMM_STAGES][DGEMM_TILE_N * DGEMM_STRIDE];
  const int m0 = blockIdx.x * DGEMM_TILE_M, n0 = blockIdx.y * DGEMM_TILE_N;
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int g = lane / 4, t = lane % 4, mat = lane / 8;

  float acc[DGEMM_TILE_N / 8][4];
#pragma unroll
  for (int j = 0; j < DGEMM_TILE_N / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  const int num_k = (K + DGEMM_TILE_K - 1) / DGEMM_TILE_K;
  dgemm_load_tile<T>(x_s[0], x, m0, M, 0, K);
  dgemm_load_tile<T>(w_s[0], w, n0, N, 0, K);
  cp_async_commit();
  for (int kt = 0; kt < num_k; ++kt) {
    if (kt + 1 < num_k) {
      dgemm_load_tile<T>(x_s[(kt + 1) % DGEMM_STAGES], x, m0, M, (kt + 1) * DGEMM_TILE_K, K);
      dgemm_load_tile<T>(w_s[(kt + 1) % DGEMM_STAGES], w, n0, N, (kt + 1) * DGEMM_TILE_K, K);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this thread's copies of stage kt have landed
    __syncthreads();     // and everyone else's
    const T* xs = x_s[kt % DGEMM_STAGES];
    const T* ws = w_s[kt % DGEMM_STAGES];
#pragma unroll
    for (int ks = 0; ks < DGEMM_TILE_K / 16; ++ks) {
      unsigned a[4];  // rows warp*16.. of x, k 16ks..16ks+15 (matrices: rows +0/+8, k +0/+8)
      ldmatrix_x4(a, xs + (warp * 16 + (mat % 2) * 8 + lane % 8) * DGEMM_STRIDE + ks * 16 + (mat / 2) * 8);
#pragma unroll
      for (int nb = 0; nb < DGEMM_TILE_N / 16; ++nb) {  // columns 16nb..16nb+15: (cols +0/+8) x (k +0/+8)
        unsigned b[4];
        ldmatrix_x4(b, ws + (nb * 16 + (mat / 2) * 8 + lane % 8) * DGEMM_STRIDE + ks * 16 + (mat % 2) * 8);
        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_16816<T>(acc[2 * nb], a, b0);
        mma_16816<T>(acc[2 * nb + 1], a, b1);
      }
    }
    __syncthreads();  // everyone is done with this stage before the next load overwrites it
  }
  cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = m0 + warp * 16 + g + 8 * h;
    if (m >= M) continue;
#pragma unroll
    for (int j = 0; j < DGEMM_TILE_N / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int n = n0 + 8 * j + 2 * t + e;
        if (n < N) y[(long long)m * N + n] = from_float<T>(acc[j][2 * h + e]);
      }
    }
  }
}

}  // namespace folio
