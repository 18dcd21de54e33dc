// x W^T for block-quantized weights, as llama.cpp multiplies them: the activations are
// quantized to int8 per block of 32 too, and each block's products are integer dot
// products (AVX-512 VNNI's vpdpbusd: 64 multiply-adds of unsigned by signed bytes in one
// instruction), scaled once per block.
//
// Every weight block b of an output row n is  w = d[n,b] * code + m[n,b]  with unsigned
// codes. Q4_1 is that with 4-bit codes (m its minimum); Q8_0's signed codes c become
// c + 128 with m = -128 d. With the activations' blocks  x = e[b] * q  (q signed, |q| <= 127):
//
//   sum_k x_k w_k = sum_b d[n,b] e[b] (q . code)_b  +  sum_b m[n,b] e[b] sum(q)_b
//
// Layout (`pack_q4` / `pack_q8`, once at load): output rows go in groups of 16, one per
// lane of a 512-bit register, so a group's 16 results build up in one register and need no
// horizontal sums. For group g and block b, the codes are 8 "quads" (inputs 4j..4j+3 of the
// block) of 16 rows x 4 bytes: one vpdpbusd against the activation quad broadcast to every
// lane. Four-bit codes keep quad j in the low nibbles and quad j + 4 in the high nibbles of
// the same 64 bytes (256 bytes a block, 512 for eight-bit codes). d and m are [G, blocks,
// 16] float16, as the file stores them (Q4_1's d and m, Q8_0's d: exact; half the bytes of
// float32, which a one-row product spends most of its time reading). Rows past N (to a multiple of 16) and inputs past K (to a multiple of 32) are
// zero.
//
// With AVX-512 VNNI the loop below runs; with AVX2 only, block_matmul_avx2.cpp's; else a
// portable loop computes the same sums over the same layout. Where AMX's tiles run,
// products of kAmxInt8MinRows rows or more go to their int8 design (the VNNI loop's bits),
// of kAmxBf16MinRows or more to their bfloat16 design (matrix_engine.cpp,
// block_matmul_amx.h): bfloat16's precision, not the VNNI loop's bits. `block_loops()` says which
// run here, the fastest first (the loader picks these weights where one of the first two
// does).

#include "block_matmul.h"
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SENDPATH_VNNI 1
#endif
#if defined(SENDPATH_VNNI) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using namespace sendpath_blocks;

constexpr int kRowTile = 8;     // activation rows multiplied per pass over the weights (VNNI)

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

inline int64_t blocks_for(int64_t k) { return (k + kBlock - 1) / kBlock; }

#ifdef SENDPATH_VNNI
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bfloat16 is a float32's upper half
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#elif defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// A full block of 32 on AVX2: the codes (as the portable loop rounds them) and their sum.
template <typename T>
float quantize_block_avx2(const T* xb, int8_t* qb, float* amax_out) {
  __m256 v[4];
  __m256 top = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(xb + 8 * i);
    top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_movehdup_ps(half));
  const float amax = _mm_cvtss_f32(half);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  // packs interleave the 128-bit lanes: 4-byte groups come out as q0 q1 q2 q3 (low halves),
  // then the high halves; the permutation puts them back in order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  *amax_out = amax;
  return static_cast<float>(_mm_cvtsi128_si32(s));
}
#endif

