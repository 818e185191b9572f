// Shared pieces of folio's kernels: storage types, float conversions, warp reductions.
//
// No CUDA headers are included on purpose: NVRTC from pip has no include path, and the CPU
// emulation (cuda/emulation/cuda_emu.h, compiled with FOLIO_EMULATION) supplies its own versions
// of the few conversion functions below. The 16-bit types are plain bit containers with the same
// size and alignment as torch's float16/bfloat16, so raw torch pointers can be cast to them.
#pragma once

namespace folio {

struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };
// e4m3 ("fn": no infinities, 0x7f/0xff are NaN, largest finite 448), the storage of an fp8 KV
// pool; same size and bit layout as torch's float8_e4m3fn and CUDA's __nv_fp8_e4m3.
struct fp8e4m3 { unsigned char bits; };

constexpr int WARP_SIZE = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;

#ifndef FOLIO_EMULATION
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(f16 x) {
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x.bits));
  return r;
}
__device__ __forceinline__ float to_float(bf16 x) {
  // bf16 is the top half of an fp32: widening is a shift, no rounding involved.
  return __uint_as_float(((unsigned)x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ f16 from_float<f16>(float x) {
  f16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) {
  bf16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));  // sm_80+, round to nearest even
  return r;
}

// cp.async (sm_80+): 16 bytes from global to shared memory without passing through registers.
// The copy is asynchronous: the data is there only after cp_async_wait<N>() has retired its
// group (and a __syncthreads() makes it visible to the other threads). src_bytes < 16 reads that
// many bytes and zero-fills the rest (0: no read at all, the 16 bytes become zeros). .cg caches
// in L2 only: K/V are streamed once per CTA.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
}
// Closes the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
#else
FOLIO_EMU_CONVERSIONS  // host versions, from cuda/emulation/cuda_emu.h
FOLIO_EMU_CP_ASYNC
#endif

// e4m3 <-> fp32 in plain integer and float arithmetic, the same code on every architecture and in
// the emulation (sm_80 has no fp8 conversion instruction). Widening is exact. Narrowing rounds to
// nearest even and saturates to +-448 (CUDA's __NV_SATFINITE); NaN stays NaN. Bit for bit the
// same as torch's x.clamp(-448, 448).to(torch.float8_e4m3fn) (tests/cuda/test_fp8_emulated.py).
__device__ __forceinline__ float to_float(fp8e4m3 x) {
  const unsigned b = x.bits, mag = b & 0x7fu;
  const unsigned sign = (b & 0x80u) << 24;
  if (mag == 0x7fu) return __uint_as_float(sign | 0x7fc00000u);
  // subnormals (exponent field 0): m * 2^-9, exactly; normals: rebias the exponent (7 -> 127)
  const float f = mag < 8u ? (float)mag * 0.001953125f : __uint_as_float((mag << 20) + (120u << 23));
  return __uint_as_float(__float_as_uint(f) | sign);
}

__device__ __forceinline__ fp8e4m3 fp8_from_float(float x) {
  const unsigned u = __float_as_uint(x);
  const unsigned sign = (u >> 24) & 0x80u, mag = u & 0x7fffffffu;
  unsigned char r;
  if (mag > 0x7f800000u) {
    r = 0x7fu;  // NaN
  } else if (mag >= 0x43e00000u) {
    r = 0x7eu;  // |x| >= 448 (and infinity): saturate
  } else if (mag >= 0x3c800000u) {
    // normal (|x| >= 2^-6): keep 3 mantissa bits, rounding to nearest even, then rebias
    r = (unsigned char)(((mag + 0x7ffffu + ((mag >> 20) & 1u)) >> 20) - (120u << 3));
  } else {
    // subnormal: adding 2^14 leaves |x| rounded (nearest even, the FP add's rounding) to a
    // multiple of 2^-9 in the low mantissa bits
    r = (unsigned char)(__float_as_uint(__uint_as_float(mag) + 16384.0f) - 0x46800000u);
  }
  return fp8e4m3{(unsigned char)(r | sign)};
}

// A new K/V element as the pool stores it (write_kv, rope_write_kv): unchanged in a pool of the
// activations' type; in an fp8 pool, less its channel's shift (K; none for V: shift null), divided
// by its channel's scale (i: the element's index in [num_kv_heads, head_dim]) and narrowed:
// (x - shift) / scale in fp32, as kv_quant.quantize computes it.
template <typename T>
__device__ __forceinline__ T to_cache(T x, const float*, const float*, int, T*) { return x; }
template <typename T>
__device__ __forceinline__ fp8e4m3 to_cache(T x, const float* scale, const float* shift, int i, fp8e4m3*) {
  const float f = shift != nullptr ? to_float(x) - shift[i] : to_float(x);
  return fp8_from_float(f / scale[i]);
}

// One 16-byte vector of T. Reading through an aggregate of T (not a word type reinterpreted as T)
// keeps the access legal under C++ aliasing rules, which g++ -O2 enforces in the emulation.
template <typename T>
struct alignas(16) vec16 { T e[16 / sizeof(T)]; };
// N elements of T (N * sizeof(T) = 4, 8 or 16 bytes), read as one aligned vector.
template <typename T, int N>
struct alignas(N * sizeof(T)) vecn { T e[N]; };

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Attention logit soft-capping (Gemma 2): cap * tanh(s / cap), with inv_cap = 1 / cap computed
// on the host (clamped to the largest float, so a tiny cap never makes 0 * inf). cap = 0: off.
// Scores of +-inf (or beyond cap * 2^127) become +-cap, as the reference's division and tanh give.
__device__ __forceinline__ float soft_cap(float s, float cap, float inv_cap) {
  return cap > 0.f ? cap * tanhf(s * inv_cap) : s;
}

// The keys a CTA of attention rows (rows row0 .. row0 + num_rows - 1, `group` rows per key
// position, the sequence's new tokens starting at ctx_len) may need: from its first row's window
// start (0 without a window) to the causal limit of its last row, clipped to partition `part`.
// partition_size > 0: partitions of that many keys from `first` rounded down to a multiple of it
// (fixed positions, whatever the CTA's rows: batch-invariant plans); 0: one partition, the CTA's
// own keys. Keys before `first` are never read (zero-filled or skipped).
struct KeySpan {
  int first, begin, end;  // the first key any row attends; the partition's keys [begin, end)
};

__device__ __forceinline__ KeySpan cta_key_span(int seq_len, int ctx_len, int row0, int num_rows, int group,
                                                int window, int partition_size, int part) {
  const int kv_first = window > 0 ? max(0, ctx_len + row0 / group - window + 1) : 0;
  const int kv_begin = partition_size > 0 ? kv_first - kv_first % partition_size : kv_first;
  const int kv_end = min(seq_len, ctx_len + (row0 + num_rows - 1) / group + 1);
  const int span = partition_size > 0 ? partition_size : kv_end - kv_begin;
  const int part_begin = kv_begin + part * span;
  return {kv_first, part_begin, min(kv_end, part_begin + span)};
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, mask));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2) v += __shfl_xor_sync(FULL_MASK, v, mask);
  return v;
}

}  // namespace folio
