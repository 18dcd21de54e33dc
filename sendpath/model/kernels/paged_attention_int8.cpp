// Decode attention on an int8 cache (`--kv-cache-dtype int8`) with AVX-512 VNNI's integer
// dot products, for bfloat16 queries: no key or value row is widened to float32.
//
// Keys: each query head is rounded to int16 once a task (a scale per head, the softmax
// scale folded in), and a key row's dot with it is one vpdpwssd (pairs of int16 products
// added into int32) per 32 dims, the row's codes widened to int16 on the load. The dot is
// exact in int32; the score is that dot times the query's scale and the key row's. (An
// int8 query, one vpdpbusd per 64 dims, moved the built-in model's log-likelihood 0.8%
// from the bfloat16 cache's, where the cache's own rounding moves it 0.24%.)
//
// Values: each block's softmax weights, times their value rows' scales, are rounded to
// int16 against the block's largest (a relative error under 2e-5 of it), and two value rows
// at a time, widened to int16 and interleaved as paged_attention_bf16.cpp interleaves its
// pairs, go into int32 accumulators by vpdpwssd (pairs of int16 products added); each
// block's sum joins the float32 accumulators once, times its weights' scale.
//
// Against paged_attention.cpp's float32 task on the same cache (which converts every code
// to float32 first), a 32-decode step's attention on a 2-core AMX Xeon: see
// benchmarks/README.md. Where the query is float32 that task stays (its tests ask it to
// match the dequantized cache to 1e-5, which a quantized query would not).

#include "attention_simd.h"

#include <cstring>

#include "kernels.h"