// One row's blocks; `cvtps_epi32` rounds to nearest even as `nearbyint` does, so both
// loops give the same codes.
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t blocks, int8_t* q, float* scale,
                  float* scaled_sum) {
  for (int64_t b = 0; b < blocks; ++b) {
    const T* xb = x + b * kBlock;
    const int64_t n = std::min(kBlock, k - b * kBlock);
    int8_t* qb = q + b * kBlock;
#ifdef SENDPATH_VNNI
    if (n == kBlock) {
      const __m512 lo = load16(xb), hi = load16(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(qhi));
      scale[b] = amax / 127.f;
      scaled_sum[b] = amax / 127.f * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
      continue;
    }
#elif defined(__AVX2__)
    if (n == kBlock) {
      float amax;
      const float sum = quantize_block_avx2(xb, qb, &amax);
      scale[b] = amax / 127.f;
      scaled_sum[b] = amax / 127.f * sum;
      continue;
    }
#endif
    float amax = 0.f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(widen(xb[i])));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      qb[i] = static_cast<int8_t>(std::nearbyint(widen(xb[i]) * inv));
      sum += qb[i];
    }
    scale[b] = amax / 127.f;
    scaled_sum[b] = amax / 127.f * static_cast<float>(sum);
  }
}

// `padded_rows` (at least `rows`): the rows kept, those past `rows` all zero (AMX tiles
// take 16 at a time).
template <typename T>
Quantized quantize_all(const T* x, int64_t rows, int64_t k, int64_t padded_rows) {
  const int64_t blocks = blocks_for(k);
  Quantized out{rows, blocks, std::vector<int8_t>(padded_rows * blocks * kBlock, 0),
                std::vector<float>(padded_rows * blocks, 0.f),
                std::vector<float>(padded_rows * blocks, 0.f)};
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(x + r * k, k, blocks, out.q.data() + r * blocks * kBlock,
                   out.scale.data() + r * blocks, out.scaled_sum.data() + r * blocks);
  });
  return out;
}

// The code of row `lane` of a group, input i of block b (the packed layout read back).
inline int code_at(const Packed& w, int64_t g, int64_t b, int64_t lane, int64_t i) {
  const uint8_t* block = w.codes + (g * w.blocks + b) * w.block_bytes;
  const int64_t quad = i / 4, byte = i % 4;
  if (!w.four_bit) return block[quad * 64 + lane * 4 + byte];
  const uint8_t packed = block[(quad % 4) * 64 + lane * 4 + byte];
  return quad < 4 ? (packed & 0x0F) : (packed >> 4);
}

// ----------------------------------------------------------------- portable loop

template <typename T>
void groups_portable(const Packed& w, const Quantized& x, T* out, int64_t n_out, int64_t g_begin,
                     int64_t g_end) {
  for (int64_t g = g_begin; g < g_end; ++g) {
    for (int64_t r = 0; r < x.rows; ++r) {
      float acc[kLanes] = {};
      for (int64_t b = 0; b < w.blocks; ++b) {
        const int8_t* qb = x.q.data() + (r * x.blocks + b) * kBlock;
        const at::Half* d = w.d + (g * w.blocks + b) * kLanes;
        const at::Half* m = w.m + (g * w.blocks + b) * kLanes;
        for (int64_t lane = 0; lane < kLanes; ++lane) {
          int dot = 0;
          for (int64_t i = 0; i < kBlock; ++i) dot += code_at(w, g, b, lane, i) * qb[i];
          acc[lane] += d[lane] * x.scale[r * x.blocks + b] * static_cast<float>(dot) +
                       m[lane] * x.scaled_sum[r * x.blocks + b];
        }
      }
      for (int64_t lane = 0; lane < kLanes && g * kLanes + lane < n_out; ++lane)
        out[r * n_out + g * kLanes + lane] = static_cast<T>(acc[lane]);
    }
  }
}

// ----------------------------------------------------------------- AVX-512 VNNI

#ifdef SENDPATH_VNNI
inline void store_lanes(float* p, __m512 v, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), v);
}
inline void store_lanes(at::BFloat16* p, __m512 v, int64_t n) {
  alignas(64) float tmp[kLanes];
  _mm512_store_ps(tmp, v);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<at::BFloat16>(tmp[i]);
}

