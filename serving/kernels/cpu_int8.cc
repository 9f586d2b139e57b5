// int8-weight matmuls y[M, N] = x[M, K] @ w[K, N] for every x86-64 CPU with AVX2 and FMA, and the
// W8A8 matmul (int8 activations times int8 weights) on AVX-512 VNNI. XLA FFI handlers:
// PathserveInt8Avx2Matmul, PathserveW8a8Avx2Matmul, PathserveW8a8Matmul, PathserveW8a8AmxMatmul.
//
// Why: where the CPU lacks AVX-512 VNNI the model otherwise runs XLA's own int8 dots, which move a
// few GB/s: a decode step of a 135M model read its weights ~5x slower than the memory allows. And
// MaxText's quantization=int8 (W8A8) multiplies int8 by int8: on VNNI four multiply-adds per 32-bit
// lane per instruction (vpdpbusd), twice the rate of int16 activations (vpdpwssd).
//
// Three loops, each over 64-column tiles shared out between threads (pathserve::ParallelFor):
// - int8 weights, float activations, AVX2 (PathserveInt8Avx2Matmul): the AVX-512 int8 kernel's
//   layout [tiles, pairs, 64, 2] and arithmetic: each row of x quantized to int16 (absmax / 32767),
//   vpmaddwd of an (x[2k], x[2k+1]) broadcast with 8 columns' weight pairs widened to int16, int32
//   sums flushed to float every kPairs pairs (2 * 128 * 32767 * 127 < 2^31).
// - W8A8, AVX2 (PathserveW8a8Avx2Matmul): layout [tiles, quads, 64, 4], four input rows side by
//   side per column. Each row of x quantized to int8 as XLA's W8A8 does (scale max(absmax, 1e-30) /
//   127, x / scale rounded to even, clipped to +-127). vpmaddubsw multiplies unsigned by signed
//   bytes, so the weights' magnitudes are the unsigned operand and x takes their signs (vpsignb):
//   |w| * (x * sign(w)) = x * w exactly, a pair at most 2 * 128 * 127 < 2^15, no saturation; then
//   vpmaddwd by ones gives int32 sums of four. Exact int32 sums over all of K.
// - W8A8, AVX-512 VNNI (PathserveW8a8Matmul): the same layout; vpdpbusd multiplies x + 128
//   (unsigned) by w (signed) into int32, and the column sums of w (packed beside the scales)
//   take 128 * sum(w) back off: exact, as int32 arithmetic wraps (vpdpbusd does not saturate).
// - W8A8, AMX-INT8 (PathserveW8a8AmxMatmul, where the CPU has AMX): the same layout read in place,
//   64 input rows (16 quads) of 16 columns one B tile at a 256-byte stride; x signed (no offset),
//   TDPBSSD, exact int32 sums (cpu_amx.h; PATHSERVE_CPU_AMX=emulate checks it on any AVX-512 CPU).
// The W8A8 result is float(sum) * x_scale * w_scale, in that order, as XLA's int8 dot path computes.
// Weights may hold every layer ([layers, ...]); the `layer` operand picks one in place. `counts` names
// the rows of x that count, as for cpu_matmul.cc's handlers (pathserve::SelectRows).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#define PATHSERVE_AVX2 __attribute__((target("avx2,fma")))

