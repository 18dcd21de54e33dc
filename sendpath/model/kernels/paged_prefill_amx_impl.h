// The prompt-chunk attention paged_prefill_amx.h describes, written once over amx_tiles.h's
// operations: paged_prefill_amx.cpp includes this on the tiles themselves,
// paged_prefill_amx_emulated.cpp on their software model (SENDPATH_AMX_EMULATE), each with
// SENDPATH_AMX_NS naming its namespace (as block_matmul_amx_impl.h is built).
//
// Tiles (8 of 16 rows x 64 bytes): C0..C3 accumulators (16 x 16 float32), A = tile 4,
// B = tile 6. Scores take up to four sets of 16 keys at once (C0..C3, each summed over the
// head dim's 32-dim chunks); values four 16-dim parts of the output at once, summed over
// the segment's keys 32 at a time.

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "amx_tiles.h"
#include "avx512_lanes.h"
#include "paged_prefill_amx.h"

namespace sendpath_amx {
namespace SENDPATH_AMX_NS {
namespace {

constexpr int64_t kSegment = 256;  // keys a softmax step folds (a multiple of 32; 128: 20% slower)
constexpr int kA = 4, kB = 6;

inline int64_t lesser(int64_t a, int64_t b) { return a < b ? a : b; }
inline __mmask16 lanes_below(int64_t n) {  // the first n lanes (none for n <= 0)
  return n >= 16 ? __mmask16{0xFFFF} : n <= 0 ? __mmask16{0} : static_cast<__mmask16>((1u << n) - 1u);
}

void configure() {
  tiles::Config c;
  for (int t = 0; t < 8; ++t) c.set(t, 16, 64);
  tiles::configure(c);
}

template <int I>  // C_I += A (loaded) x the B tile at b
inline void product(const void* b) {
  tiles::load<kB>(b, 64);
  tiles::dpbf16ps<I, kA, kB>();
}

// Up to four C tiles: zeroed, and stored to `p` + i * `step` bytes, `stride` bytes a row.
inline void zero_up_to(int n) {
  tiles::zero<0>();
  if (n > 1) tiles::zero<1>();
  if (n > 2) tiles::zero<2>();
  if (n > 3) tiles::zero<3>();
}
inline void store_up_to(int n, char* p, int64_t step, int64_t stride) {
  tiles::store<0>(p, stride);
  if (n > 1) tiles::store<1>(p + step, stride);
  if (n > 2) tiles::store<2>(p + 2 * step, stride);
  if (n > 3) tiles::store<3>(p + 3 * step, stride);
}

// Key `at`'s row in a kv head's cache.
inline int64_t slot_of(const PrefillRows& p, int64_t at) {
  return p.table[at / p.block_size] * p.block_size + at % p.block_size;
}

template <int kDim>
struct Task {
  static constexpr int kChunks = kDim / 32;    // a query row's A tiles (32 dims each)
  static constexpr int kDimTiles = kDim / 16;  // an output row's C tiles (16 dims each)
  const PrefillRows& p;
  int64_t head_tiles;  // 16-token row tiles of one query head
  uint16_t* q;         // [group * head_tiles][16][kDim] the queries, zero past the tokens
  float* acc;          // [group * head_tiles * 16][kDim]
  float* run_max;      // [group * head_tiles * 16]
  float* run_sum;
  uint32_t* keys;      // [kSegment / 16][kChunks][16 dim pairs][16 keys]: B tiles
  uint16_t* values;    // [kSegment / 32][kDimTiles][16 key pairs][16 dims x 2]: B tiles
  float* scores;       // [16][kSegment]
  uint16_t* weights;   // [16][kSegment] bfloat16: A tiles
  float* part;         // [16][kDim]: a segment's P V

  // The segment's keys [s0, s0 + n), 16 at a time, transposed into B tiles (zero past n).
  void transpose_keys(int64_t s0, int64_t n) const {
    for (int64_t j = 0; j < (n + 15) / 16; ++j) {
      const int64_t in_set = lesser(16, n - 16 * j);
      const uint16_t* rows = p.k_head + slot_of(p, s0 + 16 * j) * kDim;  // 16 keys in a block
      for (int c = 0; c < kChunks; ++c) {
        __m512i r[16];
        for (int k = 0; k < 16; ++k)
          r[k] = k < in_set ? _mm512_loadu_si512(rows + k * kDim + c * 32) : _mm512_setzero_si512();
        lanes::transpose16(r);
        uint32_t* tile = keys + (j * kChunks + c) * 256;
        for (int d = 0; d < 16; ++d) _mm512_store_si512(tile + d * 16, r[d]);
      }
    }
  }

