// Mixture-of-experts on the GPU: routing, grouping by expert, and a grouped GEMM over
// (expert, row tile) work items on tensor cores (f16/bf16 inputs, fp32 accumulation).
// See cuda/LAYOUT.md ("Mixture-of-experts") for the arguments and the launch geometry.
//
// A step runs six kernels, none of which needs the host to read anything back (the work list is
// built on the device, the GEMM grids are sized for the worst case):
//   moe_route    per token: softmax over the router's logits (fp32), top-k, optional renormalisation;
//   moe_group    per expert: its count, its offset (the count of every lower expert) and its rows of
//                the permutation of (token, slot) pairs sorted by expert, tokens ascending (stable);
//   moe_plan     one block: the work items (expert, first sorted row), BM rows each;
//   moe_gemm<T, true>   per item and 64 output columns: h = silu(x W_gate^T) * (x W_up^T), the rows
//                gathered from x through the permutation;
//   moe_gemm<T, false>  per item and 64 output columns: the down projection of h, each row written to
//                its (token, slot) place;
//   moe_combine  per token: the sum of its k slots times their weights, in slot order (deterministic,
//                no atomics).
// No atomics anywhere: every result is the same from run to run.
#include "mma.cuh"

namespace folio {

constexpr int ROUTE_THREADS = 128;      // one warp per token
constexpr int ROUTE_MAX_EXPERTS = 256;  // 8 router probabilities per lane, in registers
constexpr int GROUP_THREADS = 256;
constexpr int PLAN_THREADS = 256;
constexpr int MOE_THREADS = 128;        // 4 warps, 2 x 2 over the 64 x 64 output tile
constexpr int MOE_BM = 64;              // sorted rows per work item
constexpr int MOE_BN = 64;              // output columns per CTA (gate_up: 64 of gate and the same 64 of up)
constexpr int MOE_BK = 32;              // k per pipeline stage
constexpr int MOE_STRIDE = MOE_BK + 8;  // shared row stride in elements: 16 bytes of padding (no ldmatrix bank conflicts)
constexpr int COMBINE_THREADS = 128;

// Per token (one warp each): probs = softmax(logits) in fp32; the k largest, largest first (ties:
// the lower expert id, as torch.topk usually picks); weights renormalised to sum to 1 when
// `renormalize`. Grid ceil(n / 4), block ROUTE_THREADS; num_experts <= ROUTE_MAX_EXPERTS, k <= min(32, num_experts).
template <typename T>
__global__ void __launch_bounds__(ROUTE_THREADS) moe_route(
    int* __restrict__ topk_ids,        // [n, k]
    float* __restrict__ topk_weights,  // [n, k]
    const T* __restrict__ logits,      // [n, num_experts], token stride logit_stride
    int n, int num_experts, int k, long long logit_stride, int renormalize) {
  constexpr int PER_LANE = ROUTE_MAX_EXPERTS / WARP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE;
  const int token = blockIdx.x * (ROUTE_THREADS / WARP_SIZE) + threadIdx.x / WARP_SIZE;
  if (token >= n) return;  // the whole warp leaves together
  const T* row = logits + token * logit_stride;
  float p[PER_LANE];
  float mx = neg_inf();
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    const int e = j * WARP_SIZE + lane;
    p[j] = e < num_experts ? to_float(row[e]) : neg_inf();
    mx = fmaxf(mx, p[j]);
  }
  mx = warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    p[j] = j * WARP_SIZE + lane < num_experts ? expf(p[j] - mx) : 0.f;
    sum += p[j];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) p[j] = j * WARP_SIZE + lane < num_experts ? p[j] / sum : -1.f;  // -1: no expert
  // k rounds of a warp argmax; a picked probability becomes -1 (below every real one, >= 0)
  float picked_sum = 0.f, mine = 0.f;  // lane s < k keeps slot s
  int mine_id = 0;
  for (int slot = 0; slot < k; ++slot) {
    float best = -2.f;
    int best_id = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j)
      if (p[j] > best) best = p[j], best_id = j * WARP_SIZE + lane;  // ascending ids: the lowest wins a tie
#pragma unroll
    for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2) {
      const float ob = __shfl_xor_sync(FULL_MASK, best, mask);
      const int oid = __shfl_xor_sync(FULL_MASK, best_id, mask);
      if (ob > best || (ob == best && oid < best_id)) best = ob, best_id = oid;
    }
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j)
      if (j * WARP_SIZE + lane == best_id) p[j] = -1.f;
    picked_sum += best;  // in slot order, the same on every lane
    if (lane == slot) mine = best, mine_id = best_id;
  }
  if (lane < k) {
    topk_ids[(long long)token * k + lane] = mine_id;
    topk_weights[(long long)token * k + lane] = renormalize ? mine / picked_sum : mine;
  }
}

