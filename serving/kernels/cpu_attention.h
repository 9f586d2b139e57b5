// The decode attention kernel's body (cpu_attention.cc says what and why), written once for every
// instruction set: cpu_attention.cc includes it in one namespace per set, after defining there
// PATHSERVE_TARGET (the function attribute) and the 16-float vector V with its operations: Zero,
// Load16 (float or int8), Fma, Set1, Sum, Mul, Store16, and ExpAndSum(scores, n) (scores <-
// exp(scores - max), returning their sum). No include guard: it is meant to be included twice.

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
  PATHSERVE_TARGET void Item(int64_t b, int64_t h, std::vector<float>& scores) const {
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
      V dot[G];
      for (int g = 0; g < G; ++g) dot[g] = Zero();
      for (int64_t c = 0; c < chunks; ++c) {
        const V key = t < n ? Load16(keys + t * row + 16 * c) : Load16(own_k + 16 * c);
        for (int g = 0; g < G; ++g) dot[g] = Fma(Load16(query + g * head_dim + 16 * c), key, dot[g]);
      }
      const float key_scale = (t < n && k_scales) ? k_scales[t * kv_heads] * scale : scale;
      for (int g = 0; g < G; ++g) scores[g * width + t] = Sum(dot[g]) * key_scale;
    }

    float inverse_total[G];
    for (int g = 0; g < G; ++g) inverse_total[g] = 1.0f / ExpAndSum(scores.data() + g * width, width);

    float* result = out + (b * kv_heads + h) * G * head_dim;
    for (int64_t c = 0; c < chunks; ++c) {
      V acc[G];
      for (int g = 0; g < G; ++g) acc[g] = Zero();
      for (int64_t t = 0; t <= n; ++t) {
        const V value = t < n ? Load16(values + t * row + 16 * c) : Load16(own_v + 16 * c);
        const float value_scale = (t < n && v_scales) ? v_scales[t * kv_heads] : 1.0f;
        for (int g = 0; g < G; ++g)
          acc[g] = Fma(Set1(scores[g * width + t] * value_scale), value, acc[g]);
      }
      for (int g = 0; g < G; ++g)
        Store16(result + g * head_dim + 16 * c, Mul(acc[g], Set1(inverse_total[g])));
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

