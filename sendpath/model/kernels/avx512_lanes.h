// AVX-512 pieces that both the torch sources' attention (attention_simd.h,
// paged_prefill_bf16.cpp) and the AMX sources' (paged_prefill_amx_impl.h) use. It includes
// no torch header, and everything here has internal linkage (an anonymous namespace): the
// AMX sources are compiled for AVX-512 whatever the build machine, so no inline code of
// theirs may be shared with a source built for this machine alone (see amx_tiles.h).

#pragma once

#include <immintrin.h>

namespace {
namespace lanes {

// e^x for x <= 0 (a score less the running max): 2^(x log2 e) as 2^n 2^f with n whole and
// |f| <= 1/2, 2^f by its Taylor series to f^7 (relative error under 1e-7); 0 below -87.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)),
                                 _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  constexpr float kCoef[] = {1.525273380405984e-05f, 1.5403530393381606e-04f,
                             1.3333558146428443e-03f, 9.618129107628477e-03f,
                             5.550410866482158e-02f,  2.402265069591007e-01f,
                             6.931471805599453e-01f,  1.f};
  __m512 p = _mm512_set1_ps(kCoef[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kCoef[i]));
  return _mm512_scalef_ps(p, n);
}

// r[i] holds row i's 16 dwords; afterwards r[j] holds column j (lane i: row i's dword j).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];  // u[4a + c], 128-bit lane j: rows 4a..4a+3 of column 4j + c
  for (int a = 0; a < 4; ++a) {
    u[4 * a] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i w = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i v2 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
    r[c] = _mm512_shuffle_i32x4(v, w, _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + c] = _mm512_shuffle_i32x4(v, w, _MM_SHUFFLE(3, 1, 3, 1));
    r[4 + c] = _mm512_shuffle_i32x4(v2, w2, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + c] = _mm512_shuffle_i32x4(v2, w2, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

}  // namespace lanes
}  // namespace
