// y[M, N] = x[M, K] @ w[K, N] on x86 CPUs with AVX-512 (and AMX where present), for float32 weights
// and for int8 weights with per-column scales. XLA FFI handlers: PathserveF32Matmul,
// PathserveInt8Matmul, PathserveInt8AmxMatmul, PathserveF32AmxMatmul, PathserveF32BlocksAmxMatmul.
//
// Why: on XLA:CPU a decode step's matrix-vector products stream weights far below the memory
// bandwidth. Inside a scan each layer's weight slice is copied before the dot; int8 weights are
// converted to float before it (or, for int8 x int8, take a path that moves a few GB/s). Here the
// weights are read once, in place, in a layout made for the loop below, by the calling thread and
// XLA's intra-op pool together.
//
// Weights are packed once (serving/kernels/cpu_matmul.py), 64 output columns per tile:
// - float32: [tiles, K, 64]; each k adds x[k] * 64 weights (four 16-lane FMAs per row of x).
// - int8: [tiles, pairs, 64, 2], the weights of input rows 2k and 2k+1 side by side for each column:
//   the operand layout of vpdpwssd, which multiplies them with a broadcast (x[2k], x[2k+1]). Each row
//   of x is quantized to int16 (symmetric, absmax / 32767: near lossless next to int8 weights) and
//   32 multiply-adds run per instruction, straight from the int8 weights. int32 sums are flushed to
//   float every kPairs pairs, so they cannot overflow: 2 * 128 * 32767 * 127 < 2^31.
// - int8 on AMX (PathserveInt8AmxMatmul, where the CPU has AMX-INT8): [tiles, quads, 16, 4], 16
//   columns per tile, input rows in fours per column: a tile's weights for 64 input rows are one
//   AMX B tile (1 KB, read straight from memory). The int16 activations are split into a signed
//   high byte and an unsigned low byte (x = 256 * high + low), two tile multiplies per weight tile
//   (TDPBSSD, TDPBUSD) with exact int32 sums over all of K, combined in float at the end. A tile
//   multiply costs the same for 1 row as for 16, yet is cheap enough that even one row is bound by
//   reading the weights; at batch 32 the AVX-512 loop above is bound by its multiply-adds instead
//   (AMX: ~3x its rate there, measured with 30 distinct layers on two threads).
// - float32 on AMX (PathserveF32AmxMatmul, where the CPU has AMX-BF16, for weights that are each
//   exactly the sum of two bfloat16, checked when packing): [tiles, blocks * 32, 16, 2] bfloat16, per
//   16 columns and block of 32 input rows one B tile of the weights' high halves and one of their
//   low halves (the same 4 bytes per weight as float32). x is split exactly into three bfloat16
//   parts; six tile multiplies per block give every product exactly, summed in float32 (TDPBF16PS
//   flushes denormals). ~1.5x the AVX-512 loop at batch 32, where that loop is bound by its FMAs.
// - float32 in blocks on AMX (PathserveF32BlocksAmxMatmul, AMX-BF16, for weights that are, per block
//   of 32 inputs and column, integers times a scale plus an offset with no rounding: dequantized
//   Q8_0 and Q4_1 GGUF tensors, checked when packing): [tiles, blocks * 16, 16, 2] bfloat16
//   integers, one B tile per 16 columns and block, and [tiles, blocks, 2, 16] float32 scales and
//   offsets. Three tile multiplies per block (x's parts times the integers, exact), then per block
//   sums += scale * block sums + offset * sum(x over the block), in float32. ~2.1 bytes per weight
//   instead of 4: the decode step reads about half.
// Any of them may hold every layer ([layers, ...]): the `layer` operand picks one in place, so a scanned
// model does not copy each layer's weight out of the stack.
//
// Rows that do not count: the AVX-512 handlers (and cpu_int8.cc's) take `counts` [G], x's M rows in
// G groups of M / G, each group's first counts[g] computed and the others zeros, not read
// (pathserve::SelectRows): a prompt's padding to its length bucket and a decode bucket's inactive
// rows cost no multiply-adds (the mixed benchmark padded 19% of its prompt tokens). The AMX
// handlers compute every row.
//
// Threads: the output tiles are shared out between the calling thread and XLA's intra-op pool
// (pathserve::ParallelFor in cpu_common.h).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_amx.h"
#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using pathserve::CheckShapes;
using pathserve::Lanes;
using pathserve::Shapes;

constexpr int64_t kTile = 64;    // output columns per packed tile: four vectors of 16 lanes
constexpr int64_t kPairs = 128;  // int8: input-row pairs per int32 accumulation
constexpr int kRows = 4;         // rows of x per register block
static_assert(kRows == 4, "pathserve::InterleaveRows interleaves blocks of 4 rows");

constexpr int64_t kChunk = 128;  // float32: input rows per pass over a tile (32 KB of weights, in L1)

// Partial sums of columns [t * 64, t * 64 + 64), computed rows [row, row + R) (y's rows out[row + r]),
// kept in y between passes over the input rows: loaded unless this is the first pass, scaled (int8)
// after the last, stored.
template <int R>
struct Block {
  __m512 sum[R][4];

  PATHSERVE_AVX512 void Start(const float* y, const int64_t* out, int64_t n, int64_t t, int64_t row, bool first) {
    for (int c = 0; c < 4; ++c) {
      const __mmask16 mask = Lanes(n - (t * kTile + 16 * c));
      for (int r = 0; r < R; ++r)
        sum[r][c] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, y + out[row + r] * n + t * kTile + 16 * c);
    }
  }

  PATHSERVE_AVX512 void Finish(float* y, const int64_t* out_rows, int64_t n, int64_t t, int64_t row,
                               const float* w_scales, const float* x_scales) {
    for (int c = 0; c < 4; ++c) {
      const int64_t col = t * kTile + 16 * c;
      const __mmask16 mask = Lanes(n - col);
      for (int r = 0; r < R; ++r) {
        __m512 out = sum[r][c];
        if (w_scales) {
          out = _mm512_mul_ps(out, _mm512_mul_ps(_mm512_loadu_ps(w_scales + col), _mm512_set1_ps(x_scales[row + r])));
        }
        _mm512_mask_storeu_ps(y + out_rows[row + r] * n + col, mask, out);
      }
    }
  }
};

