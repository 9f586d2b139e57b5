// The attention kernel's body (cpu_attention.cc says what and why), written once for every
// instruction set: cpu_attention.cc includes it in one namespace per set, after defining there
// PATHSERVE_TARGET (the function attribute) and the 16-float vector V with its operations: Zero,
// Load16 (float or int8), Fma, Set1, Sum, Mul, Store16, and ExpAndSum(scores, n) (scores <-
// exp(scores - max), returning their sum); the checks (Layout, CheckLayout) come before, once for
// every set. No include guard: it is meant to be included twice.

template <typename T>
struct Problem {
  const float* q;
  const T* k;            // this layer's pool: [pages, page_size, kv, hd]
  const T* v;
  const float* k_scale;  // this layer's pool: [pages, page_size, scale_heads] (int8 only)
  const float* v_scale;
  const int32_t* pages;  // block table [B, max_pages], every entry a page of the pool (checked)
  const int32_t* lengths;
  const float* k_new;    // [B, chunk, kv, hd]: the call's own positions, not yet in the cache
  const float* v_new;
  float* out;
  int64_t batch, chunk, max_pages, page_size, kv_heads, groups, head_dim;
  float scale;
  int64_t scale_heads;  // an int8 pool's scales per token: kv_heads (dkv) or 1 (heads_and_dkv)

  // Row b's cached positions, lengths[b] clamped to what its table can hold.
  int64_t Length(int64_t b) const {
    return std::min<int64_t>(std::max<int32_t>(lengths[b], 0), max_pages * page_size);
  }

  // scores[g * width] <- scale * query g . key, for the G query heads of one kv head.
  template <int G, typename U>
  PATHSERVE_TARGET void Score(const float* query, const U* key, float key_scale, float* scores,
                              int64_t width) const {
    V dot[G];
    for (int g = 0; g < G; ++g) dot[g] = Zero();
    for (int64_t c = 0; c < head_dim / 16; ++c) {
      const V k16 = Load16(key + 16 * c);
      for (int g = 0; g < G; ++g) dot[g] = Fma(Load16(query + g * head_dim + 16 * c), k16, dot[g]);
    }
    for (int g = 0; g < G; ++g) scores[g * width] = Sum(dot[g]) * key_scale;
  }

  // Attention of the `G` query heads sharing kv head `h` of row `b`'s query position `s` (of
  // `chunk`): its cached positions, then the call's own positions 0..s. Position t of the row is
  // the layer's token pages[b, t / page_size] * page_size + t % page_size; both passes walk the row
  // a page at a time, so the table is read once per page, with no division per position.
  template <int G>
  PATHSERVE_TARGET void Item(int64_t b, int64_t s, int64_t h, std::vector<float>& scores) const {
    const int64_t n = Length(b);
    const int64_t row = kv_heads * head_dim;  // stride between tokens
    const int32_t* table = pages + b * max_pages;
    const float* query = q + ((b * chunk + s) * kv_heads + h) * G * head_dim;
    const float* own_k = k_new + (b * chunk * kv_heads + h) * head_dim;  // own position j at + j * row
    const float* own_v = v_new + (b * chunk * kv_heads + h) * head_dim;
    const int64_t width = n + s + 1;  // the cached positions, then the call's own up to s
    scores.resize(G * width);

    // The prefetch runs kAhead positions ahead, into the page of that position (its own walk).
    int64_t ahead_slot = kAhead / page_size, ahead_offset = kAhead % page_size;
    for (int64_t first = 0, slot = 0; first < n; first += page_size, ++slot) {
      const int64_t token = int64_t{table[slot]} * page_size;
      const T* keys = k + token * row + h * head_dim;
      const float* k_scales = k_scale ? k_scale + token * scale_heads + (scale_heads > 1 ? h : 0) : nullptr;
      for (int64_t t = first; t < std::min(first + page_size, n); ++t) {
        if (t + kAhead < n) {  // this position's keys and values are far apart in the pool: fetch both early
          const int64_t at = (int64_t{table[ahead_slot]} * page_size + ahead_offset) * row + h * head_dim;
          for (int64_t c = 0; c < head_dim * static_cast<int64_t>(sizeof(T)); c += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(k + at) + c, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(v + at) + c, _MM_HINT_T0);
          }
          if (++ahead_offset == page_size) {
            ahead_offset = 0;
            ++ahead_slot;
          }
        }
        const float key_scale = k_scales ? k_scales[(t - first) * scale_heads] * scale : scale;
        Score<G>(query, keys + (t - first) * row, key_scale, scores.data() + t, width);
      }
    }
    for (int64_t j = 0; j <= s; ++j) Score<G>(query, own_k + j * row, scale, scores.data() + n + j, width);