namespace sendpath_attention {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
namespace {

template <int kDim>
void task_int8(const at::BFloat16* q, const int8_t* k_head, const int8_t* v_head,
               const int64_t* table, int64_t length, at::BFloat16* out, const Shape& s,
               int64_t group) {
  constexpr int kHalves = kDim / 32;  // 32 codes widened to int16 a register
  constexpr int64_t kStride = kDim + kInt8ScaleBytes;
  const int64_t bs = s.block_size;
  __m512i qv[kMaxGroup][kHalves];
  float q_scale[kMaxGroup];
  __m512 acc[kMaxGroup][kHalves][2];  // [half]: dims as write_pairs reads them
  alignas(64) float scores[kMaxGroup * 64];
  alignas(64) int16_t weights[kMaxGroup * 64 + 2];  // a zero after each run
  float weight_scale[kMaxGroup];
  float run_max[kMaxGroup], run_sum[kMaxGroup], shrink[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    __m512 x[kDim / 16];
    __m512 top = _mm512_setzero_ps();
    for (int c = 0; c < kDim / 16; ++c) {
      x[c] = _mm512_mul_ps(load16(q + g * kDim + c * 16), _mm512_set1_ps(s.scale));
      top = _mm512_max_ps(top, _mm512_abs_ps(x[c]));
    }
    const float amax = _mm512_reduce_max_ps(top);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    alignas(64) int16_t codes[kDim];
    for (int c = 0; c < kDim / 16; ++c)  // nearest, |.| <= 32767
      _mm256_store_si256(reinterpret_cast<__m256i*>(codes + c * 16),
                         _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x[c], inv))));
    for (int c = 0; c < kHalves; ++c) qv[g][c] = _mm512_load_si512(codes + c * 32);
    q_scale[g] = amax / 32767.f;
    for (int c = 0; c < kHalves; ++c) acc[g][c][0] = acc[g][c][1] = _mm512_setzero_ps();
    run_max[g] = -std::numeric_limits<float>::infinity();
    run_sum[g] = 0.f;
  }
  const __m512i row_bytes = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(kStride)));
  for (int64_t start = 0; start < length; start += bs) {
    const int64_t block = table[start / bs], n = std::min(bs, length - start);
    const int8_t* keys = k_head + block * bs * kStride;
    const int8_t* values = v_head + block * bs * kStride;
    prefetch_ahead(k_head, v_head, table, start, length, bs, kStride);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {  // 16 keys' dots for every head, then their sums
      __m512 dots[kMaxGroup][16];
      for (int64_t i = 0; i < 16; ++i) {
        if (t0 + i >= n) {
          for (int64_t g = 0; g < group; ++g) dots[g][i] = _mm512_setzero_ps();
          continue;
        }
        __m512i row[kHalves];
        for (int c = 0; c < kHalves; ++c)
          row[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(keys + (t0 + i) * kStride + c * 32)));
        for (int64_t g = 0; g < group; ++g) {
          __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), row[0], qv[g][0]);
          for (int c = 1; c < kHalves; ++c) dot = _mm512_dpwssd_epi32(dot, row[c], qv[g][c]);
          dots[g][i] = _mm512_cvtepi32_ps(dot);  // rounded by 6e-8 at most
        }
      }
      const __mmask16 m = first(n - t0);
      const __m512 key_scale = _mm512_mask_i32gather_ps(
          _mm512_setzero_ps(), m, row_bytes, keys + t0 * kStride + kDim, 1);
      for (int64_t g = 0; g < group; ++g) {
        const __m512 dot = _mm512_mul_ps(sum_each(dots[g]), _mm512_set1_ps(q_scale[g]));
        _mm512_mask_storeu_ps(scores + g * bs + t0, m, _mm512_mul_ps(dot, key_scale));
      }
    }
    fold_block_avx512(scores, n, bs, group, run_max, run_sum, shrink);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {  // the weights times their rows' scales
      const __mmask16 m = first(n - t0);
      const __m512 value_scale = _mm512_mask_i32gather_ps(
          _mm512_setzero_ps(), m, row_bytes, values + t0 * kStride + kDim, 1);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores + g * bs + t0;
        _mm512_mask_storeu_ps(sg, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sg), value_scale));
      }
    }
    for (int64_t g = 0; g < group; ++g) {  // rounded to int16 against the block's largest
      __m512 top = _mm512_setzero_ps();
      for (int64_t t = 0; t < n; t += 16)
        top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(first(n - t), scores + g * bs + t)));
      const float wmax = _mm512_reduce_max_ps(top);
      weight_scale[g] = wmax / 32767.f;
      const __m512 inv = _mm512_set1_ps(wmax > 0.f ? 32767.f / wmax : 0.f);
      for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 m = first(n - t);
        const __m512i w = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, scores + g * bs + t), inv));
        _mm256_mask_storeu_epi16(weights + g * bs + t, m, _mm512_cvtepi32_epi16(w));
      }
      weights[g * bs + n] = 0;  // the partner of an odd last row
    }
    __m512i sums[kMaxGroup][kHalves][2];
    for (int64_t g = 0; g < group; ++g)
      for (int c = 0; c < kHalves; ++c) sums[g][c][0] = sums[g][c][1] = _mm512_setzero_si512();
    for (int64_t t = 0; t < n; t += 2) {  // rows t and t + 1 interleaved, every head
      __m512i pair[kHalves][2];
      for (int c = 0; c < kHalves; ++c) {
        const __m512i a = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + t * kStride + c * 32)));
        const __m512i b = t + 1 < n ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                          reinterpret_cast<const __m256i*>(values + (t + 1) * kStride + c * 32)))
                                    : _mm512_setzero_si512();
        pair[c][0] = _mm512_unpacklo_epi16(a, b);
        pair[c][1] = _mm512_unpackhi_epi16(a, b);
      }
      for (int64_t g = 0; g < group; ++g) {
        int32_t both;
        std::memcpy(&both, weights + g * bs + t, sizeof(both));
        const __m512i w = _mm512_set1_epi32(both);
        for (int c = 0; c < kHalves; ++c)
          for (int h = 0; h < 2; ++h) sums[g][c][h] = _mm512_dpwssd_epi32(sums[g][c][h], pair[c][h], w);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const __m512 f = _mm512_set1_ps(shrink[g]), by = _mm512_set1_ps(weight_scale[g]);
      for (int c = 0; c < kHalves; ++c)
        for (int h = 0; h < 2; ++h)
          acc[g][c][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[g][c][h]), by,
                                         _mm512_mul_ps(acc[g][c][h], f));
    }
  }
  write_pairs<kDim>(acc, run_sum, out, group);
}

}  // namespace
#endif

bool decode_task_int8(const at::BFloat16* q, const int8_t* k_head, const int8_t* v_head,
                      const int64_t* table, int64_t length, at::BFloat16* out, const Shape& s,
                      int64_t group) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (s.head_dim == 64) {
    task_int8<64>(q, k_head, v_head, table, length, out, s, group);
    return true;
  }
  if (s.head_dim == 128) {
    task_int8<128>(q, k_head, v_head, table, length, out, s, group);
    return true;
  }
#endif
  (void)q, (void)k_head, (void)v_head, (void)table, (void)length, (void)out, (void)s, (void)group;
  return false;
}

}  // namespace sendpath_attention
