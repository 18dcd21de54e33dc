// A register of floats as wide as this CPU's vectors, for loops written once for both:
// AVX-512 (16 lanes) or AVX2 with FMA (8 lanes). SENDPATH_VEC is defined where one of them
// is there; kernels keep a scalar loop for the rest (and for the tail of a row).
//
// Loads and stores take float32 or bfloat16 (a float32's upper half: widening is a shift,
// narrowing rounds to nearest even and keeps NaN a NaN, as `narrow` in the scalar loops).

#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#define SENDPATH_VEC 16
#elif defined(__AVX2__) && defined(__FMA__)
#define SENDPATH_VEC 8
#endif

#ifdef SENDPATH_VEC
#include <immintrin.h>

namespace sendpath_vec {

constexpr int64_t kWidth = SENDPATH_VEC;

#if SENDPATH_VEC == 16
using Vec = __m512;
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store(float* p, Vec x) { _mm512_storeu_ps(p, x); }
inline void store(at::BFloat16* p, Vec x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i top = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  top = _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
}
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec fnma(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }
inline Vec round(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float sum(Vec x) { return _mm512_reduce_add_ps(x); }
inline Vec scale_by_pow2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }
#else
using Vec = __m256;
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline void store(float* p, Vec x) { _mm256_storeu_ps(p, x); }
inline void store(at::BFloat16* p, Vec x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i top = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  top = _mm256_blendv_epi8(top, _mm256_set1_epi32(0x7FC0), nan);
  // 8 int32 -> 8 uint16 (each below 65536): pack within the 128-bit lanes, then join them
  const __m256i packed = _mm256_packus_epi32(top, top);
  const __m128i out = _mm_unpacklo_epi64(_mm256_castsi256_si128(packed),
                                         _mm256_extracti128_si256(packed, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), out);
}
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec fnma(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline Vec round(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float sum(Vec x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// p 2^n for whole n, as scalef gives it (0 below 2^-126: no subnormals; inf above 2^127)
inline Vec scale_by_pow2(Vec p, Vec n) {
  const __m256i e = _mm256_cvtps_epi32(max(min(n, set1(127.f)), set1(-126.f)));
  const Vec two_n = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  const Vec out = _mm256_andnot_ps(_mm256_cmp_ps(n, set1(-126.5f), _CMP_LT_OQ), mul(p, two_n));
  return _mm256_blendv_ps(out, set1(INFINITY), _mm256_cmp_ps(n, set1(127.5f), _CMP_GT_OQ));
}
#endif

// e^x: x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor series to r^6 (relative error
// about 2e-7, float32's own), times 2^n (saturating to 0 and inf).
inline Vec exp(Vec x) {
  const Vec n = round(mul(x, set1(1.44269504f)));
  Vec r = fnma(n, set1(0.693145752f), x);  // ln2 in two parts
  r = fnma(n, set1(1.42860677e-6f), r);
  Vec p = set1(1.f / 720);
  p = fma(p, r, set1(1.f / 120));
  p = fma(p, r, set1(1.f / 24));
  p = fma(p, r, set1(1.f / 6));
  p = fma(p, r, set1(0.5f));
  p = fma(p, r, set1(1.f));
  p = fma(p, r, set1(1.f));
  return scale_by_pow2(p, n);
}

}  // namespace sendpath_vec

#endif
