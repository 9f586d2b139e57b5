// One decode step's attention on x86 CPUs with AVX-512, reading the KV cache in place.
// XLA FFI handlers: PathserveF32DecodeAttention, PathserveInt8DecodeAttention.
//
// Why: on XLA:CPU each layer of a decode step sliced its layer and attention window out of the
// cache (a copy of every slot's window, live or not) before attending, which cost more than the
// matmuls at batch 32. Here each (slot, kv head) reads its own layer's keys and values where they
// lie, and only the positions before the token: lengths[b] of them, then the token's own key and
// value (not yet in the cache).
//
// Layout: q [B, kv_heads, groups, head_dim]; cache [layers, S, T, kv_heads, head_dim] float32, or
// int8 with scales [layers, S, T, kv_heads, 1], S >= B (query b reads cache row b: a decode over
// the first B slots); k_new, v_new [B, kv_heads, head_dim]; out like q.
// head_dim is a multiple of 16 and groups at most kMaxGroups (checked in Python and here).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using pathserve::Lanes;

constexpr int kMaxGroups = 16;
constexpr int64_t kAhead = 8;  // positions between a prefetch and the scores that use it

// e^x for x <= 0 (scores minus their max): 2^n * 2^f with a degree-6 polynomial for 2^f, |f| <= 1/2
// (relative error about 2e-7).
PATHSERVE_AVX512 inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 values of a cache row (float32, or int8 to be scaled by the caller).
PATHSERVE_AVX512 inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
PATHSERVE_AVX512 inline __m512 Load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <typename T>
struct Problem {
  const float* q;
  const T* k;            // this layer: [S, T, kv, hd], rows [0, B) read
  const T* v;
  const float* k_scale;  // this layer: [S, T, kv] (int8 only)
  const float* v_scale;
  const int32_t* lengths;
  const float* k_new;
  const float* v_new;
  float* out;
  int64_t batch, capacity, kv_heads, groups, head_dim;
  float scale;

  // Attention of the `G` query heads sharing kv head `h` of slot `b`.
  template <int G>
  PATHSERVE_AVX512 void Item(int64_t b, int64_t h, std::vector<float>& scores) const {
    const int64_t n = std::min<int64_t>(std::max<int32_t>(lengths[b], 0), capacity);
    const int64_t row = kv_heads * head_dim;  // stride between positions
    const int64_t chunks = head_dim / 16;
    const T* keys = k + b * capacity * row + h * head_dim;
    const T* values = v + b * capacity * row + h * head_dim;
    const float* k_scales = k_scale ? k_scale + b * capacity * kv_heads + h : nullptr;
    const float* v_scales = v_scale ? v_scale + b * capacity * kv_heads + h : nullptr;
    const float* query = q + (b * kv_heads + h) * G * head_dim;
    const float* own_k = k_new + (b * kv_heads + h) * head_dim;
    const float* own_v = v_new + (b * kv_heads + h) * head_dim;
    const int64_t width = n + 1;  // the cached positions, then the token itself
    scores.resize(G * width);

    for (int64_t t = 0; t <= n; ++t) {
      if (t + kAhead < n) {  // this position's keys and values are far apart in the cache: fetch both early
        for (int64_t c = 0; c < head_dim * static_cast<int64_t>(sizeof(T)); c += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(keys + (t + kAhead) * row) + c, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(values + (t + kAhead) * row) + c, _MM_HINT_T0);
        }
      }
      __m512 dot[G];
      for (int g = 0; g < G; ++g) dot[g] = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 key = t < n ? Load16(keys + t * row + 16 * c) : _mm512_loadu_ps(own_k + 16 * c);
        for (int g = 0; g < G; ++g) dot[g] = _mm512_fmadd_ps(_mm512_loadu_ps(query + g * head_dim + 16 * c), key, dot[g]);
      }
      const float key_scale = (t < n && k_scales) ? k_scales[t * kv_heads] * scale : scale;
      for (int g = 0; g < G; ++g) scores[g * width + t] = _mm512_reduce_add_ps(dot[g]) * key_scale;
    }

    float inverse_total[G];
    for (int g = 0; g < G; ++g) {
      float* s = scores.data() + g * width;
      __m512 top = _mm512_set1_ps(-INFINITY);
      for (int64_t t = 0; t < width; t += 16) top = _mm512_mask_max_ps(top, Lanes(width - t), top, _mm512_loadu_ps(s + t));
      const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top));
      __m512 total = _mm512_setzero_ps();
      for (int64_t t = 0; t < width; t += 16) {
        const __mmask16 mask = Lanes(width - t);
        const __m512 e = Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), max));
        _mm512_mask_storeu_ps(s + t, mask, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
      }
      inverse_total[g] = 1.0f / _mm512_reduce_add_ps(total);
    }

    float* result = out + (b * kv_heads + h) * G * head_dim;
    for (int64_t c = 0; c < chunks; ++c) {
      __m512 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (int64_t t = 0; t <= n; ++t) {
        const __m512 value = t < n ? Load16(values + t * row + 16 * c) : _mm512_loadu_ps(own_v + 16 * c);
        const float value_scale = (t < n && v_scales) ? v_scales[t * kv_heads] : 1.0f;
        for (int g = 0; g < G; ++g)
          acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * width + t] * value_scale), value, acc[g]);
      }
      for (int g = 0; g < G; ++g)
        _mm512_storeu_ps(result + g * head_dim + 16 * c, _mm512_mul_ps(acc[g], _mm512_set1_ps(inverse_total[g])));
    }
  }

  template <int G>
  void Items(int64_t first, int64_t last) const {
    thread_local std::vector<float> scores;
    for (int64_t i = first; i < last; ++i) Item<G>(i / kv_heads, i % kv_heads, scores);
  }

  void Items(int64_t first, int64_t last) const {
    switch (groups) {
#define PATHSERVE_GROUPS(G) \
  case G:                   \
    Items<G>(first, last);  \
    break;
      PATHSERVE_GROUPS(1) PATHSERVE_GROUPS(2) PATHSERVE_GROUPS(3) PATHSERVE_GROUPS(4) PATHSERVE_GROUPS(5)
      PATHSERVE_GROUPS(6) PATHSERVE_GROUPS(7) PATHSERVE_GROUPS(8) PATHSERVE_GROUPS(12) PATHSERVE_GROUPS(16)
#undef PATHSERVE_GROUPS
      default:
        break;
    }
  }
};

