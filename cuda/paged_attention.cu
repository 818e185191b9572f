// Paged attention over folio's KV pool: one kernel for decode and varlen chunks, plus the reduce
// kernel of the partitioned path. See cuda/LAYOUT.md for the argument shapes and launch geometry.
//
// Work decomposition. For KV head h, a sequence with q_len new tokens has q_len * group "rows"
// (query token t, query head h*group + g), numbered row = t*group + g. A CUDA block takes up to
// ATTN_ROWS consecutive rows of one sequence (a "work item", listed by the host) and one
// partition of the context, so every K/V element it loads from the pool serves all of those
// rows: the GQA heads of a token, and neighbouring tokens of a chunk. Decode is the case
// q_len == 1. Inside the block, the warps split the keys (32 per sub-tile, one key per lane),
// keep an online softmax per row, and merge through shared memory at the end.
//
// Sliding window (window > 0): row r at position p sees keys p - window < k <= p; a block's key
// loop starts at its first row's window start (keys before it are never read) and partitions cut
// [that start, the last row's position]. Soft-cap (softcap > 0): score = cap * tanh(score / cap),
// after the scale, before the mask and the softmax.
#include "common.cuh"

namespace folio {

constexpr int ATTN_WARPS = 4;
constexpr int ATTN_THREADS = ATTN_WARPS * WARP_SIZE;
constexpr int ATTN_ROWS = 8;           // rows per block; 8 covers every GQA group of 8 or less
// Resident blocks per SM we ask ptxas to allow for: 2 x 128 threads leaves up to 255 registers a
// thread, enough for the per-row accumulators without spilling (checked by tests/cuda).
constexpr int ATTN_MIN_BLOCKS = 2;

// Dot products of one K row (HEAD elements at k) with every row's query in shared memory.
// Rows past num_rows (a short last work item, or decode with a small GQA group) are skipped:
// the branch is uniform across the warp, and the loops stay unrolled so s[] lives in registers.
template <typename C, int HEAD>
__device__ __forceinline__ void score_key(const C* __restrict__ k, const float (*q_s)[HEAD], int num_rows,
                                          float (&s)[ATTN_ROWS]) {
  constexpr int VEC = 16 / sizeof(C);
#pragma unroll
  for (int r = 0; r < ATTN_ROWS; ++r) s[r] = 0.f;
  for (int c = 0; c < HEAD; c += VEC) {
    const vec16<C> w = *reinterpret_cast<const vec16<C>*>(k + c);
    float kf[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) kf[v] = to_float(w.e[v]);
#pragma unroll
    for (int r = 0; r < ATTN_ROWS; ++r) {
      if (r >= num_rows) break;
#pragma unroll
      for (int v = 0; v < VEC; ++v) s[r] += q_s[r][c + v] * kf[v];
    }
  }
}

// C: the pool's element type (T, or fp8e4m3 with the layer's k_scale/v_scale: fp32
// [num_kv_heads, HEAD] each, per head and channel; null for a pool of T).
template <typename T, int HEAD, int BLOCK, typename C = T>
__global__ void __launch_bounds__(ATTN_THREADS, ATTN_MIN_BLOCKS) paged_attention(
    T* __restrict__ out,                   // [num_tokens, num_heads, HEAD] (one partition)
    float* __restrict__ part_out,          // [num_tokens, num_heads, num_partitions, HEAD]
    float* __restrict__ part_lse,          // [num_tokens, num_heads, num_partitions]
    const T* __restrict__ query,           // [num_tokens, num_heads, HEAD], token stride q_stride
    const C* __restrict__ k_cache,         // [num_blocks, BLOCK, num_kv_heads, HEAD]
    const C* __restrict__ v_cache,         // [num_blocks, BLOCK, num_kv_heads, HEAD]
    const int* __restrict__ block_tables,  // [num_seqs, max_blocks]
    const int* __restrict__ seq_lens,      // [num_seqs]
    const int* __restrict__ query_start_loc,  // [num_seqs + 1]
    const int* __restrict__ work,          // [num_work, 2]: (seq, first row)
    int num_kv_heads, int group, int max_blocks, long long q_stride, float scale,
    int num_partitions, int partition_size, const float* __restrict__ k_scale,
    const float* __restrict__ v_scale, int window, float softcap, float softcap_inv) {
  constexpr int PER_LANE = HEAD / WARP_SIZE;  // head dims each lane accumulates
  __shared__ float q_s[ATTN_ROWS][HEAD];
  __shared__ float p_s[ATTN_WARPS][ATTN_ROWS][WARP_SIZE];
  __shared__ long long off_s[ATTN_WARPS][WARP_SIZE];
  __shared__ float m_s[ATTN_WARPS][ATTN_ROWS];
  __shared__ float l_s[ATTN_WARPS][ATTN_ROWS];
  __shared__ float acc_s[ATTN_WARPS][ATTN_ROWS][HEAD];

  // Work items go along grid x (up to 2^31 - 1 blocks): no batch the scheduler forms can exceed it.
  const int kv_head = blockIdx.y;
  const int seq = work[2 * blockIdx.x];
  const int row0 = work[2 * blockIdx.x + 1];
  const int warp = threadIdx.x / WARP_SIZE;
  const int lane = threadIdx.x % WARP_SIZE;
  const int q_begin = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_begin;
  const int seq_len = seq_lens[seq];
  const int ctx_len = seq_len - q_len;  // position of the first new token
  const int num_rows = min(ATTN_ROWS, q_len * group - row0);
  const int num_heads = num_kv_heads * group;

  // Keys this block may need (cta_key_span): its partition's, none before kv_first.
  const KeySpan keys = cta_key_span(seq_len, ctx_len, row0, num_rows, group, window, partition_size, blockIdx.z);
  const int kv_first = keys.first, part_begin = keys.begin, part_end = keys.end;

  // The softmax scale and the pool's K scale of each channel are folded into q once instead of
  // into every score.
  for (int i = threadIdx.x; i < ATTN_ROWS * HEAD; i += ATTN_THREADS) {
    const int r = i / HEAD, d = i % HEAD, row = row0 + r;
    float q = 0.f;
    if (r < num_rows) {
      const int head = kv_head * group + row % group;
      const float q_scale = scale * (k_scale != nullptr ? k_scale[kv_head * HEAD + d] : 1.f);
      q = to_float(query[(long long)(q_begin + row / group) * q_stride + head * HEAD + d]) * q_scale;
    }
    q_s[r][d] = q;
  }
  __syncthreads();

  float m[ATTN_ROWS], l[ATTN_ROWS], acc[ATTN_ROWS][PER_LANE];
#pragma unroll
  for (int r = 0; r < ATTN_ROWS; ++r) {
    m[r] = neg_inf();
    l[r] = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) acc[r][i] = 0.f;
  }

