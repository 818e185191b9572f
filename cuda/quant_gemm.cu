// W4A16 matrix products over AutoAWQ's GEMM layout: y[M, N] = x[M, K] @ W[K, N], with W held as
// 4-bit codes and dequantized in registers, w[k][n] = (q[k][n] - z[k/g][n]) * s[k/g][n].
//
//   qweight [K, N/8] int32: word (k, j) holds columns 8j..8j+7 of row k, column 8j + AWQ_ORDER[i]
//                           in nibble i (bits 4i..4i+3), AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7;
//   qzeros  [K/g, N/8] int32, the same packing; scales [K/g, N] f16.
//
// awq_gemv (a few rows: decode) streams qweight once with 16-byte loads and writes fp32 partial
// sums per K slice; awq_gemm (many rows: chunks) dequantizes a tile to shared memory and runs FMA
// on CUDA cores. Both accumulate in fp32. Requirements (checked by folio/core/executor/quant/gpu.py):
// N % 32 == 0, g % 32 == 0, K % g == 0, contiguous x. See cuda/LAYOUT.md.
#include "common.cuh"

namespace folio {

constexpr int GEMV_THREADS = 256;  // 8 warps
constexpr int GEMV_ROWS = 2;       // activation rows per block (grid z covers more)
constexpr int GEMV_COLS = 256;     // output columns per block: 8 lanes x 32 columns (one 16-byte word group)
constexpr int GEMV_RUN = 8;        // contiguous k-rows per thread, inside one group (g % 8 == 0)
constexpr int GEMV_K = 256;        // k-rows per block: 32 runs (4 per warp)
constexpr int GEMM_THREADS = 256;
constexpr int GEMM_BM = 32;        // rows of x per block
constexpr int GEMM_BN = 128;       // output columns per block
constexpr int GEMM_BK = 32;        // k-rows per tile (g % 32 == 0: one group per tile)

// Four words of a packed row: 32 columns, read as one 16-byte load.
struct alignas(16) words4 { unsigned w[4]; };

// Column c (0..7) of a packed word, as an exact float: 2^23 + c's bits as a float, minus 2^23.
__device__ __forceinline__ float awq_nibble(unsigned word, int c) {
  const int shift = 4 * ((c & 1) * 4 + (c >> 1));  // nibble i holds column AWQ_ORDER[i]
  return __uint_as_float(0x4B000000u | ((word >> shift) & 0xFu)) - 8388608.f;
}

// Decode: partial[blockIdx.y, m, n] = sum over this block's GEMV_K rows of x[m, k] * w[k, n].
// Thread = 32 output columns (one 16-byte load of qweight per k-row) x GEMV_RUN consecutive
// k-rows of one group: it sums x * q and x alone over its run, then applies the group's scale
// and zero once: s * (sum x q - z * sum x). The 32 runs of a column tile are summed with warp
// shuffles (4 runs per warp) and shared memory (8 warps).
// Grid (ceil(N / GEMV_COLS), ceil(K / GEMV_K), ceil(M / GEMV_ROWS)), block GEMV_THREADS.
template <typename T>
__global__ void __launch_bounds__(GEMV_THREADS) awq_gemv(
    float* __restrict__ partial,         // [gridDim.y, M, N] fp32
    const T* __restrict__ x,             // [M, K], contiguous
    const int* __restrict__ qweight,     // [K, N / 8]
    const int* __restrict__ qzeros,      // [K / g, N / 8]
    const f16* __restrict__ scales,      // [K / g, N]
    int M, int N, int K, int group_size) {
  __shared__ float red[GEMV_THREADS / WARP_SIZE][GEMV_ROWS * 32][8];
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  const int chunk = lane % 8, run = warp * 4 + lane / 8;
  const int col0 = blockIdx.x * GEMV_COLS + chunk * 32;
  const int k0 = blockIdx.y * GEMV_K + run * GEMV_RUN;
  const int m0 = blockIdx.z * GEMV_ROWS;
  const int rows = min(GEMV_ROWS, M - m0);
  const long long words = N / 8;
  float acc[GEMV_ROWS][32];
#pragma unroll
  for (int m = 0; m < GEMV_ROWS; ++m)
#pragma unroll
    for (int c = 0; c < 32; ++c) acc[m][c] = 0.f;
  if (col0 < N && k0 < K) {  // K % 8 == 0: a run is whole
    words4 q[GEMV_RUN];
#pragma unroll
    for (int r = 0; r < GEMV_RUN; ++r) q[r] = *reinterpret_cast<const words4*>(qweight + (k0 + r) * words + col0 / 8);
    float xsum[GEMV_ROWS];
#pragma unroll
    for (int m = 0; m < GEMV_ROWS; ++m) xsum[m] = 0.f;
#pragma unroll
    for (int r = 0; r < GEMV_RUN; ++r) {
      float xv[GEMV_ROWS];
#pragma unroll
      for (int m = 0; m < GEMV_ROWS; ++m) {
        xv[m] = m < rows ? to_float(x[(long long)(m0 + m) * K + k0 + r]) : 0.f;
        xsum[m] += xv[m];
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const float w = awq_nibble(q[r].w[j], c);
#pragma unroll
          for (int m = 0; m < GEMV_ROWS; ++m) acc[m][j * 8 + c] = fmaf(xv[m], w, acc[m][j * 8 + c]);
        }
    }
    const int g = k0 / group_size;
    const words4 z = *reinterpret_cast<const words4*>(qzeros + g * words + col0 / 8);
    const f16* s = scales + g * (long long)N + col0;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const float sc = to_float(s[j * 8 + c]), zc = awq_nibble(z.w[j], c);
#pragma unroll
        for (int m = 0; m < GEMV_ROWS; ++m) acc[m][j * 8 + c] = sc * (acc[m][j * 8 + c] - zc * xsum[m]);
      }
  }
#pragma unroll
  for (int m = 0; m < GEMV_ROWS; ++m) {
    if (m >= rows) break;  // uniform over the block
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      float v = acc[m][c];
      v += __shfl_xor_sync(FULL_MASK, v, 8);
      v += __shfl_xor_sync(FULL_MASK, v, 16);
      if (lane < 8) red[warp][m * 32 + c][chunk] = v;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows * GEMV_COLS; i += GEMV_THREADS) {
    const int m = i / GEMV_COLS, col = i % GEMV_COLS, n = blockIdx.x * GEMV_COLS + col;
    if (n >= N) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < GEMV_THREADS / WARP_SIZE; ++w) sum += red[w][m * 32 + col % 32][col / 32];
    partial[((long long)blockIdx.y * M + m0 + m) * N + n] = sum;
  }
}

