// Paged attention for chunks (prefill, speculative verification) on tensor cores, f16/bf16.
// See cuda/LAYOUT.md for the arguments and the launch geometry.
//
// A CTA takes 64 "rows" of one sequence and one KV head, a row being (query token t, head g of
// the group) = t * group + g: the GQA group is packed into the M dimension, so the K/V tiles a
// CTA loads serve every head of the group and several tokens at once. Each of the 4 warps owns
// 16 rows. Per tile of 32 keys (cp.async, 2 stages, rows padded by 16 bytes so that ldmatrix is
// free of bank conflicts): S = Q K^T with mma.sync m16n8k16 (Q fragments held in registers for
// the whole context), causal mask and online softmax on the accumulators, P rounded to T and
// reused in place as the A operand of O += P V (V fragments by ldmatrix.trans). fp32 throughout
// except the mma inputs. The fragment layouts are those of cuda/mma.cuh.
//
// Sliding window (window > 0): row r at position p sees keys p - window < k <= p; the CTA's key
// loop starts at its first row's window start (keys before it are never read) and each row masks
// the keys before its own start. Soft-cap (softcap > 0): score = cap * tanh(score / cap), after
// the scale, before the mask and the softmax.
#include "mma.cuh"

namespace folio {

constexpr int PREFILL_THREADS = 128;
constexpr int PREFILL_ROWS = 64;  // rows per CTA: 16 per warp
constexpr int PREFILL_KEYS = 32;  // keys per tile
constexpr int PREFILL_STAGES = 2;

template <typename T, int HEAD>
struct PrefillShape {
  static constexpr int STRIDE = HEAD + 8;  // shared row stride in elements: 16 bytes of padding
  static constexpr int KSTEPS = HEAD / 16;  // k-steps of S = Q K^T
  static constexpr int DBLOCKS = HEAD / 8;  // 8-wide output column blocks
  static constexpr int TILE_ELEMS = PREFILL_KEYS * STRIDE;
  static constexpr int PIPE_ELEMS = PREFILL_STAGES * 2 * TILE_ELEMS;
  static constexpr int Q_ELEMS = PREFILL_ROWS * STRIDE;
  static constexpr int SMEM_ELEMS = PIPE_ELEMS > Q_ELEMS ? PIPE_ELEMS : Q_ELEMS;
  static constexpr int CHUNKS = HEAD / 8;  // 16-byte vectors per row
  static_assert(sizeof(T) == 2 && HEAD % 16 == 0, "tensor-core path: 16-bit types, head a multiple of 16");
};

// The K/V load path of this kernel: keys [first, first + PREFILL_KEYS) of one KV head into a
// [PREFILL_KEYS][STRIDE] tile each, 16-byte cp.async, zero-filled before `lo` and past `end`.
template <typename T, int HEAD, int BLOCK>
__device__ __forceinline__ void load_prefill_tile(T* k_s, T* v_s, const T* __restrict__ k_cache,
                                                  const T* __restrict__ v_cache, const int* __restrict__ table,
                                                  int first, int end, long long token_stride, int head_offset,
                                                  int lo) {
  using S = PrefillShape<T, HEAD>;
  for (int c = threadIdx.x; c < PREFILL_KEYS * S::CHUNKS; c += PREFILL_THREADS) {
    const int key = c / S::CHUNKS, col = c % S::CHUNKS, pos = first + key;
    const bool valid = pos >= lo && pos < end;
    long long off = 0;
    if (valid) off = ((long long)table[pos / BLOCK] * BLOCK + pos % BLOCK) * token_stride + head_offset + col * 8;
    cp_async16(k_s + key * S::STRIDE + col * 8, k_cache + off, valid ? 16 : 0);
    cp_async16(v_s + key * S::STRIDE + col * 8, v_cache + off, valid ? 16 : 0);
  }
}

template <typename T, int HEAD, int BLOCK>
__global__ void __launch_bounds__(PREFILL_THREADS) paged_prefill(
    T* __restrict__ out,                      // [num_tokens, num_heads, HEAD] (one partition)
    float* __restrict__ part_out,             // [num_tokens, num_heads, num_partitions, HEAD]
    float* __restrict__ part_lse,             // [num_tokens, num_heads, num_partitions]
    const T* __restrict__ query,              // [num_tokens, num_heads, HEAD], token stride q_stride
    const T* __restrict__ k_cache,            // [num_blocks, BLOCK, num_kv_heads, HEAD]
    const T* __restrict__ v_cache,            // [num_blocks, BLOCK, num_kv_heads, HEAD]
    const int* __restrict__ block_tables,     // [num_seqs, max_blocks]
    const int* __restrict__ seq_lens,         // [num_seqs]
    const int* __restrict__ query_start_loc,  // [num_seqs + 1]
    const int* __restrict__ work,             // [num_work, 2]: (seq, first row)
    int num_kv_heads, int group, int max_blocks, long long q_stride, float scale, int num_partitions,
    int partition_size, const float*, const float*, int window, float softcap, float softcap_inv) {
  // the two pointers: an fp8 pool's K/V scales, the other kernels' argument; null here (a pool of
  // T: fp8 pools take the CUDA-core kernel)
  using S = PrefillShape<T, HEAD>;
  alignas(16) __shared__ T smem[S::SMEM_ELEMS];

  const int seq = work[2 * blockIdx.x], row0 = work[2 * blockIdx.x + 1];
  const int kv_head = blockIdx.y;
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  const int g = lane / 4, t = lane % 4;
  const int q_begin = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_begin;
  const int seq_len = seq_lens[seq];
  const int ctx_len = seq_len - q_len;
  const int num_rows = min(PREFILL_ROWS, q_len * group - row0);
  const int num_heads = num_kv_heads * group;

  // Keys this CTA may need (cta_key_span): its partition's, none before kv_first.
  const KeySpan keys = cta_key_span(seq_len, ctx_len, row0, num_rows, group, window, partition_size, blockIdx.z);
  const int kv_first = keys.first, part_begin = keys.begin, part_end = keys.end;

  // Q rows into shared memory (rows past the last are zeros), then into A fragments for good.
  for (int c = threadIdx.x; c < PREFILL_ROWS * S::CHUNKS; c += PREFILL_THREADS) {
    const int r = c / S::CHUNKS, col = c % S::CHUNKS, row = row0 + r;
    vec16<T> v;
    for (int e = 0; e < 8; ++e) v.e[e].bits = 0;
    if (r < num_rows) {
      const int head = kv_head * group + row % group;
      v = *reinterpret_cast<const vec16<T>*>(query + (long long)(q_begin + row / group) * q_stride +
                                             (long long)head * HEAD + col * 8);
    }
    *reinterpret_cast<vec16<T>*>(smem + r * S::STRIDE + col * 8) = v;
  }
  __syncthreads();
  unsigned qf[S::KSTEPS][4];
  {
    const int m = lane / 8;  // ldmatrix: lanes 8m..8m+7 address matrix m (rows +8 for m odd, cols +8 for m >= 2)
    const T* base = smem + (warp * 16 + (m % 2) * 8 + lane % 8) * S::STRIDE + (m / 2) * 8;
#pragma unroll
    for (int k = 0; k < S::KSTEPS; ++k) ldmatrix_x4(qf[k], base + k * 16);
  }
  __syncthreads();  // the Q tile's space becomes the K/V pipeline

  // Per thread: rows r_lo = warp*16 + g and r_hi = r_lo + 8; output columns 8*j + 2t, +1.
  float o[S::DBLOCKS][4], m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < S::DBLOCKS; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  int limit[2], lower[2];  // each row's visible keys [lower, limit): window, causal position, partition
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + warp * 16 + g + 8 * h;
    limit[h] = min(part_end, ctx_len + row / group + 1);
    lower[h] = window > 0 ? ctx_len + row / group - window + 1 : 0;
  }

