// Attention of a prompt chunk's tokens with float32 queries (a CPU without bfloat16
// arithmetic: AVX-512 without BF16, or AVX2 with FMA), a tile of rows at a time,
// flash-attention style, on a float32 cache or an int8 one (dequantized a set of keys at a
// time).
//
// The row task (paged_attention.cpp) reads a row's whole context for that row alone: a
// 1,024-token prompt's rows read half a million keys each layer, and on a 2-core Ice Lake
// Xeon its attention took more than its matmuls (~900 of a 1,700 ms prompt). Here the rows
// of a tile (up to kRows: tokens x the kv head's query heads) are the lanes: the queries
// are transposed once a tile, so that register i of dim d holds rows [iL, iL + L)'s query
// dim d (pre-scaled), and a key's scores for L rows are head_dim FMAs against its dims
// broadcast, with nothing to sum across lanes. The online softmax is then vertical too (a
// running max and sum per lane), over sets of 16 keys; the values go the same way, into
// float accumulators held transposed ([dim][row]) and put back in rows at the end. A row
// stops at its own position (the causal mask: lanes past it get weight 0). Each row's
// arithmetic is its own lane's, whatever the other rows in its tile: a token's result does
// not depend on the chunk it came in.

#include "attention_simd.h"
#include "kernels.h"
#include "vec.h"

#include <limits>
#include <utility>

