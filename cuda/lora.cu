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
#include "mma.cuh"

namespace folio {

constexpr int LORA_MAX_RANK = 128;
constexpr int LORA_BM = 16;             // rows per SGMV work item
constexpr int LORA_BK = 32;             // k per shared-memory tile of sgmv_shrink
constexpr int BGMV_SHRINK_THREADS = 128;  // 4 warps: 4 rank rows of one token per CTA
constexpr int SGMV_SHRINK_THREADS = 256;
constexpr int EXPAND_THREADS = 128;     // one output column each
constexpr int MMA_THREADS = 128;        // tensor-core SGMV: 4 warps
constexpr int MMA_BM = 64;              // rows per tensor-core work item (16 per warp in the shrink)
constexpr int MMA_BN = 64;              // output columns per CTA of sgmv_expand_mma
constexpr int MMA_BK = 32;              // k per pipeline stage of sgmv_shrink_mma
constexpr int MMA_STRIDE = MMA_BK + 8;  // shared row stride (elements): 16 bytes of padding, no ldmatrix bank conflicts
constexpr int MMA_RSTRIDE = LORA_MAX_RANK + 8;

// The SGMV work item `item`: the segments with an adapter (slot >= 0), in order, each cut into
// ceil(len / BM) items. Every thread of a CTA runs this (same addresses: broadcast reads);
// the number of segments is the step's number of prefill chunks. False past the last item.
template <int BM>
__device__ __forceinline__ bool lora_find_item(const long long* __restrict__ seg_starts,
                                               const long long* __restrict__ seg_slots, int num_segs, int item,
                                               int& row0, int& rows, int& slot) {
  int before = 0;
  for (int s = 0; s < num_segs; ++s) {
    const long long b = seg_starts[s], e = seg_starts[s + 1];
    const long long sl = seg_slots[s];
    const int count = (sl >= 0 && e > b) ? (int)((e - b + BM - 1) / BM) : 0;
    if (item < before + count) {
      row0 = (int)(b + (long long)(item - before) * BM);
      rows = (int)min((long long)BM, e - row0);
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
  if (!lora_find_item<LORA_BM>(seg_starts, seg_slots, num_segs, blockIdx.x, row0, rows, slot)) return;  // block-uniform
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
    if (!lora_find_item<LORA_BM>(indices, seg_slots, num_segs, blockIdx.x, row0, rows, slot)) return;
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

// Tensor-core SGMV (f16/bf16): the same two steps over work items of up to MMA_BM rows.
//
// part[split, row, r] = x[row, k-range] . A[slot, r, k-range]: per MMA_BK step (cp.async, 2
// stages; rows past the item, rank rows past r_max and k past the split are zero-filled) warp w
// multiplies its 16 rows by every rank column, r_max / 8 mma.sync m16n8k16 per 16 of k (A's rows
// are the B operand's "col" layout as they are in memory). fp32 partials, one per k split.
// Grid (max_items, splits), block MMA_THREADS; in % 8 == 0, r_max % 8 == 0, k_per_split % MMA_BK == 0.
template <typename T>
__global__ void __launch_bounds__(MMA_THREADS) sgmv_shrink_mma(
    float* __restrict__ part,                 // [splits, n, r_max]
    const T* __restrict__ x,                  // [n, in], row stride x_stride
    const T* __restrict__ lora_a,             // [slots, r_max, in]
    const long long* __restrict__ seg_starts, // [num_segs + 1]
    const long long* __restrict__ seg_slots,  // [num_segs]
    int num_segs, int n, int in, int r_max, int k_per_split, long long x_stride) {
  static_assert(sizeof(T) == 2, "tensor-core path: 16-bit types");
  constexpr int X_ELEMS = MMA_BM * MMA_STRIDE, A_ELEMS = LORA_MAX_RANK * MMA_STRIDE;
  constexpr int CHUNKS = MMA_BK / 8;  // 16-byte vectors per tile row
  constexpr int NT = LORA_MAX_RANK / 8;  // n8 tiles at most
  alignas(16) __shared__ T smem[2 * (X_ELEMS + A_ELEMS)];
  int row0, rows, slot;
  if (!lora_find_item<MMA_BM>(seg_starts, seg_slots, num_segs, blockIdx.x, row0, rows, slot)) return;
  const int k_begin = blockIdx.y * k_per_split;
  const int k_end = min(in, k_begin + k_per_split);
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int g = lane / 4, t = lane % 4, m = lane / 8;
  const int chunk = threadIdx.x % CHUNKS;
  const T* a_slot = lora_a + (long long)slot * r_max * in;

  auto load = [&](int stage, int k0) {
    T* xs = smem + stage * (X_ELEMS + A_ELEMS);
    T* as = xs + X_ELEMS;
    const int k = k0 + chunk * 8;
    const bool k_ok = k < k_end;
#pragma unroll
    for (int i = 0; i < MMA_BM * CHUNKS / MMA_THREADS; ++i) {
      const int r = threadIdx.x / CHUNKS + i * (MMA_THREADS / CHUNKS);
      const bool ok = k_ok && r < rows;
      cp_async16(xs + r * MMA_STRIDE + chunk * 8, ok ? x + (long long)(row0 + r) * x_stride + k : x, ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < LORA_MAX_RANK * CHUNKS / MMA_THREADS; ++i) {
      const int r = threadIdx.x / CHUNKS + i * (MMA_THREADS / CHUNKS);
      if (r >= r_max) break;  // those rows are never read
      cp_async16(as + r * MMA_STRIDE + chunk * 8, k_ok ? a_slot + (long long)r * in + k : lora_a, k_ok ? 16 : 0);
    }
  };

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  const int steps = (k_end - k_begin + MMA_BK - 1) / MMA_BK;
  load(0, k_begin);
  cp_async_commit();
  for (int step = 0; step < steps; ++step) {
    if (step + 1 < steps) load((step + 1) % 2, k_begin + (step + 1) * MMA_BK);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* xs = smem + (step % 2) * (X_ELEMS + A_ELEMS);
    const T* as = xs + X_ELEMS;
#pragma unroll
    for (int kk = 0; kk < MMA_BK; kk += 16) {
      unsigned af[4];
      ldmatrix_x4(af, xs + (warp * 16 + (m % 2) * 8 + lane % 8) * MMA_STRIDE + kk + (m / 2) * 8);
#pragma unroll
      for (int jb = 0; jb < NT / 2; ++jb) {
        if (jb * 16 >= r_max) break;
        // r_max % 16 == 8: the last ldmatrix reads 8 rows past r_max (in the tile, never
        // loaded); their products land in columns that are not written
        unsigned b[4];
        ldmatrix_x4(b, as + (jb * 16 + (m / 2) * 8 + lane % 8) * MMA_STRIDE + kk + (m % 2) * 8);
        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_16816<T>(acc[2 * jb], af, b0);
        mma_16816<T>(acc[2 * jb + 1], af, b1);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = warp * 16 + g + 8 * hr;
    if (r >= rows) continue;
    float* dst = part + ((long long)blockIdx.y * n + row0 + r) * r_max;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int col = j * 8 + 2 * t;
      if (col >= r_max) break;  // r_max % 8 == 0: the pair is whole
      dst[col] = acc[j][2 * hr];
      dst[col + 1] = acc[j][2 * hr + 1];
    }
  }
}

// y[row, n0 + c] = T(y + scale[slot] * v[row] . B[slot, n0 + c]) for the rows of work item
// blockIdx.x: v (the partials summed over their splits, rounded to T) and B's 64 rows (columns of
// y) are staged whole in shared memory (K = r_max, zero-padded to a multiple of 16), then each warp
// runs 2 x 4 mma.sync m16n8k16 per 16 of K over its 32 x 32 quarter of the 64 x 64 tile.
// Grid (max_items, ceil(out / MMA_BN)), block MMA_THREADS; r_max % 8 == 0.
template <typename T>
__global__ void __launch_bounds__(MMA_THREADS) sgmv_expand_mma(
    T* __restrict__ y,                        // [n, out], row stride y_stride
    const float* __restrict__ part,           // [splits, n, r_max]
    const T* __restrict__ lora_b,             // [slots, out, r_max]
    const float* __restrict__ scales,         // [slots]
    const long long* __restrict__ seg_starts, // [num_segs + 1]
    const long long* __restrict__ seg_slots,  // [num_segs]
    int num_segs, int n, int out, int r_max, int splits, long long y_stride) {
  static_assert(sizeof(T) == 2, "tensor-core path: 16-bit types");
  alignas(16) __shared__ T vs[MMA_BM * MMA_RSTRIDE];
  alignas(16) __shared__ T bs[MMA_BN * MMA_RSTRIDE];
  int row0, rows, slot;
  if (!lora_find_item<MMA_BM>(seg_starts, seg_slots, num_segs, blockIdx.x, row0, rows, slot)) return;
  const int n0 = blockIdx.y * MMA_BN;
  const int r_pad = (r_max + 15) / 16 * 16;
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int g = lane / 4, t = lane % 4, m = lane / 8;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
  const T* b_slot = lora_b + (long long)slot * out * r_max;
  for (int e = threadIdx.x; e < MMA_BN * (r_pad / 8); e += MMA_THREADS) {
    const int c = e / (r_pad / 8), ch = e % (r_pad / 8);
    const bool ok = n0 + c < out && ch * 8 < r_max;
    cp_async16(bs + c * MMA_RSTRIDE + ch * 8, ok ? b_slot + (long long)(n0 + c) * r_max + ch * 8 : lora_b,
               ok ? 16 : 0);
  }
  cp_async_commit();
  for (int e = threadIdx.x; e < MMA_BM * r_pad; e += MMA_THREADS) {
    const int i = e / r_pad, r = e % r_pad;
    float v = 0.f;
    if (i < rows && r < r_max) {
      const long long src = (long long)(row0 + i) * r_max + r;
      for (int s = 0; s < splits; ++s) v += part[(long long)s * n * r_max + src];
    }
    vs[i * MMA_RSTRIDE + r] = from_float<T>(v);
  }
  cp_async_wait<0>();
  __syncthreads();

  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
  for (int kk = 0; kk < r_pad; kk += 16) {
    unsigned af[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
      ldmatrix_x4(af[i], vs + (wm + i * 16 + (m % 2) * 8 + lane % 8) * MMA_RSTRIDE + kk + (m / 2) * 8);
#pragma unroll
    for (int jb = 0; jb < 2; ++jb) {
      unsigned b[4];
      ldmatrix_x4(b, bs + (wn + jb * 16 + (m / 2) * 8 + lane % 8) * MMA_RSTRIDE + kk + (m % 2) * 8);
      const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mma_16816<T>(acc[i][2 * jb], af[i], b0);
        mma_16816<T>(acc[i][2 * jb + 1], af[i], b1);
      }
    }
  }
  const float scale = scales[slot];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = wm + i * 16 + g + 8 * hr;
      if (r >= rows) continue;
      T* dst = y + (long long)(row0 + r) * y_stride;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int col = n0 + wn + j * 8 + 2 * t + q;
          if (col < out) dst[col] = from_float<T>(fmaf(scale, acc[i][j][2 * hr + q], to_float(dst[col])));
        }
    }
}

}  // namespace folio