bool SupportedGroups(int64_t g) { return (g >= 1 && g <= 8) || g == 12 || g == 16; }

template <typename T, typename CacheBuffer>
ffi::Error Attend(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> q, CacheBuffer k, CacheBuffer v, const float* k_scale,
                  const float* v_scale, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths,
                  ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto cd = k.dimensions();
  if (qd.size() != 4 || cd.size() != 5 || !std::equal(cd.begin(), cd.end(), v.dimensions().begin(), v.dimensions().end()) || cd[1] < qd[0] || cd[3] != qd[1] ||
      cd[4] != qd[3] || qd[3] % 16 != 0 || !SupportedGroups(qd[2]) ||
      static_cast<int64_t>(lengths.element_count()) != qd[0] ||
      static_cast<int64_t>(k_new.element_count()) != qd[0] * qd[1] * qd[3] ||
      static_cast<int64_t>(v_new.element_count()) != qd[0] * qd[1] * qd[3]) {
    return ffi::Error::InvalidArgument(
        "decode_attention: expected q[B, kv, groups, head_dim] with head_dim a multiple of 16, cache "
        "[layers, >= B, T, kv, head_dim], lengths[B], k_new and v_new [B, kv, head_dim]");
  }
  const int64_t index = layer.typed_data()[0];
  if (index < 0 || index >= cd[0]) {
    return ffi::Error::InvalidArgument("decode_attention: layer " + std::to_string(index) + " of " +
                                       std::to_string(cd[0]));
  }
  const int64_t batch = qd[0], kv = qd[1], groups = qd[2], hd = qd[3], capacity = cd[2];
  // The cache may hold more rows than the query (decode over the first B slots): layers are cd[1] rows apart.
  const int64_t per_layer = cd[1] * capacity * kv * hd;
  const int64_t scales_per_layer = cd[1] * capacity * kv;
  const Problem<T> problem{q.typed_data(),
                           k.typed_data() + index * per_layer,
                           v.typed_data() + index * per_layer,
                           k_scale ? k_scale + index * scales_per_layer : nullptr,
                           v_scale ? v_scale + index * scales_per_layer : nullptr,
                           lengths.typed_data(),
                           k_new.typed_data(),
                           v_new.typed_data(),
                           out->typed_data(),
                           batch,
                           capacity,
                           kv,
                           groups,
                           hd,
                           1.0f / std::sqrt(static_cast<float>(hd))};
  int64_t positions = 0;
  for (int64_t b = 0; b < batch; ++b) positions += std::min<int64_t>(std::max<int32_t>(lengths.typed_data()[b], 0), capacity) + 1;
  pathserve::ParallelFor(pool, batch * kv, 2 * positions * kv * groups * hd,
                         [problem](int64_t first, int64_t last) { problem.Items(first, last); });
  return ffi::Error::Success();
}

ffi::Error F32DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                              ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths,
                              ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                              ffi::ResultBuffer<ffi::F32> out) {
  return Attend<float>(pool, q, k, v, nullptr, nullptr, layer, lengths, k_new, v_new, out);
}

ffi::Error Int8DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k,
                               ffi::Buffer<ffi::S8> v, ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths,
                               ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                               ffi::ResultBuffer<ffi::F32> out) {
  const auto cd = k.dimensions();
  const int64_t expected = cd.size() == 5 ? cd[0] * cd[1] * cd[2] * cd[3] : -1;
  if (static_cast<int64_t>(k_scale.element_count()) != expected ||
      static_cast<int64_t>(v_scale.element_count()) != expected) {
    return ffi::Error::InvalidArgument("decode_attention: int8 cache scales must be [layers, B, T, kv, 1]");
  }
  return Attend<int8_t>(pool, q, k, v, k_scale.typed_data(), v_scale.typed_data(), layer, lengths, k_new, v_new,
                        out);
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
                                  .Ret<ffi::Buffer<ffi::F32>>());
