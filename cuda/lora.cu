// Multi-LoRA deltas, Punica's two operators (BGMV for decode rows, SGMV for prefill segments):
//   y[t] += scale[slot] * (x[t] A[slot]^T) B[slot]^T
// with A = lora_a[slot] [r_max, in] and B = lora_b[slot] [out, r_max] (ranks zero-padded to r_max),
// slot -1 = no adapter (the row is left alone). fp32 accumulation, fp32 intermediate; y is read,
// added to in fp32 and rounded to T once. See cuda/LAYOUT.md ("Multi-LoRA") for the arguments.
//
// Each operator is two launches, shrink then expand, with no host synchronisation (the grids are
// sized from shapes the host knows; which rows a CTA takes is read on the device):
//   bgmv_shrink   per (row, 4 rank rows): one warp per rank row, a 16-byte-vector dot product of
//                 x[t] and A[slot, r] (the adapter gathered per row through indices[t]);
//   sgmv_shrink   per (work item, k split): a work item is up to LORA_BM rows of one segment; the
//                 segment's A[slot] k-tile is loaded into shared memory once for all its rows;
//                 each k split writes its own fp32 partial (no atomics: deterministic);
//   lora_expand   per (work item, 128 output columns): the item's fp32 intermediate (the k splits
//                 summed in order) in shared memory, each thread one column: B[slot, c] read once
//                 for all the item's rows (LORA_BM for segments, 1 for BGMV rows).
#include "common.cuh"

