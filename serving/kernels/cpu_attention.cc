// Attention over a paged KV cache on x86 CPUs with AVX-512 or AVX2 and FMA, reading the cache in
// place: one decode step, or a call with several query positions per row (a prompt's chunk after
// its cached positions, speculative verify's k + 1). XLA FFI handlers: PathserveF32DecodeAttention,
// PathserveInt8DecodeAttention (AVX-512) and PathserveF32DecodeAttentionAvx2,
// PathserveInt8DecodeAttentionAvx2 (the names from when they took one position); one body
// (cpu_attention.h) over a 16-float vector that is one AVX-512 register or two AVX2 ones.
//
// Why: on XLA:CPU each layer of a decode step sliced its layer and attention window out of the
// cache (a copy of every slot's window, live or not) before attending, which cost more than the
// matmuls at batch 32; a chunk or a verify call gathered every layer's history into one copy, then
// dequantized and concatenated it per layer. Here each row reads its own layer's keys and values
// where they lie, and only the positions before the call: lengths[b] of them, then the call's own
// keys and values (not yet in the cache) up to each query's position. A decode step (and a call
// with too few blocks of queries to share among the threads) takes items of one query position:
// its scores 16 positions at a time (one transposing sum for 16, not a horizontal sum per
// position), then its values. A decode step on a float pool with rows enough for every thread (two
// each) takes an item per whole row: every kv head of each token row before the next, so the pool
// is read in one stream (30 layers of 18 rows x 400 positions of SmolLM2's heads on a 2-core EPYC,
// alternating runs: 22-25 -> 18.5-19.5 ms; AVX2 25.6-28 -> 20-21 ms; then with rows asked for
// 16 positions ahead, kRowAhead: 14.9 ms).
// Otherwise (an int8 pool, few rows) an item is one kv head, its values in one pass holding every
// query head's sums in registers, its first kv head prefetching the other heads' lines of each
// token; a chunk takes blocks of up to 64 queries (positions x query heads of one kv head) in the
// vector's lanes, reading each key and value once per block with an online softmax (measured in
// docs/cpu-kernels.md: a 32-position chunk over 2,048 cached ones 1.2-1.6x, a 512 one 1.3-1.7x).
//
// Layout: q [B, kv_heads, groups, head_dim] (one position) or [B, S, kv_heads, groups, head_dim];
// the cache is a page pool k, v [layers, pages, page_size, kv_heads, head_dim] float32, or int8
// with scales [layers, pages, page_size, kv_heads or 1, 1]; the block table pages [B, max_pages]
// says where each row's positions lie: position t of row b is token pages[b, t / page_size] *
// page_size + t % page_size of the layer (page 0 is a scratch page; unused entries are 0).
// lengths[B] is clamped to max_pages * page_size; k_new, v_new [B, (S,) kv_heads, head_dim]; out
// like q. Query position s of row b attends to the cached [0, lengths[b]) and to k_new[b, 0..s].
// counts[B]: the query positions of each row that count (a chunk's true length; clamped to [0, S]);
// the others (a chunk's padding) are not computed, their outputs zeros.
// A contiguous cache is the case page_size = T, pages[b] = [b]. head_dim is a multiple of 16 and
// groups one of the kernel's (checked in Python and here); every table entry is a page of the pool
// (checked here: an entry past it would read outside the pool).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#define PATHSERVE_AVX2 __attribute__((target("avx2,fma")))