namespace {

using pathserve::AmxReady;
using pathserve::CheckShapes;
using pathserve::kAmxCols;
using pathserve::kAmxDepth;
using pathserve::kAmxInt8;
using pathserve::kAmxRows;
using pathserve::Shapes;
using pathserve::TileConfig;

constexpr int64_t kTile = 64;    // output columns per packed tile
constexpr int kRows = 4;         // rows of x per register block (x is interleaved in blocks of 4)
static_assert(kRows == 4, "pathserve::InterleaveRows interleaves blocks of 4 rows");
constexpr int64_t kPairs = 128;  // int16 x int8: input-row pairs per int32 accumulation

// Whether a row holds NaN or infinity (x * 0 is NaN exactly there), and its largest magnitude.
PATHSERVE_AVX2 void RowRange(const float* row, int64_t k, float* absmax, bool* finite) {
  __m256 vmax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 v = _mm256_loadu_ps(row + i);
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
    bad = _mm256_add_ps(bad, _mm256_mul_ps(v, _mm256_setzero_ps()));
  }
  float lanes[8], bads[8];
  _mm256_storeu_ps(lanes, vmax);
  _mm256_storeu_ps(bads, bad);
  float best = 0.0f, nan = 0.0f;
  for (int j = 0; j < 8; ++j) {
    best = std::max(best, lanes[j]);
    nan += bads[j];
  }
  for (; i < k; ++i) {
    best = std::max(best, std::fabs(row[i]));
    nan += row[i] * 0.0f;
  }
  *absmax = best;
  *finite = !std::isnan(nan);
}

// Rows x[which[r]] for r < m of x[., K] as int16 (absmax / 32767), zero-padded to `width` columns,
// and their scales; a row with NaN or infinity gets a NaN scale (the output carries it, as a float
// matmul would).
PATHSERVE_AVX2 void QuantizeRows16(const float* x, const int64_t* which, int64_t m, int64_t k, int64_t width,
                                   int16_t* xq, float* scales) {
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + which[r] * k;
    int16_t* out = xq + r * width;
    float absmax;
    bool finite;
    RowRange(row, k, &absmax, &finite);
    std::fill(out, out + width, int16_t{0});
    if (!finite || !(absmax > 0)) {
      scales[r] = finite ? 0.0f : NAN;
      continue;
    }
    scales[r] = absmax / 32767.0f;
    const __m256 inv = _mm256_set1_ps(32767.0f / absmax);
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
      const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + i), inv));
      const __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), packed);
    }
    for (; i < k; ++i) out[i] = static_cast<int16_t>(std::nearbyint(row[i] * (32767.0f / absmax)));
  }
}

// Rows x[which[r]] for r < m of x[., K] as int8 the way XLA's W8A8 quantizes them (scale =
// max(absmax, 1e-30) / 127, x / scale rounded half to even, clipped to [-127, 127]), plus `offset`
// (128: unsigned for vpdpbusd), zero-padded (offset included) to `width` columns; and their scales
// (NaN for a row with NaN or infinity).
PATHSERVE_AVX2 void QuantizeRows8(const float* x, const int64_t* which, int64_t m, int64_t k, int64_t width,
                                  int offset, int8_t* xq, float* scales) {
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + which[r] * k;
    int8_t* out = xq + r * width;
    float absmax;
    bool finite;
    RowRange(row, k, &absmax, &finite);
    std::fill(out, out + width, static_cast<int8_t>(offset));
    if (!finite) {
      scales[r] = NAN;
      continue;
    }
    const float scale = std::max(absmax, 1e-30f) / 127.0f;
    scales[r] = scale;
    const __m256 divisor = _mm256_set1_ps(scale);
    const __m256i low = _mm256_set1_epi32(-127), high = _mm256_set1_epi32(127), shift = _mm256_set1_epi32(offset);
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
      __m256i q = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(row + i), divisor));  // to even
      q = _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(q, low), high), shift);
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), q);
      for (int j = 0; j < 8; ++j) out[i + j] = static_cast<int8_t>(lanes[j]);
    }
    for (; i < k; ++i) {
      const float q = std::nearbyint(row[i] / scale);
      out[i] = static_cast<int8_t>(static_cast<int>(std::min(127.0f, std::max(-127.0f, q))) + offset);
    }
  }
}

// The first `count` of 8 lanes as a maskstore mask.
PATHSERVE_AVX2 inline __m256i Lanes8(int64_t count) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(std::max<int64_t>(count, 0), 8))),
                            index);
}

