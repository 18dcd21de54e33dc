// What the paged-attention kernels share: the task's shape and the AVX-512 pieces of an
// online softmax (paged_attention.cpp: float32 and the portable loop;
// paged_attention_bf16.cpp: AVX-512 BF16 on a bfloat16 cache; paged_attention_int8.cpp:
// AVX-512 VNNI on an int8 cache; paged_prefill_bf16.cpp: a
// prompt chunk's rows a tile at a time on it; paged_attention_avx2.cpp: AVX2 without
// AVX-512).

#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef __AVX512F__
#include "avx512_lanes.h"
#endif

namespace sendpath_attention {

constexpr int kMaxGroup = 8;

struct Shape {
  int64_t batch, heads, kv_heads, head_dim, slots, max_blocks, block_size;
  float scale;
};

#if defined(__AVX512F__) || defined(__AVX2__)
// Where the blocks ahead are prefetched to: L2, not L1. A 2 KB block is 32 lines; into
// L1 they wait on its few miss buffers, and a 32-decode step's attention took 1.7x as long
// when its blocks lay scattered in memory, as a busy server's do (the step about 15% longer).
constexpr _mm_hint kL2 = _MM_HINT_T1;

// Before the row task scores the block at `start` of its context: the rows of the block two
// ahead into L2 (and, before the first, of the one after it). One block ahead left a
// 32-decode step's attention waiting on memory; two ahead made the step 3-5% faster (the
// blocks of 32 sequences interleaved or scattered in a 1 GB cache). `T`: the cache's type.
template <typename T, int kAhead = 2>
inline void prefetch_ahead(const T* k_head, const T* v_head, const int64_t* table, int64_t start,
                           int64_t length, int64_t bs, int64_t dim) {
  for (int64_t ahead = start == 0 ? 1 : kAhead; ahead <= kAhead && start + ahead * bs < length;
       ++ahead) {
    const int64_t next = table[start / bs + ahead] * bs * dim;
    for (int64_t i = 0; i < bs * dim; i += 64 / static_cast<int64_t>(sizeof(T))) {
      _mm_prefetch(reinterpret_cast<const char*>(k_head + next + i), kL2);
      _mm_prefetch(reinterpret_cast<const char*>(v_head + next + i), kL2);
    }
  }
}

#endif

// A head of the cache as rows, one per slot: a cache of T has `dim` values a row; an int8
// cache (kernels.h) `dim` codes and their float32 scale.
template <typename T>
struct PlainRows {
  static constexpr bool kScaled = false;
  const T* head;
  int64_t dim;
  const T* row(int64_t slot) const { return head + slot * dim; }
  float scale(int64_t) const { return 1.f; }
  int64_t stride() const { return dim; }
};

struct Int8Rows {
  static constexpr bool kScaled = true;
  const int8_t* head;
  int64_t dim;
  const int8_t* row(int64_t slot) const { return head + slot * stride(); }
  float scale(int64_t slot) const {
    float f;
    std::memcpy(&f, row(slot) + dim, sizeof(f));
    return f;
  }
  int64_t stride() const { return dim + 4; }  // kernels.h's kInt8ScaleBytes
};

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {  // an int8 cache's codes, unscaled
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const at::BFloat16* p) {  // bf16 is a float32's upper half
  __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __mmask16 first(int64_t n) {  // the first min(n, 16) lanes
  return n >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << n) - 1u);
}

// Lane i of the result: the sum of v[i]'s 16 lanes (a transposing tree of adds: about
// three instructions a sum, where one horizontal sum each takes about ten).
inline __m512 sum_each(const __m512 v[16]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128 bits: v[2i], v[2i+1], v[2i], v[2i+1] partial sums
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128 bits: v[4i] .. v[4i+3] summed over those bits
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The accumulators of a task whose values went in as interleaved pairs of rows
// (_mm512_unpacklo/hi_epi16 of rows t and t + 1: acc[g][c][half] holds 16 of the 32 dims
// of chunk c, lane i dim (i / 4) * 8 + half * 4 + i % 4), divided by each head's softmax
// sum, into its bfloat16 output row.
template <int kDim>
inline void write_pairs(const __m512 (*acc)[kDim / 32][2], const float* run_sum,
                        at::BFloat16* out, int64_t group) {
  for (int64_t g = 0; g < group; ++g) {
    alignas(64) float tmp[16];
    const __m512 inv = _mm512_set1_ps(run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f);
    for (int c = 0; c < kDim / 32; ++c) {
      for (int h = 0; h < 2; ++h) {
        _mm512_store_ps(tmp, _mm512_mul_ps(acc[g][c][h], inv));
        for (int lane = 0; lane < 16; ++lane)
          out[g * kDim + c * 32 + (lane / 4) * 8 + h * 4 + lane % 4] = static_cast<at::BFloat16>(tmp[lane]);
      }
    }
  }
}

// The softmax fold of one block's scores [group][n] (as fold_block, 16 lanes at a time).
inline void fold_block_avx512(float* scores, int64_t n, int64_t block_size, int64_t group,
                              float* run_max, float* run_sum, float* shrink) {
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * block_size;
    __m512 top = none;
    for (int64_t t = 0; t < n; t += 16)
      top = _mm512_max_ps(top, _mm512_mask_loadu_ps(none, first(n - t), sg + t));
    const float new_max = std::max(run_max[g], _mm512_reduce_max_ps(top));
    shrink[g] = std::exp(run_max[g] - new_max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
      const __mmask16 m = first(n - t);
      const __m512 e = lanes::exp_nonpositive(
          _mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + t), _mm512_set1_ps(new_max)));
      _mm512_mask_storeu_ps(sg + t, m, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
    }
    run_sum[g] = run_sum[g] * shrink[g] + _mm512_reduce_add_ps(sum);
    run_max[g] = new_max;
  }
}