namespace {

using pathserve::Lanes;

// Positions between a prefetch and the scores that use it (Item; RowItem: kRowAhead), into L2.
// Into L1 (Item: 8 ahead; RowItem: none, or 4 ahead as tried) a row read ~11 GB/s (Item) or
// ~17 GB/s (RowItem, two threads) where two threads stream ~31 GB/s, RowItem's samples sitting on
// the instruction after each L1 prefetch (the L1's misses in flight are the limit); 16 positions
// into L2: 1 row x 1,000 positions x 30 layers 4.1 -> 2.6 ms, 18 rows x 400 20.5 -> 14.9 ms
// (alternating runs; 32 measured no better).
constexpr int64_t kAhead = 16;
constexpr int64_t kRowAhead = 16;

// The shapes the handlers read (CheckLayout holds them), and the layer asked for. `chunk`: the
// query positions of each row (1 for a decode step's q [B, kv, groups, hd]).
struct Layout {
  int64_t batch, chunk, kv_heads, groups, head_dim, num_pages, page_size, max_pages, layer;
};

bool SupportedGroups(int64_t g) { return (g >= 1 && g <= 8) || g == 12 || g == 16; }

ffi::Error Invalid(const std::string& why) { return ffi::Error::InvalidArgument("decode_attention: " + why); }

// Checks the shapes, the layer and every entry of the block table, before anything is read.
ffi::ErrorOr<Layout> CheckLayout(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd, ffi::Span<const int64_t> vd,
                                 ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths,
                                 ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                                 ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> counts) {
  const auto pd = pages.dimensions();
  if (qd.size() != 4 && qd.size() != 5) return ffi::Unexpected(Invalid("q must be [B, kv, groups, hd] or [B, S, kv, groups, hd]"));
  const int64_t chunk = qd.size() == 5 ? qd[1] : 1;
  const int64_t batch = qd[0], kv = qd[qd.size() - 3], groups = qd[qd.size() - 2], hd = qd[qd.size() - 1];
  if (kd.size() != 5 || pd.size() != 2 || !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()) ||
      kd[2] < 1 || kd[3] != kv || kd[4] != hd || pd[0] != batch || hd % 16 != 0 || !SupportedGroups(groups) ||
      chunk < 1 || static_cast<int64_t>(lengths.element_count()) != batch ||
      static_cast<int64_t>(counts.element_count()) != batch ||
      static_cast<int64_t>(k_new.element_count()) != batch * chunk * kv * hd ||
      static_cast<int64_t>(v_new.element_count()) != batch * chunk * kv * hd) {
    return ffi::Unexpected(
        Invalid("expected q[B, (S,) kv, groups, head_dim] with head_dim a multiple of 16, a page pool [layers, "
                "pages, page_size, kv, head_dim], pages[B, max_pages], lengths[B], k_new and v_new [B, (S,) kv, "
                "head_dim]"));
  }
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= kd[0]) {
    return ffi::Unexpected(Invalid("layer " + std::to_string(index) + " of " + std::to_string(kd[0])));
  }
  const int32_t* table = pages.typed_data();
  for (int64_t i = 0; i < pd[0] * pd[1]; ++i) {
    if (table[i] < 0 || table[i] >= kd[1]) {
      return ffi::Unexpected(Invalid("pages[" + std::to_string(i / pd[1]) + ", " + std::to_string(i % pd[1]) +
                                     "] = " + std::to_string(table[i]) + " is not a page of the pool's " +
                                     std::to_string(kd[1])));
    }
  }
  return Layout{batch, chunk, kv, groups, hd, kd[1], kd[2], pd[1], index};
}

// An int8 pool's scales, MaxText's kv_quant_axis layouts: one per token and kv head (dkv),
// [layers, pages, page_size, kv, 1], or one per token (heads_and_dkv), [layers, pages, page_size, 1, 1].
// Returns the scales per token.
ffi::ErrorOr<int64_t> CheckScales(ffi::Span<const int64_t> kd, ffi::Buffer<ffi::F32> k_scale,
                                  ffi::Buffer<ffi::F32> v_scale) {
  const auto sd = k_scale.dimensions();
  const auto vd = v_scale.dimensions();
  if (kd.size() != 5 || sd.size() != 5 || !std::equal(sd.begin(), sd.end(), vd.begin(), vd.end()) || sd[0] != kd[0] ||
      sd[1] != kd[1] || sd[2] != kd[2] || (sd[3] != kd[3] && sd[3] != 1) || sd[4] != 1) {
    return ffi::Unexpected(Invalid("int8 pool scales must be [layers, pages, page_size, kv or 1, 1]"));
  }
  return sd[3];
}

// Polynomial for 2^f, |f| <= 1/2, degree 6 (relative error about 2e-7), highest power first.
constexpr float kExp2[] = {1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f,
                           2.4022651e-1f, 6.9314718e-1f, 1.0f};

