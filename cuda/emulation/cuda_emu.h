// CPU emulation of the bit of CUDA that folio's kernels use, so g++ compiles the SAME .cu sources.
//
// Test equipment, not a runtime: a launch runs the grid's blocks one after another; a block's
// threads are real std::threads running concurrently, __syncthreads is a std::barrier over the
// block, and warp shuffles / __syncwarp go through a per-warp exchange buffer and barrier. Since
// only one block runs at a time, a __shared__ variable can simply be a function-level static.
// cuda/LAYOUT.md lists what this cannot catch. Include it before the kernel sources
// (g++ -std=c++20 -include cuda_emu.h).
#pragma once

#include <barrier>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#define FOLIO_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // one block at a time: a static is exactly that block's shared copy

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace emu {

struct Warp {
  explicit Warp(int lanes) : barrier(lanes) {}
  std::barrier<> barrier;
  alignas(8) unsigned char slots[32][8];
  const void* rows[32];      // ldmatrix: each lane's row address
  unsigned frag_a[32][4];    // mma: each lane's A and B fragment registers
  unsigned frag_b[32][2];
};

struct Launch {
  dim3 grid, block;
  std::unique_ptr<std::barrier<>> block_barrier;
  std::vector<std::unique_ptr<Warp>> warps;
};

inline Launch* current = nullptr;  // set for the duration of one launch (launches are serialized)
inline thread_local dim3 thread_idx, block_idx;
inline thread_local int linear_tid = 0;

// cp.async queues of the calling thread (see FOLIO_EMU_CP_ASYNC below).
struct AsyncCopy {
  void* dst;
  const void* src;
  int src_bytes;
};
inline thread_local std::vector<AsyncCopy> open_group;               // issued, not yet committed
inline thread_local std::vector<std::vector<AsyncCopy>> committed;   // oldest first
inline void retire(const std::vector<AsyncCopy>& group) {
  for (const AsyncCopy& c : group) {
    std::memcpy(c.dst, c.src, c.src_bytes);
    std::memset(static_cast<unsigned char*>(c.dst) + c.src_bytes, 0, 16 - c.src_bytes);
  }
}

inline Warp& my_warp() { return *current->warps[linear_tid / 32]; }

// Every lane of the warp must call this (as CUDA's full-mask shuffles require), or it deadlocks.
template <typename T>
T exchange(T v, int src_lane) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  Warp& w = my_warp();
  std::memcpy(w.slots[linear_tid % 32], &v, sizeof(T));
  w.barrier.arrive_and_wait();
  T r;
  std::memcpy(&r, w.slots[src_lane & 31], sizeof(T));
  w.barrier.arrive_and_wait();  // nobody overwrites a slot before every lane has read
  return r;
}

// Runs the blocks with linear ids [first, first + count) of the grid (x fastest), with their
// real blockIdx: a test can run the far end of a grid too large to emulate whole.
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16, per the PTX ISA: lanes 8i..8i+7 give the
// row addresses of 8x8 matrix i; register i of lane l holds M_i[l/4][2(l%4)], M_i[l/4][2(l%4)+1]
// (low half first), or with .trans M_i[2(l%4)][l/4], M_i[2(l%4)+1][l/4]. A warp-wide collective.
inline void ldmatrix_x4(unsigned (&r)[4], const void* row, bool trans) {
  Warp& w = my_warp();
  const int lane = linear_tid % 32, g = lane / 4, t = lane % 4;
  w.rows[lane] = row;
  w.barrier.arrive_and_wait();
  for (int i = 0; i < 4; ++i) {
    std::uint16_t lo, hi;
    if (!trans) {
      const auto* p = static_cast<const std::uint16_t*>(w.rows[8 * i + g]);
      lo = p[2 * t];
      hi = p[2 * t + 1];
    } else {
      lo = static_cast<const std::uint16_t*>(w.rows[8 * i + 2 * t])[g];
      hi = static_cast<const std::uint16_t*>(w.rows[8 * i + 2 * t + 1])[g];
    }
    r[i] = lo | (static_cast<unsigned>(hi) << 16);
  }
  w.barrier.arrive_and_wait();
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: every lane hands in its fragments, the warp's
// A (16x16) and B (16x8) are rebuilt by the PTX ISA's fragment tables, and each lane adds its four
// entries of A * B to d in fp32 (the products of 16-bit inputs are exact in fp32).
template <typename Widen>
void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], Widen widen) {
  Warp& w = my_warp();
  const int lane = linear_tid % 32;
  std::memcpy(w.frag_a[lane], a, sizeof(a));
  std::memcpy(w.frag_b[lane], b, sizeof(b));
  w.barrier.arrive_and_wait();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int h = 0; h < 2; ++h) {
      auto elem = [&](unsigned reg) { return widen(static_cast<unsigned short>(reg >> (16 * h))); };
      A[g][2 * t + h] = elem(w.frag_a[l][0]);
      A[g + 8][2 * t + h] = elem(w.frag_a[l][1]);
      A[g][2 * t + 8 + h] = elem(w.frag_a[l][2]);
      A[g + 8][2 * t + 8 + h] = elem(w.frag_a[l][3]);
      B[2 * t + h][g] = elem(w.frag_b[l][0]);
      B[2 * t + 8 + h][g] = elem(w.frag_b[l][1]);
    }
  }
  w.barrier.arrive_and_wait();
  const int g = lane / 4, t = lane % 4;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int e = 0; e < 4; ++e) {
    float acc = d[e];
    for (int k = 0; k < 16; ++k) acc += A[rows[e]][k] * B[k][cols[e]];
    d[e] = acc;
  }
}

