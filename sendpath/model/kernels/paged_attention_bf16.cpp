// Decode attention on a bfloat16 cache with AVX-512 BF16's dot products (vdpbf16ps: pairs
// of bfloat16 products added into float32), so no row is widened to float32 first: half
// the instructions of paged_attention.cpp's float32 task. A key row's dot with a head's
// query is head_dim / 32 of them (the scale applied to the summed scores); the values go
// in pairs of rows, interleaved so that each pair of lanes holds one dim of rows t and
// t + 1, against the pair of their weights (rounded to bfloat16, as torch's bfloat16
// attention rounds its probabilities before multiplying the values). The interleave puts
// dims in the order write_pairs (attention_simd.h) reads back.

#include "attention_simd.h"

#include <cstring>

namespace sendpath_attention {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace {

template <int kDim>
void task_avx512_bf16(const at::BFloat16* q, const at::BFloat16* k_head,
                      const at::BFloat16* v_head, const int64_t* table, int64_t length,
                      at::BFloat16* out, const Shape& s, int64_t group) {
  constexpr int kChunks = kDim / 32;  // 32 bfloat16 a register
  const int64_t bs = s.block_size;
  __m512bh qv[kMaxGroup][kChunks];
  __m512 acc[kMaxGroup][kChunks][2];  // [half]: dims as write_pairs reads them
  float scores[kMaxGroup * 64];
  alignas(64) uint16_t weights[kMaxGroup * 64 + 16];  // bfloat16 bits, a zero after each run
  float run_max[kMaxGroup], run_sum[kMaxGroup], shrink[kMaxGroup];
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int64_t g = 0; g < group; ++g) {
    for (int c = 0; c < kChunks; ++c) {
      qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * kDim + c * 32);
      acc[g][c][0] = acc[g][c][1] = _mm512_setzero_ps();
    }
    run_max[g] = -std::numeric_limits<float>::infinity();
    run_sum[g] = 0.f;
  }
  for (int64_t start = 0; start < length; start += bs) {
    const int64_t block = table[start / bs], n = std::min(bs, length - start);
    const at::BFloat16* keys = k_head + block * bs * kDim;
    const at::BFloat16* values = v_head + block * bs * kDim;
    prefetch_ahead(k_head, v_head, table, start, length, bs, kDim);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {  // 16 keys' dots for every head, then their sums
      __m512 dots[kMaxGroup][16];
      for (int64_t i = 0; i < 16; ++i) {
        if (t0 + i >= n) {
          for (int64_t g = 0; g < group; ++g) dots[g][i] = _mm512_setzero_ps();
          continue;
        }
        __m512bh row[kChunks];
        for (int c = 0; c < kChunks; ++c)
          row[c] = (__m512bh)_mm512_loadu_si512(keys + (t0 + i) * kDim + c * 32);
        for (int64_t g = 0; g < group; ++g) {
          __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), row[0], qv[g][0]);
          for (int c = 1; c < kChunks; ++c) dot = _mm512_dpbf16_ps(dot, row[c], qv[g][c]);
          dots[g][i] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g)
        _mm512_mask_storeu_ps(scores + g * bs + t0, first(n - t0),
                              _mm512_mul_ps(sum_each(dots[g]), scale));
    }
    fold_block_avx512(scores, n, bs, group, run_max, run_sum, shrink);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 f = _mm512_set1_ps(shrink[g]);
      for (int c = 0; c < kChunks; ++c)
        for (int h = 0; h < 2; ++h) acc[g][c][h] = _mm512_mul_ps(acc[g][c][h], f);
      for (int64_t t = 0; t < n; t += 16) {
        const __m256bh w = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(first(n - t), scores + g * bs + t));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + g * bs + t), (__m256i)w);
      }
      weights[g * bs + n] = 0;  // the partner of an odd last row
    }
    for (int64_t t = 0; t < n; t += 2) {  // rows t and t + 1 interleaved, every head
      __m512bh pair[kChunks][2];
      for (int c = 0; c < kChunks; ++c) {
        const __m512i a = _mm512_loadu_si512(values + t * kDim + c * 32);
        const __m512i b = t + 1 < n ? _mm512_loadu_si512(values + (t + 1) * kDim + c * 32)
                                    : _mm512_setzero_si512();
        pair[c][0] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        pair[c][1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
      for (int64_t g = 0; g < group; ++g) {
        uint32_t both;
        std::memcpy(&both, weights + g * bs + t, sizeof(both));
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(both));
        for (int c = 0; c < kChunks; ++c)
          for (int h = 0; h < 2; ++h) acc[g][c][h] = _mm512_dpbf16_ps(acc[g][c][h], pair[c][h], w);
      }
    }
  }
  write_pairs<kDim>(acc, run_sum, out, group);
}

}  // namespace
#endif

bool decode_task_bf16(const at::BFloat16* q, const at::BFloat16* k_head, const at::BFloat16* v_head,
                      const int64_t* table, int64_t length, at::BFloat16* out, const Shape& s,
                      int64_t group) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (s.head_dim == 64) {
    task_avx512_bf16<64>(q, k_head, v_head, table, length, out, s, group);
    return true;
  }
  if (s.head_dim == 128) {
    task_avx512_bf16<128>(q, k_head, v_head, table, length, out, s, group);
    return true;
  }
#endif
  (void)q, (void)k_head, (void)v_head, (void)table, (void)length, (void)out, (void)s, (void)group;
  return false;
}

}  // namespace sendpath_attention
