// The two AMX designs block_matmul_amx.h describes, written once over amx_tiles.h's
// operations: block_matmul_amx.cpp includes this on the tiles themselves,
// block_matmul_amx_emulated.cpp on the software model (SENDPATH_AMX_EMULATE), each with
// SENDPATH_AMX_NS naming its namespace. Both are compiled for AVX-512 (F, BW, VL, BF16;
// the fix-ups and the dequantization are AVX-512 code in either build) and run only where
// block_matmul.cpp found it (and, for the tiles, AMX) at run time.
//
// Tiles (8 of 1 KB): C0..C3 accumulators, A0 and A1 activation rows, B0 and B1 weights.
//   int8: Ci = block b0 + i's 16 rows x 16 outputs (int32), A = 16 rows x 32 codes,
//         B = a block's 8 quads x 16 outputs x 4 codes: the packed layout as it is (eight-bit
//         codes) or with its nibbles unpacked (four-bit). Four blocks go to the tiles before
//         their sums come back for the fix-up, so the tile unit works while the fix-ups run.
//   bf16: C = 16 rows x 16 outputs (float32) for two row tiles x two groups, summed over
//         every block; A = 16 rows x 32 inputs, B = 16 input pairs x 16 outputs x 2. After the
//         first pair, each pair of groups' panels is dequantized a block at a time between
//         the tile products of the pair before it (two pairs of panels, in turn).

#include <immintrin.h>

#include <cstdint>

#include "amx_tiles.h"
#include "block_matmul_amx.h"

namespace sendpath_amx {
namespace SENDPATH_AMX_NS {
namespace {

constexpr int64_t kLanes = 16, kBlock = 32;
constexpr int kA0 = 4, kB0 = 6;  // A1 = 5, B1 = 7; C0..C3 = 0..3
constexpr int64_t kAhead = 8;     // blocks: the dequantization prefetches this far ahead

inline int64_t lesser(int64_t a, int64_t b) { return a < b ? a : b; }

inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lanes [0, lanes) of v to element `at` of the output, as float32 or as bfloat16.
inline void store_lanes(const Output& out, int64_t at, __m512 v, int64_t lanes) {
  const auto mask = static_cast<__mmask16>((1u << lanes) - 1u);
  if (out.f32 != nullptr) _mm512_mask_storeu_ps(out.f32 + at, mask, v);
  else _mm256_mask_storeu_epi16(out.bf16 + at, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// ----------------------------------------------------------------- int8

void configure_int8() {
  tiles::Config c;
  for (int t = 0; t < 4; ++t) c.set(t, 16, 64);  // 16 rows x 16 int32
  c.set(kA0, 16, 32);                             // 16 rows x a block's 32 codes
  c.set(kA0 + 1, 16, 32);
  c.set(kB0, 8, 64);  // 8 quads x 16 outputs x 4 codes
  c.set(kB0 + 1, 8, 64);
  tiles::configure(c);
}

// Group g's codes as bytes in the packed quad layout, blocks x 512 (a B tile each): the
// packed codes themselves (eight-bit), or their nibbles unpacked into `buffer`.
const uint8_t* codes8(const Weights& w, int64_t g, uint8_t* buffer) {
  const uint8_t* src = w.codes + g * w.blocks * w.block_bytes;
  if (!w.four_bit) return src;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < w.blocks; ++b) {
    for (int j = 0; j < 4; ++j) {  // quad j in the low nibbles, j + 4 in the high ones
      const __m512i both = _mm512_loadu_si512(src + b * 256 + j * 64);
      _mm512_store_si512(buffer + b * 512 + j * 64, _mm512_and_si512(both, nibble));
      _mm512_store_si512(buffer + b * 512 + (j + 4) * 64,
                         _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble));
    }
  }
  return buffer;
}

template <int I>  // block I of a run of four: into C_I, through A and B tiles I % 2
inline void block_product(const int8_t* a, int64_t a_stride, const uint8_t* b) {
  tiles::zero<I>();
  tiles::load<kA0 + I % 2>(a, a_stride);
  tiles::load<kB0 + I % 2>(b, 64);
  tiles::dpbsud<I, kA0 + I % 2, kB0 + I % 2>();
}

// 16 rows from r0 against group g: acc[r] += each block's sums, scaled as the VNNI loop
// scales them (the same two FMAs in the same order, so the same bits).
void rows_int8(const Weights& w, const Int8Rows& x, const uint8_t* codes, int64_t g, int64_t r0,
               int32_t* sums, __m512* acc) {
  const int64_t stride = x.blocks * kBlock;
  const int8_t* a = x.q + r0 * stride;
  for (int64_t b0 = 0; b0 < w.blocks; b0 += 4) {
    const int64_t n = lesser(4, w.blocks - b0);
    block_product<0>(a + b0 * kBlock, stride, codes + b0 * 512);
    if (n > 1) block_product<1>(a + (b0 + 1) * kBlock, stride, codes + (b0 + 1) * 512);
    if (n > 2) block_product<2>(a + (b0 + 2) * kBlock, stride, codes + (b0 + 2) * 512);
    if (n > 3) block_product<3>(a + (b0 + 3) * kBlock, stride, codes + (b0 + 3) * 512);
    tiles::store<0>(sums, 64);
    if (n > 1) tiles::store<1>(sums + 256, 64);
    if (n > 2) tiles::store<2>(sums + 512, 64);
    if (n > 3) tiles::store<3>(sums + 768, 64);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = b0 + i, at0 = r0 * x.blocks + b;
      const __m512 d = half16(w.d + (g * w.blocks + b) * kLanes);
      const __m512 m = half16(w.m + (g * w.blocks + b) * kLanes);
      for (int r = 0; r < 16; ++r) {
        const int64_t at = at0 + r * x.blocks;
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_load_si512(sums + i * 256 + r * 16));
        acc[r] = _mm512_fmadd_ps(dots, _mm512_mul_ps(d, _mm512_set1_ps(x.scale[at])), acc[r]);
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.scaled_sum[at]), acc[r]);
      }
    }
  }
}