#endif

// One (sequence, kv head) task on a bfloat16 cache with AVX-512 BF16; false where it does
// not run (no AVX-512 BF16, or a head dim other than 64 and 128).
bool decode_task_bf16(const at::BFloat16* q, const at::BFloat16* k_head, const at::BFloat16* v_head,
                      const int64_t* table, int64_t length, at::BFloat16* out, const Shape& s,
                      int64_t group);

// One (sequence, kv head) task on an int8 cache for bfloat16 queries with AVX-512 VNNI
// (paged_attention_int8.cpp); false where it does not run (no AVX-512 VNNI, or a head dim
// other than 64 and 128).
bool decode_task_int8(const at::BFloat16* q, const int8_t* k_head, const int8_t* v_head,
                      const int64_t* table, int64_t length, at::BFloat16* out, const Shape& s,
                      int64_t group);

// One (sequence, kv head) task with AVX2 and FMA, where there is no AVX-512; false where it
// does not run (no AVX2, a head dim other than 64 and 128, a block size not a multiple of 8).
bool decode_task_avx2(const float* q, const float* k_head, const float* v_head,
                      const int64_t* table, int64_t length, float* out, const Shape& s,
                      int64_t group);
bool decode_task_avx2(const at::BFloat16* q, const at::BFloat16* k_head,
                      const at::BFloat16* v_head, const int64_t* table, int64_t length,
                      at::BFloat16* out, const Shape& s, int64_t group);
bool decode_task_avx2(const float* q, const int8_t* k_head, const int8_t* v_head,
                      const int64_t* table, int64_t length, float* out, const Shape& s,
                      int64_t group);  // an int8 cache (Int8Rows)
bool decode_task_avx2(const at::BFloat16* q, const int8_t* k_head, const int8_t* v_head,
                      const int64_t* table, int64_t length, at::BFloat16* out, const Shape& s,
                      int64_t group);

// What takes a prompt chunk's rows on a bfloat16 cache: AMX's tiles where they run
// (paged_prefill_amx.h; kTilesEmulated: their software model, for tests), else the AVX-512
// BF16 vector tile (paged_prefill_bf16.cpp), else the row task one token at a time.
enum class Prefill { kRows, kVector, kTiles, kTilesEmulated };

// The path `name` asks for ("": the fastest that runs here; "rows", "vector", "amx",
// "amx-emulated"), checked against this CPU and the shape: an error says why it cannot run.
Prefill prefill_path(const std::string& name, const Shape& s, int64_t group);

// How many tokens of a prompt chunk `prefill_tile_bf16` takes at once on `path`.
int64_t prefill_tile_tokens(Prefill path, int64_t group);

// `tokens` consecutive rows of one sequence (a prompt chunk's, the first one with
// `first_len` tokens of context) against one kv head on a bfloat16 cache; q and out point
// at the first row's group of query heads, rows `row_stride` elements apart.
void prefill_tile_bf16(Prefill path, const at::BFloat16* q, const at::BFloat16* k_head,
                       const at::BFloat16* v_head, const int64_t* table, int64_t first_len,
                       int64_t tokens, int64_t row_stride, at::BFloat16* out, const Shape& s,
                       int64_t group);

// What takes a prompt chunk's rows with float32 queries (a CPU without bfloat16
// arithmetic): the float32 vector tile (paged_prefill_f32.cpp: AVX-512, or AVX2 with FMA)
// or the row task; `name` as for prefill_path ("": the tile where it runs; "rows";
// "vector"), an error saying why where it cannot.
Prefill prefill_path_f32(const std::string& name, const Shape& s, int64_t group);

// How many tokens of a prompt chunk `prefill_tile_f32` takes at once on `path`.
int64_t prefill_tile_tokens_f32(Prefill path, int64_t group);

// As prefill_tile_bf16, with float32 queries on a float32 cache or an int8 one.
void prefill_tile_f32(const float* q, const float* k_head, const float* v_head,
                      const int64_t* table, int64_t first_len, int64_t tokens, int64_t row_stride,
                      float* out, const Shape& s, int64_t group);
void prefill_tile_f32(const float* q, const int8_t* k_head, const int8_t* v_head,
                      const int64_t* table, int64_t first_len, int64_t tokens, int64_t row_stride,
                      float* out, const Shape& s, int64_t group);

}  // namespace sendpath_attention
