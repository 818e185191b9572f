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

// One 16-byte vector of T. Reading through an aggregate of T (not a word type reinterpreted as T)
// keeps the access legal under C++ aliasing rules, which g++ -O2 enforces in the emulation.
template <typename T>
struct alignas(16) vec16 { T e[16 / sizeof(T)]; };

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

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