// Lines of a later pass's weights that one row block asks for (into L2) while it computes, so that
// the weights stream in from memory while earlier passes run from cache. Spread over every row
// block (and over each block's steps) so that a few lines are in flight at a time, not a whole pass
// at once. Two passes ahead measured best (one pass: int8 batch 1 ~15% slower).
struct Prefetch {
  const char* next = nullptr;  // first line, then advancing
  const char* end = nullptr;
  int64_t per_step = 0;

  PATHSERVE_AVX512 void Step() {
    for (int64_t i = 0; i < per_step && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

struct F32Problem {
  const float* x;  // [blocks, K, kRows]: x's rows interleaved in blocks of kRows (InterleaveRows)
  const float* w;  // [tiles, K, kTile]
  float* y;        // [M, N]
  const int64_t* out;  // [m]: the row of y each computed row goes to (pathserve::SelectRows)
  int64_t m, k, n, tiles;

  static constexpr int64_t kStepBytes = kTile * sizeof(float);  // weights per input row

  int64_t depth() const { return k; }
  int64_t chunk() const { return kChunk; }
  const char* weights(int64_t t, int64_t k0) const { return reinterpret_cast<const char*>(w + (t * k + k0) * kTile); }

  // Input rows [k0, k1) of tile `t` into rows [row, row + R) of y.
  template <int R>
  PATHSERVE_AVX512 void Rows(int64_t t, int64_t row, int64_t k0, int64_t k1, Prefetch prefetch) const {
    const float* wp = w + (t * k + k0) * kTile;
    const float* xr = x + row * k;  // row is a multiple of kRows: its block starts here
    Block<R> block;
    block.Start(y, out, n, t, row, k0 == 0);
    for (int64_t i = k0; i < k1; ++i, wp += kTile) {
      prefetch.Step();
      __m512 wv[4];
      for (int c = 0; c < 4; ++c) wv[c] = _mm512_loadu_ps(wp + 16 * c);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(xr[i * kRows + r]);
        for (int c = 0; c < 4; ++c) block.sum[r][c] = _mm512_fmadd_ps(xv, wv[c], block.sum[r][c]);
      }
    }
    block.Finish(y, out, n, t, row, nullptr, nullptr);
  }
};

struct Int8Problem {
  const int32_t* x;       // [blocks, pairs, kRows] of int16 pairs, interleaved like F32Problem's x
  const float* x_scales;  // [M]
  const int8_t* w;        // [tiles, pairs, kTile, 2]
  const float* w_scales;  // [tiles * kTile]
  float* y;               // [M, N]
  const int64_t* out;     // [m]: the row of y each computed row goes to
  int64_t m, pairs, n, tiles;

  static constexpr int64_t kStepBytes = kTile * 2;  // weights per input-row pair

  int64_t depth() const { return pairs; }
  int64_t chunk() const { return kPairs; }
  const char* weights(int64_t t, int64_t k0) const { return reinterpret_cast<const char*>(w + (t * pairs + k0) * kTile * 2); }

  // Input-row pairs [k0, k1) of tile `t` into rows [row, row + R) of y (one int32 accumulation).
  template <int R>
  PATHSERVE_AVX512 void Rows(int64_t t, int64_t row, int64_t k0, int64_t k1, Prefetch prefetch) const {
    const int8_t* wp = w + (t * pairs + k0) * kTile * 2;
    const int32_t* xr = x + row * pairs;
    __m512i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; ++k, wp += kTile * 2) {
      prefetch.Step();
      __m512i wv[4];
      for (int c = 0; c < 4; ++c)
        wv[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * c)));
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(xr[k * kRows + r]);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpwssd_epi32(acc[r][c], xv, wv[c]);
      }
    }
    Block<R> block;
    block.Start(y, out, n, t, row, k0 == 0);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) block.sum[r][c] = _mm512_add_ps(block.sum[r][c], _mm512_cvtepi32_ps(acc[r][c]));
    const bool last = k1 == pairs;
    block.Finish(y, out, n, t, row, last ? w_scales : nullptr, x_scales);
  }
};

// Rows [r0, r1) (r0 a multiple of kRows) of tile `t`: pass by pass over the input rows, every block
// of rows, so a pass's weights are read from memory once (prefetched two passes before) and from L1
// by the other row blocks: once per part where the rows are split in parts (below; parts on two
// threads stream the tile twice, from L3 at best). Tiles and passes lie one after another, so later
// passes start where this ends (after the last one, the lines asked for are simply not used: a
// prefetch never faults).
template <typename Problem>
void TileRows(const Problem& p, int64_t t, int64_t r0, int64_t r1) {
  const int64_t blocks = (r1 - r0 + kRows - 1) / kRows;
  const int64_t lines = p.chunk() * Problem::kStepBytes / 64;  // of a whole pass
  const int64_t per_block = (lines + blocks - 1) / blocks;
  for (int64_t k0 = 0; k0 < p.depth(); k0 += p.chunk()) {
    const int64_t k1 = std::min(p.depth(), k0 + p.chunk());
    const char* next = p.weights(t, k1) + lines * 64;  // the pass after the next
    const auto prefetch = [&](int64_t row) {
      const int64_t begin = std::min(lines, (row - r0) / kRows * per_block);
      const int64_t end = std::min(lines, begin + per_block);
      return Prefetch{next + 64 * begin, next + 64 * end, (end - begin + (k1 - k0) - 1) / (k1 - k0)};
    };
    int64_t row = r0;
    for (; row + kRows <= r1; row += kRows) p.template Rows<kRows>(t, row, k0, k1, prefetch(row));
    switch (r1 - row) {
      case 3: p.template Rows<3>(t, row, k0, k1, prefetch(row)); break;
      case 2: p.template Rows<2>(t, row, k0, k1, prefetch(row)); break;
      case 1: p.template Rows<1>(t, row, k0, k1, prefetch(row)); break;
      default: break;
    }
  }
}