namespace sendpath_attention {

#ifdef SENDPATH_VEC
namespace {

using namespace sendpath_vec;

constexpr int64_t kLanes = kWidth;
constexpr int kMaxRowVecs = kLanes == 16 ? 4 : 2;  // 64 rows of 16 lanes, or 16 of 8
constexpr int64_t kRows = kMaxRowVecs * kLanes;
constexpr int64_t kSet = 16;  // keys a softmax step folds in (the block size's divisor)

#if SENDPATH_VEC == 16
using Mask = __mmask16;
inline Mask greater(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline Vec select(Mask m, Vec a, Vec b) { return _mm512_mask_blend_ps(m, b, a); }
#else
using Mask = __m256;
inline Mask greater(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline Vec select(Mask m, Vec a, Vec b) { return _mm256_blendv_ps(b, a, m); }
#endif

// A set's key and value rows as float32: a float32 cache's rows where they are, an int8
// cache's dequantized (codes x their row's scale) into the scratch.
template <int kDim>
struct SetRows {
  alignas(64) float keys[kSet][kDim];
  alignas(64) float values[kSet][kDim];

  std::pair<const float*, const float*> at(const float* k_head, const float* v_head,
                                           int64_t slot, int64_t) {
    return {k_head + slot * kDim, v_head + slot * kDim};
  }

  std::pair<const float*, const float*> at(const int8_t* k_head, const int8_t* v_head,
                                           int64_t slot, int64_t n) {
    const Int8Rows k_rows{k_head, kDim}, v_rows{v_head, kDim};
    for (int64_t j = 0; j < n; ++j) {
      widen(k_rows, slot + j, keys[j]);
      widen(v_rows, slot + j, values[j]);
    }
    return {&keys[0][0], &values[0][0]};
  }

  static void widen(const Int8Rows& rows, int64_t slot, float* out) {
    const int8_t* codes = rows.row(slot);
    const float scale = rows.scale(slot);
    for (int d = 0; d < kDim; ++d) out[d] = static_cast<float>(codes[d]) * scale;
  }
};

// The scores of kNR row registers against keys j .. j + 3 (rows kDim apart), into
// scores[j + i][r]: kNR x 4 chains of kDim FMAs, each key dim broadcast once for all rows.
template <int kDim, int kNR>
inline void score4(const float (*qt)[kRows], const float* k0, const float* k1, const float* k2,
                   const float* k3, float (*scores)[kRows], int64_t j) {
  Vec acc[kNR][4];
  for (int i = 0; i < kNR; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = zero();
  const float* keys[4] = {k0, k1, k2, k3};
#pragma GCC unroll 2
  for (int d = 0; d < kDim; ++d) {
    Vec q[kNR];
    for (int i = 0; i < kNR; ++i) q[i] = load(qt[d] + i * kLanes);
    for (int c = 0; c < 4; ++c) {
      const Vec k = set1(keys[c][d]);
      for (int i = 0; i < kNR; ++i) acc[i][c] = fma(q[i], k, acc[i][c]);
    }
  }
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < kNR; ++i) store(scores[j + c] + i * kLanes, acc[i][c]);
}

// out_t[d][rows] += sum over the set's n keys of weights[j][rows] x values[j][d], kD dims
// at a time: kNR x kD accumulators, each weight register loaded once for kD dims.
template <int kDim, int kNR, int kD>
inline void add_values(const float (*weights)[kRows], const float* values, int64_t n,
                       float (*out_t)[kRows]) {
  for (int d0 = 0; d0 < kDim; d0 += kD) {
    Vec acc[kNR][kD];
    for (int i = 0; i < kNR; ++i)
      for (int e = 0; e < kD; ++e) acc[i][e] = load(out_t[d0 + e] + i * kLanes);
    for (int64_t j = 0; j < n; ++j) {
      Vec w[kNR];
      for (int i = 0; i < kNR; ++i) w[i] = load(weights[j] + i * kLanes);
      const float* v = values + j * kDim + d0;
      for (int e = 0; e < kD; ++e) {
        const Vec x = set1(v[e]);
        for (int i = 0; i < kNR; ++i) acc[i][e] = fma(w[i], x, acc[i][e]);
      }
    }
    for (int i = 0; i < kNR; ++i)
      for (int e = 0; e < kD; ++e) store(out_t[d0 + e] + i * kLanes, acc[i][e]);
  }
}

template <int kDim, int kNR, typename cache_t>
void tile(const float* q, const cache_t* k_head, const cache_t* v_head, const int64_t* table,
          int64_t first_len, int64_t tokens, int64_t row_stride, float* out, const Shape& s,
          int64_t group) {
  constexpr int kD = kNR == 1 ? 8 : 4;  // value dims a pass: kNR x kD accumulators
  const int64_t rows = tokens * group, bs = s.block_size, last = first_len + tokens - 1;
  const int64_t row_size = kDim + (std::is_same_v<cache_t, int8_t> ? kInt8ScaleBytes : 0);
  alignas(64) float qt[kDim][kRows];     // queries x scale, transposed
  alignas(64) float out_t[kDim][kRows];  // value sums, transposed
  alignas(64) float scores[kSet][kRows];  // a set's scores, then its weights
  alignas(64) float seen[kRows];          // how many keys each row sees (its context)
  Vec run_max[kNR], run_sum[kNR];
  SetRows<kDim> staged;
  for (int64_t r = 0; r < kNR * kLanes; ++r) {  // lanes past the rows: zero queries
    const float* row = r < rows ? q + (r / group) * row_stride + (r % group) * kDim : nullptr;
    for (int d = 0; d < kDim; ++d) {
      qt[d][r] = row != nullptr ? row[d] * s.scale : 0.f;
      out_t[d][r] = 0.f;
    }
    seen[r] = row != nullptr ? static_cast<float>(first_len + r / group) : 1e30f;  // all
  }
  for (int i = 0; i < kNR; ++i) run_sum[i] = zero();
  for (int64_t start = 0; start < last; start += kSet) {
    const int64_t n = std::min<int64_t>(kSet, last - start);
    const int64_t slot = table[start / bs] * bs + start % bs;  // bs is a multiple of 16
    if (start + kSet < last) {  // the next set's rows into L2 while this one is scored
      const int64_t next = table[(start + kSet) / bs] * bs + (start + kSet) % bs;
      const char* k_next = reinterpret_cast<const char*>(k_head + next * row_size);
      const char* v_next = reinterpret_cast<const char*>(v_head + next * row_size);
      for (int64_t b = 0; b < kSet * row_size * int64_t(sizeof(cache_t)); b += 64) {
        _mm_prefetch(k_next + b, kL2);
        _mm_prefetch(v_next + b, kL2);
      }
    }
    const auto [keys, values] = staged.at(k_head, v_head, slot, n);
    for (int64_t j = 0; j < n; j += 4) {  // keys past n: key 0 stands in, scores never read
      const auto key = [&](int64_t c) { return keys + (j + c < n ? j + c : 0) * kDim; };
      score4<kDim, kNR>(qt, key(0), key(1), key(2), key(3), scores, j);
    }
    const bool all_seen = start + n <= first_len;  // every row sees every key of the set
    for (int i = 0; i < kNR; ++i) {
      const Vec limit = load(seen + i * kLanes);
      const auto sees = [&](int64_t j) { return greater(limit, set1(float(start + j))); };
      Vec top = set1(-std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < n; ++j) {
        const Vec x = max(top, load(scores[j] + i * kLanes));
        top = all_seen ? x : select(sees(j), x, top);
      }
      if (start > 0) {  // every row saw key 0: the running max is finite
        top = max(top, run_max[i]);
        const Vec shrink = exp(sub(run_max[i], top));
        run_sum[i] = mul(run_sum[i], shrink);
        for (int d = 0; d < kDim; ++d)
          store(out_t[d] + i * kLanes, mul(load(out_t[d] + i * kLanes), shrink));
      }
      run_max[i] = top;
      Vec sum = run_sum[i];
      for (int64_t j = 0; j < n; ++j) {
        float* w = scores[j] + i * kLanes;
        Vec e = exp(sub(load(w), top));
        if (!all_seen) e = select(sees(j), e, zero());
        store(w, e);
        sum = add(sum, e);
      }
      run_sum[i] = sum;
    }
    add_values<kDim, kNR, kD>(scores, values, n, out_t);
  }
  alignas(64) float inv[kRows];
  for (int i = 0; i < kNR; ++i) store(inv + i * kLanes, div(set1(1.f), run_sum[i]));
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + (r / group) * row_stride + (r % group) * kDim;
    for (int d = 0; d < kDim; ++d) o[d] = out_t[d][r] * inv[r];
  }
}

template <int kDim, typename cache_t>
void tile_of(const float* q, const cache_t* k_head, const cache_t* v_head, const int64_t* table,
             int64_t first_len, int64_t tokens, int64_t row_stride, float* out, const Shape& s,
             int64_t group) {
  switch ((tokens * group + kLanes - 1) / kLanes) {
    case 1:
      return tile<kDim, 1>(q, k_head, v_head, table, first_len, tokens, row_stride, out, s, group);
    case 2:
      return tile<kDim, 2>(q, k_head, v_head, table, first_len, tokens, row_stride, out, s, group);
#if SENDPATH_VEC == 16
    case 3:
      return tile<kDim, 3>(q, k_head, v_head, table, first_len, tokens, row_stride, out, s, group);
    case 4:
      return tile<kDim, 4>(q, k_head, v_head, table, first_len, tokens, row_stride, out, s, group);
#endif
  }
  TORCH_CHECK(false, "prefill_tile_f32: more rows than a tile holds");
}

}  // namespace
#endif

namespace {

// The tile's rows here: 0 where there is no tile (neither AVX-512 nor AVX2 with FMA).
constexpr int64_t kRowsHere =
#ifdef SENDPATH_VEC
    kRows;
#else
    0;
#endif

template <typename cache_t>
void tile_f32(const float* q, const cache_t* k_head, const cache_t* v_head, const int64_t* table,
              int64_t first_len, int64_t tokens, int64_t row_stride, float* out, const Shape& s,
              int64_t group) {
#ifdef SENDPATH_VEC
  if (s.head_dim == 64)
    return tile_of<64>(q, k_head, v_head, table, first_len, tokens, row_stride, out, s, group);
  if (s.head_dim == 128)
    return tile_of<128>(q, k_head, v_head, table, first_len, tokens, row_stride, out, s, group);
#endif
  (void)q, (void)k_head, (void)v_head, (void)table, (void)first_len, (void)tokens;
  (void)row_stride, (void)out, (void)s, (void)group;
  TORCH_CHECK(false, "prefill_tile_f32: no tile path here (see prefill_path_f32)");
}

}  // namespace

Prefill prefill_path_f32(const std::string& name, const Shape& s, int64_t group) {
#ifdef SENDPATH_VEC
  const bool runs = (s.head_dim == 64 || s.head_dim == 128) && s.block_size % kSet == 0 &&
                    group <= kRows / 2;  // two tokens a tile at least
#else
  const bool runs = false;
#endif
  if (name.empty()) return runs ? Prefill::kVector : Prefill::kRows;
  if (name == "rows") return Prefill::kRows;
  TORCH_CHECK(name == "vector", "a float32 query's prompt rows take the row task or the vector "
              "tile (rows or vector; AMX's tiles take bfloat16), not '", name, "'");
  TORCH_CHECK(kRowsHere > 0, "the float32 vector prefill tile needs AVX-512 or AVX2 with FMA");
  TORCH_CHECK(runs, "the float32 vector prefill tile needs a head dim of 64 or 128, a block size "
              "a multiple of 16 and at most ", kRowsHere / 2, " query heads a kv head");
  return Prefill::kVector;
}

int64_t prefill_tile_tokens_f32(Prefill path, int64_t group) {
  return path == Prefill::kVector ? kRowsHere / group : 1;
}

void prefill_tile_f32(const float* q, const float* k_head, const float* v_head,
                      const int64_t* table, int64_t first_len, int64_t tokens, int64_t row_stride,
                      float* out, const Shape& s, int64_t group) {
  tile_f32(q, k_head, v_head, table, first_len, tokens, row_stride, out, s, group);
}

void prefill_tile_f32(const float* q, const int8_t* k_head, const int8_t* v_head,
                      const int64_t* table, int64_t first_len, int64_t tokens, int64_t row_stride,
                      float* out, const Shape& s, int64_t group) {
  tile_f32(q, k_head, v_head, table, first_len, tokens, row_stride, out, s, group);
}

}  // namespace sendpath_attention