  // The segment's values, key pairs interleaved per 16 dims into B tiles (zero past n).
  void interleave_values(int64_t s0, int64_t n) const {
    alignas(64) static constexpr uint16_t kLow[32] = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static constexpr uint16_t kHigh[32] = {
        16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
        24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
    for (int64_t kk = 0; kk < (n + 31) / 32; ++kk) {
      for (int pair = 0; pair < 16; ++pair) {
        __m512i x[kChunks], y[kChunks];
        const int64_t a = 32 * kk + 2 * pair;
        const uint16_t* va = p.v_head + slot_of(p, s0 + a) * kDim;
        const uint16_t* vb = p.v_head + slot_of(p, s0 + a + 1) * kDim;
        for (int c = 0; c < kChunks; ++c) {
          x[c] = a < n ? _mm512_loadu_si512(va + c * 32) : _mm512_setzero_si512();
          y[c] = a + 1 < n ? _mm512_loadu_si512(vb + c * 32) : _mm512_setzero_si512();
        }
        for (int d = 0; d < kDimTiles; ++d) {
          uint16_t* tile = values + (kk * kDimTiles + d) * 512;
          _mm512_store_si512(tile + pair * 32,
                             _mm512_permutex2var_epi16(x[d / 2], d % 2 ? high : low, y[d / 2]));
        }
      }
    }
  }

  // Row tile `rt` (tokens t0.. of its head) against the segment's first kn keys from s0.
  void row_tile(int64_t rt, int64_t t0, int64_t s0, int64_t kn) const {
    const int64_t sets = (kn + 15) / 16, pairs32 = (kn + 31) / 32;
    const uint16_t* qt = q + rt * 16 * kDim;
    for (int64_t j0 = 0; j0 < sets; j0 += 4) {  // S = Q K^T, four sets of 16 keys at once
      const int m = static_cast<int>(lesser(4, sets - j0));
      zero_up_to(m);
      for (int c = 0; c < kChunks; ++c) {
        tiles::load<kA>(qt + c * 32, kDim * 2);
        const uint32_t* b = keys + (j0 * kChunks + c) * 256;
        product<0>(b);
        if (m > 1) product<1>(b + kChunks * 256);
        if (m > 2) product<2>(b + 2 * kChunks * 256);
        if (m > 3) product<3>(b + 3 * kChunks * 256);
      }
      store_up_to(m, reinterpret_cast<char*>(scores + j0 * 16), 64, kSegment * 4);
    }
    alignas(64) float shrink[16];
    const __m512 scale = _mm512_set1_ps(p.scale);
    const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int r = 0; r < 16; ++r) {  // the softmax of each row's keys, weights in bfloat16
      const int64_t row = rt * 16 + r, valid = lesser(p.first_len + t0 + r - s0, kn);
      float* s = scores + r * kSegment;
      uint16_t* w = weights + r * kSegment;
      if (valid <= 0) {  // it sees none of these keys
        shrink[r] = 1.f;
        std::memset(w, 0, static_cast<size_t>(pairs32) * 64);
        continue;
      }
      __m512 top = none;
      for (int64_t k = 0; k < valid; k += 16)
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(none, lanes_below(valid - k), s + k));
      const float new_max = std::fmax(run_max[row], _mm512_reduce_max_ps(top) * p.scale);
      shrink[r] = std::exp(run_max[row] - new_max);
      const __m512 at_max = _mm512_set1_ps(new_max);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = 0; k < pairs32 * 32; k += 16) {
        const __mmask16 seen = lanes_below(valid - k);
        const __m512 x = _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(seen, s + k), scale), at_max);
        const __m512 e = _mm512_maskz_mov_ps(seen, lanes::exp_nonpositive(x));
        sum = _mm512_add_ps(sum, e);
        _mm256_store_si256(reinterpret_cast<__m256i*>(w + k), (__m256i)_mm512_cvtneps_pbh(e));
      }
      run_sum[row] = run_sum[row] * shrink[r] + _mm512_reduce_add_ps(sum);
      run_max[row] = new_max;
    }
    for (int pass = 0; pass < kDim / 64; ++pass) {  // O_seg = P V, 64 dims at a time
      zero_up_to(4);
      for (int64_t kk = 0; kk < pairs32; ++kk) {
        tiles::load<kA>(weights + kk * 32, kSegment * 2);
        const uint16_t* b = values + (kk * kDimTiles + pass * 4) * 512;
        product<0>(b);
        product<1>(b + 512);
        product<2>(b + 1024);
        product<3>(b + 1536);
      }
      store_up_to(4, reinterpret_cast<char*>(part + pass * 64), 64, kDim * 4);
    }
    for (int r = 0; r < 16; ++r) {  // acc = acc * e^(old max - new max) + O_seg
      float* a = acc + (rt * 16 + r) * kDim;
      const __m512 f = _mm512_set1_ps(shrink[r]);
      for (int d = 0; d < kDim; d += 16)
        _mm512_store_ps(a + d, _mm512_fmadd_ps(_mm512_load_ps(a + d), f, _mm512_load_ps(part + r * kDim + d)));
    }
  }

  void run() const {
    const int64_t rows = p.group * head_tiles * 16;
    for (int64_t g = 0; g < p.group; ++g)
      for (int64_t i = 0; i < head_tiles; ++i)
        for (int64_t r = 0; r < 16; ++r) {
          uint16_t* dst = q + ((g * head_tiles + i) * 16 + r) * kDim;
          const int64_t t = 16 * i + r;
          if (t < p.tokens) std::memcpy(dst, p.q + t * p.row_stride + g * kDim, kDim * 2);
          else std::memset(dst, 0, kDim * 2);
        }
    std::memset(acc, 0, static_cast<size_t>(rows * kDim) * sizeof(float));
    std::memset(run_sum, 0, static_cast<size_t>(rows) * sizeof(float));
    for (int64_t r = 0; r < rows; ++r) run_max[r] = -std::numeric_limits<float>::infinity();
    const int64_t last = p.first_len + p.tokens - 1;  // keys the last token sees
    configure();
    for (int64_t s0 = 0; s0 < last; s0 += kSegment) {
      const int64_t n = lesser(kSegment, last - s0);
      transpose_keys(s0, n);
      interleave_values(s0, n);
      for (int64_t i = 0; i < head_tiles; ++i) {
        const int64_t t0 = 16 * i, tile_last = p.first_len + lesser(t0 + 15, p.tokens - 1);
        if (tile_last <= s0) continue;  // the tile's rows see no key from here on
        for (int64_t g = 0; g < p.group; ++g)
          row_tile(g * head_tiles + i, t0, s0, lesser(n, tile_last - s0));
      }
    }
    tiles::release();
    for (int64_t g = 0; g < p.group; ++g)
      for (int64_t t = 0; t < p.tokens; ++t) {
        const int64_t row = (g * head_tiles + t / 16) * 16 + t % 16;
        const float total = run_sum[row];
        const __m512 inv = _mm512_set1_ps(total > 0.f ? 1.f / total : 0.f);
        uint16_t* o = p.out + t * p.row_stride + g * kDim;
        for (int d = 0; d < kDim; d += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc + row * kDim + d), inv)));
      }
  }
};

template <int kDim>
void prefill(const PrefillRows& p) {
  static thread_local tiles::Scratch queries, sums, rows, keys, values, scores, weights, part;
  const int64_t head_tiles = (p.tokens + 15) / 16, n_rows = p.group * head_tiles * 16;
  float* row_state = static_cast<float*>(rows.get(2 * n_rows * 4));
  const Task<kDim> task{
      p,
      head_tiles,
      static_cast<uint16_t*>(queries.get(n_rows * kDim * 2)),
      static_cast<float*>(sums.get(n_rows * kDim * 4)),
      row_state,
      row_state + n_rows,
      static_cast<uint32_t*>(keys.get(kSegment * kDim * 2)),
      static_cast<uint16_t*>(values.get(kSegment * kDim * 2)),
      static_cast<float*>(scores.get(16 * kSegment * 4)),
      static_cast<uint16_t*>(weights.get(16 * kSegment * 2)),
      static_cast<float*>(part.get(16 * kDim * 4)),
  };
  task.run();
}

}  // namespace

void prefill_bf16(const PrefillRows& rows) {
  if (rows.head_dim == 64) prefill<64>(rows);
  else prefill<128>(rows);
}

}  // namespace SENDPATH_AMX_NS
}  // namespace sendpath_amx