  const int* table = block_tables + (long long)seq * max_blocks;
  const long long token_stride = (long long)num_kv_heads * HEAD;
  const int num_tiles = part_begin < part_end ? (part_end - part_begin + PREFILL_KEYS - 1) / PREFILL_KEYS : 0;
  if (num_tiles > 0)
    load_prefill_tile<T, HEAD, BLOCK>(smem, smem + S::TILE_ELEMS, k_cache, v_cache, table, part_begin, part_end,
                                      token_stride, kv_head * HEAD, kv_first);
  cp_async_commit();
  for (int tile = 0; tile < num_tiles; ++tile) {
    if (tile + 1 < num_tiles) {
      T* next = smem + ((tile + 1) % PREFILL_STAGES) * 2 * S::TILE_ELEMS;
      load_prefill_tile<T, HEAD, BLOCK>(next, next + S::TILE_ELEMS, k_cache, v_cache, table,
                                        part_begin + (tile + 1) * PREFILL_KEYS, part_end, token_stride, kv_head * HEAD,
                                        kv_first);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this thread's copies of this tile have landed
    __syncthreads();     // and everyone else's
    const T* k_s = smem + (tile % PREFILL_STAGES) * 2 * S::TILE_ELEMS;
    const T* v_s = k_s + S::TILE_ELEMS;
    const int first = part_begin + tile * PREFILL_KEYS;

    // S = Q K^T: 4 key blocks of 8; one ldmatrix.x4 gives the B fragments of 2 key blocks.
    float s[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    const int m = lane / 8;
#pragma unroll
    for (int k = 0; k < S::KSTEPS; ++k) {
#pragma unroll
      for (int kb = 0; kb < 2; ++kb) {  // keys 16kb..16kb+15: matrices (keys +0/+8) x (dims +0/+8)
        unsigned b[4];
        ldmatrix_x4(b, k_s + (kb * 16 + (m / 2) * 8 + lane % 8) * S::STRIDE + k * 16 + (m % 2) * 8);
        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_16816<T>(s[2 * kb], qf[k], b0);
        mma_16816<T>(s[2 * kb + 1], qf[k], b1);
      }
    }
    // Mask, online softmax per row (a row's 32 scores sit with the 4 lanes of its quad).
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m_run[h];
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int pos = first + n * 8 + 2 * t + e;
          float& v = s[n][2 * h + e];
          v = pos < limit[h] && pos >= lower[h] ? soft_cap(v * scale, softcap, softcap_inv) : neg_inf();
          mx = fmaxf(mx, v);
        }
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
      alpha[h] = (m_run[h] == neg_inf() || mx == neg_inf()) ? (mx == neg_inf() ? 1.f : 0.f) : __expf(m_run[h] - mx);
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& v = s[n][2 * h + e];
          v = v == neg_inf() ? 0.f : __expf(v - mx);
          sum += v;
        }
      l_run[h] = l_run[h] * alpha[h] + sum;  // this lane's share; the quad is summed at the end
      m_run[h] = mx;
    }
#pragma unroll
    for (int j = 0; j < S::DBLOCKS; ++j) {
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[0];
      o[j][2] *= alpha[1];
      o[j][3] *= alpha[1];
    }
    // O += P V: P's accumulator layout is the A layout of the next mma (k = keys).
#pragma unroll
    for (int kb = 0; kb < 2; ++kb) {
      const unsigned pa[4] = {pack2<T>(s[2 * kb][0], s[2 * kb][1]), pack2<T>(s[2 * kb][2], s[2 * kb][3]),
                              pack2<T>(s[2 * kb + 1][0], s[2 * kb + 1][1]),
                              pack2<T>(s[2 * kb + 1][2], s[2 * kb + 1][3])};
#pragma unroll
      for (int j = 0; j < S::DBLOCKS; j += 2) {  // dims 8j..8j+15: matrices (keys +0/+8) x (dims +0/+8)
        unsigned b[4];
        ldmatrix_x4_trans(b, v_s + (kb * 16 + (m % 2) * 8 + lane % 8) * S::STRIDE + j * 8 + (m / 2) * 8);
        const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_16816<T>(o[j], pa, b0);
        mma_16816<T>(o[j + 1], pa, b1);
      }
    }
    __syncthreads();  // everyone is done with this stage before the next load overwrites it
  }
  cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = l_run[h];
    l += __shfl_xor_sync(FULL_MASK, l, 1);
    l += __shfl_xor_sync(FULL_MASK, l, 2);
    const int r = warp * 16 + g + 8 * h, row = row0 + r;
    if (r >= num_rows) continue;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const long long out_row = (long long)(q_begin + row / group) * num_heads + kv_head * group + row % group;
    if (num_partitions == 1) {
#pragma unroll
      for (int j = 0; j < S::DBLOCKS; ++j) {
        out[out_row * HEAD + 8 * j + 2 * t] = from_float<T>(o[j][2 * h] * inv);
        out[out_row * HEAD + 8 * j + 2 * t + 1] = from_float<T>(o[j][2 * h + 1] * inv);
      }
    } else {
      const long long p = out_row * num_partitions + blockIdx.z;
#pragma unroll
      for (int j = 0; j < S::DBLOCKS; ++j) {
        part_out[p * HEAD + 8 * j + 2 * t] = o[j][2 * h] * inv;
        part_out[p * HEAD + 8 * j + 2 * t + 1] = o[j][2 * h + 1] * inv;
      }
      if (t == 0) part_lse[p] = l > 0.f ? m_run[h] + logf(l) : neg_inf();
    }
  }
}

}  // namespace folio