// ----------------------------------------------------------------- bfloat16

void configure_bf16() {
  tiles::Config c;
  for (int t = 0; t < 8; ++t) c.set(t, 16, 64);  // C 16 x 16 float32, A 16 x 32, B 16 x 16 x 2
  tiles::configure(c);
}

// Code k of each lane's dword (four codes of one output, a quad's layout), shifted down by
// kShift and kept to kBits, as float32 scaled: d * code + m, lanes = the 16 outputs.
template <int kShift, int kBits>
inline __m512 code_at(__m512i dwords, __m512i mask, __m512 d, __m512 m) {
  __m512i c = kShift != 0 ? _mm512_srli_epi32(dwords, kShift) : dwords;
  if (kShift + kBits < 32) c = _mm512_and_si512(c, mask);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), d, m);
}

// Block b of group g's weights, d * code + m rounded to bfloat16, into its B tile in
// `panel`: row p holds inputs 2p and 2p + 1 of every output lane (so A's inputs stay in
// order). A quad's dword is one output's four inputs, so each code's floats have the
// outputs as lanes and the block's d and m as they are; two codes' bfloat16 words are then
// interleaved into a row (one permute).
void dequantize_block(const Weights& w, int64_t g, int64_t b, uint16_t* panel) {
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int64_t at = g * w.blocks + b;  // the groups' blocks lie in order
  const uint8_t* block = w.codes + at * w.block_bytes;
  // the weights stream from memory once a step: ask for a later block's now (a prefetch
  // does not fault, so past the last block is harmless; addresses as integers, so no
  // pointer leaves its array)
  const auto ahead = [](const void* p, int64_t bytes) {
    _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + bytes), _MM_HINT_T0);
  };
  for (int64_t i = 0; i < w.block_bytes; i += 64) ahead(block, kAhead * w.block_bytes + i);
  ahead(w.d + at * kLanes, kAhead * kLanes * 2);
  ahead(w.m + at * kLanes, kAhead * kLanes * 2);
  const __m512 d = half16(w.d + at * kLanes);
  const __m512 m = half16(w.m + at * kLanes);
  uint16_t* tile = panel + b * 512;
  auto rows = [&](int j, __m512 f0, __m512 f1, __m512 f2, __m512 f3) {  // quad j: rows 2j, 2j + 1
    _mm512_store_si512(tile + (2 * j) * 32,
                       _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(f1, f0)));
    _mm512_store_si512(tile + (2 * j + 1) * 32,
                       _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(f3, f2)));
  };
  if (w.four_bit) {  // quad j in the low nibbles, j + 4 in the high ones
    const __m512i mask = _mm512_set1_epi32(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i q = _mm512_loadu_si512(block + j * 64);
      rows(j, code_at<0, 4>(q, mask, d, m), code_at<8, 4>(q, mask, d, m),
           code_at<16, 4>(q, mask, d, m), code_at<24, 4>(q, mask, d, m));
      rows(j + 4, code_at<4, 4>(q, mask, d, m), code_at<12, 4>(q, mask, d, m),
           code_at<20, 4>(q, mask, d, m), code_at<28, 4>(q, mask, d, m));
    }
  } else {
    const __m512i mask = _mm512_set1_epi32(0xFF);
    for (int j = 0; j < 8; ++j) {
      const __m512i q = _mm512_loadu_si512(block + j * 64);
      rows(j, code_at<0, 8>(q, mask, d, m), code_at<8, 8>(q, mask, d, m),
           code_at<16, 8>(q, mask, d, m), code_at<24, 8>(q, mask, d, m));
    }
  }
}

