// Probe kernels of the emulation's own tests (tests/cuda/test_intrinsics_emulated.py): they pin
// down the semantics of the emulated intrinsics, so that a wrong emulation fails a test instead
// of hiding a kernel bug. Emulation only; never compiled by NVRTC.
#pragma once
#include "common.cuh"

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

}  // namespace folio_probe
