// Helpers shared by the CPU kernels: lane masks and splitting work between the calling thread and
// XLA's intra-op thread pool.
//
// Work is split into runs of items that the calling thread and the pool's tasks claim from a shared
// counter. The caller never waits for a task that has not started: it takes every item nobody has
// claimed, then waits only for items already being computed. So a busy (or absent) pool costs
// parallelism, never a deadlock.

#ifndef PATHSERVE_KERNELS_CPU_COMMON_H_
#define PATHSERVE_KERNELS_CPU_COMMON_H_

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#define PATHSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

namespace pathserve {

// Below this much work (multiply-adds) one thread is faster than waking another.
constexpr int64_t kParallelWork = int64_t{1} << 18;

// The first `count` of 16 lanes (all 16 from 16 up, none below 1).
inline __mmask16 Lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF)
                     : static_cast<__mmask16>((1u << std::max<int64_t>(count, 0)) - 1);
}

// rows[which[r]] (`which` null: rows[r]) for r < m, `cols` 4-byte values each (floats, or int16
// pairs and int8 quads as int32) -> out[blocks, cols, 4]: the 4 values a register block of 4 rows
// broadcasts at each step lie together, so each block streams its x from one place instead of 4
// rows apart (worth ~10% at batch 32, where x no longer fits in L1 beside the weights). Lanes past
// m are zeros. 4 rows x 8 columns per step, transposed in registers (AVX2; one copy for every
// matmul handler): a scalar copy of each value took ~4% of a 256-row int8 matmul's samples, on
// one thread before the tiles share out, ~1% this way.
template <typename T>
__attribute__((target("avx2"))) void InterleaveRows(const T* rows, const int64_t* which, int64_t m, int64_t cols,
                                                    T* out) {
  static_assert(sizeof(T) == 4, "4-byte values");
  thread_local std::vector<T> zeros;  // the rows past m
  if (m % 4 && static_cast<int64_t>(zeros.size()) < cols) zeros.assign(cols, T{});
  for (int64_t b = 0; b < (m + 3) / 4; ++b) {
    const T* src[4];
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t r = 4 * b + j;
      src[j] = r < m ? rows + (which ? which[r] : r) * cols : zeros.data();
    }
    T* dst = out + b * cols * 4;
    int64_t i = 0;
    for (; i + 8 <= cols; i += 8) {
      __m256i q[4];
      for (int j = 0; j < 4; ++j) q[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[j] + i));
      // per 128-bit half: columns (0 1 2 3) of each row -> (r0 r1 r2 r3) of each column
      const __m256i a = _mm256_unpacklo_epi32(q[0], q[1]), b2 = _mm256_unpacklo_epi32(q[2], q[3]);
      const __m256i c = _mm256_unpackhi_epi32(q[0], q[1]), d = _mm256_unpackhi_epi32(q[2], q[3]);
      const __m256i c0 = _mm256_unpacklo_epi64(a, b2), c1 = _mm256_unpackhi_epi64(a, b2);  // columns 0, 1 | 4, 5
      const __m256i c2 = _mm256_unpacklo_epi64(c, d), c3 = _mm256_unpackhi_epi64(c, d);   // columns 2, 3 | 6, 7
      __m256i* to = reinterpret_cast<__m256i*>(dst + i * 4);
      _mm256_storeu_si256(to, _mm256_permute2x128_si256(c0, c1, 0x20));
      _mm256_storeu_si256(to + 1, _mm256_permute2x128_si256(c2, c3, 0x20));
      _mm256_storeu_si256(to + 2, _mm256_permute2x128_si256(c0, c1, 0x31));
      _mm256_storeu_si256(to + 3, _mm256_permute2x128_si256(c2, c3, 0x31));
    }
    for (; i < cols; ++i)
      for (int j = 0; j < 4; ++j) dst[i * 4 + j] = src[j][i];
  }
}

// Allocates on 64-byte lines: an AMX tile row that straddles two lines costs two loads (measured:
// a float32 AMX loop on vectors with 16-byte alignment ran at half speed).
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64)); }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

