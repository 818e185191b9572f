// Tensor-core pieces for 16-bit types (sm_80+), as inline PTX: ldmatrix (8x8 b16 tiles from
// shared memory into the fragment layout) and mma.sync m16n8k16 with fp32 accumulation.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16" and "ldmatrix"), with
// g = lane / 4 and t = lane % 4; a register holds two 16-bit elements, the lower column (or
// row, for B) in its low half:
//   A (16x16, row-major):  a0 = A[g][2t..2t+1],   a1 = A[g+8][2t..],  a2 = A[g][2t+8..],  a3 = A[g+8][2t+8..]
//   B (16x8, "col"):       b0 = B[2t..2t+1][g],   b1 = B[2t+8..2t+9][g]
//   C/D (16x8, fp32):      c0, c1 = C[g][2t], C[g][2t+1];  c2, c3 = C[g+8][2t], C[g+8][2t+1]
//   ldmatrix .x4: lanes 8i..8i+7 give the row addresses (16 bytes each) of matrix i; register i
//   of a lane = M_i[g][2t..2t+1]; with .trans, M_i[2t][g] (low half) and M_i[2t+1][g].
// The CPU emulation (cuda/emulation/cuda_emu.h) implements exactly these tables.
#pragma once
#include "common.cuh"

namespace folio {

// Two floats as one register of T pairs (lo in the low half), rounded as cvt.rn does.
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  return (unsigned)from_float<T>(lo).bits | ((unsigned)from_float<T>(hi).bits << 16);
}

#ifndef FOLIO_EMULATION
// ldmatrix reads shared memory that plain stores and cp.async wrote: the "memory" clobber keeps
// the compiler from moving it across them (the barrier in between orders the threads).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

// d += A * B for one 16x8x16 tile (fp32 accumulators).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]);

template <>
__device__ __forceinline__ void mma_16816<bf16>(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16816<f16>(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#else
inline void ldmatrix_x4(unsigned (&r)[4], const void* row) { ::emu::ldmatrix_x4(r, row, false); }
inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) { ::emu::ldmatrix_x4(r, row, true); }
template <typename T>
inline void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  ::emu::mma_16816(d, a, b, [](unsigned short bits) { return to_float(T{bits}); });
}
#endif

}  // namespace folio