namespace avx512 {

#define PATHSERVE_TARGET PATHSERVE_AVX512

struct V {
  __m512 v;
};
constexpr int kVectorRegisters = 32;
PATHSERVE_TARGET inline V Zero() { return {_mm512_setzero_ps()}; }
PATHSERVE_TARGET inline V Set1(float x) { return {_mm512_set1_ps(x)}; }
// 16 values of a cache row (float32, or int8 to be scaled by the caller).
PATHSERVE_TARGET inline V Load16(const float* p) { return {_mm512_loadu_ps(p)}; }
PATHSERVE_TARGET inline V Load16(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
PATHSERVE_TARGET inline V Fma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
PATHSERVE_TARGET inline V Mul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
PATHSERVE_TARGET inline float Sum(V a) { return _mm512_reduce_add_ps(a.v); }
// Lane j: the sum of x[j]'s lanes, for 16 vectors: a transposing tree of adds (45 instructions for
// 16 sums, where 16 Sums take ~10 each). Per 128-bit quarter first (unpack, then shuffle), then
// the quarters across vectors (shuffle_f32x4).
PATHSERVE_TARGET inline V Sums16(const V* x) {
  __m512 two[8], four[4], eight[2];
  for (int i = 0; i < 8; ++i)  // per quarter: [a0+a2, b0+b2, a1+a3, b1+b3] of x[2i] = a, x[2i+1] = b
    two[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i].v, x[2 * i + 1].v), _mm512_unpackhi_ps(x[2 * i].v, x[2 * i + 1].v));
  for (int i = 0; i < 4; ++i)  // per quarter: the quarter's sums of x[4i .. 4i + 3]
    four[i] = _mm512_add_ps(_mm512_shuffle_ps(two[2 * i], two[2 * i + 1], 0x44), _mm512_shuffle_ps(two[2 * i], two[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // [quarters 0+1, 2+3] of four[2i], then of four[2i + 1]
    eight[i] = _mm512_add_ps(_mm512_shuffle_f32x4(four[2 * i], four[2 * i + 1], 0x88), _mm512_shuffle_f32x4(four[2 * i], four[2 * i + 1], 0xDD));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(eight[0], eight[1], 0x88), _mm512_shuffle_f32x4(eight[0], eight[1], 0xDD))};
}
PATHSERVE_TARGET inline void Store16(float* p, V a) { _mm512_storeu_ps(p, a.v); }
PATHSERVE_TARGET inline V Add(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
PATHSERVE_TARGET inline V Sub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
PATHSERVE_TARGET inline V Max(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
// The lanes whose `pos` is at least `at` from `keep`, the others from `other`.
PATHSERVE_TARGET inline V Select(V pos, float at, V keep, V other) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(pos.v, _mm512_set1_ps(at), _CMP_GE_OQ), other.v, keep.v)};
}

// e^x for x <= 0 (scores minus their max): 2^n * 2^f.
PATHSERVE_TARGET inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2[i]));
  return _mm512_scalef_ps(p, n);
}
PATHSERVE_TARGET inline V ExpV(V x) { return {Exp(x.v)}; }

// s[0, n) <- exp(s - max(s)); returns their sum.
PATHSERVE_TARGET inline float ExpAndSum(float* s, int64_t n) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; t += 16) top = _mm512_mask_max_ps(top, Lanes(n - t), top, _mm512_loadu_ps(s + t));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 mask = Lanes(n - t);
    const __m512 e = Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), max));
    _mm512_mask_storeu_ps(s + t, mask, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
  }
  return _mm512_reduce_add_ps(total);
}

#include "cpu_attention.h"

#undef PATHSERVE_TARGET

}  // namespace avx512

namespace avx2 {

#define PATHSERVE_TARGET PATHSERVE_AVX2

struct V {
  __m256 lo, hi;
};
constexpr int kVectorRegisters = 8;  // 16 ymm registers
PATHSERVE_TARGET inline V Zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
PATHSERVE_TARGET inline V Set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
PATHSERVE_TARGET inline V Load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
PATHSERVE_TARGET inline V Load16(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)))};
}
PATHSERVE_TARGET inline V Fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
PATHSERVE_TARGET inline V Mul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
PATHSERVE_TARGET inline float Sum8(__m256 a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
PATHSERVE_TARGET inline float Sum(V a) { return Sum8(_mm256_add_ps(a.lo, a.hi)); }
// Lane j: the sum of a[j]'s lanes, for 8 vectors: two rounds of hadd (per 128-bit half), then the
// halves added across.
PATHSERVE_TARGET inline __m256 Sums8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(a[0], a[1]), h1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h2 = _mm256_hadd_ps(a[4], a[5]), h3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 g0 = _mm256_hadd_ps(h0, h1), g1 = _mm256_hadd_ps(h2, h3);  // [a0..a3 | a4..a7] per half
  return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}