  const long long token_stride = (long long)num_kv_heads * HEAD;
  for (int tile = part_begin + warp * WARP_SIZE; tile < part_end; tile += ATTN_WARPS * WARP_SIZE) {
    const int pos = tile + lane;
    const bool valid = pos >= kv_first && pos < part_end;
    long long off = 0;
    float s[ATTN_ROWS];
    if (valid) {
      const int block = block_tables[seq * max_blocks + pos / BLOCK];
      off = ((long long)block * BLOCK + pos % BLOCK) * token_stride + kv_head * HEAD;
      score_key<C, HEAD>(k_cache + off, q_s, num_rows, s);
    }
#pragma unroll
    for (int r = 0; r < ATTN_ROWS; ++r) {
      if (r >= num_rows) break;  // block-uniform: every lane leaves together, shuffles stay whole
      // causal: row r (query position ctx_len + its token) sees keys up to its own position, and
      // with a window only the last `window` of them
      const int row_pos = ctx_len + (row0 + r) / group;
      const bool visible = valid && pos <= row_pos && (window <= 0 || pos > row_pos - window);
      const float score = visible ? soft_cap(s[r], softcap, softcap_inv) : neg_inf();
      const float m_new = fmaxf(m[r], warp_max(score));
      const float p = score == neg_inf() ? 0.f : __expf(score - m_new);
      const float alpha = m[r] == neg_inf() ? 0.f : __expf(m[r] - m_new);
      l[r] = l[r] * alpha + warp_sum(p);
      m[r] = m_new;
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) acc[r][i] *= alpha;
      p_s[warp][r][lane] = p;
    }
    off_s[warp][lane] = off;
    __syncwarp();
    // Each V row is read once (lanes take interleaved dims: coalesced) and serves every row.
    const int num_keys = min(WARP_SIZE, part_end - tile);
    for (int j = max(0, kv_first - tile); j < num_keys; ++j) {  // keys before kv_first weigh 0 and are not read
      const C* v = v_cache + off_s[warp][j];
      float vf[PER_LANE];
#pragma unroll
      for (int i = 0; i < PER_LANE; ++i) vf[i] = to_float(v[lane + i * WARP_SIZE]);
#pragma unroll
      for (int r = 0; r < ATTN_ROWS; ++r) {
        if (r >= num_rows) break;
        const float p = p_s[warp][r][j];
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) acc[r][i] += p * vf[i];
      }
    }
    __syncwarp();  // p_s and off_s are rewritten by the next sub-tile
  }

