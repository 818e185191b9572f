// Fused elementwise kernels of a decoder layer: RMSNorm with the residual add, RoPE with the
// KV-cache write, and SiLU (or GeGLU's tanh GELU) times the gate. Each replaces several torch ops
// (and their launches and round trips through memory) by one pass. They round where the torch reference (model/llama.py) rounds,
// so in 16-bit types they agree with it up to the order of the RMS sum and the exponential.
// See cuda/LAYOUT.md.
#include "common.cuh"

namespace folio {

constexpr int NORM_THREADS = 256;
constexpr int ACT_THREADS = 256;
constexpr int ROPE_THREADS = 128;

// x rounded to T and widened back: where the reference rounds an intermediate result.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

template <typename T>
__device__ __forceinline__ void load16(const T* p, float (&out)[16 / sizeof(T)]) {
  const vec16<T> v = *reinterpret_cast<const vec16<T>*>(p);
#pragma unroll
  for (int i = 0; i < 16 / (int)sizeof(T); ++i) out[i] = to_float(v.e[i]);
}

template <typename T>
__device__ __forceinline__ void store16(T* p, const float (&in)[16 / sizeof(T)]) {
  vec16<T> v;
#pragma unroll
  for (int i = 0; i < 16 / (int)sizeof(T); ++i) v.e[i] = from_float<T>(in[i]);
  *reinterpret_cast<vec16<T>*>(p) = v;
}

// The sum of v over the block (NORM_THREADS threads), returned to every thread.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[NORM_THREADS / WARP_SIZE];
  const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
  v = warp_sum(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < NORM_THREADS / WARP_SIZE; ++w) total += partial[w];
  __syncthreads();  // partial is reused by the next call
  return total;
}

// One CUDA block per token. With add != 0: residual <- x + residual (rounded to T, as the
// reference's add), out <- RMSNorm(residual) * weight. With add == 0: out <- RMSNorm(x) * weight
// (residual unused). fp32 statistics; the normalized row is rounded to T before the weight, as the
// reference does. Rows are read and written as 16-byte vectors (hidden * sizeof(T) % 16 == 0);
// the second pass re-reads the row the first pass wrote (from L1/L2).
template <typename T>
__global__ void __launch_bounds__(NORM_THREADS) add_rms_norm(
    T* __restrict__ out,             // [num_tokens, hidden], contiguous
    T* __restrict__ residual,        // [num_tokens, hidden], contiguous; updated in place (add)
    const T* __restrict__ x,         // [num_tokens, hidden], token stride x_stride
    const T* __restrict__ weight,    // [hidden]
    int hidden, long long x_stride, float eps, int add) {
  constexpr int VEC = 16 / sizeof(T);
  const long long token = blockIdx.x;
  const T* src = x + token * x_stride;
  T* res = residual + token * hidden;
  float sum_sq = 0.f;
  for (int c = threadIdx.x * VEC; c < hidden; c += NORM_THREADS * VEC) {
    float v[VEC];
    load16<T>(src + c, v);
    if (add) {
      float r[VEC];
      load16<T>(res + c, r);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = round_to<T>(v[i] + r[i]);
      store16<T>(res + c, v);
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) sum_sq += v[i] * v[i];
  }
  const float inv_rms = 1.f / sqrtf(block_sum(sum_sq) / hidden + eps);
  const T* normed_src = add ? res : src;
  T* dst = out + token * hidden;
  for (int c = threadIdx.x * VEC; c < hidden; c += NORM_THREADS * VEC) {
    float v[VEC], w[VEC];
    load16<T>(normed_src + c, v);
    load16<T>(weight + c, w);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = w[i] * round_to<T>(v[i] * inv_rms);
    store16<T>(dst + c, v);
  }
}

// out[t, i] = silu(x[t, i]) * x[t, d + i]: the gate and up halves of the fused gate_up projection.
// silu is rounded to T before the product, as the reference's F.silu(gate) * up. __fdividef:
// the IEEE division's slow path spilled registers (fp32, sm_90); for a gate below about -88 the
// denominator overflows to inf and the result is 0, which silu's limit is.
// Grid (num_tokens), one block per token; d * sizeof(T) % 16 == 0.
template <typename T>
__global__ void __launch_bounds__(ACT_THREADS) silu_and_mul(
    T* __restrict__ out,        // [num_tokens, d], contiguous
    const T* __restrict__ x,    // [num_tokens, 2 * d], token stride x_stride
    int d, long long x_stride) {
  constexpr int VEC = 16 / sizeof(T);
  const long long token = blockIdx.x;
  const T* gate = x + token * x_stride;
  const T* up = gate + d;
  for (int c = threadIdx.x * VEC; c < d; c += ACT_THREADS * VEC) {
    float g[VEC], u[VEC];
    load16<T>(gate + c, g);
    load16<T>(up + c, u);
#pragma unroll
    for (int i = 0; i < VEC; ++i) g[i] = round_to<T>(__fdividef(g[i], 1.f + __expf(-g[i]))) * u[i];
    store16<T>(out + token * d + c, g);
  }
}

