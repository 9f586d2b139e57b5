// The attention kernel's body (cpu_attention.cc says what and why), written once for every
// instruction set: cpu_attention.cc includes it in one namespace per set, after defining there
// PATHSERVE_TARGET (the function attribute) and the 16-float vector V with its operations: Zero,
// Load16 (float or int8), Fma, Set1, Sum, Sums16 (16 vectors' sums in one), Mul, Add, Sub, Max,
// ExpV, Select, Store16, and ExpAndSum(scores, n) (scores <- exp(scores - max), returning their
// sum), and kVectorRegisters (the Vs the registers hold); the checks (Layout, CheckLayout) come
// before, once for every set.
// No include guard: it is meant to be included twice.

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
  const int32_t* counts;  // [B]: the query positions of each row that count (the rest: zeros)
  float* out;
  int64_t batch, chunk, max_pages, page_size, kv_heads, groups, head_dim;
  float scale;
  int64_t scale_heads;  // an int8 pool's scales per token: kv_heads (dkv) or 1 (heads_and_dkv)
  bool whole_rows = false;  // Items: RowItem (every kv head of a row per item), else Item (one head)

  // Row b's query positions that count, counts[b] clamped to [0, chunk].
  int64_t Count(int64_t b) const { return std::min<int64_t>(std::max<int32_t>(counts[b], 0), chunk); }

  // Zeros for query positions [s0, s1) of row b, kv head h: a chunk's padding.
  void Clear(int64_t b, int64_t h, int64_t s0, int64_t s1) const {
    for (int64_t s = s0; s < s1; ++s) {
      float* result = out + ((b * chunk + s) * kv_heads + h) * groups * head_dim;
      std::fill(result, result + groups * head_dim, 0.0f);
    }
  }

  // Row b's cached positions, lengths[b] clamped to what its table can hold.
  int64_t Length(int64_t b) const {
    return std::min<int64_t>(std::max<int32_t>(lengths[b], 0), max_pages * page_size);
  }

  // dot[g * step] <- query g . key as 16 partial sums, for the G query heads of one kv head.
  template <int G, typename U>
  PATHSERVE_TARGET void Dots(const float* query, const U* key, V* dot, int64_t step) const {
    for (int g = 0; g < G; ++g) dot[g * step] = Zero();
    for (int64_t c = 0; c < head_dim / 16; ++c) {
      const V k16 = Load16(key + 16 * c);
      for (int g = 0; g < G; ++g) dot[g * step] = Fma(Load16(query + g * head_dim + 16 * c), k16, dot[g * step]);
    }
  }

  // scores[g * width] <- scale * query g . key, for the G query heads of one kv head.
  template <int G, typename U>
  PATHSERVE_TARGET void Score(const float* query, const U* key, float key_scale, float* scores,
                              int64_t width) const {
    V dot[G];
    Dots<G>(query, key, dot, 1);
    for (int g = 0; g < G; ++g) scores[g * width] = Sum(dot[g]) * key_scale;
  }

  // Attention of the `G` query heads sharing kv head `h` of row `b`'s query position `s` (of
  // `chunk`): its cached positions, then the call's own positions 0..s. Position t of the row is
  // the layer's token pages[b, t / page_size] * page_size + t % page_size; both passes walk the row
  // a page at a time, so the table is read once per page, with no division per position.
  // Scores: each key's G dot products stay vectors (16 partial sums each) for a tile of 16
  // positions, then one transposing reduction (Sums16) gives 16 scores per query head: no
  // horizontal sum per (position, head). Values: one pass over the positions per CC vectors of
  // head_dim, G x CC sums in registers (each value vector loaded once, each score broadcast once).
  template <int G>
  PATHSERVE_TARGET void Item(int64_t b, int64_t s, int64_t h, std::vector<float>& scores) const {
    const int64_t n = Length(b);
    const int64_t row = kv_heads * head_dim;  // stride between tokens
    const int64_t vectors = head_dim / 16;
    const int64_t bytes = head_dim * static_cast<int64_t>(sizeof(T));  // one head of one token
    const int32_t* table = pages + b * max_pages;
    const float* query = q + ((b * chunk + s) * kv_heads + h) * G * head_dim;
    const float* own_k = k_new + (b * chunk * kv_heads + h) * head_dim;  // own position j at + j * row
    const float* own_v = v_new + (b * chunk * kv_heads + h) * head_dim;
    const int64_t width = n + s + 1;  // the cached positions, then the call's own up to s
    // each head's scores, a tile's full 16 stored even past its last position: the slack holds it
    const int64_t stride = (width + 15) / 16 * 16 + 16;
    scores.resize(G * stride);

    V tile[G][16];
    float tile_scales[16];
    // The prefetch runs kAhead positions ahead, into the page of that position (its own walk).
    int64_t ahead_slot = kAhead / page_size, ahead_offset = kAhead % page_size;
    for (int64_t first = 0, slot = 0; first < n; first += page_size, ++slot) {
      const int64_t token = int64_t{table[slot]} * page_size;
      const T* keys = k + token * row + h * head_dim;
      const float* k_scales = k_scale ? k_scale + token * scale_heads + (scale_heads > 1 ? h : 0) : nullptr;
      const int64_t end = std::min(first + page_size, n);
      for (int64_t t0 = first; t0 < end; t0 += 16) {
        const int64_t count = std::min<int64_t>(16, end - t0);
        for (int64_t j = 0; j < count; ++j) {
          if (t0 + j + kAhead < n) {  // this position's keys and values are far apart in the pool: fetch both into L2
            const int64_t at = (int64_t{table[ahead_slot]} * page_size + ahead_offset) * row;
            const char* k_at = reinterpret_cast<const char*>(k + at);
            const char* v_at = reinterpret_cast<const char*>(v + at);
            for (int64_t c = h * bytes; c < (h + 1) * bytes; c += 64) {
              _mm_prefetch(k_at + c, _MM_HINT_T1);
              _mm_prefetch(v_at + c, _MM_HINT_T1);
            }
            if (h == 0) {  // the other kv heads' lines of the token too, into L2: the row in one stream
              for (int64_t c = bytes; c < row * static_cast<int64_t>(sizeof(T)); c += 64) {
                _mm_prefetch(k_at + c, _MM_HINT_T1);
                _mm_prefetch(v_at + c, _MM_HINT_T1);
              }
            }
            if (++ahead_offset == page_size) {
              ahead_offset = 0;
              ++ahead_slot;
            }
          }
          Dots<G>(query, keys + (t0 - first + j) * row, &tile[0][j], 16);
          tile_scales[j] = k_scales ? k_scales[(t0 - first + j) * scale_heads] * scale : scale;
        }
        for (int64_t j = count; j < 16; ++j) {
          for (int g = 0; g < G; ++g) tile[g][j] = Zero();
          tile_scales[j] = 0.0f;
        }
        const V key_scales = Load16(tile_scales);
        for (int g = 0; g < G; ++g) Store16(scores.data() + g * stride + t0, Mul(Sums16(tile[g]), key_scales));
      }
    }
    for (int64_t j = 0; j <= s; ++j) Score<G>(query, own_k + j * row, scale, scores.data() + n + j, stride);

    float inverse_total[G];
    for (int g = 0; g < G; ++g) inverse_total[g] = 1.0f / ExpAndSum(scores.data() + g * stride, width);

    float* result = out + ((b * chunk + s) * kv_heads + h) * G * head_dim;
    constexpr int CC = std::max(1, std::min(4, (kVectorRegisters - 2) / G));  // vectors of head_dim per pass
    for (int64_t c0 = 0; c0 < vectors;) {
      if (c0 + CC <= vectors) {
        Values<G, CC>(b, h, c0, n, s, table, own_v, scores.data(), stride, inverse_total, result);
        c0 += CC;
      } else {
        Values<G, 1>(b, h, c0, n, s, table, own_v, scores.data(), stride, inverse_total, result);
        c0 += 1;
      }
    }
  }

  // Vectors [c0, c0 + CC) of head_dim of Item's output: the probabilities `scores` (stride apart
  // per query head) times the cached values, then the call's own values 0..s, normalized.
  template <int G, int CC>
  PATHSERVE_TARGET void Values(int64_t b, int64_t h, int64_t c0, int64_t n, int64_t s, const int32_t* table,
                               const float* own_v, const float* scores, int64_t stride, const float* inverse_total,
                               float* result) const {
    const int64_t row = kv_heads * head_dim;
    V acc[G][CC];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CC; ++c) acc[g][c] = Zero();
    for (int64_t first = 0, slot = 0; first < n; first += page_size, ++slot) {
      const int64_t token = int64_t{table[slot]} * page_size;
      const T* values = v + token * row + h * head_dim + 16 * c0;
      const float* v_scales = v_scale ? v_scale + token * scale_heads + (scale_heads > 1 ? h : 0) : nullptr;
      for (int64_t t = first; t < std::min(first + page_size, n); ++t) {
        V value[CC];
        for (int c = 0; c < CC; ++c) value[c] = Load16(values + (t - first) * row + 16 * c);
        const float value_scale = v_scales ? v_scales[(t - first) * scale_heads] : 1.0f;
        for (int g = 0; g < G; ++g) {
          const V weight = Set1(scores[g * stride + t] * value_scale);
          for (int c = 0; c < CC; ++c) acc[g][c] = Fma(weight, value[c], acc[g][c]);
        }
      }
    }
    for (int64_t j = 0; j <= s; ++j) {
      for (int c = 0; c < CC; ++c) {
        const V value = Load16(own_v + j * row + 16 * (c0 + c));
        for (int g = 0; g < G; ++g) acc[g][c] = Fma(Set1(scores[g * stride + n + j]), value, acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CC; ++c) Store16(result + g * head_dim + 16 * (c0 + c), Mul(acc[g][c], Set1(inverse_total[g])));
  }

  // Item for every kv head of row `b`'s query position `s` at once, for a float pool (no int8
  // scales here) where the rows are enough to share among the threads (Attend decides). Item reads
  // a head's slice of each token row (256 of 768 bytes for SmolLM2), a stride the hardware
  // prefetchers follow poorly: ~15 GB/s on two threads. Here both passes read whole token rows one
  // after another (one stream, ~19 GB/s; ~22 on 2 MB pages): each tile of 16
  // positions takes every head's G dot products per row (vectors in `dots`, reduced per head by
  // Sums16 as in Item), and the values' pass adds each row's values to sums [kv heads, G,
  // head_dim] held in L1 (too many for the registers) before the next row.
  template <int G>
  PATHSERVE_TARGET void RowItem(int64_t b, int64_t s, std::vector<float>& scores, std::vector<float>& sums,
                                std::vector<float>& dots) const {
    const int64_t n = Length(b);
    const int64_t row = kv_heads * head_dim;  // stride between tokens
    const int64_t vectors = head_dim / 16;
    const int32_t* table = pages + b * max_pages;
    const float* queries = q + (b * chunk + s) * row * G;  // kv head h's G queries at + h * G * head_dim
    const float* own_k = k_new + b * chunk * row;          // own position j, kv head h at + j * row + h * head_dim
    const float* own_v = v_new + b * chunk * row;
    const int64_t width = n + s + 1;  // the cached positions, then the call's own up to s
    const int64_t stride = (width + 15) / 16 * 16 + 16;  // per (kv head, query head), as in Item
    scores.resize(kv_heads * G * stride);
    sums.assign(kv_heads * G * head_dim, 0.0f);
    // a tile's dot products [kv heads, G, 16 positions], vectors aligned in `dots`
    dots.resize(kv_heads * G * 16 * 16 + 16);
    V* tile = reinterpret_cast<V*>((reinterpret_cast<uintptr_t>(dots.data()) + 63) & ~uintptr_t{63});
    for (int64_t t = 0; t < kRowAhead; ++t) FetchRow(k, table, t, n);  // the first keys; the pass asks ahead
    for (int64_t first = 0, slot = 0; first < n; first += page_size, ++slot) {
      const T* keys = k + int64_t{table[slot]} * page_size * row;
      const int64_t end = std::min(first + page_size, n);
      for (int64_t t0 = first; t0 < end; t0 += 16) {
        const int64_t count = std::min<int64_t>(16, end - t0);
        for (int64_t j = 0; j < 16; ++j) {
          if (j < count) FetchRow(k, table, t0 + j + kRowAhead, n);
          for (int64_t h = 0; h < kv_heads; ++h) {
            V* dot = tile + h * G * 16 + j;
            if (j < count) {
              Dots<G>(queries + h * G * head_dim, keys + (t0 - first + j) * row + h * head_dim, dot, 16);
            } else {
              for (int g = 0; g < G; ++g) dot[g * 16] = Zero();
            }
          }
        }
        for (int64_t i = 0; i < kv_heads * G; ++i)
          Store16(scores.data() + i * stride + t0, Mul(Sums16(tile + i * 16), Set1(scale)));
      }
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t j = 0; j <= s; ++j) {
        Score<G>(queries + h * G * head_dim, own_k + j * row + h * head_dim, scale,
                 scores.data() + h * G * stride + n + j, stride);
      }
    }
    for (int64_t t = 0; t < kRowAhead; ++t) FetchRow(v, table, t, n);  // the first values, during the softmax
    float inverse_total[16 * G];  // kv_heads <= 16 (Attend)
    for (int64_t i = 0; i < kv_heads * G; ++i) inverse_total[i] = 1.0f / ExpAndSum(scores.data() + i * stride, width);

    for (int64_t first = 0, slot = 0; first < n; first += page_size, ++slot) {
      const T* values = v + int64_t{table[slot]} * page_size * row;
      for (int64_t t = first; t < std::min(first + page_size, n); ++t) {
        FetchRow(v, table, t + kRowAhead, n);
        AddRow<G>(values + (t - first) * row, scores.data() + t, stride, sums.data());
      }
    }
    for (int64_t j = 0; j <= s; ++j) AddRow<G>(own_v + j * row, scores.data() + n + j, stride, sums.data());
    float* result = out + (b * chunk + s) * row * G;
    for (int64_t i = 0; i < kv_heads * G; ++i)
      for (int64_t c = 0; c < vectors; ++c)
        Store16(result + i * head_dim + 16 * c,
                Mul(Load16(sums.data() + i * head_dim + 16 * c), Set1(inverse_total[i])));
  }

  // Asks for the token row (every kv head) of position t, into L2, of a row whose block table is
  // `table` in `pool` (k or v), if t < n: RowItem's loads alone kept too few lines in flight
  // (kRowAhead says what it measured).
  PATHSERVE_TARGET void FetchRow(const T* pool, const int32_t* table, int64_t t, int64_t n) const {
    if (t >= n) return;
    const int64_t row = kv_heads * head_dim;
    const char* at = reinterpret_cast<const char*>(pool + (int64_t{table[t / page_size]} * page_size + t % page_size) * row);
    // asm, not _mm_prefetch: GCC 12 compiled this loop of builtin prefetches to nothing here
    for (int64_t c = 0; c < row * static_cast<int64_t>(sizeof(T)); c += 64) asm volatile("prefetcht1 %0" : : "m"(at[c]));
  }

  // sums [kv heads, G, head_dim] += each head's probabilities probs[(h * G + g) * stride] times the
  // token row `value`'s values [kv heads, head_dim].
  template <int G, typename U>
  PATHSERVE_TARGET void AddRow(const U* value, const float* probs, int64_t stride, float* sums) const {
    for (int64_t h = 0; h < kv_heads; ++h) {
      V weight[G];  // read before the stores below, which the compiler cannot tell from `probs`
      for (int g = 0; g < G; ++g) weight[g] = Set1(probs[(h * G + g) * stride]);
      float* head_sums = sums + h * G * head_dim;
      for (int64_t c = 0; c < head_dim / 16; ++c) {
        const V v16 = Load16(value + h * head_dim + 16 * c);
        for (int g = 0; g < G; ++g) {
          float* sum = head_sums + g * head_dim + 16 * c;
          Store16(sum, Fma(weight[g], v16, Load16(sum)));
        }
      }
    }
  }

  // -- Several query positions per row (chunk > 1): the queries in the vector's lanes -------------
  // Item's loop reads every cached key and value once per query position and sums each score
  // across a vector; for a chunk of S positions that is S passes over the row's history. Here an
  // item is a block of query positions [s0, s1) of row b with the G heads of kv head h: up to
  // kBlockQueries queries, lane r = (s - s0) * G + g. Each position's key and value is read once
  // per block; a score is that key's element d broadcast times 16 queries' element d (the queries
  // transposed once per block), so no horizontal sums; the softmax runs online over tiles of kTile
  // positions (a running max and sum per lane), and the values' pass accumulates out^T [hd, lanes].
  static constexpr int64_t kBlockQueries = 64;  // 4 vectors of lanes
  static constexpr int64_t kTile = 16;          // positions per softmax step
  static constexpr float kMasked = -1e30f;      // a masked score, and the running max's start

  // Blocks per row and kv head, and the positions of each (the last may have fewer): as few
  // blocks as hold kBlockQueries queries, their positions spread evenly.
  int64_t BlockCount() const {
    const int64_t most = std::max<int64_t>(1, kBlockQueries / groups);
    return (chunk + most - 1) / most;
  }
  int64_t BlockPositions() const { return (chunk + BlockCount() - 1) / BlockCount(); }

  // One thread's buffers for a block (W = 16 * RV lanes).
  struct Scratch {
    std::vector<float> qt;      // [hd, W]: the queries transposed, times the softmax scale
    std::vector<float> o;       // [hd, W]: the unnormalized outputs, transposed
    std::vector<float> p;       // [kTile, W]: a tile's scores, then its probabilities (times v's scale)
    std::vector<float> top;     // [W]: the running max of each lane's scores
    std::vector<float> total;   // [W]: the running sum of exp(score - top)
    std::vector<float> pos;     // [W]: each lane's query position (its own keys 0..pos are causal)
    std::vector<float> kf, vf;  // [kTile, hd]: an int8 tile's keys and values as floats (unscaled)
  };

  // Keys (and head_dim elements) per step of Tile for RV vectors of lanes: 8, 4, 2 or 1.
  static constexpr int Keys(int rv) {
    for (int x = 8; x > 1; x /= 2)
      if (x * rv + rv + 2 <= kVectorRegisters) return x;
    return 1;
  }

  // One tile of `count` positions: keys[j] and values[j] rows of head_dim floats with their scales
  // ks[j], vs[j] (an int8 pool's, else 1). `own` < 0: cached positions, every lane attends; else
  // the call's own positions own + j, which a lane attends only up to its own position.
  template <int RV>
  PATHSERVE_TARGET void Tile(Scratch& w, const float* const* keys, const float* const* values, const float* ks,
                             const float* vs, int64_t count, int64_t own) const {
    constexpr int64_t W = 16 * RV;
    const float* qt = w.qt.data();
    float* p = w.p.data();
    V pos[RV];
    for (int i = 0; i < RV; ++i) pos[i] = Load16(w.pos.data() + 16 * i);
    // X keys at a time (and X elements of head_dim in the values' pass below), as many of 8, 4, 2
    // as the registers hold X * RV sums for beside RV vectors of queries: each vector loaded
    // serves X keys, each broadcast RV vectors. (X = 2 left the loads at 5 for every 6 multiply-adds:
    // a 24-position chunk over 2,048 cached ones ran at ~47% of the two cores' FMA peak.)
    constexpr int X = Keys(RV);
    for (int64_t j = 0; j < count; j += X) {
      const int64_t here = std::min<int64_t>(X, count - j);
      V acc[X][RV];
      const float* key[X];
      for (int x = 0; x < X; ++x) {
        key[x] = keys[j + std::min<int64_t>(x, here - 1)];  // the last key twice when one is left
        for (int i = 0; i < RV; ++i) acc[x][i] = Zero();
      }
      for (int64_t d = 0; d < head_dim; ++d) {
        V query[RV];  // RV queries, then one broadcast at a time: X * RV + RV + 1 registers live
        for (int i = 0; i < RV; ++i) query[i] = Load16(qt + d * W + 16 * i);
        for (int x = 0; x < X; ++x) {
          const V element = Set1(key[x][d]);
          for (int i = 0; i < RV; ++i) acc[x][i] = Fma(element, query[i], acc[x][i]);
        }
      }
      for (int64_t x = 0; x < here; ++x) {
        const V key_scale = Set1(ks[j + x]);
        for (int i = 0; i < RV; ++i) {
          V score = Mul(acc[x][i], key_scale);
          if (own >= 0) score = Select(pos[i], static_cast<float>(own + j + x), score, Set1(kMasked));
          Store16(p + (j + x) * W + 16 * i, score);
        }
      }
    }
    V fixup[RV];
    for (int i = 0; i < RV; ++i) {
      const V before = Load16(w.top.data() + 16 * i);
      V top = before;
      for (int64_t j = 0; j < count; ++j) top = Max(top, Load16(p + j * W + 16 * i));
      fixup[i] = ExpV(Sub(before, top));
      V sum = Zero();
      for (int64_t j = 0; j < count; ++j) {
        V e = ExpV(Sub(Load16(p + j * W + 16 * i), top));
        if (own >= 0) e = Select(pos[i], static_cast<float>(own + j), e, Zero());
        sum = Add(sum, e);
        Store16(p + j * W + 16 * i, Mul(e, Set1(vs[j])));
      }
      Store16(w.total.data() + 16 * i, Fma(Load16(w.total.data() + 16 * i), fixup[i], sum));
      Store16(w.top.data() + 16 * i, top);
    }
    float* o = w.o.data();
    for (int64_t d = 0; d < head_dim; d += X) {  // X elements at a time (head_dim is a multiple of 16): each p serves X
      V acc[X][RV];
      for (int x = 0; x < X; ++x)
        for (int i = 0; i < RV; ++i) acc[x][i] = Mul(Load16(o + (d + x) * W + 16 * i), fixup[i]);
      for (int64_t j = 0; j < count; ++j) {
        V weight[RV];
        for (int i = 0; i < RV; ++i) weight[i] = Load16(p + j * W + 16 * i);
        for (int x = 0; x < X; ++x) {
          const V element = Set1(values[j][d + x]);
          for (int i = 0; i < RV; ++i) acc[x][i] = Fma(element, weight[i], acc[x][i]);
        }
      }
      for (int x = 0; x < X; ++x)
        for (int i = 0; i < RV; ++i) Store16(o + (d + x) * W + 16 * i, acc[x][i]);
    }
  }

  // Query positions [s0, s1) of row b, kv head h: its cached positions a page (and a tile) at a
  // time, then the call's own positions 0..s1-1.
  template <int RV>
  PATHSERVE_TARGET void Block(int64_t b, int64_t h, int64_t s0, int64_t s1, Scratch& w) const {
    constexpr int64_t W = 16 * RV;
    const int64_t n = Length(b), queries = (s1 - s0) * groups, row = kv_heads * head_dim;
    w.qt.assign(head_dim * W, 0.0f);
    w.o.assign(head_dim * W, 0.0f);
    w.p.resize(kTile * W);
    w.top.assign(W, kMasked);
    w.total.assign(W, 0.0f);
    w.pos.assign(W, static_cast<float>(chunk));  // the padding lanes: queries of zeros, never masked
    w.kf.resize(kTile * head_dim);
    w.vf.resize(kTile * head_dim);
    for (int64_t r = 0; r < queries; ++r) {
      const int64_t s = s0 + r / groups;
      const float* query = q + ((b * chunk + s) * kv_heads + h) * groups * head_dim + r % groups * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) w.qt[d * W + r] = query[d] * scale;
      w.pos[r] = static_cast<float>(s);
    }
    const float* keys[kTile];
    const float* values[kTile];
    float ks[kTile], vs[kTile];
    const int32_t* table = pages + b * max_pages;
    for (int64_t first = 0, slot = 0; first < n; first += page_size, ++slot) {
      const int64_t token = int64_t{table[slot]} * page_size - first;  // + t: position t's token
      const int64_t end = std::min(first + page_size, n);
      for (int64_t t0 = first; t0 < end; t0 += kTile) {
        const int64_t count = std::min(kTile, end - t0);
        for (int64_t j = 0; j < count; ++j) {
          const int64_t at = (token + t0 + j) * row + h * head_dim;
          if constexpr (std::is_same_v<T, float>) {
            keys[j] = k + at;
            values[j] = v + at;
            ks[j] = vs[j] = 1.0f;
          } else {
            float* kf = w.kf.data() + j * head_dim;
            float* vf = w.vf.data() + j * head_dim;
            for (int64_t c = 0; c < head_dim; c += 16) {
              Store16(kf + c, Load16(k + at + c));
              Store16(vf + c, Load16(v + at + c));
            }
            keys[j] = kf;
            values[j] = vf;
            const int64_t scale_at = (token + t0 + j) * scale_heads + (scale_heads > 1 ? h : 0);
            ks[j] = k_scale[scale_at];
            vs[j] = v_scale[scale_at];
          }
        }
        Tile<RV>(w, keys, values, ks, vs, count, -1);
      }
    }
    for (int64_t j0 = 0; j0 < s1; j0 += kTile) {
      const int64_t count = std::min(kTile, s1 - j0);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t at = ((b * chunk + j0 + j) * kv_heads + h) * head_dim;
        keys[j] = k_new + at;
        values[j] = v_new + at;
        ks[j] = vs[j] = 1.0f;
      }
      Tile<RV>(w, keys, values, ks, vs, count, j0);
    }
    for (int64_t r = 0; r < queries; ++r) {
      const int64_t s = s0 + r / groups;
      float* result = out + ((b * chunk + s) * kv_heads + h) * groups * head_dim + r % groups * head_dim;
      const float inverse = 1.0f / w.total[r];
      for (int64_t d = 0; d < head_dim; ++d) result[d] = w.o[d * W + r] * inverse;
    }
  }

  // Blocks [first, last): block i is row i / (kv * blocks), kv head i / blocks % kv, positions
  // from i % blocks * BlockPositions().
  void Blocks(int64_t first, int64_t last) const {
    thread_local Scratch scratch;
    const int64_t blocks = BlockCount(), per = BlockPositions();
    for (int64_t i = first; i < last; ++i) {
      const int64_t b = i / (kv_heads * blocks), h = i / blocks % kv_heads;
      const int64_t s0 = i % blocks * per, end = std::min(chunk, s0 + per), s1 = std::min(end, Count(b));
      Clear(b, h, std::max(s0, s1), end);
      if (s1 <= s0) continue;
      switch (((s1 - s0) * groups + 15) / 16) {
        case 1:
          Block<1>(b, h, s0, s1, scratch);
          break;
        case 2:
          Block<2>(b, h, s0, s1, scratch);
          break;
        case 3:
          Block<3>(b, h, s0, s1, scratch);
          break;
        default:
          Block<4>(b, h, s0, s1, scratch);
          break;
      }
    }
  }

  template <int G>
  void Items(int64_t first, int64_t last) const {
    thread_local std::vector<float> scores;
    if constexpr (std::is_same_v<T, float>) {
      if (whole_rows) {  // item i: row i / chunk, query position i % chunk, every kv head
        thread_local std::vector<float> sums, dots;
        for (int64_t i = first; i < last; ++i) {
          const int64_t b = i / chunk, s = i % chunk;
          if (s < Count(b)) {
            RowItem<G>(b, s, scores, sums, dots);
          } else {
            for (int64_t h = 0; h < kv_heads; ++h) Clear(b, h, s, s + 1);
          }
        }
        return;
      }
    }
    // item i: row i / (chunk * kv), query position (i / kv) % chunk, kv head i % kv
    for (int64_t i = first; i < last; ++i) {
      const int64_t b = i / (chunk * kv_heads), s = i / kv_heads % chunk, h = i % kv_heads;
      if (s < Count(b)) {
        Item<G>(b, s, h, scores);
      } else {
        Clear(b, h, s, s + 1);
      }
    }
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
                  ffi::Buffer<ffi::S32> counts, ffi::ResultBuffer<ffi::F32> out) {
  const auto checked =
      CheckLayout(q.dimensions(), k.dimensions(), v.dimensions(), layer, lengths, k_new, v_new, pages, counts);
  if (checked.has_error()) return checked.error();
  const Layout& s = checked.value();
  const int64_t tokens = s.num_pages * s.page_size;  // per layer of the pool
  Problem<T> problem{q.typed_data(),
                     k.typed_data() + s.layer * tokens * s.kv_heads * s.head_dim,
                     v.typed_data() + s.layer * tokens * s.kv_heads * s.head_dim,
                     k_scale ? k_scale + s.layer * tokens * scale_heads : nullptr,
                     v_scale ? v_scale + s.layer * tokens * scale_heads : nullptr,
                     pages.typed_data(),
                     lengths.typed_data(),
                     k_new.typed_data(),
                     v_new.typed_data(),
                     counts.typed_data(),
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
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t count = problem.Count(b);
    positions += count * problem.Length(b) + count * (count + 1) / 2;
  }
  const int64_t work = 2 * positions * s.kv_heads * s.groups * s.head_dim;
  // Blocks when they fill at least half their 16 lanes (a block of 5 positions x 1 query head
  // would pay head_dim broadcast multiply-adds per key for 5 scores, the items ~5 x head_dim / 16)
  // and there are enough of them to share among the threads (or a row's chunk is more than one
  // block): a verify call of k + 1 = 5 positions on one row is 3 blocks of SmolLM2's heads for 2
  // threads, where the per-position items (15) share better.
  const int64_t blocks = s.batch * s.kv_heads * problem.BlockCount();
  const bool filled = problem.BlockPositions() * s.groups >= 8;
  if (s.chunk > 1 && filled && (blocks >= 2 * pool.num_threads() || problem.BlockCount() > 1)) {
    pathserve::ParallelFor(pool, blocks, work,
                           [problem](int64_t first, int64_t last) { problem.Blocks(first, last); });
  } else {
    // A decode step's rows whole on a float pool where they alone give every thread two items or
    // more (an int8 pool reads a quarter of the bytes, and there Item's registers measured faster;
    // with fewer rows, a row's kv heads go to different threads; a verify call's positions keep
    // the per-position items, as measured when they were chosen).
    problem.whole_rows =
        std::is_same_v<T, float> && s.chunk == 1 && s.kv_heads <= 16 && s.batch >= 2 * pool.num_threads();
    pathserve::ParallelFor(pool, s.batch * s.chunk * (problem.whole_rows ? 1 : s.kv_heads), work,
                           [problem](int64_t first, int64_t last) { problem.Items(first, last); });
  }
  return ffi::Error::Success();
}