// Rows per part when a tile's rows are split between threads (below: one part).
constexpr int64_t kPartRows = 32;

// Items [first, last) of `parts` per tile: item i is tile i / parts, its rows' part i % parts.
template <typename Problem>
void Items(const Problem& p, int64_t parts, int64_t first, int64_t last) {
  const int64_t span = ((p.m + parts - 1) / parts + kRows - 1) / kRows * kRows;
  for (int64_t i = first; i < last; ++i) {
    const int64_t r0 = i % parts * span, r1 = std::min(p.m, r0 + span);
    if (r0 < r1) TileRows(p, i / parts, r0, r1);
  }
}

// All tiles of `problem`, shared out between threads when the work is large enough. 64 rows or
// more (a prompt's; a decode call of 64 rows too) split each tile's rows into parts too, so that a
// few tiles still share out evenly: SmolLM2's 576-wide outputs are 9 tiles, 5 against 4 on two
// threads.
template <typename Problem>
void Run(ffi::ThreadPool& pool, const Problem& problem, int64_t multiply_adds) {
  const int64_t parts = std::clamp<int64_t>(problem.m / kPartRows, 1, 8);
  pathserve::ParallelFor(pool, problem.tiles * parts, multiply_adds,
                         [problem, parts](int64_t first, int64_t last) { Items(problem, parts, first, last); });
}

// Rows x[which[r]] (`which` null: x[r]) for r < m of x[., K] as int16 with their scales (absmax /
// 32767), zero-padded to 2 * pairs columns. A row holding NaN or infinity gets a NaN scale, so the
// output carries it as a float matmul would.
PATHSERVE_AVX512 void QuantizeRows(const float* x, const int64_t* which, int64_t m, int64_t k, int64_t pairs,
                                   int16_t* xq, float* scales) {
  const int64_t width = 2 * pairs;
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + (which ? which[r] : r) * k;
    __m512 vmax = _mm512_setzero_ps();
    __m512 nonfinite = _mm512_setzero_ps();  // x * 0 is NaN exactly where x is NaN or infinite
    for (int64_t i = 0; i < k; i += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(Lanes(k - i), row + i);
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
      nonfinite = _mm512_add_ps(nonfinite, _mm512_mul_ps(v, _mm512_setzero_ps()));
    }
    const float absmax = _mm512_reduce_max_ps(vmax);
    const bool finite = !std::isnan(_mm512_reduce_add_ps(nonfinite));
    int16_t* out = xq + r * width;
    if (!finite || !(absmax > 0)) {
      std::fill(out, out + width, int16_t{0});
      scales[r] = finite ? 0.0f : NAN;
      continue;
    }
    scales[r] = absmax / 32767.0f;
    const __m512 inv = _mm512_set1_ps(32767.0f / absmax);
    for (int64_t i = 0; i < width; i += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(Lanes(k - i), row + i), inv));
      _mm256_mask_storeu_epi16(out + i, Lanes(width - i), _mm512_cvtsepi32_epi16(q));
    }
  }
}

ffi::Error F32Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> counts, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  auto shapes = CheckShapes("f32_matmul", xd, w.dimensions(), y->dimensions(), 3, xd.size() == 2 ? xd[1] : -1,
                            layer.typed_data()[0]);
  if (shapes.has_error()) return shapes.error();
  const Shapes& s = *shapes;
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  thread_local std::vector<int64_t> rows;  // per calling thread: XLA may run two matmuls at once
  thread_local std::vector<float> xi;
  auto m = pathserve::SelectRows("f32_matmul", s.m, counts, s.n, y->typed_data(), rows);
  if (m.has_error()) return m.error();
  if (*m == 0) return ffi::Error::Success();
  const float* w_layer = w.typed_data() + s.index * s.tiles * s.k * kTile;
  xi.resize(((*m + kRows - 1) / kRows) * kRows * s.k);
  pathserve::InterleaveRows(x.typed_data(), rows.data(), *m, s.k, xi.data());
  const F32Problem problem{xi.data(), w_layer, y->typed_data(), rows.data(), *m, s.k, s.n, s.tiles};
  Run(pool, problem, *m * s.k * s.tiles * kTile);
  return ffi::Error::Success();
}

ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                      ffi::Buffer<ffi::F32> w_scales, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> counts,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const int64_t pairs = xd.size() == 2 ? (xd[1] + 1) / 2 : -1;
  auto shapes = CheckShapes("int8_matmul", xd, w.dimensions(), y->dimensions(), 4, pairs, layer.typed_data()[0]);
  if (shapes.has_error()) return shapes.error();
  const Shapes& s = *shapes;
  if (static_cast<int64_t>(w_scales.element_count()) != s.layers * s.tiles * kTile) {
    return ffi::Error::InvalidArgument("int8_matmul: scales must hold one float per packed column");
  }
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  // Per calling thread: XLA may run two matmuls at once on different threads.
  thread_local std::vector<int64_t> rows;
  thread_local std::vector<int16_t> xq;
  thread_local std::vector<int32_t> xi;
  thread_local std::vector<float> x_scales;
  auto m = pathserve::SelectRows("int8_matmul", s.m, counts, s.n, y->typed_data(), rows);
  if (m.has_error()) return m.error();
  if (*m == 0) return ffi::Error::Success();
  xq.resize(*m * 2 * pairs);
  xi.resize(((*m + kRows - 1) / kRows) * kRows * pairs);
  x_scales.resize(*m);
  QuantizeRows(x.typed_data(), rows.data(), *m, s.k, pairs, xq.data(), x_scales.data());
  pathserve::InterleaveRows(reinterpret_cast<const int32_t*>(xq.data()), nullptr, *m, pairs, xi.data());
  const Int8Problem problem{xi.data(),
                            x_scales.data(),
                            w.typed_data() + s.index * s.tiles * pairs * kTile * 2,
                            w_scales.typed_data() + s.index * s.tiles * kTile,
                            y->typed_data(),
                            rows.data(),
                            *m,
                            pairs,
                            s.n,
                            s.tiles};
  Run(pool, problem, *m * 2 * pairs * s.tiles * kTile);
  return ffi::Error::Success();
}