// Stores out (8 columns from `col`) into row `r` of y[., n], columns past n left alone.
PATHSERVE_AVX2 inline void Store8(float* y, int64_t n, int64_t r, int64_t col, __m256 out) {
  if (col >= n) return;
  if (col + 8 <= n) {
    _mm256_storeu_ps(y + r * n + col, out);
  } else {
    _mm256_maskstore_ps(y + r * n + col, Lanes8(n - col), out);
  }
}

// Column vectors (of 8) per pass over a tile's weights for a block of R rows: as many as the
// registers hold beside R rows' sums (one row: the whole tile in one pass).
template <int R>
constexpr int Columns() {
  return R == 1 ? 8 : (R == 2 ? 4 : 2);
}

// ---- int8 weights, int16 activations, AVX2 -------------------------------------------------------

struct Int8Avx2Problem {
  const int32_t* x;       // [blocks, pairs, kRows] int16 pairs, interleaved
  const float* x_scales;  // [M]
  const int8_t* w;        // [tiles, pairs, kTile, 2]
  const float* w_scales;  // [tiles * kTile]
  float* y;               // [M, N]
  const int64_t* out;     // [m]: the row of y each computed row goes to (pathserve::SelectRows)
  int64_t m, pairs, n, tiles;

  // Rows [row, row + R) of tile t, C vectors of 8 columns at a time.
  template <int R>
  PATHSERVE_AVX2 void Rows(int64_t t, int64_t row) const {
    constexpr int C = Columns<R>();
    const int32_t* xr = x + row * pairs;
    for (int g = 0; g < 8 / C; ++g) {
      __m256 sum[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) sum[r][c] = _mm256_setzero_ps();
      const int8_t* base = w + t * pairs * kTile * 2 + g * C * 16;
      for (int64_t k0 = 0; k0 < pairs; k0 += kPairs) {
        const int64_t k1 = std::min(pairs, k0 + kPairs);
        __m256i acc[R][C];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_si256();
        const int8_t* wp = base + k0 * kTile * 2;
        for (int64_t k = k0; k < k1; ++k, wp += kTile * 2) {
          __m256i wv[C];
          for (int c = 0; c < C; ++c)
            wv[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16 * c)));
          for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_set1_epi32(xr[k * kRows + r]);
            for (int c = 0; c < C; ++c) acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(xv, wv[c]));
          }
        }
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) sum[r][c] = _mm256_add_ps(sum[r][c], _mm256_cvtepi32_ps(acc[r][c]));
      }
      for (int c = 0; c < C; ++c) {
        const int64_t col = t * kTile + (g * C + c) * 8;
        const __m256 ws = _mm256_loadu_ps(w_scales + col);
        for (int r = 0; r < R; ++r) {
          const __m256 result = _mm256_mul_ps(sum[r][c], _mm256_mul_ps(ws, _mm256_set1_ps(x_scales[row + r])));
          Store8(y, n, out[row + r], col, result);
        }
      }
    }
  }
};

// ---- W8A8, AVX2 ------------------------------------------------------------------------------------

struct W8a8Avx2Problem {
  const int32_t* x;       // [blocks, quads, kRows] int8 quads, interleaved
  const float* x_scales;  // [M]
  const int8_t* w;        // [tiles, quads, kTile, 4]
  const float* w_scales;  // [tiles * kTile]
  float* y;               // [M, N]
  const int64_t* out;     // [m]: the row of y each computed row goes to
  int64_t m, quads, n, tiles;