// Activation rows r0 .. r0 + R - 1 against weight groups [g_begin, g_end) of this
// thread's [.., g_end_all).
template <int R, typename T>
void groups_vnni(const Packed& w, const Quantized& x, T* out, int64_t n_out, int64_t r0,
                 int64_t g_begin, int64_t g_end, int64_t g_end_all) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = g_begin; g < g_end; ++g) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* block = w.codes + (g * w.blocks + b) * w.block_bytes;
      // From a few rows on, the products are bound by their arithmetic and the hardware's
      // prefetch falls behind: the first pass over a group fetches the next group's block
      // into L2 (8 decodes' forward about 8% faster; one row streams well without it; into
      // L1, the lines wait on its few miss buffers, a little slower again).
      if (x.rows >= 4 && r0 == 0 && g + 1 < g_end_all) {
        const uint8_t* next = block + w.blocks * w.block_bytes;
        for (int64_t line = 0; line < w.block_bytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(next + line), _MM_HINT_T1);
        const int64_t scales = ((g + 1) * w.blocks + b) * kLanes;
        _mm_prefetch(reinterpret_cast<const char*>(w.d + scales), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(w.m + scales), _MM_HINT_T1);
      }
      __m512i quad[8];  // 16 rows x 4 codes each
      if (w.four_bit) {
        for (int j = 0; j < 4; ++j) {
          const __m512i both = _mm512_loadu_si512(block + j * 64);
          quad[j] = _mm512_and_si512(both, nibble);
          quad[j + 4] = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
        }
      } else {
        for (int j = 0; j < 8; ++j) quad[j] = _mm512_loadu_si512(block + j * 64);
      }
      const __m512 d = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + (g * w.blocks + b) * kLanes)));
      const __m512 m = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.m + (g * w.blocks + b) * kLanes)));
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * x.blocks + b;
        const auto* q = reinterpret_cast<const int32_t*>(x.q.data() + at * kBlock);
        __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();  // two chains
        for (int j = 0; j < 8; j += 2) {
          even = _mm512_dpbusd_epi32(even, quad[j], _mm512_set1_epi32(q[j]));
          odd = _mm512_dpbusd_epi32(odd, quad[j + 1], _mm512_set1_epi32(q[j + 1]));
        }
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
        acc[r] = _mm512_fmadd_ps(dots, _mm512_mul_ps(d, _mm512_set1_ps(x.scale[at])), acc[r]);
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.scaled_sum[at]), acc[r]);
      }
    }
    const int64_t lanes = std::min(kLanes, n_out - g * kLanes);
    for (int r = 0; r < R; ++r) store_lanes(out + (r0 + r) * n_out + g * kLanes, acc[r], lanes);
  }
}
#endif

enum class Loop { kVnni, kAvx2, kPortable };

template <typename T>
void run(const Packed& w, const T* x, int64_t rows, int64_t k, T* out, int64_t n_out,
         Loop loop) {
  const Quantized q = quantize_all(x, rows, k, rows);
  const int64_t groups = (n_out + kLanes - 1) / kLanes;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    if (loop == Loop::kPortable) return groups_portable(w, q, out, n_out, begin, end);
    if (loop == Loop::kAvx2) {
      for (int64_t g = begin; g < end; ++g) group_avx2(w, q, out, n_out, g);
      return;
    }
#ifdef SENDPATH_VNNI
    for (int64_t g = begin; g < end; ++g) {  // a group's weights stay in cache for all rows
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        switch (std::min<int64_t>(kRowTile, rows - r0)) {
          case 1: groups_vnni<1>(w, q, out, n_out, r0, g, g + 1, end); break;
          case 2: groups_vnni<2>(w, q, out, n_out, r0, g, g + 1, end); break;
          case 3: groups_vnni<3>(w, q, out, n_out, r0, g, g + 1, end); break;
          case 4: groups_vnni<4>(w, q, out, n_out, r0, g, g + 1, end); break;
          case 5: groups_vnni<5>(w, q, out, n_out, r0, g, g + 1, end); break;
          case 6: groups_vnni<6>(w, q, out, n_out, r0, g, g + 1, end); break;
          case 7: groups_vnni<7>(w, q, out, n_out, r0, g, g + 1, end); break;
          default: groups_vnni<8>(w, q, out, n_out, r0, g, g + 1, end); break;
        }
      }
    }