// out[t, i] = gelu_tanh(x[t, i]) * x[t, d + i]: GeGLU (Gemma), the tanh approximation of GELU,
// 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), in fp32 with torch's constants and grouping
// (F.gelu(approximate="tanh")), rounded to T before the product as the reference's
// F.gelu(gate, approximate="tanh") * up. Grid (num_tokens), one block per token; d * sizeof(T) % 16 == 0.
template <typename T>
__global__ void __launch_bounds__(ACT_THREADS) gelu_tanh_and_mul(
    T* __restrict__ out,        // [num_tokens, d], contiguous
    const T* __restrict__ x,    // [num_tokens, 2 * d], token stride x_stride
    int d, long long x_stride) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr float BETA = 0.7978845608028654f;  // sqrt(2 / pi): M_SQRT2 * M_2_SQRTPI * 0.5, as torch
  constexpr float KAPPA = 0.044715f;
  const long long token = blockIdx.x;
  const T* gate = x + token * x_stride;
  const T* up = gate + d;
  for (int c = threadIdx.x * VEC; c < d; c += ACT_THREADS * VEC) {
    float g[VEC], u[VEC];
    load16<T>(gate + c, g);
    load16<T>(up + c, u);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float inner = BETA * (g[i] + KAPPA * (g[i] * g[i] * g[i]));
      g[i] = round_to<T>(0.5f * g[i] * (1.f + tanhf(inner))) * u[i];
    }
    store16<T>(out + token * d + c, g);
  }
}

// Rotates the query and key heads of one token (rotate-half RoPE, cos/sin from the model's table,
// so every scaling type the table was built with, llama3 included) and writes the rotated key and
// the value into the token's pool slot: the reference's apply_rope on q and k plus write_kv, in one
// pass. The rotated query goes to q_out (heads contiguous, as the attention kernels read it).
// Work unit = one 16-byte vector of a head's first half and the matching vector of its second
// half, or one 16-byte vector of the value row. Padding tokens (slot < 0) rotate q, write nothing.
// Grid (num_tokens), one block per token; (head_dim / 2) * sizeof(T) % 16 == 0.
//
// C: the pool's element type, T or fp8e4m3. An fp8 pool's layer (kv_quant) also has a rotated
// basis: `rotation` (T [head_dim, head_dim], orthogonal) multiplies every q, k and v head after
// RoPE (the reference's `x @ rotation`, accumulated in fp32 and rounded to T once), and k and v
// are stored through to_cache with k_scale/v_scale/k_shift (fp32 [num_kv_heads, head_dim]; k_shift
// may be null). That path works head by head through shared memory (ROPE_ROT_FLOATS of them per
// pass); a pool of T without a rotation takes the vector path (rotation, scales and shift null).
constexpr int ROPE_ROT_FLOATS = 4096;