// Lane j: the sum of x[j]'s lanes, for 16 vectors: each vector's halves added, then Sums8 twice.
PATHSERVE_TARGET inline V Sums16(const V* x) {
  __m256 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm256_add_ps(x[i].lo, x[i].hi);
  return {Sums8(a), Sums8(a + 8)};
}
PATHSERVE_TARGET inline void Store16(float* p, V a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
PATHSERVE_TARGET inline V Add(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
PATHSERVE_TARGET inline V Sub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
PATHSERVE_TARGET inline V Max(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
// The lanes whose `pos` is at least `at` from `keep`, the others from `other`.
PATHSERVE_TARGET inline V Select(V pos, float at, V keep, V other) {
  const __m256 bound = _mm256_set1_ps(at);
  return {_mm256_blendv_ps(other.lo, keep.lo, _mm256_cmp_ps(pos.lo, bound, _CMP_GE_OQ)),
          _mm256_blendv_ps(other.hi, keep.hi, _mm256_cmp_ps(pos.hi, bound, _CMP_GE_OQ))};
}

// e^x for x <= 0: 2^n * 2^f, 2^n built in the exponent bits (n >= -126 for x >= -87).
PATHSERVE_TARGET inline __m256 Exp(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2[i]));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}
PATHSERVE_TARGET inline V ExpV(V x) { return {Exp(x.lo), Exp(x.hi)}; }

// s[0, n) <- exp(s - max(s)); returns their sum.
PATHSERVE_TARGET inline float ExpAndSum(float* s, int64_t n) {
  float top = -INFINITY;
  for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
  const __m256 max = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = Exp(_mm256_sub_ps(_mm256_loadu_ps(s + t), max));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = Sum8(total);
  if (t < n) {  // the last few, through a padded copy
    alignas(32) float rest[8] = {};
    std::fill(rest, rest + 8, -INFINITY);
    std::copy(s + t, s + n, rest);
    const __m256 e = Exp(_mm256_sub_ps(_mm256_load_ps(rest), max));
    _mm256_store_ps(rest, e);
    for (int64_t i = 0; i < n - t; ++i) {
      s[t + i] = rest[i];
      sum += rest[i];
    }
  }
  return sum;
}

#include "cpu_attention.h"

#undef PATHSERVE_TARGET

}  // namespace avx2

ffi::Error F32DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths,
                              ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::S32> pages,
                              ffi::Buffer<ffi::S32> counts, ffi::ResultBuffer<ffi::F32> out) {
  return avx512::Attend<float>(pool, q, k, v, nullptr, nullptr, 0, layer, lengths, k_new, v_new, pages, counts, out);
}

ffi::Error Int8DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k,
                               ffi::Buffer<ffi::S8> v, ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths,
                               ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::S32> pages,
                               ffi::Buffer<ffi::S32> counts, ffi::ResultBuffer<ffi::F32> out) {
  const auto scale_heads = CheckScales(k.dimensions(), k_scale, v_scale);
  if (scale_heads.has_error()) return scale_heads.error();
  return avx512::Attend<int8_t>(pool, q, k, v, k_scale.typed_data(), v_scale.typed_data(), scale_heads.value(), layer,
                                lengths, k_new, v_new, pages, counts, out);
}

ffi::Error F32DecodeAttentionAvx2(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                  ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths,
                                  ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::S32> pages,
                                  ffi::Buffer<ffi::S32> counts, ffi::ResultBuffer<ffi::F32> out) {
  return avx2::Attend<float>(pool, q, k, v, nullptr, nullptr, 0, layer, lengths, k_new, v_new, pages, counts, out);
}

ffi::Error Int8DecodeAttentionAvx2(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k,
                                   ffi::Buffer<ffi::S8> v, ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                                   ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths,
                                   ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::S32> pages,
                                   ffi::Buffer<ffi::S32> counts, ffi::ResultBuffer<ffi::F32> out) {
  const auto scale_heads = CheckScales(k.dimensions(), k_scale, v_scale);
  if (scale_heads.has_error()) return scale_heads.error();
  return avx2::Attend<int8_t>(pool, q, k, v, k_scale.typed_data(), v_scale.typed_data(), scale_heads.value(), layer,
                              lengths, k_new, v_new, pages, counts, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PathserveF32DecodeAttention, F32DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PathserveInt8DecodeAttention, Int8DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PathserveF32DecodeAttentionAvx2, F32DecodeAttentionAvx2,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PathserveInt8DecodeAttentionAvx2, Int8DecodeAttentionAvx2,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // counts
                                  .Ret<ffi::Buffer<ffi::F32>>());