// Inclusive prefix sum over a warp (every lane calls it).
__device__ __forceinline__ int warp_inclusive_scan(int v) {
  const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
  for (int d = 1; d < WARP_SIZE; d *= 2) {
    const int o = __shfl_sync(FULL_MASK, v, lane >= d ? lane - d : lane);
    if (lane >= d) v += o;
  }
  return v;
}

// Block e: offsets[e] = the number of pairs routed to experts below e; perm[offsets[e] + r] = the
// flat index (token * k + slot) of the r-th pair routed to e, in ascending flat order (so tokens
// ascend within an expert: torch.argsort(topk_ids.flatten(), stable=True)). The last block also
// writes offsets[num_experts] = total. Every block reads all pairs (coalesced, twice).
// Grid (num_experts), block GROUP_THREADS.
__global__ void __launch_bounds__(GROUP_THREADS) moe_group(
    int* __restrict__ perm,            // [total]
    int* __restrict__ offsets,         // [num_experts + 1]
    const int* __restrict__ topk_ids,  // [total] = [n, k] flattened
    int total, int num_experts) {
  constexpr int WARPS = GROUP_THREADS / WARP_SIZE;
  __shared__ int warp_sums[WARPS];
  const int e = blockIdx.x, lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  int below = 0;
  for (int p = threadIdx.x; p < total; p += GROUP_THREADS) below += topk_ids[p] < e;
#pragma unroll
  for (int mask = WARP_SIZE / 2; mask > 0; mask /= 2) below += __shfl_xor_sync(FULL_MASK, below, mask);
  if (lane == 0) warp_sums[warp] = below;
  __syncthreads();
  int offset = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) offset += warp_sums[w];
  __syncthreads();
  int done = 0;  // pairs of this expert in the chunks before
  for (int base = 0; base < total; base += GROUP_THREADS) {
    const int p = base + threadIdx.x;
    const int hit = p < total && topk_ids[p] == e;
    const int incl = warp_inclusive_scan(hit);
    if (lane == WARP_SIZE - 1) warp_sums[warp] = incl;
    __syncthreads();
    int before = 0, chunk = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      before += w < warp ? warp_sums[w] : 0;
      chunk += warp_sums[w];
    }
    if (hit) perm[offset + done + before + incl - 1] = p;
    done += chunk;
    __syncthreads();  // warp_sums is rewritten by the next chunk
  }
  if (threadIdx.x == 0) {
    offsets[e] = offset;
    if (e == num_experts - 1) offsets[num_experts] = offset + done;
  }
}

// One block: the work items, expert by expert, MOE_BM sorted rows each (an expert without rows
// has none): items[i] = (expert, first sorted row); *num_items = their number. max_items (the
// GEMM grids' size) is at least total / MOE_BM + min(num_experts, total), more than enough.
// Grid (1), block PLAN_THREADS; num_experts <= ROUTE_MAX_EXPERTS.
__global__ void __launch_bounds__(PLAN_THREADS) moe_plan(
    int* __restrict__ items,          // [max_items, 2]
    int* __restrict__ num_items,      // [1]
    const int* __restrict__ offsets,  // [num_experts + 1]
    int num_experts) {
  __shared__ int first_item[ROUTE_MAX_EXPERTS + 1];
  if (threadIdx.x == 0) {
    int acc = 0;
    for (int e = 0; e < num_experts; ++e) {
      first_item[e] = acc;
      acc += (offsets[e + 1] - offsets[e] + MOE_BM - 1) / MOE_BM;
    }
    first_item[num_experts] = acc;
    *num_items = acc;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += PLAN_THREADS)
    for (int i = first_item[e]; i < first_item[e + 1]; ++i) {
      items[2 * i] = e;
      items[2 * i + 1] = offsets[e] + (i - first_item[e]) * MOE_BM;
    }
}

__device__ __forceinline__ float moe_silu(float g) { return __fdividef(g, 1.f + __expf(-g)); }

