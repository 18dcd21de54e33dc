// Attention of a prompt chunk's tokens on a bfloat16 cache, a tile of them at a time (AVX-512
// BF16), flash-attention style.
//
// paged_attention.cpp's row task scores one query row against 16 keys as 16 dot products
// along the head dim, then sums each one's lanes (attention_simd.h's sum_each): right for a
// decode, which has one row per sequence, but most of its instructions are those sums. The
// rows of a prompt chunk are consecutive positions of one sequence, so they share their
// keys: here a tile of up to kTileRows rows (tokens x the kv head's query heads) reads each
// 16 keys once, transposed so that lane k of a register holds key k's dims (2p, 2p + 1),
// and a row's 16 scores are one register built by head_dim / 2 dot products of pairs, with
// nothing to sum. The values go as in the row task, two rows interleaved against the pair
// of their weights. A row stops at its own position (the causal mask: lanes past it get no
// weight), and the online softmax (a running max and a sum per row, as lanes until the end)
// folds 32 keys at a time (two registers of scores, one query broadcast for both) into
// float accumulators: per key, half the softmax's max, rescaling and accumulator traffic of
// 16 at a time (a 1,024-token prompt's attention on a 2-core Zen 5: ~5.9 -> ~4.3 ms a layer).

#include "attention_simd.h"
#include "block_matmul.h"
#include "paged_prefill_amx.h"

#include <cstring>