// ---- AMX: readiness, tile configuration, int8 weights -----------------------------------------

#if PATHSERVE_HAS_AMX

using pathserve::AmxReady;
using pathserve::kAmxBf16;
using pathserve::kAmxCols;
using pathserve::kAmxDepth;
using pathserve::kAmxInt8;
using pathserve::kAmxRows;
using pathserve::PrefetchTile;
using pathserve::TileConfig;

constexpr int64_t kAmxMaxDepth = 65536;  // low-byte sums stay in int32: 255 * 128 * 65536 < 2^31

struct Int8AmxProblem {
  // x's int16 rows as bytes, [M, depth] (or, past one row tile, [mtiles * 16, depth] with zero rows):
  const int8_t* x_high;   // signed high bytes
  const uint8_t* x_low;   // unsigned low bytes
  const float* x_scales;  // [M]
  const int8_t* w;        // [tiles, depth / 4, 16, 4]
  const float* w_scales;  // [tiles * 16]
  float* y;               // [M, N]
  int64_t m, n, tiles, mtiles, depth;

  const int8_t* weights(int64_t t) const { return w + t * depth * kAmxCols; }

  // y rows of row tile `mt`, columns of tile `t`, from the int32 sums of the high and low bytes.
  PATHSERVE_AMX void Finish(int64_t mt, int64_t t, const int32_t* high, const int32_t* low) const {
    const int64_t rows = std::min(kAmxRows, m - mt * kAmxRows), col = t * kAmxCols;
    const __mmask16 mask = Lanes(n - col);
    const __m512 ws = _mm512_loadu_ps(w_scales + col);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(high + 16 * r)), _mm512_set1_ps(256.0f),
                                         _mm512_cvtepi32_ps(_mm512_load_si512(low + 16 * r)));
      const __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(x_scales[mt * kAmxRows + r]));
      _mm512_mask_storeu_ps(y + (mt * kAmxRows + r) * n + col, mask, _mm512_mul_ps(sum, scale));
    }
  }
};

// Asks for the weights `kAhead` tile multiplies ahead (measured: 2 to 4 best, 8 worse).
constexpr int64_t kAhead = 4;

// Column tiles [first, last). Tile registers: 0-3 int32 sums, 4-5 x's high and low bytes, 6-7
// weights. With one row tile, two column tiles at a time (sums: high and low of each); with more,
// one column tile for two row tiles at a time, so each weight tile read serves 32 rows.
PATHSERVE_AMX void AmxTiles(const Int8AmxProblem& p, int64_t first, int64_t last) {
  // Tiles of x and of the sums hold 16 rows, or M when M is less: no padding rows to compute.
  const uint8_t rows = static_cast<uint8_t>(std::min(kAmxRows, p.m));
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.colsb[i] = 64;
    config.rows[i] = i < 6 ? rows : kAmxRows;
  }
  _tile_loadconfig(&config);
  const int64_t steps = p.depth / kAmxDepth;
  const int64_t stride = p.depth;  // bytes between rows of x_high, x_low
  alignas(64) int32_t high[kAmxRows * kAmxCols], low[kAmxRows * kAmxCols];
  if (p.mtiles == 1) {
    for (int64_t t = first; t < last; t += 2) {
      const bool two = t + 1 < last;
      const int8_t* w0 = p.weights(t);
      const int8_t* w1 = two ? p.weights(t + 1) : w0;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        PrefetchTile(w0 + (s + kAhead) * 1024);
        if (two) PrefetchTile(w1 + (s + kAhead) * 1024);
        _tile_loadd(4, p.x_high + s * kAmxDepth, stride);
        _tile_loadd(5, p.x_low + s * kAmxDepth, stride);
        _tile_loadd(6, w0 + s * 1024, 64);
        _tile_loadd(7, w1 + s * 1024, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbusd(1, 5, 6);
        _tile_dpbssd(2, 4, 7);
        _tile_dpbusd(3, 5, 7);
      }
      _tile_stored(0, high, 64);
      _tile_stored(1, low, 64);
      p.Finish(0, t, high, low);
      if (two) {
        _tile_stored(2, high, 64);
        _tile_stored(3, low, 64);
        p.Finish(0, t + 1, high, low);
      }
    }
  } else {
    for (int64_t t = first; t < last; ++t) {
      const int8_t* wt = p.weights(t);
      for (int64_t mt = 0; mt < p.mtiles; mt += 2) {
        const bool two = mt + 1 < p.mtiles;
        const int8_t* h = p.x_high + mt * kAmxRows * stride;
        const uint8_t* l = p.x_low + mt * kAmxRows * stride;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps; ++s) {
          if (mt == 0) PrefetchTile(wt + (s + kAhead) * 1024);  // later row tiles find it in cache
          _tile_loadd(6, wt + s * 1024, 64);
          _tile_loadd(4, h + s * kAmxDepth, stride);
          _tile_loadd(5, l + s * kAmxDepth, stride);
          _tile_dpbssd(0, 4, 6);
          _tile_dpbusd(1, 5, 6);
          if (two) {
            _tile_loadd(4, h + kAmxRows * stride + s * kAmxDepth, stride);
            _tile_loadd(5, l + kAmxRows * stride + s * kAmxDepth, stride);
            _tile_dpbssd(2, 4, 6);
            _tile_dpbusd(3, 5, 6);
          }
        }
        _tile_stored(0, high, 64);
        _tile_stored(1, low, 64);
        p.Finish(mt, t, high, low);
        if (two) {
          _tile_stored(2, high, 64);
          _tile_stored(3, low, 64);
          p.Finish(mt + 1, t, high, low);
        }
      }
    }
  }
  _tile_release();
}