  template <int R>
  PATHSERVE_AVX2 void Rows(int64_t t, int64_t row) const {
    constexpr int C = Columns<R>();
    const int32_t* xr = x + row * quads;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int g = 0; g < 8 / C; ++g) {
      __m256i acc[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_si256();
      const int8_t* wp = w + t * quads * kTile * 4 + g * C * 32;
      for (int64_t q = 0; q < quads; ++q, wp += kTile * 4) {
        __m256i wv[C], mag[C];
        for (int c = 0; c < C; ++c) {
          wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32 * c));
          mag[c] = _mm256_abs_epi8(wv[c]);
        }
        for (int r = 0; r < R; ++r) {
          const __m256i xv = _mm256_set1_epi32(xr[q * kRows + r]);
          for (int c = 0; c < C; ++c) {
            const __m256i pairs = _mm256_maddubs_epi16(mag[c], _mm256_sign_epi8(xv, wv[c]));
            acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
      for (int c = 0; c < C; ++c) {
        const int64_t col = t * kTile + (g * C + c) * 8;
        const __m256 ws = _mm256_loadu_ps(w_scales + col);
        for (int r = 0; r < R; ++r) {
          const __m256 result =
              _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][c]), _mm256_set1_ps(x_scales[row + r])), ws);
          Store8(y, n, out[row + r], col, result);
        }
      }
    }
  }
};

// ---- W8A8, AVX-512 VNNI ----------------------------------------------------------------------------

struct W8a8VnniProblem {
  const int32_t* x;       // [blocks, quads, kRows] int8 quads plus 128 (unsigned), interleaved
  const float* x_scales;  // [M]
  const int8_t* w;        // [tiles, quads, kTile, 4]
  const float* w_scales;  // [tiles * kTile]
  const int32_t* w_sums;  // [tiles * kTile]: each column's sum of its weights
  float* y;               // [M, N]
  const int64_t* out;     // [m]: the row of y each computed row goes to
  int64_t m, quads, n, tiles;

  template <int R>
  PATHSERVE_AVX512 void Rows(int64_t t, int64_t row) const {
    const int32_t* xr = x + row * quads;
    __m512i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_si512();
    const int8_t* wp = w + t * quads * kTile * 4;
    for (int64_t q = 0; q < quads; ++q, wp += kTile * 4) {
      __m512i wv[4];
      for (int c = 0; c < 4; ++c) wv[c] = _mm512_loadu_si512(wp + 64 * c);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(xr[q * kRows + r]);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], xv, wv[c]);
      }
    }
    for (int c = 0; c < 4; ++c) {
      const int64_t col = t * kTile + 16 * c;
      const __mmask16 mask = pathserve::Lanes(n - col);
      const __m512 ws = _mm512_loadu_ps(w_scales + col);
      const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(w_sums + col), 7);  // 128 * sum(w)
      for (int r = 0; r < R; ++r) {
        const __m512i exact = _mm512_sub_epi32(acc[r][c], offset);
        const __m512 result = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(x_scales[row + r])), ws);
        if (mask) _mm512_mask_storeu_ps(y + out[row + r] * n + col, mask, result);
      }
    }
  }
};

// Tiles [first, last) of `p`, every block of kRows rows (then the remainder) per tile: a tile's
// weights come from memory for the first block and from cache for the others.
template <typename Problem>
void Tiles(const Problem& p, int64_t first, int64_t last) {
  for (int64_t t = first; t < last; ++t) {
    int64_t row = 0;
    for (; row + kRows <= p.m; row += kRows) p.template Rows<kRows>(t, row);
    switch (p.m - row) {
      case 3: p.template Rows<3>(t, row); break;
      case 2: p.template Rows<2>(t, row); break;
      case 1: p.template Rows<1>(t, row); break;
      default: break;
    }
  }
}

template <typename Problem>
void Run(ffi::ThreadPool& pool, const Problem& problem, int64_t multiply_adds) {
  pathserve::ParallelFor(pool, problem.tiles, multiply_adds,
                         [problem](int64_t first, int64_t last) { Tiles(problem, first, last); });
}

// Per calling thread: XLA may run two matmuls at once on different threads.
struct Scratch {
  std::vector<int64_t> rows;  // the rows of x computed (pathserve::SelectRows)
  pathserve::LineVector<int8_t> bytes;  // AMX: its tiles' rows of x start on 64-byte lines
  std::vector<int32_t> interleaved;
  std::vector<float> scales;
};
Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