inline void launch(dim3 grid, dim3 block, const std::function<void()>& body, unsigned long long first,
                   unsigned long long count) {
  static std::mutex serialize;
  std::lock_guard<std::mutex> guard(serialize);
  const int num_threads = static_cast<int>(block.x * block.y * block.z);
  Launch l{grid, block, std::make_unique<std::barrier<>>(num_threads), {}};
  for (int first_lane = 0; first_lane < num_threads; first_lane += 32)
    l.warps.push_back(std::make_unique<Warp>(std::min(32, num_threads - first_lane)));
  current = &l;
  const unsigned long long total = 1ull * grid.x * grid.y * grid.z;
  const unsigned long long last = std::min(total, first + count);
  std::vector<std::thread> threads;
  for (int t = 0; t < num_threads; ++t) {
    threads.emplace_back([&, t] {
      linear_tid = t;
      thread_idx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
      for (unsigned long long b = first; b < last; ++b) {
        block_idx = {static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                     static_cast<unsigned>(b / (1ull * grid.x * grid.y))};
        body();
        emu::open_group.clear();  // copies never waited for are dropped (their data unused)
        emu::committed.clear();
        l.block_barrier->arrive_and_wait();  // the next block reuses the statics
      }
    });
  }
  for (auto& th : threads) th.join();
  current = nullptr;
}

// Kernel registry: name expression (as the loader spells it) -> launcher taking CUDA-style
// kernelParams (an array of pointers to each argument's value).
using Entry = std::function<void(dim3, dim3, void**, unsigned long long, unsigned long long)>;
inline std::map<std::string, Entry>& registry() {
  static std::map<std::string, Entry> r;
  return r;
}

template <typename... A, std::size_t... I>
void call_kernel(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<A>*>(params[I])...);
}

struct Registrar {
  template <typename... A>
  Registrar(const char* name, void (*kernel)(A...)) {
    registry()[name] = [kernel](dim3 grid, dim3 block, void** params, unsigned long long first,
                                unsigned long long count) {
      launch(grid, block, [&] { call_kernel(kernel, params, std::index_sequence_for<A...>{}); }, first, count);
    };
  }
};

}  // namespace emu

#define FOLIO_EMU_CAT_(a, b) a##b
#define FOLIO_EMU_CAT(a, b) FOLIO_EMU_CAT_(a, b)
// FOLIO_EMU_REGISTER(folio::write_kv<float>) registers the instance under its spelled name.
#define FOLIO_EMU_REGISTER(...) \
  static ::emu::Registrar FOLIO_EMU_CAT(folio_emu_reg_, __COUNTER__)(#__VA_ARGS__, &__VA_ARGS__);

#define threadIdx (::emu::thread_idx)
#define blockIdx (::emu::block_idx)
#define blockDim (::emu::current->block)
#define gridDim (::emu::current->grid)

inline void __syncthreads() { emu::current->block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::my_warp().barrier.arrive_and_wait(); }
template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask) { return emu::exchange(v, (emu::linear_tid % 32) ^ lane_mask); }
template <typename T>
T __shfl_sync(unsigned, T v, int src_lane) { return emu::exchange(v, src_lane); }

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
using std::fmaxf;
inline float logf(float x) { return std::log(x); }
using std::max;
using std::min;

// cp.async: each thread keeps its own queue of copies, in groups; a copy happens only when a
// cp_async_wait<N> retires its group (as late as the hardware may do it), so a kernel that reads
// its shared tile before the wait, or waits on the wrong group, reads stale data here too.

#define FOLIO_EMU_CP_ASYNC                                                                    \
  inline void cp_async16(void* smem, const void* gmem, int src_bytes) {                       \
    if (src_bytes < 0 || src_bytes > 16) std::abort();                                        \
    ::emu::open_group.push_back({smem, gmem, src_bytes});                                     \
  }                                                                                           \
  inline void cp_async_commit() {                                                             \
    ::emu::committed.push_back(std::move(::emu::open_group));                                 \
    ::emu::open_group.clear();                                                                \
  }                                                                                           \
  template <int N> inline void cp_async_wait() {                                              \
    while (::emu::committed.size() > static_cast<std::size_t>(N)) {                           \
      ::emu::retire(::emu::committed.front());                                                \
      ::emu::committed.erase(::emu::committed.begin());                                       \
    }                                                                                         \
  }

// Host versions of cuda/common.cuh's conversions; common.cuh expands this inside namespace folio,
// after its storage types, in place of the inline-PTX device versions.
#define FOLIO_EMU_CONVERSIONS                                                                 \
  inline float to_float(float x) { return x; }                                                \
  inline float to_float(f16 x) { _Float16 h; std::memcpy(&h, &x.bits, 2); return (float)h; }  \
  inline float to_float(bf16 x) { return __uint_as_float(((unsigned)x.bits) << 16); }          \
  template <typename T> T from_float(float x);                                                \
  template <> inline float from_float<float>(float x) { return x; }                           \
  template <> inline f16 from_float<f16>(float x) {                                           \
    _Float16 h = (_Float16)x; f16 r; std::memcpy(&r.bits, &h, 2); return r;                    \
  }                                                                                           \
  template <> inline bf16 from_float<bf16>(float x) { /* round to nearest even, as cvt.rn */   \
    unsigned u = __float_as_uint(x);                                                          \
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{(unsigned short)((u >> 16) | 0x40)};     \
    u += 0x7fffu + ((u >> 16) & 1u);                                                          \
    return bf16{(unsigned short)(u >> 16)};                                                   \
  }