// int16 rows [M, depth] -> their high bytes (signed) and low bytes (unsigned), rows M.. zero.
PATHSERVE_AVX512 void SplitBytes(const int16_t* xq, int64_t m, int64_t rows, int64_t depth, int8_t* high,
                                 uint8_t* low) {
  for (int64_t i = 0; i < m * depth; i += 32) {
    const __m512i v = _mm512_loadu_si512(xq + i);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(high + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(low + i), _mm512_cvtepi16_epi8(v));
  }
  std::fill(high + m * depth, high + rows * depth, int8_t{0});
  std::fill(low + m * depth, low + rows * depth, uint8_t{0});
}

ffi::Error Int8AmxMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                         ffi::Buffer<ffi::F32> w_scales, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  if (!AmxReady(kAmxInt8)) return ffi::Error::InvalidArgument("int8_amx_matmul: this CPU (or kernel) does not run AMX");
  const auto xd = x.dimensions();
  const int64_t depth = xd.size() == 2 ? (xd[1] + kAmxDepth - 1) / kAmxDepth * kAmxDepth : -1;
  auto shapes = CheckShapes("int8_amx_matmul", xd, w.dimensions(), y->dimensions(), 4, depth / 4,
                            layer.typed_data()[0], kAmxCols, 4);
  if (shapes.has_error()) return shapes.error();
  const Shapes& s = *shapes;
  if (depth > kAmxMaxDepth) return ffi::Error::InvalidArgument("int8_amx_matmul: at most 65536 inputs");
  if (static_cast<int64_t>(w_scales.element_count()) != s.layers * s.tiles * kAmxCols) {
    return ffi::Error::InvalidArgument("int8_amx_matmul: scales must hold one float per packed column");
  }
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  const int64_t mtiles = (s.m + kAmxRows - 1) / kAmxRows;
  // Per calling thread: XLA may run two matmuls at once on different threads.
  thread_local std::vector<int16_t> xq;
  thread_local pathserve::LineVector<int8_t> high;
  thread_local pathserve::LineVector<uint8_t> low;
  thread_local std::vector<float> x_scales;
  xq.resize(s.m * depth);
  const int64_t rows = mtiles > 1 ? mtiles * kAmxRows : s.m;  // past one tile, whole tiles of rows
  high.resize(rows * depth);
  low.resize(rows * depth);
  x_scales.resize(s.m);
  QuantizeRows(x.typed_data(), nullptr, s.m, s.k, depth / 2, xq.data(), x_scales.data());
  SplitBytes(xq.data(), s.m, rows, depth, high.data(), low.data());
  const Int8AmxProblem problem{high.data(),
                               low.data(),
                               x_scales.data(),
                               w.typed_data() + s.index * s.tiles * depth * kAmxCols,
                               w_scales.typed_data() + s.index * s.tiles * kAmxCols,
                               y->typed_data(),
                               s.m,
                               s.n,
                               s.tiles,
                               mtiles,
                               depth};
  // Items are pairs of column tiles: the one-row-tile loop takes two at a time.
  pathserve::ParallelFor(pool, (s.tiles + 1) / 2, s.m * depth * s.tiles * kAmxCols, [problem](int64_t first, int64_t last) {
    AmxTiles(problem, 2 * first, std::min(2 * last, problem.tiles));
  });
  return ffi::Error::Success();
}

// ---- float32 weights on AMX (bfloat16 parts) --------------------------------------------------

constexpr int64_t kBf16Depth = 32;  // input rows per tile multiply (an A tile row: 32 bfloat16)
constexpr int kXParts = 3;          // a float32 is exactly the sum of three bfloat16 (8 + 8 + 8 bits)
constexpr int64_t kBf16Ahead = 2;   // blocks of weights asked for ahead (measured: 2 best of 2, 4, 8)

// Rows of row tile `mt` (`rows` per tile), columns of tile `t` of y[M, N], from the tile's float32
// sums [rows, 16].
PATHSERVE_AVX512 void StoreSums(float* y, int64_t m, int64_t n, int64_t rows, int64_t mt, int64_t t, const float* sums) {
  const int64_t count = std::min(rows, m - mt * rows), col = t * kAmxCols;
  const __mmask16 mask = Lanes(n - col);
  for (int64_t r = 0; r < count; ++r)
    _mm512_mask_storeu_ps(y + (mt * rows + r) * n + col, mask, _mm512_load_ps(sums + kAmxCols * r));
}

struct F32AmxProblem {
  const uint16_t* x;  // x's bfloat16 parts, [mtiles, blocks, 3, rows, 32] (SplitParts)
  const uint16_t* w;  // [tiles, blocks, 2, 16, 16, 2]: per block of 32 inputs, high then low halves
  float* y;           // [M, N]
  int64_t m, n, tiles, mtiles, blocks, rows;

  const uint16_t* weights(int64_t t) const { return w + t * blocks * 2 * 512; }

  PATHSERVE_AMX void Store(int64_t mt, int64_t t, const float* sums) const { StoreSums(y, m, n, rows, mt, t, sums); }
};

