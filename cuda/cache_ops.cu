// Kernels that move KV data without computing on it: writing a step's new K/V into their pool
// slots, and copying whole blocks (copy-on-write inside the device pool, and swap between the
// device pool and a pinned host pool). See cuda/LAYOUT.md.
#include "common.cuh"

namespace folio {

// to_cache (common.cuh): a K/V element as the pool stores it.

// One CUDA block per new token; its threads stride over num_kv_heads * head_dim elements, so
// each token's K/V row is read and written with consecutive (coalesced) addresses. C is the
// pool's element type: T, or fp8e4m3 (then k_scale/v_scale are the layer's scales and k_shift
// its K shift, fp32 [num_kv_heads, head_dim] each; k_shift may be null). A pool of T ignores them.
template <typename T, typename C = T>
__global__ void __launch_bounds__(128) write_kv(
    const T* __restrict__ key,             // [num_tokens, num_kv_heads, head_dim], strided
    const T* __restrict__ value,           // [num_tokens, num_kv_heads, head_dim], strided
    C* __restrict__ k_cache,               // [num_blocks, block_size, num_kv_heads, head_dim]
    C* __restrict__ v_cache,               // [num_blocks, block_size, num_kv_heads, head_dim]
    const long long* __restrict__ slot_mapping,  // [num_tokens]; negative = padding
    int num_kv_heads, int head_dim, long long key_token_stride, long long key_head_stride,
    long long value_token_stride, long long value_head_stride, const float* __restrict__ k_scale,
    const float* __restrict__ v_scale, const float* __restrict__ k_shift) {
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  if (slot < 0) return;  // the whole block leaves together: no barrier below
  const int row = num_kv_heads * head_dim;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    const int head = i / head_dim, d = i % head_dim;
    k_cache[slot * row + i] =
        to_cache(key[token * key_token_stride + head * key_head_stride + d], k_scale, k_shift, i, k_cache);
    v_cache[slot * row + i] =
        to_cache(value[token * value_token_stride + head * value_head_stride + d], v_scale, nullptr, i, v_cache);
  }
}

struct alignas(16) copy_word { unsigned a, b, c, d; };

// grid = (num_pairs, num_caches): block (pair, cache) copies block src -> dst of one cache (one
// layer's K or V). Caches are given as raw addresses so that one launch covers every layer, and
// so that a source or destination may be a pinned host pool mapped into the device's address
// space (swap). block_words = bytes per block / 16.
__global__ void __launch_bounds__(256) copy_blocks(
    const long long* __restrict__ src_caches,  // [num_caches] base addresses
    const long long* __restrict__ dst_caches,  // [num_caches] base addresses
    const long long* __restrict__ pairs,       // [num_pairs, 2]: (src block, dst block)
    long long block_words) {
  const copy_word* src = reinterpret_cast<const copy_word*>(src_caches[blockIdx.y]);
  copy_word* dst = reinterpret_cast<copy_word*>(dst_caches[blockIdx.y]);
  const long long src_base = pairs[2 * blockIdx.x] * block_words;
  const long long dst_base = pairs[2 * blockIdx.x + 1] * block_words;
  for (long long i = threadIdx.x; i < block_words; i += blockDim.x) dst[dst_base + i] = src[src_base + i];
}

}  // namespace folio