// One work item's MOE_BM x MOE_BN output tile (x64 more columns of up for the gated GEMM):
//   GATED:  h[row, n0 + c] = silu(a W_e[n0 + c]) * (a W_e[N + n0 + c]), a = x[perm[row] / top_k];
//           K = hidden, N = intermediate, W_e = w + e * 2N * K ([2N, K]: gate rows then up rows);
//   !GATED: out[perm[row], n0 + c] = h[row] W_e[n0 + c], K = intermediate, N = hidden,
//           W_e = w + e * N * K ([N, K]).
// Per MOE_BK step (cp.async, 2 stages; rows past the item's end and weight rows past N are
// zero-filled), each warp runs 2 x 4 (x2 gated) mma.sync m16n8k16 per 16 of k over its 32 x 32
// quarter. Results are rounded to T once. Grid (max_items, ceil(N / MOE_BN)), block MOE_THREADS;
// items past *num_items leave at once. K % 16 == 0, N % 16 == 0 (checked by the launcher).
template <typename T, bool GATED>
__global__ void __launch_bounds__(MOE_THREADS) moe_gemm(
    T* __restrict__ out,              // GATED: h [total, N] (sorted rows); else [total, N] by (token, slot)
    const T* __restrict__ a,          // GATED: x [n, K], token stride a_stride; else h [total, K]
    const T* __restrict__ w,          // [num_experts, (GATED ? 2 : 1) N, K]
    const int* __restrict__ perm,     // [total]
    const int* __restrict__ offsets,  // [num_experts + 1]
    const int* __restrict__ items,    // [max_items, 2]
    const int* __restrict__ num_items,
    int N, int K, int top_k, long long a_stride) {
  constexpr int B_ROWS = GATED ? 2 * MOE_BN : MOE_BN;
  constexpr int A_ELEMS = MOE_BM * MOE_STRIDE, B_ELEMS = B_ROWS * MOE_STRIDE;
  constexpr int CHUNKS = MOE_BK / 8;  // 16-byte vectors per tile row
  constexpr int A_LOADS = MOE_BM * CHUNKS / MOE_THREADS, B_LOADS = B_ROWS * CHUNKS / MOE_THREADS;
  static_assert(sizeof(T) == 2, "tensor-core path: 16-bit types");
  alignas(16) __shared__ T smem[2 * (A_ELEMS + B_ELEMS)];

  const int item = blockIdx.x;
  if (item >= *num_items) return;
  const int e = items[2 * item], row0 = items[2 * item + 1];
  const int rows = min(MOE_BM, offsets[e + 1] - row0);
  const int n0 = blockIdx.y * MOE_BN;
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int g = lane / 4, t = lane % 4, m = lane / 8;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;  // the warp's quarter of the tile
  const int chunk = threadIdx.x % CHUNKS;

  // Each thread loads the same rows and 16-byte column of every stage: their sources, once.
  const T* a_src[A_LOADS];
  bool a_ok[A_LOADS];
#pragma unroll
  for (int i = 0; i < A_LOADS; ++i) {
    const int r = threadIdx.x / CHUNKS + i * (MOE_THREADS / CHUNKS);
    a_ok[i] = r < rows;
    const long long src_row = !a_ok[i] ? 0 : GATED ? perm[row0 + r] / top_k : row0 + r;
    a_src[i] = a + src_row * a_stride + chunk * 8;
  }
  const T* w_e = w + (long long)e * (GATED ? 2 : 1) * N * K;
  const T* b_src[B_LOADS];
  bool b_ok[B_LOADS];
#pragma unroll
  for (int i = 0; i < B_LOADS; ++i) {
    const int r = threadIdx.x / CHUNKS + i * (MOE_THREADS / CHUNKS);
    const int col = n0 + r % MOE_BN;  // GATED: rows MOE_BN.. are the same columns of up
    b_ok[i] = col < N;
    b_src[i] = w_e + (long long)(b_ok[i] ? col + (r / MOE_BN) * N : 0) * K + chunk * 8;
  }
  auto load = [&](int stage, int k0) {
    T* as = smem + stage * (A_ELEMS + B_ELEMS);
    T* bs = as + A_ELEMS;
    const bool k_ok = k0 + chunk * 8 < K;
#pragma unroll
    for (int i = 0; i < A_LOADS; ++i) {
      const int r = threadIdx.x / CHUNKS + i * (MOE_THREADS / CHUNKS);
      const bool ok = a_ok[i] && k_ok;
      cp_async16(as + r * MOE_STRIDE + chunk * 8, ok ? a_src[i] + k0 : a, ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < B_LOADS; ++i) {
      const int r = threadIdx.x / CHUNKS + i * (MOE_THREADS / CHUNKS);
      const bool ok = b_ok[i] && k_ok;
      cp_async16(bs + r * MOE_STRIDE + chunk * 8, ok ? b_src[i] + k0 : w, ok ? 16 : 0);
    }
  };

  float acc[GATED ? 2 : 1][2][4][4];  // [gate/up][m16 tile][n8 tile][fragment]
#pragma unroll
  for (int h = 0; h < (GATED ? 2 : 1); ++h)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[h][i][j][0] = acc[h][i][j][1] = acc[h][i][j][2] = acc[h][i][j][3] = 0.f;

  const int steps = (K + MOE_BK - 1) / MOE_BK;
  load(0, 0);
  cp_async_commit();
  for (int step = 0; step < steps; ++step) {
    if (step + 1 < steps) load((step + 1) % 2, (step + 1) * MOE_BK);
    cp_async_commit();
    cp_async_wait<1>();  // this thread's copies of this stage have landed
    __syncthreads();     // and everyone else's
    const T* as = smem + (step % 2) * (A_ELEMS + B_ELEMS);
    const T* bs = as + A_ELEMS;
#pragma unroll
    for (int kk = 0; kk < MOE_BK; kk += 16) {
      unsigned af[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i)  // matrices (rows +0/+8) x (k +0/+8)
        ldmatrix_x4(af[i], as + (wm + i * 16 + (m % 2) * 8 + lane % 8) * MOE_STRIDE + kk + (m / 2) * 8);
#pragma unroll
      for (int h = 0; h < (GATED ? 2 : 1); ++h)
#pragma unroll
        for (int jb = 0; jb < 2; ++jb) {  // columns 16jb..16jb+15: matrices (cols +0/+8) x (k +0/+8)
          unsigned b[4];
          ldmatrix_x4(b, bs + (h * MOE_BN + wn + jb * 16 + (m / 2) * 8 + lane % 8) * MOE_STRIDE + kk + (m % 2) * 8);
          const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            mma_16816<T>(acc[h][i][2 * jb], af[i], b0);
            mma_16816<T>(acc[h][i][2 * jb + 1], af[i], b1);
          }
        }
    }
    __syncthreads();  // everyone is done with this stage before the next load overwrites it
  }
  cp_async_wait<0>();

  // Thread's outputs: rows wm + 16i + g (+8), columns wn + 8j + 2t (+1).
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = wm + i * 16 + g + 8 * hr;
      if (r >= rows) continue;
      const long long dst_row = GATED ? row0 + r : perm[row0 + r];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = n0 + wn + j * 8 + 2 * t;
        if (col >= N) continue;  // N % 16 == 0: the pair is whole
        float v0 = acc[0][i][j][2 * hr], v1 = acc[0][i][j][2 * hr + 1];
        if constexpr (GATED) {
          v0 = moe_silu(v0) * acc[GATED ? 1 : 0][i][j][2 * hr];
          v1 = moe_silu(v1) * acc[GATED ? 1 : 0][i][j][2 * hr + 1];
        }
        T* o = out + dst_row * N + col;
        o[0] = from_float<T>(v0);
        o[1] = from_float<T>(v1);
      }
    }
}

// y[token] = sum over slots s = 0..k-1 (in that order) of weights[token, s] * slots[token * k + s],
// in fp32, rounded to T once. Grid (n), block COMBINE_THREADS; hidden % 8 == 0.
template <typename T>
__global__ void __launch_bounds__(COMBINE_THREADS) moe_combine(
    T* __restrict__ y,                  // [n, hidden]
    const T* __restrict__ slots,        // [n * k, hidden]
    const float* __restrict__ weights,  // [n, k]
    int k, int hidden) {
  constexpr int VEC = 8;
  const long long token = blockIdx.x;
  for (int c = threadIdx.x * VEC; c < hidden; c += COMBINE_THREADS * VEC) {
    float acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
    for (int s = 0; s < k; ++s) {
      const float wt = weights[token * k + s];
      const vec16<T> v = *reinterpret_cast<const vec16<T>*>(slots + (token * k + s) * hidden + c);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] = fmaf(wt, to_float(v.e[i]), acc[i]);
    }
    vec16<T> o;
#pragma unroll
    for (int i = 0; i < VEC; ++i) o.e[i] = from_float<T>(acc[i]);
    *reinterpret_cast<vec16<T>*>(y + token * hidden + c) = o;
  }
}

}  // namespace folio