// Column tiles [first, last), four at a time. Tile registers: 0-3 float32 sums of four column
// tiles, 4-6 the three parts of x for 32 inputs, 7 the high or low half of a block of weights. Each
// half is multiplied by all three parts of x into the same sum (6 bfloat16 products per float32
// product; the products are exact in float32 and summed in float32, as the AVX-512 loop does).
// Row tiles one after another: the four column tiles' weights, read from memory for the first,
// are in L2 for the next (measured faster than two row tiles per pass, which reload x's tiles).
PATHSERVE_AMX void F32AmxTiles(const F32AmxProblem& p, int64_t first, int64_t last) {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.colsb[i] = 64;
    config.rows[i] = i < 7 ? static_cast<uint8_t>(p.rows) : 16;
  }
  _tile_loadconfig(&config);
  const int64_t part = p.rows * kBf16Depth;  // bfloat16 in one part of x for one block
  alignas(64) float sums[kAmxRows * kAmxCols];
  for (int64_t t = first; t < last; t += 4) {
    const int64_t count = std::min<int64_t>(4, last - t);
    const uint16_t* w[4];
    for (int64_t j = 0; j < 4; ++j) w[j] = p.weights(t + std::min(j, count - 1));
    for (int64_t mt = 0; mt < p.mtiles; ++mt) {
      const uint16_t* xt = p.x + mt * p.blocks * kXParts * part;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t b = 0; b < p.blocks; ++b) {
        const uint16_t* xb = xt + b * kXParts * part;
        _tile_loadd(4, xb, 64);
        _tile_loadd(5, xb + part, 64);
        _tile_loadd(6, xb + 2 * part, 64);
        // Tile numbers are immediates: one line per column tile.
#define PATHSERVE_COLUMN(j)                             \
  if (mt == 0) {                                        \
    PrefetchTile(w[j] + (b + kBf16Ahead) * 1024);       \
    PrefetchTile(w[j] + (b + kBf16Ahead) * 1024 + 512); \
  }                                                     \
  _tile_loadd(7, w[j] + b * 1024, 64);                  \
  _tile_dpbf16ps(j, 4, 7);                              \
  _tile_dpbf16ps(j, 5, 7);                              \
  _tile_dpbf16ps(j, 6, 7);                              \
  _tile_loadd(7, w[j] + b * 1024 + 512, 64);            \
  _tile_dpbf16ps(j, 4, 7);                              \
  _tile_dpbf16ps(j, 5, 7);                              \
  _tile_dpbf16ps(j, 6, 7);
        PATHSERVE_COLUMN(0)
        if (count > 1) { PATHSERVE_COLUMN(1) }
        if (count > 2) { PATHSERVE_COLUMN(2) }
        if (count > 3) { PATHSERVE_COLUMN(3) }
#undef PATHSERVE_COLUMN
      }
      _tile_stored(0, sums, 64);
      p.Store(mt, t, sums);
      if (count > 1) {
        _tile_stored(1, sums, 64);
        p.Store(mt, t + 1, sums);
      }
      if (count > 2) {
        _tile_stored(2, sums, 64);
        p.Store(mt, t + 2, sums);
      }
      if (count > 3) {
        _tile_stored(3, sums, 64);
        p.Store(mt, t + 3, sums);
      }
    }
  }
  _tile_release();
}

// x[M, K] -> its three bfloat16 parts (high, middle, low 8 significant bits: x = sum exactly, for
// normal numbers) as A tiles, [mtiles, blocks, 3, rows, 32], zero past M and K. Each part is cut
// from what the parts before left, by masking the low 16 bits; the differences are exact.
PATHSERVE_AVX512 void SplitParts(const float* x, int64_t m, int64_t k, int64_t blocks, int64_t rows,
                                 uint16_t* out) {
  const int64_t mtiles = (m + rows - 1) / rows, part = rows * kBf16Depth;
  std::fill(out, out + mtiles * blocks * kXParts * part, uint16_t{0});
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < k; i += 16) {
      const __mmask16 lanes = Lanes(k - i);
      __m512 rest = _mm512_maskz_loadu_ps(lanes, x + r * k + i);
      uint16_t* at = out + ((r / rows) * blocks + i / kBf16Depth) * kXParts * part + (r % rows) * kBf16Depth + i % kBf16Depth;
      for (int j = 0; j < kXParts; ++j) {
        const __m512i bits = _mm512_and_si512(_mm512_castps_si512(rest), high);
        _mm256_mask_storeu_epi16(at + j * part, lanes, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
        rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(bits));
      }
    }
  }
}

ffi::Error F32AmxMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                        ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  if (!AmxReady(kAmxBf16)) return ffi::Error::InvalidArgument("f32_amx_matmul: this CPU (or kernel) does not run AMX-BF16");
  const auto xd = x.dimensions();
  const int64_t depth = xd.size() == 2 ? (xd[1] + kBf16Depth - 1) / kBf16Depth * kBf16Depth : -1;
  auto shapes = CheckShapes("f32_amx_matmul", xd, w.dimensions(), y->dimensions(), 4, depth, layer.typed_data()[0],
                            kAmxCols, 2);
  if (shapes.has_error()) return shapes.error();
  const Shapes& s = *shapes;
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  const int64_t rows = std::min(kAmxRows, s.m), mtiles = (s.m + rows - 1) / rows, blocks = depth / kBf16Depth;
  thread_local pathserve::LineVector<uint16_t> parts;  // per calling thread: XLA may run two at once
  parts.resize(mtiles * blocks * kXParts * rows * kBf16Depth);
  SplitParts(x.typed_data(), s.m, s.k, blocks, rows, parts.data());
  const F32AmxProblem problem{parts.data(),
                              w.typed_data() + s.index * s.tiles * depth * kAmxCols * 2,
                              y->typed_data(),
                              s.m,
                              s.n,
                              s.tiles,
                              mtiles,
                              blocks,
                              rows};
  // Items are groups of four column tiles, as F32AmxTiles takes them.
  pathserve::ParallelFor(pool, (s.tiles + 3) / 4, s.m * depth * s.tiles * kAmxCols, [problem](int64_t first, int64_t last) {
    F32AmxTiles(problem, 4 * first, std::min(4 * last, problem.tiles));
  });
  return ffi::Error::Success();
}