template <typename Body>
struct Shared {
  Shared(Body b, int64_t n, int64_t t) : body(std::move(b)), items(n), threads(t) {}
  Body body;
  const int64_t items;
  const int64_t threads;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Claims shrinking runs of items (a share of what is left) until none are left: long runs first,
  // so each thread streams contiguous weights, short ones at the end, so threads finish together.
  void Drain() {
    int64_t mine = 0;
    int64_t first = next.load(std::memory_order_relaxed);
    while (first < items) {
      const int64_t run = std::max<int64_t>(1, (items - first) / (2 * threads));
      if (next.compare_exchange_weak(first, first + run, std::memory_order_relaxed)) {
        body(first, first + run);
        mine += run;
        first = next.load(std::memory_order_relaxed);
      }
    }
    done.fetch_add(mine, std::memory_order_release);
  }
};

// body(first, last) over runs of items [0, items), on this thread alone when `work` is small.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, int64_t work, Body body) {
  const int64_t threads = std::min<int64_t>(pool.num_threads(), items);
  if (threads <= 1 || work < kParallelWork) {
    body(0, items);
    return;
  }
  auto shared = std::make_shared<Shared<Body>>(std::move(body), items, threads);
  for (int64_t i = 1; i < threads; ++i) pool.Schedule([shared] { shared->Drain(); });
  shared->Drain();
  for (int spins = 0; shared->done.load(std::memory_order_acquire) < items; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

// The checks the handlers share: x[M, K], w[(layers,) tiles, inner, width(, group)], y[M, N], layer.
struct Shapes {
  int64_t m, k, n, tiles, layers, index;
};

inline xla::ffi::ErrorOr<Shapes> CheckShapes(const char* name, xla::ffi::Span<const int64_t> xd, xla::ffi::Span<const int64_t> wd,
                                 xla::ffi::Span<const int64_t> yd, size_t rank, int64_t inner, int64_t layer,
                                 int64_t width = 64, int64_t group = 2) {
  const size_t lead = wd.size() == rank + 1 ? 1 : 0;
  const std::string where = std::string(name) + ": ";
  if (xd.size() != 2 || yd.size() != 2 || wd.size() != rank + lead || wd[lead + 2] != width ||
      (rank == 4 && wd[lead + 3] != group)) {
    return xla::ffi::Unexpected(xla::ffi::Error::InvalidArgument(where + "expected x[M, K], a packed w and y[M, N]"));
  }
  Shapes s{xd[0], xd[1], yd[1], wd[lead], lead ? wd[0] : 1, layer};
  if (yd[0] != s.m || wd[lead + 1] != inner || (s.n + width - 1) / width != s.tiles) {
    return xla::ffi::Unexpected(xla::ffi::Error::InvalidArgument(where + "shapes disagree: x[" + std::to_string(s.m) + ", " +
                                       std::to_string(s.k) + "], y[" + std::to_string(yd[0]) + ", " +
                                       std::to_string(s.n) + "], " + std::to_string(s.tiles) + " tiles of " +
                                       std::to_string(wd[lead + 1]) + " rows"));
  }
  if (layer < 0 || layer >= s.layers) {
    return xla::ffi::Unexpected(xla::ffi::Error::InvalidArgument(where + "layer " + std::to_string(layer) + " of " + std::to_string(s.layers)));
  }
  return s;
}

// The rows of x[M, K] a matmul computes. `counts` [G] splits the M rows into G groups of M / G
// consecutive rows and says how many of each group's first rows count: a prompt row's true length
// (padding past it), or 1 or 0 for a decode row that is active or not. Fills `rows` with the
// counted rows' indices in order (the kernels quantize and multiply only those, then store each
// result row at its index) and zeroes y[M, N]'s other rows. Returns how many rows count.
inline xla::ffi::ErrorOr<int64_t> SelectRows(const char* name, int64_t m, const xla::ffi::Buffer<xla::ffi::S32>& counts,
                                             int64_t n, float* y, std::vector<int64_t>& rows) {
  const int64_t groups = static_cast<int64_t>(counts.element_count());
  if (groups < 1 || m % groups != 0) {
    return xla::ffi::Unexpected(xla::ffi::Error::InvalidArgument(
        std::string(name) + ": " + std::to_string(groups) + " row counts do not split " + std::to_string(m) + " rows"));
  }
  const int64_t span = m / groups;
  rows.clear();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t count = std::clamp<int64_t>(counts.typed_data()[g], 0, span);
    for (int64_t r = 0; r < count; ++r) rows.push_back(g * span + r);
    std::fill(y + (g * span + count) * n, y + (g + 1) * span * n, 0.0f);
  }
  return static_cast<int64_t>(rows.size());
}

}  // namespace pathserve

#endif  // PATHSERVE_KERNELS_CPU_COMMON_H_
