// block_matmul.cpp's sums on a CPU with AVX2 but no AVX-512 VNNI (Zen 2 and 3, Intel
// before Ice Lake), over the same packed layout, as llama.cpp's AVX2 loops compute them:
// vpmaddubsw multiplies unsigned codes by signed activations and adds each pair into
// int16, vpmaddwd adds pairs of those into int32.
//
// A 256-bit register holds half a group's lanes (8 output rows x 4 codes), so a group goes
// a half at a time. A four-bit code times an activation (|q| <= 127) makes at most
// 15 * 127 * 2 = 3,810 a pair, so a block's eight quads add up in int16 (at most 30,480)
// before one vpmaddwd widens them; eight-bit codes go as their two nibbles, each summed so,
// the high one's dot product times 16.

#include "block_matmul.h"

#include <algorithm>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SENDPATH_AVX2 1
#include <immintrin.h>
#endif

namespace sendpath_blocks {

#ifdef SENDPATH_AVX2
namespace {

constexpr int kRowTile = 4;  // activation rows multiplied per pass over a half group

inline void store8(float* p, __m256 v, int64_t n) {
  if (n == 8) return _mm256_storeu_ps(p, v);
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  std::copy(tmp, tmp + n, p);
}
inline void store8(at::BFloat16* p, __m256 v, int64_t n) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<at::BFloat16>(tmp[i]);
}

// 8 lanes' int32 dot products of a block's codes (the 8 quads, each below 16) with an
// activation row's block (8 quads of 4 signed bytes).
inline __m256i dots(const __m256i quad[8], const int32_t* q) {
  __m256i sum = _mm256_maddubs_epi16(quad[0], _mm256_set1_epi32(q[0]));
  for (int j = 1; j < 8; ++j)
    sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(quad[j], _mm256_set1_epi32(q[j])));
  return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
}

// Activation rows r0 .. r0 + R - 1 against lanes 8 half .. 8 half + 7 of group g.
template <int R, bool kFourBit, typename T>
void rows_half(const Packed& w, const Quantized& x, T* out, int64_t n_out, int64_t r0,
               int64_t g, int half) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* block = w.codes + (g * w.blocks + b) * w.block_bytes + half * 32;
    const int64_t scales = (g * w.blocks + b) * kLanes + half * 8;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + scales)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m + scales)));
    __m256i low[8], high[8];  // a quad's codes (eight-bit ones: their low and high nibbles)
    for (int j = 0; j < (kFourBit ? 4 : 8); ++j) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + j * 64));
      const __m256i upper = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      low[j] = _mm256_and_si256(bytes, nibble);
      if (kFourBit) low[j + 4] = upper;  // quad j + 4 in the high nibbles
      else high[j] = upper;
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * x.blocks + b;
      const auto* q = reinterpret_cast<const int32_t*>(x.q.data() + at * kBlock);
      __m256i sums = dots(low, q);
      if (!kFourBit) sums = _mm256_add_epi32(sums, _mm256_slli_epi32(dots(high, q), 4));
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x.scale[at]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.scaled_sum[at]), acc[r]);
    }
  }
  const int64_t first = g * kLanes + half * 8, lanes = std::min<int64_t>(8, n_out - first);
  if (lanes <= 0) return;
  for (int r = 0; r < R; ++r) store8(out + (r0 + r) * n_out + first, acc[r], lanes);
}

template <bool kFourBit, typename T>
void group(const Packed& w, const Quantized& x, T* out, int64_t n_out, int64_t g) {
  for (int half = 0; half < 2; ++half) {  // the half group's codes stay in L1 for all rows
    for (int64_t r0 = 0; r0 < x.rows; r0 += kRowTile) {
      switch (std::min<int64_t>(kRowTile, x.rows - r0)) {
        case 1: rows_half<1, kFourBit>(w, x, out, n_out, r0, g, half); break;
        case 2: rows_half<2, kFourBit>(w, x, out, n_out, r0, g, half); break;
        case 3: rows_half<3, kFourBit>(w, x, out, n_out, r0, g, half); break;
        default: rows_half<4, kFourBit>(w, x, out, n_out, r0, g, half); break;
      }
    }
  }
}

template <typename T>
void group_any(const Packed& w, const Quantized& x, T* out, int64_t n_out, int64_t g) {
  if (w.four_bit) return group<true>(w, x, out, n_out, g);
  group<false>(w, x, out, n_out, g);
}

}  // namespace

bool has_avx2_loop() { return true; }
void group_avx2(const Packed& w, const Quantized& x, float* out, int64_t n_out, int64_t g) {
  group_any(w, x, out, n_out, g);
}
void group_avx2(const Packed& w, const Quantized& x, at::BFloat16* out, int64_t n_out, int64_t g) {
  group_any(w, x, out, n_out, g);
}

#else

bool has_avx2_loop() { return false; }
void group_avx2(const Packed&, const Quantized&, float*, int64_t, int64_t) {}
void group_avx2(const Packed&, const Quantized&, at::BFloat16*, int64_t, int64_t) {}

#endif

}  // namespace sendpath_blocks