// The next groups' panels, dequantized a block at a time between the tile products of
// the groups before them: the vector units work while the tiles do (dequantizing a pair
// and then its tiles, one after the other, took longer than the two apart).
struct NextPanels {
  const Weights* w;  // null: nothing to dequantize
  int64_t g;
  int ng;
  uint16_t* panel;  // two groups' panels, blocks * 512 apart
  void block(int64_t b) const {
    if (w == nullptr) return;
    dequantize_block(*w, g, b, panel);
    if (ng == 2) dequantize_block(*w, g + 1, b, panel + w->blocks * 512);
  }
};

// RT row tiles from r0 x NG groups' panels -> sums [RT][NG] 16 x 16 float32 tiles.
template <int RT, int NG>
void tiles_bf16(const Bf16Rows& x, int64_t r0, const uint16_t* p0, const uint16_t* p1,
                float* sums, const NextPanels& next) {
  const int64_t width = x.blocks * kBlock;
  const uint16_t* a = x.row(r0);  // a tail's rows lie elsewhere: each tile its own pointer
  const uint16_t* a1 = RT == 2 ? x.row(r0 + 16) : a;
  tiles::zero<0>();
  if constexpr (NG == 2) tiles::zero<1>();
  if constexpr (RT == 2) tiles::zero<2>();
  if constexpr (RT == 2 && NG == 2) tiles::zero<3>();
  for (int64_t b = 0; b < x.blocks; ++b) {
    tiles::load<kA0>(a + b * kBlock, width * 2);
    if constexpr (RT == 2) tiles::load<kA0 + 1>(a1 + b * kBlock, width * 2);
    tiles::load<kB0>(p0 + b * 512, 64);
    if constexpr (NG == 2) tiles::load<kB0 + 1>(p1 + b * 512, 64);
    tiles::dpbf16ps<0, kA0, kB0>();
    if constexpr (NG == 2) tiles::dpbf16ps<1, kA0, kB0 + 1>();
    if constexpr (RT == 2) tiles::dpbf16ps<2, kA0 + 1, kB0>();
    if constexpr (RT == 2 && NG == 2) tiles::dpbf16ps<3, kA0 + 1, kB0 + 1>();
    next.block(b);
  }
  tiles::store<0>(sums, 64);
  if constexpr (NG == 2) tiles::store<1>(sums + 256, 64);
  if constexpr (RT == 2) tiles::store<2>(sums + 512, 64);
  if constexpr (RT == 2 && NG == 2) tiles::store<3>(sums + 768, 64);
}

}  // namespace