namespace sendpath_attention {

namespace {
constexpr int kTileRows = 48;  // the vector tile's rows (tokens x query heads)
}  // namespace

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace {

constexpr int64_t kKeys = 32;  // keys a softmax step folds in: two sets of 16

inline int lane_dim(int half, int lane) { return (lane / 4) * 8 + half * 4 + lane % 4; }

template <int kDim>
void tile_avx512_bf16(const at::BFloat16* q, const at::BFloat16* k_head,
                      const at::BFloat16* v_head, const int64_t* table, int64_t first_len,
                      int64_t tokens, int64_t row_stride, at::BFloat16* out, const Shape& s,
                      int64_t group) {
  constexpr int kPairs = kDim / 2;    // dim pairs: registers of 16 keys' transposed keys
  constexpr int kChunks = kDim / 32;  // registers of one bfloat16 row
  const int64_t rows = tokens * group, bs = s.block_size, last = first_len + tokens - 1;
  alignas(64) uint32_t keys_t[2][kPairs][16];      // a set of 16 keys, transposed
  alignas(64) uint16_t pairs[16][kChunks][2][32];  // rows 2i, 2i + 1 interleaved (lane_dim)
  alignas(64) float acc[kTileRows][kDim];          // [row][chunk, half, lane]
  alignas(64) float sums[kTileRows][16];
  float run_max[kTileRows];
  const uint32_t* q32[kTileRows];
  for (int64_t r = 0; r < rows; ++r) {
    const at::BFloat16* row = q + (r / group) * row_stride + (r % group) * kDim;
    q32[r] = reinterpret_cast<const uint32_t*>(row);
    run_max[r] = -std::numeric_limits<float>::infinity();
    std::memset(acc[r], 0, sizeof(acc[r]));
    std::memset(sums[r], 0, sizeof(sums[r]));
  }
  const __m512 scale = _mm512_set1_ps(s.scale);
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t start = 0; start < last; start += kKeys) {  // 32 keys (two sets of 16) at a time
    const int64_t n = std::min<int64_t>(kKeys, last - start);
    const int sets = n > 16 ? 2 : 1;
    for (int set = 0; set < sets; ++set) {
      const int64_t at = start + 16 * set, in_set = std::min<int64_t>(16, n - 16 * set);
      const int64_t slot = table[at / bs] * bs + at % bs;  // bs is a multiple of 16
      const at::BFloat16* k_rows = k_head + slot * kDim;
      const at::BFloat16* v_rows = v_head + slot * kDim;
      for (int half = 0; half < kPairs / 16; ++half) {  // 16 keys x 16 dim pairs each time
        __m512i r[16];
        for (int k = 0; k < 16; ++k)
          r[k] = k < in_set ? _mm512_loadu_si512(k_rows + k * kDim + half * 32)
                            : _mm512_setzero_si512();
        lanes::transpose16(r);
        for (int p = 0; p < 16; ++p) _mm512_store_si512(keys_t[set][half * 16 + p], r[p]);
      }
      for (int64_t i = 0; i < 8; ++i) {
        for (int c = 0; c < kChunks; ++c) {
          const __m512i zero = _mm512_setzero_si512();
          const at::BFloat16* a = v_rows + 2 * i * kDim + c * 32;
          const __m512i x = 2 * i < in_set ? _mm512_loadu_si512(a) : zero;
          const __m512i y = 2 * i + 1 < in_set ? _mm512_loadu_si512(a + kDim) : zero;
          _mm512_store_si512(pairs[8 * set + i][c][0], _mm512_unpacklo_epi16(x, y));
          _mm512_store_si512(pairs[8 * set + i][c][1], _mm512_unpackhi_epi16(x, y));
        }
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {  // four rows' scores at once
      const int64_t count = std::min<int64_t>(4, rows - r0);
      __m512 dot[4][2];  // [row][set], each query broadcast once for both sets of keys
      for (int j = 0; j < 4; ++j) dot[j][0] = dot[j][1] = _mm512_setzero_ps();
      {
        const uint32_t* qr[4];  // the last row stands in for missing ones (scores unused)
        for (int j = 0; j < 4; ++j) qr[j] = q32[r0 + std::min<int64_t>(j, count - 1)];
        if (sets == 2) {
          for (int p = 0; p < kPairs; ++p) {
            const __m512bh k0 = (__m512bh)_mm512_load_si512(keys_t[0][p]);
            const __m512bh k1 = (__m512bh)_mm512_load_si512(keys_t[1][p]);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
              const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[j][p]));
              dot[j][0] = _mm512_dpbf16_ps(dot[j][0], k0, qp);
              dot[j][1] = _mm512_dpbf16_ps(dot[j][1], k1, qp);
            }
          }
        } else {  // 16 keys or fewer: two chains over alternate pairs, summed below
          for (int p = 0; p < kPairs; p += 2) {
            const __m512bh k0 = (__m512bh)_mm512_load_si512(keys_t[0][p]);
            const __m512bh k1 = (__m512bh)_mm512_load_si512(keys_t[0][p + 1]);
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
              const __m512i q0 = _mm512_set1_epi32(static_cast<int>(qr[j][p]));
              const __m512i q1 = _mm512_set1_epi32(static_cast<int>(qr[j][p + 1]));
              dot[j][0] = _mm512_dpbf16_ps(dot[j][0], k0, (__m512bh)q0);
              dot[j][1] = _mm512_dpbf16_ps(dot[j][1], k1, (__m512bh)q1);
            }
          }
          for (int j = 0; j < 4; ++j) {
            dot[j][0] = _mm512_add_ps(dot[j][0], dot[j][1]);
            dot[j][1] = _mm512_setzero_ps();
          }
        }
      }
      for (int j = 0; j < count; ++j) {
        const int64_t r = r0 + j;
        const int64_t valid = std::min(first_len + r / group - start, n);  // keys it sees here
        if (valid <= 0) continue;
        const __mmask16 seen0 = first(valid), seen1 = valid > 16 ? first(valid - 16) : 0;
        const __m512 score0 = _mm512_mask_mov_ps(none, seen0, _mm512_mul_ps(dot[j][0], scale));
        const __m512 score1 = _mm512_mask_mov_ps(none, seen1, _mm512_mul_ps(dot[j][1], scale));
        const float new_max =
            std::max(run_max[r], _mm512_reduce_max_ps(_mm512_max_ps(score0, score1)));
        const __m512 top = _mm512_set1_ps(new_max);
        const __m512 e0 = _mm512_maskz_mov_ps(seen0, lanes::exp_nonpositive(_mm512_sub_ps(score0, top)));
        const __m512 e1 = _mm512_maskz_mov_ps(seen1, lanes::exp_nonpositive(_mm512_sub_ps(score1, top)));
        __m512 o[kChunks][2];
        for (int c = 0; c < kChunks; ++c)
          for (int h = 0; h < 2; ++h) o[c][h] = _mm512_load_ps(acc[r] + (c * 2 + h) * 16);
        __m512 sum = _mm512_load_ps(sums[r]);
        if (new_max > run_max[r]) {  // rescale what came before by e^(old max - new max)
          const __m512 f = lanes::exp_nonpositive(_mm512_set1_ps(run_max[r] - new_max));
          for (int c = 0; c < kChunks; ++c)
            for (int h = 0; h < 2; ++h) o[c][h] = _mm512_mul_ps(o[c][h], f);
          sum = _mm512_mul_ps(sum, f);
          run_max[r] = new_max;
        }
        _mm512_store_ps(sums[r], _mm512_add_ps(sum, _mm512_add_ps(e0, e1)));
        alignas(64) uint32_t weights[16];  // keys 2i and 2i + 1's, as bfloat16 pairs
        _mm512_store_si512(weights, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        const auto add_pair = [&](int64_t i) {
          const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[i]));
          for (int c = 0; c < kChunks; ++c)
            for (int h = 0; h < 2; ++h)
              o[c][h] = _mm512_dpbf16_ps(o[c][h], (__m512bh)_mm512_load_si512(pairs[i][c][h]), w);
        };
        const int64_t seen_pairs = (valid + 1) / 2;
        if (seen_pairs == 16) {  // a whole 32 keys: unrolled
#pragma GCC unroll 16
          for (int64_t i = 0; i < 16; ++i) add_pair(i);
        } else {
          for (int64_t i = 0; i < seen_pairs; ++i) add_pair(i);
        }
        for (int c = 0; c < kChunks; ++c)
          for (int h = 0; h < 2; ++h) _mm512_store_ps(acc[r] + (c * 2 + h) * 16, o[c][h]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float total = _mm512_reduce_add_ps(_mm512_load_ps(sums[r]));
    const float inv = total > 0.f ? 1.f / total : 0.f;
    at::BFloat16* o = out + (r / group) * row_stride + (r % group) * kDim;
    for (int c = 0; c < kChunks; ++c)
      for (int h = 0; h < 2; ++h)
        for (int lane = 0; lane < 16; ++lane)
          o[c * 32 + lane_dim(h, lane)] =
              static_cast<at::BFloat16>(acc[r][(c * 2 + h) * 16 + lane] * inv);
  }
}

}  // namespace
#endif

