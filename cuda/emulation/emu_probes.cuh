// Probe kernels of the emulation's own tests (tests/cuda/test_intrinsics_emulated.py): they pin
// down the semantics of the emulated intrinsics, so that a wrong emulation fails a test instead
// of hiding a kernel bug. Emulation only; never compiled by NVRTC.
#pragma once
#include "mma.cuh"

namespace folio_probe {

// cp.async: nothing lands before its group is waited for; wait<N> leaves the N newest groups in
// flight; a short source zero-fills the rest of the 16 bytes; an uncommitted copy is not waited
// for. out gets 5 snapshots of 4 ints.
__global__ void cp_async_probe(int* out, const int* src) {
  alignas(16) __shared__ int buf[3][4];
  if (threadIdx.x != 0) return;
  for (int k = 0; k < 3; ++k)
    for (int i = 0; i < 4; ++i) buf[k][i] = -1;
  folio::cp_async16(buf[0], src, 16);
  folio::cp_async_commit();  // group A
  folio::cp_async16(buf[1], src + 4, 8);
  folio::cp_async_commit();  // group B: 8 bytes read, 8 zero-filled
  folio::cp_async16(buf[2], src + 8, 0);  // not committed yet
  for (int i = 0; i < 4; ++i) out[i] = buf[0][i];
  folio::cp_async_wait<1>();  // A has landed; B may still be in flight
  for (int i = 0; i < 4; ++i) out[4 + i] = buf[0][i];
  for (int i = 0; i < 4; ++i) out[8 + i] = buf[1][i];
  folio::cp_async_wait<0>();  // B too; the uncommitted copy is in no group
  for (int i = 0; i < 4; ++i) out[12 + i] = buf[1][i] + 100 * buf[2][i];
  folio::cp_async_commit();
  folio::cp_async_wait<0>();
  for (int i = 0; i < 4; ++i) out[16 + i] = buf[2][i];
}

// ldmatrix .x4 and .x4.trans: mats holds four 8x8 b16 matrices, row-major; lane l addresses row
// l % 8 of matrix l / 8. out[l][0..3] = the plain registers, out[l][4..7] = the transposed ones.
__global__ void ldmatrix_probe(unsigned* out, const unsigned short* mats) {
  alignas(16) __shared__ unsigned short buf[32][8];
  const int lane = threadIdx.x;
  for (int c = 0; c < 8; ++c) buf[lane][c] = mats[lane * 8 + c];
  __syncthreads();
  unsigned r[4], rt[4];
  folio::ldmatrix_x4(r, buf[lane]);
  folio::ldmatrix_x4_trans(rt, buf[lane]);
  for (int i = 0; i < 4; ++i) {
    out[lane * 8 + i] = r[i];
    out[lane * 8 + 4 + i] = rt[i];
  }
}

// mma.sync m16n8k16: lane l hands in the fragments a[l][0..3], b[l][0..1] and accumulators
// c[l][0..3] as given, and writes back its d[l][0..3].
template <typename T>
__global__ void mma_probe(float* d, const unsigned* a, const unsigned* b, const float* c) {
  const int lane = threadIdx.x;
  const unsigned fa[4] = {a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3]};
  const unsigned fb[2] = {b[2 * lane], b[2 * lane + 1]};
  float acc[4] = {c[4 * lane], c[4 * lane + 1], c[4 * lane + 2], c[4 * lane + 3]};
  folio::mma_16816<T>(acc, fa, fb);
  for (int e = 0; e < 4; ++e) d[4 * lane + e] = acc[e];
}

// The fp8 (e4m3) conversions of common.cuh: out[i] = the e4m3 bits of in[i]; widened[b] = byte b
// widened to fp32, for the 256 bytes. n[0] = number of inputs.
__global__ void fp8_probe(unsigned char* out, float* widened, const float* in, const int* n) {
  for (int i = threadIdx.x; i < n[0]; i += blockDim.x) out[i] = folio::fp8_from_float(in[i]).bits;
  for (int b = threadIdx.x; b < 256; b += blockDim.x) widened[b] = folio::to_float(folio::fp8e4m3{(unsigned char)b});
}

}  // namespace folio_probe