// Chunks: y[m, n] for a GEMM_BM x GEMM_BN tile over K rows [z k_split, (z + 1) k_split). Per
// GEMM_BK step, x's tile goes to shared memory as fp32 (transposed) and the weight tile is
// dequantized into shared memory as fp32 by 128 threads (one 16-byte load of qweight each); every
// thread then owns 4 rows x 4 columns (columns tx + 32 j: consecutive lanes, consecutive banks)
// and runs FMA. One K split (gridDim.z == 1) writes y in T; more write fp32 partial sums.
// Grid (ceil(N / GEMM_BN), ceil(M / GEMM_BM), ceil(K / k_split)), block GEMM_THREADS.
template <typename T>
__global__ void __launch_bounds__(GEMM_THREADS) awq_gemm(
    T* __restrict__ y,                   // [M, N], contiguous (one split)
    float* __restrict__ partial,         // [gridDim.z, M, N] fp32 (several splits)
    const T* __restrict__ x,             // [M, K], contiguous
    const int* __restrict__ qweight,     // [K, N / 8]
    const int* __restrict__ qzeros,      // [K / g, N / 8]
    const f16* __restrict__ scales,      // [K / g, N]
    int M, int N, int K, int group_size, int k_split) {  // k_split % GEMM_BK == 0
  __shared__ float xs[GEMM_BK][GEMM_BM];
  __shared__ float ws[GEMM_BK][GEMM_BN + 4];  // +4: the dequantizing stores hit 8 banks, not 1
  const int tid = threadIdx.x, tx = tid % 32, ty = tid / 32;
  const int m_base = blockIdx.y * GEMM_BM, n_base = blockIdx.x * GEMM_BN;
  const long long words = N / 8;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  const int k_end = min(K, (int)(blockIdx.z + 1) * k_split);
  for (int k0 = blockIdx.z * k_split; k0 < k_end; k0 += GEMM_BK) {
    {  // x tile: thread = 4 consecutive k of one row
      const int r = tid / 8, c = (tid % 8) * 4, m = m_base + r;
#pragma unroll
      for (int i = 0; i < 4; ++i) xs[c + i][r] = m < M ? to_float(x[(long long)m * K + k0 + c + i]) : 0.f;
    }
    if (tid < GEMM_BK * 4) {  // weight tile: thread = 32 columns of one k-row
      const int r = tid / 4, cw = (tid % 4) * 32, n = n_base + cw;
      float* dst = &ws[r][cw];
      if (n < N) {
        const int g = (k0 + r) / group_size;
        const words4 q = *reinterpret_cast<const words4*>(qweight + (k0 + r) * words + n / 8);
        const words4 z = *reinterpret_cast<const words4*>(qzeros + g * words + n / 8);
        const f16* s = scales + g * (long long)N + n;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int c = 0; c < 8; ++c)
            dst[j * 8 + c] = (awq_nibble(q.w[j], c) - awq_nibble(z.w[j], c)) * to_float(s[j * 8 + c]);
      } else {
#pragma unroll
        for (int c = 0; c < 32; ++c) dst[c] = 0.f;
      }
    }
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < GEMM_BK; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = xs[kk][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = ws[kk][tx + 32 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = m_base + ty * 4 + i;
    if (m >= M) break;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = n_base + tx + 32 * j;
      if (n >= N) continue;
      if (gridDim.z == 1) {
        y[(long long)m * N + n] = from_float<T>(acc[i][j]);
      } else {
        partial[((long long)blockIdx.z * M + m) * N + n] = acc[i][j];
      }
    }
  }
}

}  // namespace folio