void groups_int8(const Weights& w, const Int8Rows& x, const Output& out, int64_t n_out, int64_t g_begin,
                 int64_t g_end) {
  static thread_local tiles::Scratch unpacked, tile_sums;
  uint8_t* buffer = static_cast<uint8_t*>(unpacked.get(w.blocks * 512));
  int32_t* sums = static_cast<int32_t*>(tile_sums.get(4 * 256 * 4));
  configure_int8();
  for (int64_t g = g_begin; g < g_end; ++g) {
    const uint8_t* codes = codes8(w, g, buffer);
    const int64_t lanes = lesser(kLanes, n_out - g * kLanes);
    for (int64_t r0 = 0; r0 < x.padded_rows; r0 += kTileRows) {
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      rows_int8(w, x, codes, g, r0, sums, acc);
      for (int64_t r = 0; r < lesser(16, x.rows - r0); ++r)
        store_lanes(out, (r0 + r) * n_out + g * kLanes, acc[r], lanes);
    }
  }
  tiles::release();
}

void groups_bf16(const Weights& w, const Bf16Rows& x, const Output& out, int64_t n_out, int64_t g_begin,
                 int64_t g_end) {
  if (g_begin >= g_end) return;
  static thread_local tiles::Scratch panels, tile_sums;
  const int64_t pair = 2 * w.blocks * 512;  // a pair of groups' panels; two pairs, in turn
  uint16_t* panel = static_cast<uint16_t*>(panels.get(2 * pair * sizeof(uint16_t)));
  float* sums = static_cast<float*>(tile_sums.get(4 * 256 * 4));
  configure_bf16();
  const auto in_pair = [g_end](int64_t g) { return g + 1 < g_end ? 2 : 1; };  // groups from g
  const NextPanels start{&w, g_begin, in_pair(g_begin), panel};
  for (int64_t b = 0; b < w.blocks; ++b) start.block(b);
  for (int64_t g = g_begin, turn = 0; g < g_end; g += 2, turn ^= 1) {
    const int ng = in_pair(g);
    const uint16_t* first = panel + turn * pair;
    const uint16_t* second = first + w.blocks * 512;
    const NextPanels next{g + 2 < g_end ? &w : nullptr, g + 2, in_pair(g + 2),
                          panel + (turn ^ 1) * pair};
    for (int64_t r0 = 0; r0 < x.padded_rows; r0 += 2 * kTileRows) {
      const int rt = r0 + kTileRows < x.padded_rows ? 2 : 1;
      const NextPanels now = r0 == 0 ? next : NextPanels{nullptr, 0, 0, nullptr};
      if (rt == 2 && ng == 2) tiles_bf16<2, 2>(x, r0, first, second, sums, now);
      else if (rt == 2) tiles_bf16<2, 1>(x, r0, first, second, sums, now);
      else if (ng == 2) tiles_bf16<1, 2>(x, r0, first, second, sums, now);
      else tiles_bf16<1, 1>(x, r0, first, second, sums, now);
      for (int t = 0; t < rt; ++t) {
        for (int gi = 0; gi < ng; ++gi) {
          const int64_t lanes = lesser(kLanes, n_out - (g + gi) * kLanes);
          const float* tile = sums + (t * 2 + gi) * 256;
          const int64_t rows = lesser(16, x.rows - r0 - t * 16);
          for (int64_t r = 0; r < rows; ++r)
            store_lanes(out, (r0 + t * 16 + r) * n_out + (g + gi) * kLanes,
                        _mm512_load_ps(tile + r * 16), lanes);
        }
      }
    }
  }
  tiles::release();
}

}  // namespace SENDPATH_AMX_NS
}  // namespace sendpath_amx