#pragma unroll
  for (int r = 0; r < ATTN_ROWS; ++r) {
    if (lane == 0) {
      m_s[warp][r] = m[r];
      l_s[warp][r] = l[r];
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) acc_s[warp][r][lane + i * WARP_SIZE] = acc[r][i];
  }
  __syncthreads();

  // Merge the warps' partial softmax states, one (row, dim) per thread.
  for (int i = threadIdx.x; i < num_rows * HEAD; i += ATTN_THREADS) {
    const int r = i / HEAD, d = i % HEAD, row = row0 + r;
    float m_all = neg_inf();
    for (int w = 0; w < ATTN_WARPS; ++w) m_all = fmaxf(m_all, m_s[w][r]);
    float l_all = 0.f, o = 0.f;
    if (m_all != neg_inf()) {
      for (int w = 0; w < ATTN_WARPS; ++w) {
        if (m_s[w][r] == neg_inf()) continue;
        const float weight = __expf(m_s[w][r] - m_all);
        l_all += l_s[w][r] * weight;
        o += acc_s[w][r][d] * weight;
      }
    }
    // the pool's V scale of this channel, once per output
    o = l_all > 0.f ? o / l_all * (v_scale != nullptr ? v_scale[kv_head * HEAD + d] : 1.f) : 0.f;
    const long long out_row = (long long)(q_begin + row / group) * num_heads + kv_head * group + row % group;
    if (num_partitions == 1) {
      out[out_row * HEAD + d] = from_float<T>(o);
    } else {
      const long long p = out_row * num_partitions + blockIdx.z;
      part_out[p * HEAD + d] = o;
      if (d == 0) part_lse[p] = l_all > 0.f ? m_all + logf(l_all) : neg_inf();
    }
  }
}

// Merges the partitions (splits) of each (item, head) by log-sum-exp: every partition's normalized
// output is weighted by exp(lse_p - max lse). Empty partitions carry lse = -inf and weigh nothing.
// Only the listed tokens are merged: a step's decode and chunk tokens have their own partials.
template <typename T>
__global__ void __launch_bounds__(128) paged_attention_reduce(
    T* __restrict__ out,                   // [num_tokens, num_heads, head_dim]
    const float* __restrict__ part_out,    // [num_tokens, num_heads, num_partitions, head_dim]
    const float* __restrict__ part_lse,    // [num_tokens, num_heads, num_partitions]
    const int* __restrict__ item_tokens,   // [num_items]: the tokens to merge
    int num_heads, int num_partitions, int head_dim) {
  const long long item = blockIdx.x / num_heads, head = blockIdx.x % num_heads;
  const long long row = (long long)item_tokens[item] * num_heads + head;
  const float* lse = part_lse + row * num_partitions;
  float m_all = neg_inf();
  for (int p = 0; p < num_partitions; ++p) m_all = fmaxf(m_all, lse[p]);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    // the sums start at the first non-empty partition, so that one partition gives back its
    // output bit for bit (a -0 too), as an unsplit launch writes it
    float num = 0.f, den = 0.f;
    bool first = true;
    for (int p = 0; p < num_partitions; ++p) {
      if (lse[p] == neg_inf()) continue;
      const float weight = __expf(lse[p] - m_all);
      const float term = part_out[(row * num_partitions + p) * head_dim + d] * weight;
      num = first ? term : num + term;
      den = first ? weight : den + weight;
      first = false;
    }
    out[row * head_dim + d] = from_float<T>(den > 0.f ? num / den : 0.f);
  }
}

}  // namespace folio