    float inverse_total[G];
    for (int g = 0; g < G; ++g) inverse_total[g] = 1.0f / ExpAndSum(scores.data() + g * width, width);

    float* result = out + ((b * chunk + s) * kv_heads + h) * G * head_dim;
    for (int64_t c = 0; c < head_dim / 16; ++c) {
      V acc[G];
      for (int g = 0; g < G; ++g) acc[g] = Zero();
      for (int64_t first = 0, slot = 0; first < n; first += page_size, ++slot) {
        const int64_t token = int64_t{table[slot]} * page_size;
        const T* values = v + token * row + h * head_dim + 16 * c;
        const float* v_scales = v_scale ? v_scale + token * scale_heads + (scale_heads > 1 ? h : 0) : nullptr;
        for (int64_t t = first; t < std::min(first + page_size, n); ++t) {
          const V value = Load16(values + (t - first) * row);
          const float value_scale = v_scales ? v_scales[(t - first) * scale_heads] : 1.0f;
          for (int g = 0; g < G; ++g) acc[g] = Fma(Set1(scores[g * width + t] * value_scale), value, acc[g]);
        }
      }
      for (int64_t j = 0; j <= s; ++j) {
        const V value = Load16(own_v + j * row + 16 * c);
        for (int g = 0; g < G; ++g) acc[g] = Fma(Set1(scores[g * width + n + j]), value, acc[g]);
      }
      for (int g = 0; g < G; ++g)
        Store16(result + g * head_dim + 16 * c, Mul(acc[g], Set1(inverse_total[g])));
    }
  }

  template <int G>
  void Items(int64_t first, int64_t last) const {
    thread_local std::vector<float> scores;
    // item i: row i / (chunk * kv), query position (i / kv) % chunk, kv head i % kv
    for (int64_t i = first; i < last; ++i) Item<G>(i / (chunk * kv_heads), i / kv_heads % chunk, i % kv_heads, scores);
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

template <typename T, typename CacheBuffer>
ffi::Error Attend(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> q, CacheBuffer k, CacheBuffer v, const float* k_scale,
                  const float* v_scale, int64_t scale_heads, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> lengths,
                  ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::S32> pages,
                  ffi::ResultBuffer<ffi::F32> out) {
  const auto checked = CheckLayout(q.dimensions(), k.dimensions(), v.dimensions(), layer, lengths, k_new, v_new, pages);
  if (checked.has_error()) return checked.error();
  const Layout& s = checked.value();
  const int64_t tokens = s.num_pages * s.page_size;  // per layer of the pool
  const Problem<T> problem{q.typed_data(),
                           k.typed_data() + s.layer * tokens * s.kv_heads * s.head_dim,
                           v.typed_data() + s.layer * tokens * s.kv_heads * s.head_dim,
                           k_scale ? k_scale + s.layer * tokens * scale_heads : nullptr,
                           v_scale ? v_scale + s.layer * tokens * scale_heads : nullptr,
                           pages.typed_data(),
                           lengths.typed_data(),
                           k_new.typed_data(),
                           v_new.typed_data(),
                           out->typed_data(),
                           s.batch,
                           s.chunk,
                           s.max_pages,
                           s.page_size,
                           s.kv_heads,
                           s.groups,
                           s.head_dim,
                           1.0f / std::sqrt(static_cast<float>(s.head_dim)),
                           scale_heads};
  int64_t positions = 0;  // scored by every query position of every row
  for (int64_t b = 0; b < s.batch; ++b) positions += s.chunk * problem.Length(b) + s.chunk * (s.chunk + 1) / 2;
  pathserve::ParallelFor(pool, s.batch * s.chunk * s.kv_heads, 2 * positions * s.kv_heads * s.groups * s.head_dim,
                         [problem](int64_t first, int64_t last) { problem.Items(first, last); });
  return ffi::Error::Success();
}