#endif
  });
}

// codes [N, K] (unsigned, below 16 when four_bit), d and m [N, blocks] -> the packed layout.
std::vector<torch::Tensor> pack(const torch::Tensor& codes, const torch::Tensor& d,
                                const torch::Tensor& m, bool four_bit) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "codes: uint8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1), blocks = blocks_for(k);
  const int64_t groups = (n + kLanes - 1) / kLanes, block_bytes = four_bit ? 256 : 512;
  TORCH_CHECK(d.sizes() == m.sizes() && d.size(0) == n && d.size(1) == blocks, "d, m: [N, K/32]");
  auto c = codes.contiguous();
  auto df = d.to(at::kHalf).contiguous(), mf = m.to(at::kHalf).contiguous();
  auto packed = torch::zeros({groups, blocks, block_bytes}, c.options());
  auto dp = torch::zeros({groups, blocks, kLanes}, df.options());
  auto mp = torch::zeros({groups, blocks, kLanes}, df.options());
  const uint8_t* src = c.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const at::Half *d_src = df.data_ptr<at::Half>(), *m_src = mf.data_ptr<at::Half>();
  at::Half *d_dst = dp.data_ptr<at::Half>(), *m_dst = mp.data_ptr<at::Half>();
  for (int64_t row = 0; row < n; ++row) {
    const int64_t g = row / kLanes, lane = row % kLanes;
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* block = dst + (g * blocks + b) * block_bytes;
      for (int64_t i = 0; i < kBlock && b * kBlock + i < k; ++i) {
        const uint8_t code = src[row * k + b * kBlock + i];
        TORCH_CHECK(!four_bit || code < 16, "four-bit codes must be below 16");
        const int64_t quad = i / 4, byte = i % 4;
        if (!four_bit) block[quad * 64 + lane * 4 + byte] = code;
        else block[(quad % 4) * 64 + lane * 4 + byte] |= quad < 4 ? code : code << 4;
      }
      d_dst[(g * blocks + b) * kLanes + lane] = d_src[row * blocks + b];
      m_dst[(g * blocks + b) * kLanes + lane] = m_src[row * blocks + b];
    }
  }
  return {packed, dp, mp};
}

}  // namespace

namespace sendpath_blocks {
Quantized quantize(const float* x, int64_t rows, int64_t k, int64_t padded_rows) {
  return quantize_all(x, rows, k, padded_rows);
}
Quantized quantize(const at::BFloat16* x, int64_t rows, int64_t k, int64_t padded_rows) {
  return quantize_all(x, rows, k, padded_rows);
}
}  // namespace sendpath_blocks

// The loops block_matmul runs on this CPU, the fastest first (the last is "portable").
std::vector<std::string> block_loops() {
  std::vector<std::string> loops;
#ifdef SENDPATH_VNNI
  loops.push_back("avx512-vnni");
#endif
  if (has_avx2_loop()) loops.push_back("avx2");
  loops.push_back("portable");
  return loops;
}

// Q4_1's codes [N, K] (0..15), d and m [N, K/32] -> (codes, d, m) packed for block_matmul.
std::vector<torch::Tensor> pack_q4(torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
  return pack(codes, d, m, true);
}

// Q8_0's signed codes [N, K] (int8) and d [N, K/32] -> (codes + 128, d, -128 d) packed.
std::vector<torch::Tensor> pack_q8(torch::Tensor codes, torch::Tensor d) {
  TORCH_CHECK(codes.scalar_type() == at::kChar, "codes: int8 [N, K]");
  auto shifted = (codes.to(at::kInt) + 128).to(at::kByte);
  auto dh = d.to(at::kHalf);  // -128 d is exact in float16 too
  return pack(shifted, dh, dh * -128.0, false);
}

