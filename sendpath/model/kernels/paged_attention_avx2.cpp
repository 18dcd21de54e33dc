// One (row, kv head) attention task on a CPU with AVX2 and FMA but no AVX-512: the float32
// task of paged_attention.cpp over 8 lanes, on a float32 or bfloat16 cache, or on an int8
// one (attention_simd.h's Int8Rows: a row's codes widened to float32 as they are loaded,
// its scale applied to the key's score and to the value's weight). A block's
// scores go 8 keys at a time (each key's products with a head's query in a register, the 8
// registers summed by a transposing tree of horizontal adds); the online softmax's
// exponentials are vec.h's, 8 at once; the values are added a chunk of 8 dims at a time
// into every head's accumulators, each value row read once per chunk.

#include "attention_simd.h"
#include "vec.h"

#include <algorithm>
#include <limits>
#include <type_traits>

namespace sendpath_attention {

#if defined(SENDPATH_VEC) && SENDPATH_VEC == 8
namespace {

using namespace sendpath_vec;

constexpr int kPrefetch = 4;

// 8 values of a cache row as float32: float32 and bfloat16 as vec.h loads them, int8 codes
// unscaled.
inline Vec load_row(const float* p) { return load(p); }
inline Vec load_row(const at::BFloat16* p) { return load(p); }
inline Vec load_row(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Lane i: the sum of v[i]'s 8 lanes.
inline Vec sum_each8(const Vec v[8]) {
  const Vec a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const Vec b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return add(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// A head's query (float32, scaled) against `kRows` consecutive keys `stride` elements
// apart: lane i is key i's score (unscaled by an int8 row's scale). The query's chunk is
// loaded once for all the keys.
template <int kDim, int kRows, typename T>
inline Vec dots8(const float* query, const T* keys, int64_t stride) {
  Vec dots[8];
  for (int i = 0; i < 8; ++i) dots[i] = zero();
  for (int d = 0; d < kDim; d += 8) {
    const Vec chunk = load(query + d);
    for (int i = 0; i < kRows; ++i) dots[i] = fma(chunk, load_row(keys + i * stride + d), dots[i]);
  }
  return sum_each8(dots);
}

template <int kDim, typename T>
inline Vec dots_few(const float* query, const T* keys, int64_t stride, int64_t rows) {
  switch (rows) {
    case 1: return dots8<kDim, 1>(query, keys, stride);
    case 2: return dots8<kDim, 2>(query, keys, stride);
    case 3: return dots8<kDim, 3>(query, keys, stride);
    case 4: return dots8<kDim, 4>(query, keys, stride);
    case 5: return dots8<kDim, 5>(query, keys, stride);
    case 6: return dots8<kDim, 6>(query, keys, stride);
    default: return dots8<kDim, 7>(query, keys, stride);
  }
}

// The softmax fold of one block's scores [group][block_size], n of them a head; lanes past
// n are set to -inf first, so they count for nothing.
void fold(float* scores, int64_t n, int64_t bs, int64_t group, float* run_max, float* run_sum,
          float* shrink) {
  const int64_t padded = (n + 7) / 8 * 8;
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * bs;
    std::fill(sg + n, sg + padded, -std::numeric_limits<float>::infinity());
    Vec top = load(sg);
    for (int64_t t = 8; t < padded; t += 8) top = max(top, load(sg + t));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    const float new_max = std::max(run_max[g], *std::max_element(lanes, lanes + 8));
    shrink[g] = std::exp(run_max[g] - new_max);
    Vec total = zero();
    for (int64_t t = 0; t < padded; t += 8) {
      const Vec e = exp(sub(load(sg + t), set1(new_max)));
      store(sg + t, e);
      total = add(total, e);
    }
    run_sum[g] = run_sum[g] * shrink[g] + sum(total);
    run_max[g] = new_max;
  }
}

template <int kDim, typename T, typename Rows>
void task(const T* q, const Rows& k_rows, const Rows& v_rows, const int64_t* table,
          int64_t length, T* out, const Shape& s, int64_t group) {
  const int64_t bs = s.block_size, stride = k_rows.stride();
  alignas(32) float query[kMaxGroup * kDim];
  alignas(32) float acc[kMaxGroup * kDim];
  alignas(32) float scores[kMaxGroup * 64 + 8];  // each head's run padded to 8
  float run_max[kMaxGroup], run_sum[kMaxGroup], shrink[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < kDim; d += 8) {
      store(query + g * kDim + d, mul(load(q + g * kDim + d), set1(s.scale)));
      store(acc + g * kDim + d, zero());
    }
    run_max[g] = -std::numeric_limits<float>::infinity();
    run_sum[g] = 0.f;
  }
  for (int64_t start = 0; start < length; start += bs) {
    const int64_t block = table[start / bs], n = std::min(bs, length - start);
    const auto* keys = k_rows.row(block * bs);
    const auto* values = v_rows.row(block * bs);
    prefetch_ahead<std::remove_cv_t<std::remove_pointer_t<decltype(keys)>>, kPrefetch>(
        k_rows.head, v_rows.head, table, start, length, bs, stride);
    alignas(32) float key_scale[64 + 8], value_scale[64];  // an int8 block's rows' scales
    if constexpr (Rows::kScaled) {
      for (int64_t t = 0; t < n; ++t) {
        key_scale[t] = k_rows.scale(block * bs + t);
        value_scale[t] = v_rows.scale(block * bs + t);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t t0 = 0; t0 < n; t0 += 8) {  // lanes past n: overwritten by fold
        const auto* first = keys + t0 * stride;
        Vec dots = n - t0 >= 8 ? dots8<kDim, 8>(query + g * kDim, first, stride)
                               : dots_few<kDim>(query + g * kDim, first, stride, n - t0);
        if constexpr (Rows::kScaled) dots = mul(dots, load(key_scale + t0));
        store(scores + g * bs + t0, dots);
      }
    }
    fold(scores, n, bs, group, run_max, run_sum, shrink);
    if constexpr (Rows::kScaled) {  // each weight times its value row's scale, once a row
      for (int64_t g = 0; g < group; ++g)
        for (int64_t t = 0; t < n; ++t) scores[g * bs + t] *= value_scale[t];
    }
    for (int64_t d = 0; d < kDim; d += 8) {  // a chunk of every head's accumulators at once
      Vec a[kMaxGroup];
      for (int64_t g = 0; g < group; ++g) a[g] = mul(load(acc + g * kDim + d), set1(shrink[g]));
      for (int64_t t = 0; t < n; ++t) {
        const Vec row = load_row(values + t * stride + d);
        for (int64_t g = 0; g < group; ++g) a[g] = fma(set1(scores[g * bs + t]), row, a[g]);
      }
      for (int64_t g = 0; g < group; ++g) store(acc + g * kDim + d, a[g]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const Vec inv = set1(run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f);
    for (int64_t d = 0; d < kDim; d += 8) store(out + g * kDim + d, mul(load(acc + g * kDim + d), inv));
  }
}

template <typename T, typename C>
bool dispatch(const T* q, const C* k_head, const C* v_head, const int64_t* table, int64_t length,
              T* out, const Shape& s, int64_t group) {
  if (s.block_size % 8 != 0) return false;  // each head's scores padded within its own run
  using Rows = std::conditional_t<std::is_same_v<C, int8_t>, Int8Rows, PlainRows<C>>;
  const Rows k{k_head, s.head_dim}, v{v_head, s.head_dim};
  if (s.head_dim == 64) return task<64>(q, k, v, table, length, out, s, group), true;
  if (s.head_dim == 128) return task<128>(q, k, v, table, length, out, s, group), true;
  return false;
}

}  // namespace

bool decode_task_avx2(const float* q, const float* k_head, const float* v_head,
                      const int64_t* table, int64_t length, float* out, const Shape& s,
                      int64_t group) {
  return dispatch(q, k_head, v_head, table, length, out, s, group);
}
bool decode_task_avx2(const at::BFloat16* q, const at::BFloat16* k_head,
                      const at::BFloat16* v_head, const int64_t* table, int64_t length,
                      at::BFloat16* out, const Shape& s, int64_t group) {
  return dispatch(q, k_head, v_head, table, length, out, s, group);
}
bool decode_task_avx2(const float* q, const int8_t* k_head, const int8_t* v_head,
                      const int64_t* table, int64_t length, float* out, const Shape& s,
                      int64_t group) {
  return dispatch(q, k_head, v_head, table, length, out, s, group);
}
bool decode_task_avx2(const at::BFloat16* q, const int8_t* k_head, const int8_t* v_head,
                      const int64_t* table, int64_t length, at::BFloat16* out, const Shape& s,
                      int64_t group) {
  return dispatch(q, k_head, v_head, table, length, out, s, group);
}

#else

bool decode_task_avx2(const float*, const float*, const float*, const int64_t*, int64_t, float*,
                      const Shape&, int64_t) {
  return false;
}
bool decode_task_avx2(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*,
                      const int64_t*, int64_t, at::BFloat16*, const Shape&, int64_t) {
  return false;
}
bool decode_task_avx2(const float*, const int8_t*, const int8_t*, const int64_t*, int64_t,
                      float*, const Shape&, int64_t) {
  return false;
}
bool decode_task_avx2(const at::BFloat16*, const int8_t*, const int8_t*, const int64_t*, int64_t,
                      at::BFloat16*, const Shape&, int64_t) {
  return false;
}

#endif

}  // namespace sendpath_attention