Prefill prefill_path(const std::string& name, const Shape& s, int64_t group) {
  const bool shaped = (s.head_dim == 64 || s.head_dim == 128) && s.block_size % 16 == 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const bool vector = shaped && group <= kTileRows;
#else
  const bool vector = false;
#endif
  const std::string& no_amx = sendpath_blocks::amx_unavailable();
  if (name.empty()) return shaped && no_amx.empty() ? Prefill::kTiles : vector ? Prefill::kVector : Prefill::kRows;
  if (name == "rows") return Prefill::kRows;
  const char* shape = "a head dim of 64 or 128 and a block size a multiple of 16";
  if (name == "vector") {
    TORCH_CHECK(vector, "the vector prefill tile needs AVX-512 BF16, ", shape, " and at most ",
                kTileRows, " query heads a kv head");
    return Prefill::kVector;
  }
  if (name == "amx" || name == "amx-emulated") {
    TORCH_CHECK(shaped, "the AMX prefill tile needs ", shape);
    if (name == "amx") {
      TORCH_CHECK(no_amx.empty(), "the amx prefill does not run on this CPU (", no_amx, ")");
      return Prefill::kTiles;
    }
    TORCH_CHECK(sendpath_blocks::amx_emulation_runs(), "amx-emulated needs AVX-512 BF16, which this CPU lacks");
    return Prefill::kTilesEmulated;
  }
  TORCH_CHECK(false, "unknown prefill path '", name, "': rows, vector, amx or amx-emulated");
}

int64_t prefill_tile_tokens(Prefill path, int64_t group) {
  switch (path) {
    case Prefill::kTiles:
    case Prefill::kTilesEmulated:
      return sendpath_amx::kPrefillTokens;
    case Prefill::kVector:
      return kTileRows / group;
    case Prefill::kRows:
      break;
  }
  return 1;
}

void prefill_tile_bf16(Prefill path, const at::BFloat16* q, const at::BFloat16* k_head,
                       const at::BFloat16* v_head, const int64_t* table, int64_t first_len,
                       int64_t tokens, int64_t row_stride, at::BFloat16* out, const Shape& s,
                       int64_t group) {
  if (path == Prefill::kTiles || path == Prefill::kTilesEmulated) {
    const auto bits = [](const at::BFloat16* x) { return reinterpret_cast<const uint16_t*>(x); };
    const sendpath_amx::PrefillRows rows{bits(q), reinterpret_cast<uint16_t*>(out), row_stride,
                                         bits(k_head), bits(v_head), table, s.block_size,
                                         first_len, tokens, group, s.head_dim, s.scale};
    if (path == Prefill::kTiles) sendpath_amx::hw::prefill_bf16(rows);
    else sendpath_amx::emulated::prefill_bf16(rows);
    return;
  }
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (s.head_dim == 64)
    return tile_avx512_bf16<64>(q, k_head, v_head, table, first_len, tokens, row_stride, out, s,
                                group);
  if (s.head_dim == 128)
    return tile_avx512_bf16<128>(q, k_head, v_head, table, first_len, tokens, row_stride, out, s,
                                 group);
#endif
  (void)q, (void)k_head, (void)v_head, (void)table, (void)first_len, (void)tokens;
  (void)row_stride, (void)out, (void)s, (void)group;
  TORCH_CHECK(false, "prefill_tile_bf16: no tile path here (see prefill_path)");
}

}  // namespace sendpath_attention