// ---- float32 weights in blocks on AMX: integers as bfloat16, a scale and an offset per block ----

struct F32BlocksProblem {
  const uint16_t* x;      // x's bfloat16 parts, [mtiles, blocks, 3, rows, 32] (SplitParts)
  const float* x_sums;    // [mtiles, blocks, rows]: each row's sum over each block of inputs
  const uint16_t* w;      // [tiles, blocks, 16, 16, 2]: per block of 32 inputs, the integers as bfloat16
  const float* scales;    // [tiles, blocks, 2, 16]: per block, the columns' scales, then their offsets
  float* y;               // [M, N]
  int64_t m, n, tiles, mtiles, blocks, rows;

  const uint16_t* weights(int64_t t) const { return w + t * blocks * 512; }
  const float* block_scales(int64_t t) const { return scales + t * blocks * 2 * kAmxCols; }
};

// Column tiles [first, last), two at a time. Each block's sums must leave the tile registers to be
// scaled (sums += scale x block sums + offset x sum of x, in AVX-512), and a tile store waits for the
// multiplies into its tile, a load for the tile store: so blocks alternate between sum tiles 0-1 and
// 2-3, block b's sums are stored while block b + 1's multiplies run, and scaled while block b + 2's
// run. Measured (SmolLM2's layer shapes, 30 layers, alternating runs): scaling block b right after
// storing it, ~15-25% slower at 16 and 32 rows; storing right after its own multiplies, four column
// tiles at a time, ~10% slower still.
PATHSERVE_AMX void F32BlocksTiles(const F32BlocksProblem& p, int64_t first, int64_t last) {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.colsb[i] = 64;
    config.rows[i] = i < 7 ? static_cast<uint8_t>(p.rows) : 16;
  }
  _tile_loadconfig(&config);
  const int64_t part = p.rows * kBf16Depth;
  alignas(64) float stored[2][2][kAmxRows * kAmxCols];  // [block % 2][column tile]
  alignas(64) float sums[2][kAmxRows * kAmxCols];
  for (int64_t t = first; t < last; t += 2) {
    const bool two = t + 1 < last;
    const uint16_t* w0 = p.weights(t);
    const uint16_t* w1 = p.weights(two ? t + 1 : t);
    const float* s0 = p.block_scales(t);
    const float* s1 = p.block_scales(two ? t + 1 : t);
    for (int64_t mt = 0; mt < p.mtiles; ++mt) {
      const uint16_t* xt = p.x + mt * p.blocks * kXParts * part;
      std::fill(&sums[0][0], &sums[0][0] + 2 * kAmxRows * kAmxCols, 0.0f);
      // Adds block b's stored sums into `sums`: x . w = scale * (x . integers) + offset * sum(x).
      auto scale_into_sums = [&](int64_t b) PATHSERVE_AMX {
        float(*block)[kAmxRows * kAmxCols] = stored[b % 2];
        const float* x_sums = p.x_sums + (mt * p.blocks + b) * p.rows;
        for (int j = 0; j < (two ? 2 : 1); ++j) {
          const float* sb = (j ? s1 : s0) + b * 2 * kAmxCols;
          const __m512 scale = _mm512_loadu_ps(sb), offset = _mm512_loadu_ps(sb + kAmxCols);
          for (int64_t r = 0; r < p.rows; ++r) {
            float* at = sums[j] + r * kAmxCols;
            const __m512 shifted = _mm512_fmadd_ps(_mm512_set1_ps(x_sums[r]), offset, _mm512_load_ps(at));
            _mm512_store_ps(at, _mm512_fmadd_ps(_mm512_load_ps(block[j] + r * kAmxCols), scale, shifted));
          }
        }
      };
      // Block b's sums for both column tiles into tiles A and B: x's three parts (tiles 4-6) times
      // the integers (through tile 7). Tile numbers are immediates, hence a macro.
#define PATHSERVE_BLOCK(A, B)                                  \
  if (mt == 0) PrefetchTile(w0 + (b + kBf16Ahead) * 512);      \
  _tile_zero(A);                                               \
  _tile_loadd(7, w0 + b * 512, 64);                            \
  _tile_dpbf16ps(A, 4, 7);                                     \
  _tile_dpbf16ps(A, 5, 7);                                     \
  _tile_dpbf16ps(A, 6, 7);                                     \
  if (two) {                                                   \
    if (mt == 0) PrefetchTile(w1 + (b + kBf16Ahead) * 512);    \
    _tile_zero(B);                                             \
    _tile_loadd(7, w1 + b * 512, 64);                          \
    _tile_dpbf16ps(B, 4, 7);                                   \
    _tile_dpbf16ps(B, 5, 7);                                   \
    _tile_dpbf16ps(B, 6, 7);                                   \
  }
      for (int64_t b = 0; b < p.blocks; ++b) {
        const uint16_t* xb = xt + b * kXParts * part;
        _tile_loadd(4, xb, 64);
        _tile_loadd(5, xb + part, 64);
        _tile_loadd(6, xb + 2 * part, 64);
        if (b % 2 == 0) {
          PATHSERVE_BLOCK(0, 1)
          if (b == 0) continue;
          _tile_stored(2, stored[1][0], 64);
          if (two) _tile_stored(3, stored[1][1], 64);
        } else {
          PATHSERVE_BLOCK(2, 3)
          _tile_stored(0, stored[0][0], 64);
          if (two) _tile_stored(1, stored[0][1], 64);
        }
        if (b >= 2) scale_into_sums(b - 2);
      }
#undef PATHSERVE_BLOCK
      if (p.blocks % 2) {
        _tile_stored(0, stored[0][0], 64);
        if (two) _tile_stored(1, stored[0][1], 64);
      } else {
        _tile_stored(2, stored[1][0], 64);
        if (two) _tile_stored(3, stored[1][1], 64);
      }
      if (p.blocks >= 2) scale_into_sums(p.blocks - 2);
      scale_into_sums(p.blocks - 1);
      StoreSums(p.y, p.m, p.n, p.rows, mt, t, sums[0]);
      if (two) StoreSums(p.y, p.m, p.n, p.rows, mt, t + 1, sums[1]);
    }
  }
  _tile_release();
}