ffi::Error Int8Avx2Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::F32> w_scales, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> counts,
                          ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const int64_t pairs = xd.size() == 2 ? (xd[1] + 1) / 2 : -1;
  auto shapes = CheckShapes("int8_avx2_matmul", xd, w.dimensions(), y->dimensions(), 4, pairs, layer.typed_data()[0]);
  if (shapes.has_error()) return shapes.error();
  const Shapes& s = *shapes;
  if (static_cast<int64_t>(w_scales.element_count()) != s.layers * s.tiles * kTile) {
    return ffi::Error::InvalidArgument("int8_avx2_matmul: scales must hold one float per packed column");
  }
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  Scratch& scratch = ThreadScratch();
  auto m = pathserve::SelectRows("int8_avx2_matmul", s.m, counts, s.n, y->typed_data(), scratch.rows);
  if (m.has_error()) return m.error();
  if (*m == 0) return ffi::Error::Success();
  scratch.bytes.resize(*m * 2 * pairs * sizeof(int16_t));
  scratch.interleaved.resize(((*m + kRows - 1) / kRows) * kRows * pairs);
  scratch.scales.resize(*m);
  auto* xq = reinterpret_cast<int16_t*>(scratch.bytes.data());
  QuantizeRows16(x.typed_data(), scratch.rows.data(), *m, s.k, 2 * pairs, xq, scratch.scales.data());
  pathserve::InterleaveRows(reinterpret_cast<const int32_t*>(xq), nullptr, *m, pairs, scratch.interleaved.data());
  const Int8Avx2Problem problem{scratch.interleaved.data(),
                                scratch.scales.data(),
                                w.typed_data() + s.index * s.tiles * pairs * kTile * 2,
                                w_scales.typed_data() + s.index * s.tiles * kTile,
                                y->typed_data(),
                                scratch.rows.data(),
                                *m,
                                pairs,
                                s.n,
                                s.tiles};
  Run(pool, problem, *m * 2 * pairs * s.tiles * kTile);
  return ffi::Error::Success();
}

// x's computed rows (`counts`, pathserve::SelectRows) quantized to int8 quads (plus `offset`),
// interleaved; or, for AMX (`amx_rows`), left as rows [R, K padded to 64] of int8, R = m or, past
// one tile of 16 rows, whole tiles (zero rows after m). Returns the shapes, `m` the rows computed,
// or an error.
ffi::ErrorOr<Shapes> PrepareW8a8(const char* name, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S8>& w,
                                 ffi::Buffer<ffi::F32>& w_scales, ffi::Buffer<ffi::S32>& layer,
                                 ffi::Buffer<ffi::S32>& counts, ffi::ResultBuffer<ffi::F32>& y, int offset,
                                 Scratch& scratch, bool amx_rows = false) {
  const auto xd = x.dimensions();
  const int64_t quads = xd.size() == 2 ? (xd[1] + 3) / 4 : -1;
  auto shapes = CheckShapes(name, xd, w.dimensions(), y->dimensions(), 4, quads, layer.typed_data()[0], kTile, 4);
  if (shapes.has_error()) return shapes;
  const Shapes& s = *shapes;
  if (static_cast<int64_t>(w_scales.element_count()) != s.layers * s.tiles * kTile) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(std::string(name) + ": scales must hold one float per packed column"));
  }
  auto m = pathserve::SelectRows(name, s.m, counts, s.n, y->typed_data(), scratch.rows);
  if (m.has_error()) return ffi::Unexpected(m.error());
  Shapes computed = s;
  computed.m = *m;
  const int64_t width = amx_rows ? (s.k + kAmxDepth - 1) / kAmxDepth * kAmxDepth : 4 * quads;
  const int64_t rows = amx_rows && *m > kAmxRows ? (*m + kAmxRows - 1) / kAmxRows * kAmxRows : *m;
  scratch.bytes.resize(rows * width);
  scratch.scales.resize(*m);
  QuantizeRows8(x.typed_data(), scratch.rows.data(), *m, s.k, width, offset, scratch.bytes.data(),
                scratch.scales.data());
  if (amx_rows) {
    std::fill(scratch.bytes.begin() + *m * width, scratch.bytes.end(), int8_t{0});
    return computed;
  }
  scratch.interleaved.resize(((*m + kRows - 1) / kRows) * kRows * quads);
  pathserve::InterleaveRows(reinterpret_cast<const int32_t*>(scratch.bytes.data()), nullptr, *m, quads, scratch.interleaved.data());
  return computed;
}

