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
#else
FOLIO_EMU_CONVERSIONS  // host versions, from cuda/emulation/cuda_emu.h
#endif

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