// x [M, K] float32 or bfloat16 and weights from pack_q4 / pack_q8 for N outputs -> [M, N].
// `loop`: one of block_loops(), or "" for the fastest (tests run each).
torch::Tensor block_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m,
                           int64_t n_out, const std::string& loop) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && d.dim() == 3 && m.sizes() == d.sizes());
  TORCH_CHECK(codes.scalar_type() == at::kByte && d.scalar_type() == at::kHalf &&
              m.scalar_type() == at::kHalf, "codes uint8, d and m float16 (pack_q4 / pack_q8)");
  TORCH_CHECK(codes.is_contiguous() && d.is_contiguous() && m.is_contiguous());
  const int64_t k = x.size(1);
  TORCH_CHECK(codes.size(1) == blocks_for(k) && d.size(1) == blocks_for(k) && d.size(2) == kLanes,
              "the weights' blocks do not fit the input width");
  TORCH_CHECK(codes.size(2) == 256 || codes.size(2) == 512, "codes: [groups, blocks, 256 or 512]");
  TORCH_CHECK(codes.size(0) == d.size(0) && (n_out + kLanes - 1) / kLanes == codes.size(0));
  const Packed w{codes.data_ptr<uint8_t>(), d.data_ptr<at::Half>(), m.data_ptr<at::Half>(),
                 codes.size(1), codes.size(2), codes.size(2) == 256};
  static const std::vector<std::string> loops = block_loops();
  static const std::vector<std::string> matrix = matrix_loops();
  const auto listed = [](const std::vector<std::string>& names, const std::string& name) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };
  std::string name = loop;
  if (name.empty()) {  // matrix: amx-bf16, amx-int8 (or none)
    const int64_t rows = x.size(0);
    name = matrix.empty() || rows < kAmxInt8MinRows ? loops.front()
           : rows < kAmxBf16MinRows                 ? matrix[1]
                                                    : matrix[0];
  }
  const bool emulated = name == "amx-int8-emulated" || name == "amx-bf16-emulated";
  if (emulated) {
    TORCH_CHECK(amx_emulation_runs(), "the ", name, " loop needs AVX-512 BF16, which this CPU lacks");
  } else if (!listed(loops, name) && !listed(matrix, name)) {
    const bool amx = name.rfind("amx", 0) == 0;
    TORCH_CHECK(false, "the ", name, " loop does not run on this CPU",
                amx ? " (" + amx_unavailable() + ")" : std::string());
  }
  auto input = x.contiguous();
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 || input.scalar_type() == at::kFloat,
              "float32 or bfloat16 only");
  auto out = torch::empty({x.size(0), n_out}, x.options());
  const bool bf16 = input.scalar_type() == at::kBFloat16;
  if (name.rfind("amx", 0) == 0) {  // float32 sums, rounded to bfloat16 as the vector loops round theirs
    const Amx design = name.rfind("amx-int8", 0) == 0 ? Amx::kInt8 : Amx::kBf16;
    if (bf16)
      run_amx(w, input.data_ptr<at::BFloat16>(), input.size(0), k, out.data_ptr<at::BFloat16>(),
              n_out, design, emulated);
    else
      run_amx(w, input.data_ptr<float>(), input.size(0), k, out.data_ptr<float>(), n_out, design,
              emulated);
    return out;
  }
  const Loop which = name == "avx512-vnni" ? Loop::kVnni : name == "avx2" ? Loop::kAvx2 : Loop::kPortable;
  if (bf16)
    run(w, input.data_ptr<at::BFloat16>(), input.size(0), k, out.data_ptr<at::BFloat16>(), n_out,
        which);
  else
    run(w, input.data_ptr<float>(), input.size(0), k, out.data_ptr<float>(), n_out, which);
  return out;
}