ffi::Error W8a8Avx2Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::F32> w_scales, ffi::Buffer<ffi::S32> w_sums, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::S32> counts, ffi::ResultBuffer<ffi::F32> y) {
  Scratch& scratch = ThreadScratch();
  auto shapes = PrepareW8a8("w8a8_avx2_matmul", x, w, w_scales, layer, counts, y, 0, scratch);
  if (shapes.has_error()) return shapes.error();
  const Shapes& s = *shapes;
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  const int64_t quads = (s.k + 3) / 4;
  const W8a8Avx2Problem problem{scratch.interleaved.data(),
                                scratch.scales.data(),
                                w.typed_data() + s.index * s.tiles * quads * kTile * 4,
                                w_scales.typed_data() + s.index * s.tiles * kTile,
                                y->typed_data(),
                                scratch.rows.data(),
                                s.m,
                                quads,
                                s.n,
                                s.tiles};
  Run(pool, problem, s.m * 4 * quads * s.tiles * kTile);
  return ffi::Error::Success();
}

ffi::Error W8a8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                      ffi::Buffer<ffi::F32> w_scales, ffi::Buffer<ffi::S32> w_sums, ffi::Buffer<ffi::S32> layer,
                      ffi::Buffer<ffi::S32> counts, ffi::ResultBuffer<ffi::F32> y) {
  Scratch& scratch = ThreadScratch();
  auto shapes = PrepareW8a8("w8a8_matmul", x, w, w_scales, layer, counts, y, 128, scratch);
  if (shapes.has_error()) return shapes.error();
  const Shapes& s = *shapes;
  if (static_cast<int64_t>(w_sums.element_count()) != s.layers * s.tiles * kTile) {
    return ffi::Error::InvalidArgument("w8a8_matmul: column sums must hold one int32 per packed column");
  }
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  const int64_t quads = (s.k + 3) / 4;
  const W8a8VnniProblem problem{scratch.interleaved.data(),
                                scratch.scales.data(),
                                w.typed_data() + s.index * s.tiles * quads * kTile * 4,
                                w_scales.typed_data() + s.index * s.tiles * kTile,
                                w_sums.typed_data() + s.index * s.tiles * kTile,
                                y->typed_data(),
                                scratch.rows.data(),
                                s.m,
                                quads,
                                s.n,
                                s.tiles};
  Run(pool, problem, s.m * 4 * quads * s.tiles * kTile);
  return ffi::Error::Success();
}

// ---- W8A8, AMX-INT8 -------------------------------------------------------------------------------

constexpr int64_t kQuadBytes = kTile * 4;  // one quad of input rows of a 64-column tile: 256 bytes

#if PATHSERVE_HAS_AMX

struct W8a8AmxProblem {
  const int8_t* x;        // [mtiles * rows, depth]: int8 rows, zero past K (and past m)
  const float* x_scales;  // [m]
  const int8_t* w;        // [tiles, quads, kTile, 4]
  const float* w_scales;  // [tiles * kTile]
  float* y;               // [M, N]
  const int64_t* out;     // [m]: the row of y each computed row goes to
  int64_t m, n, tiles, quads, depth, mtiles, rows;

  // y's rows of row tile `mt`, the 16 columns of quarter `j` of tile `t`, from their int32 sums.
  PATHSERVE_AMX void Finish(int64_t mt, int64_t t, int64_t j, const int32_t* sums) const {
    const int64_t count = std::min(rows, m - mt * rows), col = t * kTile + j * kAmxCols;
    const __mmask16 mask = pathserve::Lanes(n - col);
    if (!mask) return;
    const __m512 ws = _mm512_loadu_ps(w_scales + col);
    for (int64_t r = 0; r < count; ++r) {
      const int64_t row = mt * rows + r;
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(sums + kAmxCols * r));
      _mm512_mask_storeu_ps(y + out[row] * n + col, mask,
                            _mm512_mul_ps(_mm512_mul_ps(sum, _mm512_set1_ps(x_scales[row])), ws));
    }
  }
};