template <typename T, typename C = T>
__global__ void __launch_bounds__(ROPE_THREADS) rope_write_kv(
    T* __restrict__ q_out,                    // [num_tokens, num_heads, head_dim], contiguous
    C* __restrict__ k_cache,                  // [num_blocks, block_size, num_kv_heads, head_dim]
    C* __restrict__ v_cache,                  // [num_blocks, block_size, num_kv_heads, head_dim]
    const T* __restrict__ qkv,                // [num_tokens, (num_heads + 2 num_kv_heads) head_dim], stride
    const long long* __restrict__ positions,  // [num_tokens]
    const T* __restrict__ cos_table,          // [max_positions, head_dim]
    const T* __restrict__ sin_table,          // [max_positions, head_dim]
    const long long* __restrict__ slot_mapping,  // [num_tokens]; negative = padding
    int num_heads, int num_kv_heads, int head_dim, long long qkv_stride,
    const T* __restrict__ rotation,           // [head_dim, head_dim] or null
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, const float* __restrict__ k_shift) {
  constexpr int VEC = 16 / sizeof(T);
  const long long token = blockIdx.x;
  const long long slot = slot_mapping[token];
  const int half = head_dim / 2, vecs_per_half = half / VEC;
  const T* row = qkv + token * qkv_stride;
  const T* cos_row = cos_table + positions[token] * head_dim;
  const T* sin_row = sin_table + positions[token] * head_dim;
  const long long kv_row = (long long)num_kv_heads * head_dim;
  if (rotation != nullptr || sizeof(C) != sizeof(T)) {
    // heads [h0, h1) of q, k, v (in that order) per pass: RoPE'd (q, k) or copied (v) into x_s,
    // rounded to T as the reference's apply_rope leaves them; then each output element is a
    // column of the rotation (or the element itself), rounded to T, then stored
    __shared__ float x_s[ROPE_ROT_FLOATS];
    const int total_heads = num_heads + 2 * num_kv_heads, per_pass = ROPE_ROT_FLOATS / head_dim;
    for (int h0 = 0; h0 < total_heads; h0 += per_pass) {
      const int n = (min(total_heads, h0 + per_pass) - h0) * head_dim;
      for (int e = threadIdx.x; e < n; e += ROPE_THREADS) {
        const int head = h0 + e / head_dim, d = e % head_dim;
        const T* src = row + (long long)head * head_dim;
        float x;
        if (head < num_heads + num_kv_heads) {
          const float lo = to_float(src[d % half]), hi = to_float(src[d % half + half]);
          const float c = to_float(cos_row[d]), sn = to_float(sin_row[d]);
          x = d < half ? round_to<T>(lo * c) + round_to<T>(-hi * sn) : round_to<T>(hi * c) + round_to<T>(lo * sn);
          x = round_to<T>(x);
        } else {
          x = to_float(src[d]);
        }
        x_s[e] = x;
      }
      __syncthreads();
      for (int e = threadIdx.x; e < n; e += ROPE_THREADS) {
        const int local = e / head_dim, head = h0 + local, i = e % head_dim;
        float acc = x_s[e];
        if (rotation != nullptr) {
          acc = 0.f;
          for (int j = 0; j < head_dim; ++j) acc += x_s[local * head_dim + j] * to_float(rotation[j * head_dim + i]);
        }
        const T y = from_float<T>(acc);
        if (head < num_heads) {
          q_out[(token * num_heads + head) * head_dim + i] = y;
        } else if (slot >= 0 && head < num_heads + num_kv_heads) {
          const int c = (head - num_heads) * head_dim + i;
          k_cache[slot * kv_row + c] = to_cache(y, k_scale, k_shift, c, k_cache);
        } else if (slot >= 0) {
          const int c = (head - num_heads - num_kv_heads) * head_dim + i;
          v_cache[slot * kv_row + c] = to_cache(y, v_scale, nullptr, c, v_cache);
        }
      }
      __syncthreads();
    }
    return;
  }
  // a pool of T, no rotation: whole 16-byte vectors
  T* k_pool = reinterpret_cast<T*>(k_cache);
  T* v_pool = reinterpret_cast<T*>(v_cache);
  const int num_rotations = (num_heads + num_kv_heads) * vecs_per_half;
  const int num_units = num_rotations + (slot >= 0 ? num_kv_heads * head_dim / VEC : 0);
  for (int u = threadIdx.x; u < num_units; u += ROPE_THREADS) {
    if (u >= num_rotations) {  // a vector of the value row, copied as it is
      const int c = (u - num_rotations) * VEC;
      *reinterpret_cast<vec16<T>*>(v_pool + slot * kv_row + c) =
          *reinterpret_cast<const vec16<T>*>(row + (long long)(num_heads + num_kv_heads) * head_dim + c);
      continue;
    }
    const int head = u / vecs_per_half, c = (u % vecs_per_half) * VEC;
    const T* src = row + (long long)head * head_dim;
    float lo[VEC], hi[VEC], cl[VEC], ch[VEC], sl[VEC], sh[VEC], out_lo[VEC], out_hi[VEC];
    load16<T>(src + c, lo);
    load16<T>(src + half + c, hi);
    load16<T>(cos_row + c, cl);
    load16<T>(cos_row + half + c, ch);
    load16<T>(sin_row + c, sl);
    load16<T>(sin_row + half + c, sh);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {  // x * cos + rotate_half(x) * sin, each product rounded to T
      out_lo[i] = round_to<T>(lo[i] * cl[i]) + round_to<T>(-hi[i] * sl[i]);
      out_hi[i] = round_to<T>(hi[i] * ch[i]) + round_to<T>(lo[i] * sh[i]);
    }
    T* dst;
    if (head < num_heads) {
      dst = q_out + (token * num_heads + head) * head_dim;
    } else if (slot >= 0) {
      dst = k_pool + slot * kv_row + (long long)(head - num_heads) * head_dim;
    } else {
      continue;
    }
    store16<T>(dst + c, out_lo);
    store16<T>(dst + half + c, out_hi);
  }
}

}  // namespace folio