namespace folio {

constexpr int LORA_MAX_RANK = 128;
constexpr int LORA_BM = 16;             // rows per SGMV work item
constexpr int LORA_BK = 32;             // k per shared-memory tile of sgmv_shrink
constexpr int BGMV_SHRINK_THREADS = 128;  // 4 warps: 4 rank rows of one token per CTA
constexpr int SGMV_SHRINK_THREADS = 256;
constexpr int EXPAND_THREADS = 128;     // one output column each

// The SGMV work item `item`: the segments with an adapter (slot >= 0), in order, each cut into
// ceil(len / LORA_BM) items. Every thread of a CTA runs this (same addresses: broadcast reads);
// the number of segments is the step's number of prefill chunks. False past the last item.
__device__ __forceinline__ bool lora_find_item(const long long* __restrict__ seg_starts,
                                               const long long* __restrict__ seg_slots, int num_segs, int item,
                                               int& row0, int& rows, int& slot) {
  int before = 0;
  for (int s = 0; s < num_segs; ++s) {
    const long long b = seg_starts[s], e = seg_starts[s + 1];
    const long long sl = seg_slots[s];
    const int count = (sl >= 0 && e > b) ? (int)((e - b + LORA_BM - 1) / LORA_BM) : 0;
    if (item < before + count) {
      row0 = (int)(b + (long long)(item - before) * LORA_BM);
      rows = (int)min((long long)LORA_BM, e - row0);
      slot = (int)sl;
      return true;
    }
    before += count;
  }
  return false;
}

// part[t, r] = x[t] . A[indices[t], r] (fp32) for the rank rows r of this CTA; rows with
// indices[t] < 0 are skipped (part keeps whatever it held: the expand skips them too).
// Grid (n, ceil(r_max / 4)), block BGMV_SHRINK_THREADS. in % (16 / sizeof(T)) == 0, x's rows and
// A 16-byte aligned (checked by the launcher).
template <typename T>
__global__ void __launch_bounds__(BGMV_SHRINK_THREADS) bgmv_shrink(
    float* __restrict__ part,                // [n, r_max]
    const T* __restrict__ x,                 // [n, in], row stride x_stride
    const T* __restrict__ lora_a,            // [slots, r_max, in]
    const long long* __restrict__ indices,   // [n]
    int in, int r_max, long long x_stride) {
  constexpr int VEC = 16 / sizeof(T);
  const long long t = blockIdx.x;
  const long long slot = indices[t];
  const int lane = threadIdx.x % WARP_SIZE;
  const int r = blockIdx.y * (BGMV_SHRINK_THREADS / WARP_SIZE) + threadIdx.x / WARP_SIZE;
  if (slot < 0 || r >= r_max) return;  // whole warps leave (no block barrier follows)
  const T* xr = x + t * x_stride;
  const T* ar = lora_a + (slot * r_max + r) * in;
  float acc = 0.f;
  for (int k = lane * VEC; k < in; k += WARP_SIZE * VEC) {
    const vec16<T> xv = *reinterpret_cast<const vec16<T>*>(xr + k);
    const vec16<T> av = *reinterpret_cast<const vec16<T>*>(ar + k);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc = fmaf(to_float(xv.e[i]), to_float(av.e[i]), acc);
  }
  acc = warp_sum(acc);
  if (lane == 0) part[t * r_max + r] = acc;
}

// part[split, row, r] = sum over k of this split of x[row, k] A[slot, r, k], for the rows of one
// work item (one segment's slot). A's k-tile [r_max, LORA_BK] and x's [LORA_BM, LORA_BK] are
// staged in shared memory as fp32 (rows padded by one float: no bank conflicts), so each A
// element is read from global memory once per item. Thread e owns outputs e + 256 j
// (row (e + 256 j) / r_max, rank (e + 256 j) % r_max).
// Grid (max_items, splits), block SGMV_SHRINK_THREADS; k_per_split a multiple of LORA_BK.
template <typename T>
__global__ void __launch_bounds__(SGMV_SHRINK_THREADS) sgmv_shrink(
    float* __restrict__ part,                 // [splits, n, r_max]
    const T* __restrict__ x,                  // [n, in], row stride x_stride
    const T* __restrict__ lora_a,             // [slots, r_max, in]
    const long long* __restrict__ seg_starts, // [num_segs + 1]
    const long long* __restrict__ seg_slots,  // [num_segs]
    int num_segs, int n, int in, int r_max, int k_per_split, long long x_stride) {
  constexpr int OUT_PER_THREAD = LORA_BM * LORA_MAX_RANK / SGMV_SHRINK_THREADS;
  constexpr int STRIDE = LORA_BK + 1;
  __shared__ float xs[LORA_BM * STRIDE];
  __shared__ float as[LORA_MAX_RANK * STRIDE];
  int row0, rows, slot;
  if (!lora_find_item(seg_starts, seg_slots, num_segs, blockIdx.x, row0, rows, slot)) return;  // block-uniform
  const int k_begin = blockIdx.y * k_per_split;
  const int k_end = min(in, k_begin + k_per_split);
  const int tid = threadIdx.x;
  const int outputs = LORA_BM * r_max;
  const T* a_slot = lora_a + (long long)slot * r_max * in;

  float acc[OUT_PER_THREAD];
#pragma unroll
  for (int j = 0; j < OUT_PER_THREAD; ++j) acc[j] = 0.f;

  for (int k0 = k_begin; k0 < k_end; k0 += LORA_BK) {
    for (int e = tid; e < LORA_BM * LORA_BK; e += SGMV_SHRINK_THREADS) {
      const int i = e / LORA_BK, k = e % LORA_BK;
      xs[i * STRIDE + k] = (i < rows && k0 + k < k_end) ? to_float(x[(row0 + i) * x_stride + k0 + k]) : 0.f;
    }
    for (int e = tid; e < r_max * LORA_BK; e += SGMV_SHRINK_THREADS) {
      const int r = e / LORA_BK, k = e % LORA_BK;
      as[r * STRIDE + k] = k0 + k < k_end ? to_float(a_slot[(long long)r * in + k0 + k]) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < OUT_PER_THREAD; ++j) {
      const int e = tid + j * SGMV_SHRINK_THREADS;
      if (j * SGMV_SHRINK_THREADS < outputs && e < outputs) {
        const float* xrow = xs + (e / r_max) * STRIDE;
        const float* arow = as + (e % r_max) * STRIDE;
        float s = acc[j];
#pragma unroll 8
        for (int kk = 0; kk < LORA_BK; ++kk) s = fmaf(xrow[kk], arow[kk], s);
        acc[j] = s;
      }
    }
    __syncthreads();  // the tiles are rewritten by the next k step
  }
#pragma unroll
  for (int j = 0; j < OUT_PER_THREAD; ++j) {
    const int e = tid + j * SGMV_SHRINK_THREADS;
    if (e < outputs && e / r_max < rows)
      part[((long long)blockIdx.y * n + row0 + e / r_max) * r_max + e % r_max] = acc[j];
  }
}

// y[row, c] = T(y[row, c] + scale[slot] * sum_r v[row, r] B[slot, c, r]), v = the shrink's partials
// summed over their splits (in order) into shared memory. SEG: the rows of SGMV work item
// blockIdx.x (up to LORA_BM); else BGMV row blockIdx.x with slot indices[row] (BM = 1).
// Grid (items or n, ceil(out / EXPAND_THREADS)), block EXPAND_THREADS; r_max % (16 / sizeof(T)) == 0.
template <typename T, bool SEG>
__global__ void __launch_bounds__(EXPAND_THREADS) lora_expand(
    T* __restrict__ y,                        // [n, out], row stride y_stride
    const float* __restrict__ part,           // [splits, n, r_max]
    const T* __restrict__ lora_b,             // [slots, out, r_max]
    const float* __restrict__ scales,         // [slots]
    const long long* __restrict__ indices,    // SEG: segment starts [num_segs + 1]; else [n]
    const long long* __restrict__ seg_slots,  // SEG: [num_segs]; else unused
    int num_segs, int n, int out, int r_max, int splits, long long y_stride) {
  constexpr int BM = SEG ? LORA_BM : 1;
  constexpr int VEC = 16 / sizeof(T);
  __shared__ float vs[BM * LORA_MAX_RANK];
  int row0, rows, slot;
  if constexpr (SEG) {
    if (!lora_find_item(indices, seg_slots, num_segs, blockIdx.x, row0, rows, slot)) return;
  } else {
    row0 = blockIdx.x, rows = 1;
    const long long s = indices[row0];
    if (s < 0) return;
    slot = (int)s;
  }
  for (int e = threadIdx.x; e < rows * r_max; e += EXPAND_THREADS) {
    const long long src = (long long)(row0 + e / r_max) * r_max + e % r_max;
    float v = 0.f;
    for (int s = 0; s < splits; ++s) v += part[(long long)s * n * r_max + src];
    vs[e] = v;
  }
  __syncthreads();
  const int c = blockIdx.y * EXPAND_THREADS + threadIdx.x;
  if (c >= out) return;
  const T* br = lora_b + ((long long)slot * out + c) * r_max;
  float acc[BM];
#pragma unroll
  for (int i = 0; i < BM; ++i) acc[i] = 0.f;
#pragma unroll 2  // two B loads in flight (ptxas's own choice spilled 4 bytes in lora_expand<bf16, false> on sm_80)
  for (int r = 0; r < r_max; r += VEC) {
    const vec16<T> bv = *reinterpret_cast<const vec16<T>*>(br + r);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float b = to_float(bv.e[j]);
#pragma unroll
      for (int i = 0; i < BM; ++i)
        if (!SEG || i < rows) acc[i] = fmaf(vs[i * r_max + r + j], b, acc[i]);
    }
  }
  const float scale = scales[slot];
#pragma unroll
  for (int i = 0; i < BM; ++i)
    if (!SEG || i < rows) {
      T* dst = y + (long long)(row0 + i) * y_stride + c;
      *dst = from_float<T>(fmaf(scale, acc[i], to_float(*dst)));
    }
}

}  // namespace folio