// Column tiles [first, last) of 64 columns. Past 16 rows, two row tiles at a time (below); one row
// tile: the four C tiles of its quarters (tile registers 0-3); 4: x's 64 inputs, 5-7: the
// quarters' weights for them (16 quads at the layout's 256-byte stride; three registers, so a load
// need not wait for the multiply before it to finish reading its register). Quads past the last
// whole 16 come from a zero-padded copy, so no tile reads past the weights. Later row tiles find
// the tile's weights in cache.
PATHSERVE_AMX void W8a8AmxTiles(const W8a8AmxProblem& p, int64_t first, int64_t last) {
  TileConfig config;
  for (int i = 0; i < 8; ++i) {
    config.colsb[i] = 64;
    config.rows[i] = i >= 5 ? kAmxRows : static_cast<uint8_t>(p.rows);
  }
  _tile_loadconfig(&config);
  const int64_t steps = p.quads / 16, tail = p.quads % 16, step_bytes = 16 * kQuadBytes;
  alignas(64) int8_t tail_weights[16 * kQuadBytes];
  alignas(64) int32_t sums[kAmxRows * kAmxCols];
  for (int64_t t = first; t < last; ++t) {
    const int8_t* wt = p.w + t * p.quads * kQuadBytes;
    if (tail) {
      std::memcpy(tail_weights, wt + steps * step_bytes, tail * kQuadBytes);
      std::memset(tail_weights + tail * kQuadBytes, 0, (16 - tail) * kQuadBytes);
    }
    const auto weights = [&](int64_t s) { return s < steps ? wt + s * step_bytes : tail_weights; };
    const auto prefetch = [&](int64_t s) {  // the next step's 4 KB, while this one multiplies
      if (s + 1 < steps) {
        const char* next = reinterpret_cast<const char*>(wt + (s + 1) * step_bytes);
        for (int i = 0; i < 64; ++i) _mm_prefetch(next + 64 * i, _MM_HINT_T0);
      }
    };
    int64_t mt = 0;
    // Two row tiles at a time, two quarters per pass: sums 0-1 the first tile's, 2-3 the second's,
    // x's tiles in 4 and 5, the quarters' weights in 6 and 7: each weight tile read serves 32 rows.
    for (; mt + 1 < p.mtiles; mt += 2) {
      const int8_t* x0 = p.x + mt * p.rows * p.depth;
      const int8_t* x1 = x0 + p.rows * p.depth;
      for (int64_t half = 0; half < 2; ++half) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < steps + (tail ? 1 : 0); ++s) {
          if (mt == 0 && half == 0) prefetch(s);
          const int8_t* ws = weights(s) + half * 128;
          _tile_loadd(4, x0 + s * kAmxDepth, p.depth);
          _tile_loadd(5, x1 + s * kAmxDepth, p.depth);
          _tile_loadd(6, ws, kQuadBytes);
          _tile_loadd(7, ws + 64, kQuadBytes);
          _tile_dpbssd(0, 4, 6);
          _tile_dpbssd(1, 4, 7);
          _tile_dpbssd(2, 5, 6);
          _tile_dpbssd(3, 5, 7);
        }
        _tile_stored(0, sums, 64);
        p.Finish(mt, t, 2 * half, sums);
        _tile_stored(1, sums, 64);
        p.Finish(mt, t, 2 * half + 1, sums);
        _tile_stored(2, sums, 64);
        p.Finish(mt + 1, t, 2 * half, sums);
        _tile_stored(3, sums, 64);
        p.Finish(mt + 1, t, 2 * half + 1, sums);
      }
    }
    // One row tile (a decode call's rows, or an odd count's last): its four quarters at a time.
    for (; mt < p.mtiles; ++mt) {
      const int8_t* xt = p.x + mt * p.rows * p.depth;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < steps + (tail ? 1 : 0); ++s) {
        if (mt == 0) prefetch(s);
        const int8_t* ws = weights(s);
        _tile_loadd(4, xt + s * kAmxDepth, p.depth);
        _tile_loadd(5, ws, kQuadBytes);
        _tile_loadd(6, ws + 64, kQuadBytes);
        _tile_loadd(7, ws + 128, kQuadBytes);
        _tile_dpbssd(0, 4, 5);
        _tile_dpbssd(1, 4, 6);
        _tile_loadd(5, ws + 192, kQuadBytes);
        _tile_dpbssd(2, 4, 7);
        _tile_dpbssd(3, 4, 5);
      }
      _tile_stored(0, sums, 64);
      p.Finish(mt, t, 0, sums);
      _tile_stored(1, sums, 64);
      p.Finish(mt, t, 1, sums);
      _tile_stored(2, sums, 64);
      p.Finish(mt, t, 2, sums);
      _tile_stored(3, sums, 64);
      p.Finish(mt, t, 3, sums);
    }
  }
  _tile_release();
}

