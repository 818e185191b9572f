// Paged decode attention: one new token per sequence. See cuda/LAYOUT.md for the arguments and
// the launch geometry.
//
// One CTA per (sequence, KV head, split of the context). It streams the split's K/V rows of its
// KV head through shared memory once, in tiles, with 16-byte cp.async copies in a STAGES-deep
// pipeline, and every query head of the GQA group reads them there: each K/V byte leaves global
// memory once per KV head. Threads form rows of TPR lanes; a lane owns one 16-byte vector of a
// K/V row (its VEC head dims) and the matching dims of q and of the output. A thread row takes
// some heads of the group and some keys of each tile, keeps an online softmax per head, and the
// rows that split the keys of one head merge through shared memory at the end. A split CTA
// writes its normalized output and log-sum-exp; paged_attention_reduce merges the splits.
//
// Per-layer options, run-time arguments of the one kernel: a sliding window (the token at position
// p sees keys p - window < k <= p; the key loop starts at the window's first key, so keys before
// it are never read, and splits cut the window, not the whole context) and a logit soft-cap
// (score = cap * tanh(score / cap) before the softmax).
#include "common.cuh"

namespace folio {

constexpr int DECODE_THREADS = 128;
constexpr int DECODE_MAX_GROUP = 16;  // query heads per KV head this kernel serves
constexpr int DECODE_STAGES = 3;      // tiles in flight: the one computed on and two loading
constexpr int DECODE_KEYS_PER_STEP = 2;  // keys a thread scores between two softmax rescales
// At least 4 resident CTAs per SM (512 threads; up to 128 registers a thread): enough loads in
// flight per SM, and (oddly) without it ptxas spills a few bytes on the head-128 instances.
constexpr int DECODE_MIN_CTAS = 4;

constexpr int pow2_floor(int x) {
  int p = 1;
  while (2 * p <= x) p *= 2;
  return p;
}

// T: the activations' type (q, out); C: the pool's (T, or fp8e4m3: a lane's VEC dims of a K/V row
// are then VEC bytes, and one 16-byte copy carries CVEC = 16 dims).
template <typename T, int HEAD, typename C = T>
struct DecodeShape {
  static constexpr int VEC = 16 / sizeof(T);  // elements per 16-byte vector of T: a lane's dims
  static constexpr int CHUNKS = HEAD / VEC;  // lanes' vectors per K/V row
  static constexpr int CVEC = 16 / sizeof(C);  // pool elements per 16-byte copy
  static constexpr int CCHUNKS = HEAD / CVEC;  // 16-byte copies per K/V row
  static constexpr int TPR = CHUNKS <= 8 ? 8 : CHUNKS <= 16 ? 16 : 32;  // lanes per thread row
  static constexpr int ROWS = DECODE_THREADS / TPR;  // thread rows
  static constexpr int HPT = (DECODE_MAX_GROUP + ROWS - 1) / ROWS;  // most heads a thread row takes
  // Keys per tile: K + V of a tile stay within 12 KB, so three stages fit the static 48 KB.
  static constexpr int TILE = pow2_floor(12288 / (2 * HEAD * (int)sizeof(T)));
  static constexpr int TILE_ELEMS = TILE * HEAD;
  static constexpr int PIPE_BYTES = DECODE_STAGES * 2 * TILE_ELEMS * (int)sizeof(C);
  static constexpr int MERGE_BYTES = ROWS * HPT * (HEAD + 2) * (int)sizeof(float);
  static constexpr int SMEM_BYTES = PIPE_BYTES > MERGE_BYTES ? PIPE_BYTES : MERGE_BYTES;
  static_assert(HEAD % VEC == 0 && CHUNKS <= 32, "a K/V row must be whole 16-byte vectors, at most 32");
  static_assert(TILE % (ROWS * DECODE_KEYS_PER_STEP) == 0, "every thread row takes as many keys of a tile");
};

// The K/V load path: the tile of keys [first, first + TILE) of one KV head, from the paged pool
// into shared memory ([TILE][HEAD] each for K and V), as 16-byte cp.async copies. Consecutive
// threads take consecutive vectors of a row, then the next row: whole 32-byte sectors, coalesced.
// Keys at or past `end` are zero-filled (no read), so no stale or NaN bytes reach the math.
// The tiles hold the pool's raw elements (C): an fp8 pool is widened by read_vec below.
template <typename T, int HEAD, int BLOCK, typename C>
__device__ __forceinline__ void load_kv_tile(C* k_s, C* v_s, const C* __restrict__ k_cache,
                                             const C* __restrict__ v_cache, const int* __restrict__ table,
                                             int first, int end, long long token_stride, int head_offset) {
  using S = DecodeShape<T, HEAD, C>;
  for (int c = threadIdx.x; c < S::TILE * S::CCHUNKS; c += DECODE_THREADS) {
    const int key = c / S::CCHUNKS, col = c % S::CCHUNKS, pos = first + key;
    const bool valid = pos < end;
    long long off = 0;
    if (valid) off = ((long long)table[pos / BLOCK] * BLOCK + pos % BLOCK) * token_stride + head_offset + col * S::CVEC;
    cp_async16(k_s + key * HEAD + col * S::CVEC, k_cache + off, valid ? 16 : 0);
    cp_async16(v_s + key * HEAD + col * S::CVEC, v_cache + off, valid ? 16 : 0);
  }
}

// VEC consecutive elements of a row (16 bytes of T; VEC bytes of an fp8 pool), widened to fp32.
template <typename C, int VEC>
__device__ __forceinline__ void read_vec(const C* p, float (&f)[VEC]) {
  const vecn<C, VEC> w = *reinterpret_cast<const vecn<C, VEC>*>(p);
#pragma unroll
  for (int v = 0; v < VEC; ++v) f[v] = to_float(w.e[v]);
}

// Sum over the TPR lanes of a thread row (consecutive lanes of one warp).
template <int TPR>
__device__ __forceinline__ float row_sum(float v) {
#pragma unroll
  for (int mask = TPR / 2; mask > 0; mask /= 2) v += __shfl_xor_sync(FULL_MASK, v, mask);
  return v;
}

template <typename T, int HEAD, int BLOCK, typename C = T>
__global__ void __launch_bounds__(DECODE_THREADS, DECODE_MIN_CTAS) paged_decode(
    T* __restrict__ out,                      // [num_tokens, num_heads, HEAD]; written unsplit
    float* __restrict__ part_out,             // [num_tokens, num_heads, num_splits, HEAD] (split)
    float* __restrict__ part_lse,             // [num_tokens, num_heads, num_splits] (split)
    const T* __restrict__ query,              // [num_tokens, num_heads, HEAD], token stride q_stride
    const C* __restrict__ k_cache,            // [num_blocks, BLOCK, num_kv_heads, HEAD]
    const C* __restrict__ v_cache,            // [num_blocks, BLOCK, num_kv_heads, HEAD]
    const int* __restrict__ block_tables,     // [num_seqs, max_blocks]
    const int* __restrict__ seq_lens,         // [num_seqs]
    const int* __restrict__ query_start_loc,  // [num_seqs + 1]
    const int* __restrict__ items,            // [num_items]: the sequence of each decode item
    int num_kv_heads, int group, int max_blocks, long long q_stride, float scale, int num_splits,
    int split_size, const float* __restrict__ k_scale, const float* __restrict__ v_scale, int window,
    float softcap, float softcap_inv) {
  // k_scale, v_scale: an fp8 pool's, fp32 [num_kv_heads, HEAD] (per head and channel); null for a
  // pool of T
  using S = DecodeShape<T, HEAD, C>;
  constexpr int VEC = S::VEC, HPT = S::HPT, KJ = DECODE_KEYS_PER_STEP;
  alignas(16) __shared__ unsigned char smem[S::SMEM_BYTES];
  C* pipe = reinterpret_cast<C*>(smem);  // [STAGES][K, V][TILE][HEAD]

  const int item = blockIdx.x / num_splits, split = blockIdx.x % num_splits;
  const int kv_head = blockIdx.y;
  const int seq = items[item];
  const int token = query_start_loc[seq];
  const int seq_len = seq_lens[seq];
  // the keys this sequence reads: its last `window` positions (window > 0), else the whole context;
  // split s takes keys [key_begin + s * split_size, +split_size) of them (empty past the end)
  const int key_begin = window > 0 ? max(0, seq_len - window) : 0;
  const int begin = key_begin + split * split_size;
  const int end = min(seq_len, begin + split_size);
  const int num_heads = num_kv_heads * group;

  // Thread rows: head slot hs takes heads hs, hs + slots, ...; key slot kz takes key pairs kz,
  // kz + key_slots, ... of every tile. All of it is uniform over a thread row.
  const int tx = threadIdx.x % S::TPR, ty = threadIdx.x / S::TPR;
  int gpad = 1;
  while (gpad < group) gpad *= 2;
  const int head_slots = min(gpad, S::ROWS), key_slots = S::ROWS / head_slots;
  const int hs = ty % head_slots, kz = ty / head_slots, hpt = gpad / head_slots;
  const bool lane_on = tx < S::CHUNKS;  // head 96: 12 of 16 lanes hold data

  float q[HPT][VEC], acc[HPT][VEC], m[HPT], l[HPT];
#pragma unroll
  for (int i = 0; i < HPT; ++i) {
    const int h = hs + head_slots * i;
    m[i] = neg_inf();
    l[i] = 0.f;
#pragma unroll
    for (int v = 0; v < VEC; ++v) q[i][v] = acc[i][v] = 0.f;
    if (i < hpt && h < group && lane_on) {
      // the softmax scale and the pool's K scale of each channel are folded into q once instead of
      // into every score
      read_vec<T, VEC>(query + token * q_stride + (long long)(kv_head * group + h) * HEAD + tx * VEC, q[i]);
#pragma unroll
      for (int v = 0; v < VEC; ++v)
        q[i][v] *= scale * (k_scale != nullptr ? k_scale[kv_head * HEAD + tx * VEC + v] : 1.f);
    }
  }

  const int* table = block_tables + (long long)seq * max_blocks;
  const long long token_stride = (long long)num_kv_heads * HEAD;
  const int num_tiles = begin < end ? (end - begin + S::TILE - 1) / S::TILE : 0;
#pragma unroll
  for (int s = 0; s < DECODE_STAGES - 1; ++s) {
    if (s < num_tiles)
      load_kv_tile<T, HEAD, BLOCK, C>(pipe + 2 * s * S::TILE_ELEMS, pipe + (2 * s + 1) * S::TILE_ELEMS, k_cache, v_cache,
                                   table, begin + s * S::TILE, end, token_stride, kv_head * HEAD);
    cp_async_commit();  // empty groups too: the wait below counts groups
  }
  for (int t = 0; t < num_tiles; ++t) {
    __syncthreads();  // every thread is done with the stage the next load overwrites
    const int next = t + DECODE_STAGES - 1;
    if (next < num_tiles) {
      const int st = next % DECODE_STAGES;
      load_kv_tile<T, HEAD, BLOCK, C>(pipe + 2 * st * S::TILE_ELEMS, pipe + (2 * st + 1) * S::TILE_ELEMS, k_cache,
                                   v_cache, table, begin + next * S::TILE, end, token_stride, kv_head * HEAD);
    }
    cp_async_commit();
    cp_async_wait<DECODE_STAGES - 1>();  // this thread's copies of tile t have landed
    __syncthreads();                     // and everyone else's
    const C* k_s = pipe + 2 * (t % DECODE_STAGES) * S::TILE_ELEMS;
    const C* v_s = k_s + S::TILE_ELEMS;
    const int first = begin + t * S::TILE;
    for (int j = kz * KJ; j < S::TILE; j += key_slots * KJ) {
      float s[KJ][HPT], vf[KJ][VEC];
#pragma unroll
      for (int kj = 0; kj < KJ; ++kj) {
        float kf[VEC];
#pragma unroll
        for (int v = 0; v < VEC; ++v) kf[v] = vf[kj][v] = 0.f;
        if (lane_on) {
          read_vec<C, VEC>(k_s + (j + kj) * HEAD + tx * VEC, kf);
          read_vec<C, VEC>(v_s + (j + kj) * HEAD + tx * VEC, vf[kj]);
        }
        const bool visible = first + j + kj < end;
#pragma unroll
        for (int i = 0; i < HPT; ++i) {
          if (i >= hpt) break;  // uniform over the block: the row's shuffles stay whole
          float dot = 0.f;
#pragma unroll
          for (int v = 0; v < VEC; ++v) dot += q[i][v] * kf[v];
          dot = row_sum<S::TPR>(dot);
          s[kj][i] = visible ? soft_cap(dot, softcap, softcap_inv) : neg_inf();
        }
      }
#pragma unroll
      for (int i = 0; i < HPT; ++i) {
        if (i >= hpt) break;
        float m_new = m[i];
#pragma unroll
        for (int kj = 0; kj < KJ; ++kj) m_new = fmaxf(m_new, s[kj][i]);
        if (m_new == neg_inf()) continue;  // nothing visible yet
        const float alpha = m[i] == neg_inf() ? 0.f : __expf(m[i] - m_new);
        float p[KJ];
        l[i] *= alpha;
#pragma unroll
        for (int kj = 0; kj < KJ; ++kj) {
          p[kj] = s[kj][i] == neg_inf() ? 0.f : __expf(s[kj][i] - m_new);
          l[i] += p[kj];
        }
        m[i] = m_new;
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          float a = acc[i][v] * alpha;
#pragma unroll
          for (int kj = 0; kj < KJ; ++kj) a += p[kj] * vf[kj][v];
          acc[i][v] = a;
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline's shared memory becomes the merge buffer

  // Merge the key slots of each head: entry e = kz * gpad + h.
  float* m_s = reinterpret_cast<float*>(smem);
  float* l_s = m_s + S::ROWS * HPT;
  float* acc_s = l_s + S::ROWS * HPT;
#pragma unroll
  for (int i = 0; i < HPT; ++i) {
    const int h = hs + head_slots * i;
    if (i >= hpt || h >= group) break;
    const int e = kz * gpad + h;
    if (tx == 0) {
      m_s[e] = m[i];
      l_s[e] = l[i];
    }
    if (lane_on) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc_s[e * HEAD + tx * VEC + v] = acc[i][v];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * HEAD; idx += DECODE_THREADS) {
    const int h = idx / HEAD, d = idx % HEAD;
    float m_all = neg_inf();
    for (int z = 0; z < key_slots; ++z) m_all = fmaxf(m_all, m_s[z * gpad + h]);
    float l_all = 0.f, o = 0.f;
    if (m_all != neg_inf()) {
      for (int z = 0; z < key_slots; ++z) {
        const int e = z * gpad + h;
        if (m_s[e] == neg_inf()) continue;
        const float w = __expf(m_s[e] - m_all);
        l_all += l_s[e] * w;
        o += acc_s[e * HEAD + d] * w;
      }
    }
    // the pool's V scale of this channel, once per output
    o = l_all > 0.f ? o / l_all * (v_scale != nullptr ? v_scale[kv_head * HEAD + d] : 1.f) : 0.f;
    const int head = kv_head * group + h;
    if (num_splits == 1) {
      out[((long long)token * num_heads + head) * HEAD + d] = from_float<T>(o);
    } else {
      const long long p = ((long long)token * num_heads + head) * num_splits + split;
      part_out[p * HEAD + d] = o;
      if (d == 0) part_lse[p] = l_all > 0.f ? m_all + logf(l_all) : neg_inf();
    }
  }
}

}  // namespace folio