// Each row's sum over each block of 32 inputs, [mtiles, blocks, rows], zero past M.
PATHSERVE_AVX512 void BlockSums(const float* x, int64_t m, int64_t k, int64_t blocks, int64_t rows, float* out) {
  const int64_t mtiles = (m + rows - 1) / rows;
  std::fill(out, out + mtiles * blocks * rows, 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t i = b * kBf16Depth;
      const __m512 sum = _mm512_add_ps(_mm512_maskz_loadu_ps(Lanes(k - i), x + r * k + i),
                                       _mm512_maskz_loadu_ps(Lanes(k - i - 16), x + r * k + i + 16));
      out[((r / rows) * blocks + b) * rows + r % rows] = _mm512_reduce_add_ps(sum);
    }
  }
}

ffi::Error F32BlocksAmxMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                              ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  if (!AmxReady(kAmxBf16)) return ffi::Error::InvalidArgument("f32_blocks_amx_matmul: this CPU (or kernel) does not run AMX-BF16");
  const auto xd = x.dimensions();
  const int64_t depth = xd.size() == 2 ? (xd[1] + kBf16Depth - 1) / kBf16Depth * kBf16Depth : -1;
  auto shapes = CheckShapes("f32_blocks_amx_matmul", xd, w.dimensions(), y->dimensions(), 4, depth / 2,
                            layer.typed_data()[0], kAmxCols, 2);
  if (shapes.has_error()) return shapes.error();
  const Shapes& s = *shapes;
  const int64_t blocks = depth / kBf16Depth;
  if (static_cast<int64_t>(scales.element_count()) != s.layers * s.tiles * blocks * 2 * kAmxCols) {
    return ffi::Error::InvalidArgument("f32_blocks_amx_matmul: scales must hold a scale and an offset per block and packed column");
  }
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  const int64_t rows = std::min(kAmxRows, s.m), mtiles = (s.m + rows - 1) / rows;
  thread_local pathserve::LineVector<uint16_t> parts;  // per calling thread: XLA may run two at once
  parts.resize(mtiles * blocks * kXParts * rows * kBf16Depth);
  SplitParts(x.typed_data(), s.m, s.k, blocks, rows, parts.data());
  thread_local std::vector<float> x_sums;
  x_sums.resize(mtiles * blocks * rows);
  BlockSums(x.typed_data(), s.m, s.k, blocks, rows, x_sums.data());
  const F32BlocksProblem problem{parts.data(),
                                 x_sums.data(),
                                 w.typed_data() + s.index * s.tiles * blocks * 512,
                                 scales.typed_data() + s.index * s.tiles * blocks * 2 * kAmxCols,
                                 y->typed_data(),
                                 s.m,
                                 s.n,
                                 s.tiles,
                                 mtiles,
                                 blocks,
                                 rows};
  // Items are pairs of column tiles, as F32BlocksTiles takes them.
  pathserve::ParallelFor(pool, (s.tiles + 1) / 2, s.m * depth * s.tiles * kAmxCols, [problem](int64_t first, int64_t last) {
    F32BlocksTiles(problem, 2 * first, std::min(2 * last, problem.tiles));
  });
  return ffi::Error::Success();
}

#else  // a compiler without AMX intrinsics: the handlers exist and say so

using pathserve::AmxReady;
using pathserve::kAmxBf16;
using pathserve::kAmxInt8;

ffi::Error Int8AmxMatmul(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::S8>, ffi::Buffer<ffi::F32>,
                         ffi::Buffer<ffi::S32>, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::InvalidArgument("int8_amx_matmul: built by a compiler without AMX intrinsics");
}

ffi::Error F32AmxMatmul(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::S32>,
                        ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::InvalidArgument("f32_amx_matmul: built by a compiler without AMX intrinsics");
}

ffi::Error F32BlocksAmxMatmul(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::F32>,
                              ffi::Buffer<ffi::S32>, ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::InvalidArgument("f32_blocks_amx_matmul: built by a compiler without AMX intrinsics");
}

#endif

}  // namespace

// 1 when this CPU runs the kernels (AVX-512 F, BW, VL and VNNI); the Python side checks before use.
extern "C" int pathserve_cpu_kernels_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PathserveF32Matmul, F32Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts (pathserve::SelectRows)
                                  .Ret<ffi::Buffer<ffi::F32>>());

// 1 when int8 weights can take the AMX kernel here (CPU, Linux and compiler); packing asks first.
extern "C" int pathserve_cpu_amx_supported() { return AmxReady(kAmxInt8) ? 1 : 0; }

// 1 when float32 weights (those exact in two bfloat16) can take the AMX kernel here.
extern "C" int pathserve_cpu_amx_bf16_supported() { return AmxReady(kAmxBf16) ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(PathserveF32AmxMatmul, F32AmxMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PathserveF32BlocksAmxMatmul, F32BlocksAmxMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PathserveInt8AmxMatmul, Int8AmxMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PathserveInt8Matmul, Int8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts (pathserve::SelectRows)
                                  .Ret<ffi::Buffer<ffi::F32>>());