ffi::Error W8a8AmxMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                         ffi::Buffer<ffi::F32> w_scales, ffi::Buffer<ffi::S32> w_sums, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> counts, ffi::ResultBuffer<ffi::F32> y) {
  if (!AmxReady(kAmxInt8)) return ffi::Error::InvalidArgument("w8a8_amx_matmul: this CPU (or kernel) does not run AMX");
  Scratch& scratch = ThreadScratch();
  auto shapes = PrepareW8a8("w8a8_amx_matmul", x, w, w_scales, layer, counts, y, 0, scratch, true);
  if (shapes.has_error()) return shapes.error();
  const Shapes& s = *shapes;
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  const int64_t quads = (s.k + 3) / 4, depth = (s.k + kAmxDepth - 1) / kAmxDepth * kAmxDepth;
  const int64_t rows = std::min(kAmxRows, s.m), mtiles = (s.m + rows - 1) / rows;
  const W8a8AmxProblem problem{scratch.bytes.data(),
                               scratch.scales.data(),
                               w.typed_data() + s.index * s.tiles * quads * kQuadBytes,
                               w_scales.typed_data() + s.index * s.tiles * kTile,
                               y->typed_data(),
                               scratch.rows.data(),
                               s.m,
                               s.n,
                               s.tiles,
                               quads,
                               depth,
                               mtiles,
                               rows};
  pathserve::ParallelFor(pool, s.tiles, s.m * depth * s.tiles * kTile,
                         [problem](int64_t first, int64_t last) { W8a8AmxTiles(problem, first, last); });
  return ffi::Error::Success();
}

#else  // a compiler without AMX intrinsics: the handler exists and says so

ffi::Error W8a8AmxMatmul(ffi::ThreadPool, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::S8>, ffi::Buffer<ffi::F32>,
                         ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>,
                         ffi::ResultBuffer<ffi::F32>) {
  return ffi::Error::InvalidArgument("w8a8_amx_matmul: built by a compiler without AMX intrinsics");
}

#endif

}  // namespace

// 1 when this CPU runs the AVX2 kernels (AVX2 and FMA).
extern "C" int pathserve_cpu_avx2_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PathserveInt8Avx2Matmul, Int8Avx2Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts (pathserve::SelectRows)
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PathserveW8a8Avx2Matmul, W8a8Avx2Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts (pathserve::SelectRows)
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PathserveW8a8Matmul, W8a8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts (pathserve::SelectRows)
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PathserveW8a8AmxMatmul, W8a8AmxMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // column sums (unused: x is signed here)
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts (pathserve::SelectRows)
                                  .Ret<ffi::Buffer<ffi::F32>>());
