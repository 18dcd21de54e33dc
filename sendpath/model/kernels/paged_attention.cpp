// Attention over the paged KV cache, read in place.
//
// Each query row b (a decoding sequence's new token, or one token of a prompt chunk) has a
// query per head, q[b, h, :], and a context of seq_lens[b] tokens whose keys and values
// live in the cache's blocks, in the order its block table lists them: token p is slot
// block_tables[b][p / block_size] * block_size + p % block_size of a layer's [kv heads,
// slots, head dim] cache. A prompt chunk's row for position p has its sequence's table and
// p + 1 tokens of context: causal attention, the chunk's own keys written before. The
// torch path gathers every context into a padded batch in every layer (a copy of the whole
// context) and runs torch's attention with a mask for resumed prompt chunks; this reads
// the blocks where they are. A prompt chunk's rows on a bfloat16 cache go a tile at a time
// (paged_prefill_bf16.cpp): for a 512-token chunk of the built-in model, 2.6x as fast as
// torch's flash attention where the chunk starts a prompt, 2x where it resumes one at 512;
// where AMX's tiles run, on them (paged_prefill_amx.h: a 1,024-token prompt's attention
// 282 -> 62-67 ms on a 2-core AMX Xeon); with float32 queries (a CPU without bfloat16
// arithmetic) on the float32 tile (paged_prefill_f32.cpp: 3.3-3.9x the row task on a
// 2-core Ice Lake Xeon). `prefill` names the path to insist on.
//
// Otherwise one task per (row, kv head), run on torch's thread pool: the task's G query heads
// (grouped-query attention) are scored against one block of keys at a time, and an online
// softmax (a running max and sum per query head) folds each block's values into float
// accumulators, so the context is read once, whatever its length. Inputs are float32 or
// bfloat16; arithmetic is float32. With AVX-512 and a head dim of 64 or 128 (and at most 8
// query heads per kv head) each key and value row is loaded once into registers and used
// by all G heads: 16 keys' dot products are summed at once (attention_simd.h's sum_each)
// and the softmax's exponentials are a polynomial over 16 lanes; the rows of the block two
// ahead are prefetched into L2 while one is scored. A bfloat16 cache on a CPU with AVX-512
// BF16 takes paged_attention_bf16.cpp's task instead, an int8 cache with bfloat16 queries
// on AVX-512 VNNI paged_attention_int8.cpp's; a CPU with AVX2 but no AVX-512
// paged_attention_avx2.cpp's; anything else takes the portable loop.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "attention_simd.h"
#include "kernels.h"

namespace {

using namespace sendpath_attention;

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// The softmax fold of one block's scores [group][n] for one task: rescale what came
// before (sums and accumulators), exponentiate the block's scores in place, add their sums.
inline void fold_block(float* scores, int64_t n, int64_t block_size, int64_t group,
                       float* run_max, float* run_sum, float* shrink) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * block_size;
    float block_max = sg[0];
    for (int64_t t = 1; t < n; ++t) block_max = std::max(block_max, sg[t]);
    const float new_max = std::max(run_max[g], block_max);
    shrink[g] = std::exp(run_max[g] - new_max);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      sg[t] = std::exp(sg[t] - new_max);
      sum += sg[t];
    }
    run_sum[g] = run_sum[g] * shrink[g] + sum;
    run_max[g] = new_max;
  }
}

// ------------------------------------------------------------------- portable loop

template <typename scalar_t, typename Rows>
void task_portable(const scalar_t* q, const Rows& k_rows, const Rows& v_rows,
                   const int64_t* table, int64_t length, scalar_t* out, const Shape& s,
                   int64_t group) {
  const int64_t dim = s.head_dim, bs = s.block_size;
  std::vector<float> qf(group * dim), acc(group * dim, 0.f), scores(group * bs);
  std::vector<float> run_max(group, -std::numeric_limits<float>::infinity());
  std::vector<float> run_sum(group, 0.f), shrink(group);
  for (int64_t i = 0; i < group * dim; ++i) qf[i] = to_float(q[i]) * s.scale;
  for (int64_t start = 0; start < length; start += bs) {
    const int64_t block = table[start / bs], n = std::min(bs, length - start);
    for (int64_t t = 0; t < n; ++t) {
      const auto* key = k_rows.row(block * bs + t);
      const float key_scale = k_rows.scale(block * bs + t);
      for (int64_t g = 0; g < group; ++g) {
        float dot = 0.f;
        for (int64_t d = 0; d < dim; ++d) dot += qf[g * dim + d] * to_float(key[d]);
        scores[g * bs + t] = dot * key_scale;
      }
    }
    fold_block(scores.data(), n, bs, group, run_max.data(), run_sum.data(), shrink.data());
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] *= shrink[g];
    for (int64_t t = 0; t < n; ++t) {
      const auto* value = v_rows.row(block * bs + t);
      const float value_scale = v_rows.scale(block * bs + t);
      for (int64_t g = 0; g < group; ++g) {
        const float w = scores[g * bs + t] * value_scale;
        for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += w * to_float(value[d]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = static_cast<scalar_t>(acc[g * dim + d] * inv);
  }
}

// ------------------------------------------------------------------- AVX-512

#ifdef __AVX512F__
template <int kDim, typename scalar_t, typename Rows>
void task_avx512(const scalar_t* q, const Rows& k_rows, const Rows& v_rows,
                 const int64_t* table, int64_t length, scalar_t* out, const Shape& s,
                 int64_t group) {
  constexpr int kChunks = kDim / 16;
  const int64_t bs = s.block_size;
  __m512 qv[kMaxGroup][kChunks];
  __m512 acc[kMaxGroup][kChunks];
  alignas(64) float keys[64 * kDim];  // a block's keys in float32 (block_size <= 64)
  float scores[kMaxGroup * 64];
  float run_max[kMaxGroup], run_sum[kMaxGroup], shrink[kMaxGroup];
  const __m512 scale = _mm512_set1_ps(s.scale);
  for (int64_t g = 0; g < group; ++g) {
    for (int c = 0; c < kChunks; ++c) {
      qv[g][c] = _mm512_mul_ps(load16(q + g * kDim + c * 16), scale);
      acc[g][c] = _mm512_setzero_ps();
    }
    run_max[g] = -std::numeric_limits<float>::infinity();
    run_sum[g] = 0.f;
  }
  for (int64_t start = 0; start < length; start += bs) {
    const int64_t block = table[start / bs], n = std::min(bs, length - start);
    prefetch_ahead(k_rows.head, v_rows.head, table, start, length, bs, k_rows.stride());
    for (int64_t t = 0; t < n; ++t) {  // the block's keys in float32 (an int8 row scaled)
      const auto* key = k_rows.row(block * bs + t);
      const __m512 key_scale = _mm512_set1_ps(k_rows.scale(block * bs + t));
      for (int c = 0; c < kChunks; ++c) {
        const __m512 x = load16(key + c * 16);
        _mm512_store_ps(keys + t * kDim + c * 16, Rows::kScaled ? _mm512_mul_ps(x, key_scale) : x);
      }
    }
    for (int64_t g = 0; g < group; ++g) {  // 16 keys' dot products, then their 16 sums at once
      for (int64_t t0 = 0; t0 < n; t0 += 16) {
        __m512 dots[16];
        for (int64_t i = 0; i < 16; ++i) {
          if (t0 + i >= n) {
            dots[i] = _mm512_setzero_ps();
            continue;
          }
          const float* key = keys + (t0 + i) * kDim;
          dots[i] = _mm512_mul_ps(qv[g][0], _mm512_load_ps(key));
          for (int c = 1; c < kChunks; ++c)
            dots[i] = _mm512_fmadd_ps(qv[g][c], _mm512_load_ps(key + c * 16), dots[i]);
        }
        _mm512_mask_storeu_ps(scores + g * bs + t0, first(n - t0), sum_each(dots));
      }
    }
    fold_block_avx512(scores, n, bs, group, run_max, run_sum, shrink);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 f = _mm512_set1_ps(shrink[g]);
      for (int c = 0; c < kChunks; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], f);
    }
    for (int64_t t = 0; t < n; ++t) {  // each value row loaded once, added to every head
      const auto* value = v_rows.row(block * bs + t);
      const float value_scale = v_rows.scale(block * bs + t);  // into the weights: once a row
      __m512 row[kChunks];
      for (int c = 0; c < kChunks; ++c) row[c] = load16(value + c * 16);
      for (int64_t g = 0; g < group; ++g) {
        const __m512 w = _mm512_set1_ps(scores[g * bs + t] * value_scale);
        for (int c = 0; c < kChunks; ++c) acc[g][c] = _mm512_fmadd_ps(w, row[c], acc[g][c]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    alignas(64) float tmp[kDim];
    const __m512 inv = _mm512_set1_ps(run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f);
    for (int c = 0; c < kChunks; ++c) _mm512_store_ps(tmp + c * 16, _mm512_mul_ps(acc[g][c], inv));
    for (int d = 0; d < kDim; ++d) out[g * kDim + d] = static_cast<scalar_t>(tmp[d]);
  }
}

#endif

// Consecutive rows of one sequence (consecutive lengths, the same blocks): a prompt
// chunk's, taken `most` at a time; a decode is a run of one.
struct Run {
  int64_t row, tokens;
};

std::vector<Run> runs(const int64_t* tables, const int64_t* lens, const Shape& s, int64_t most) {
  std::vector<Run> out;
  for (int64_t r = 0; r < s.batch;) {
    int64_t end = r + 1;
    while (end < s.batch && end - r < most && lens[end] == lens[end - 1] + 1 &&
           std::memcmp(tables + r * s.max_blocks, tables + end * s.max_blocks,
                       sizeof(int64_t) * ((lens[end] + s.block_size - 1) / s.block_size)) == 0)
      ++end;
    out.push_back({r, end - r});
    r = end;
  }
  return out;
}

// One row's task on a cache of the query's type, or on an int8 cache (`cache_t` int8_t:
// rows of codes and a scale, read by the AVX-512 task or the portable loop).
template <typename scalar_t, typename cache_t>
void attend_row(const scalar_t* q, const cache_t* k_head, const cache_t* v_head,
                const int64_t* table, int64_t length, scalar_t* out, const Shape& s,
                int64_t group) {
  using Rows = std::conditional_t<std::is_same_v<cache_t, int8_t>, Int8Rows, PlainRows<cache_t>>;
  const Rows k_rows{k_head, s.head_dim}, v_rows{v_head, s.head_dim};
  const bool fast = group <= kMaxGroup && s.block_size <= 64;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<cache_t, at::BFloat16>) {
    if (fast && decode_task_bf16(q, k_head, v_head, table, length, out, s, group)) return;
  }
  if constexpr (std::is_same_v<cache_t, int8_t> && std::is_same_v<scalar_t, at::BFloat16>) {
    if (fast && decode_task_int8(q, k_head, v_head, table, length, out, s, group)) return;
  }
  if (fast && s.head_dim == 64)
    return task_avx512<64>(q, k_rows, v_rows, table, length, out, s, group);
  if (fast && s.head_dim == 128)
    return task_avx512<128>(q, k_rows, v_rows, table, length, out, s, group);
#else
  if (fast && decode_task_avx2(q, k_head, v_head, table, length, out, s, group)) return;
#endif
  (void)fast;
  task_portable(q, k_rows, v_rows, table, length, out, s, group);
}

// A prompt chunk's context on an int8 cache in bfloat16, for the prompt tiles (which read
// a bfloat16 cache): one copy per (chunk, kv head) a call, shared by the chunk's tiles, laid
// out as blocks 0, 1, ... of an identity table. A chunk's context is its last row's length.
struct Dequantized {
  std::vector<Run> chunks;                 // rows of one sequence's prompt chunk, in order
  std::vector<int64_t> offsets;            // where chunk i's kv head 0 starts, in values
  std::unique_ptr<at::BFloat16[]> keys, values;  // [chunk][kv head][context in blocks][dim]
  std::vector<int64_t> identity;           // block i is block i

  Dequantized(const int8_t* k_cache, const int8_t* v_cache, const int64_t* tables,
              const int64_t* lens, const Shape& s)
      : identity(s.max_blocks) {
    for (int64_t i = 0; i < s.max_blocks; ++i) identity[i] = i;
    for (const Run& run : runs(tables, lens, s, std::numeric_limits<int64_t>::max()))
      if (run.tokens > 1) chunks.push_back(run);
    int64_t total = 0;
    for (const Run& c : chunks) {
      offsets.push_back(total);
      total += s.kv_heads * padded(c, lens, s) * s.head_dim;
    }
    keys.reset(new at::BFloat16[total]);  // not zeroed: fill writes every value
    values.reset(new at::BFloat16[total]);
    const int64_t count = static_cast<int64_t>(chunks.size());
    at::parallel_for(0, count * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / s.kv_heads, kvh = task % s.kv_heads;
        const Run& c = chunks[i];
        const int64_t length = lens[c.row + c.tokens - 1], span = padded(c, lens, s);
        const int64_t at = offsets[i] + kvh * span * s.head_dim;
        const Int8Rows k_rows{k_cache + kvh * s.slots * (s.head_dim + 4), s.head_dim};
        const Int8Rows v_rows{v_cache + kvh * s.slots * (s.head_dim + 4), s.head_dim};
        fill(k_rows, tables + c.row * s.max_blocks, length, span, s, keys.get() + at);
        fill(v_rows, tables + c.row * s.max_blocks, length, span, s, values.get() + at);
      }
    });
  }

  static int64_t padded(const Run& c, const int64_t* lens, const Shape& s) {
    const int64_t length = lens[c.row + c.tokens - 1];
    return (length + s.block_size - 1) / s.block_size * s.block_size;
  }

  static void fill(const Int8Rows& rows, const int64_t* table, int64_t length, int64_t span,
                   const Shape& s, at::BFloat16* out) {
    for (int64_t p = 0; p < span; ++p, out += s.head_dim) {
      if (p >= length) {  // the last block's unwritten slots: zeros, as the tiles expect
        std::fill(out, out + s.head_dim, at::BFloat16(0.f));
        continue;
      }
      const int64_t slot = table[p / s.block_size] * s.block_size + p % s.block_size;
      const int8_t* codes = rows.row(slot);
      const float scale = rows.scale(slot);
      int64_t d = 0;
#ifdef __AVX512F__
      const __m512 by = _mm512_set1_ps(scale);  // 16 at a time, rounded as at::BFloat16 does
      for (; d + 16 <= s.head_dim; d += 16) {
        const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(load16(codes + d), by));
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
      }
#endif
      for (; d < s.head_dim; ++d) out[d] = at::BFloat16(codes[d] * scale);
    }
  }

  // The chunk holding `row`.
  int64_t chunk_of(int64_t row) const {
    const auto it = std::upper_bound(chunks.begin(), chunks.end(), row,
                                     [](int64_t r, const Run& c) { return r < c.row; });
    return static_cast<int64_t>(it - chunks.begin()) - 1;
  }
};

// One task per (run, kv head): a run of one row is the row task, a longer one (a bfloat16
// query on AVX-512 BF16) a prompt tile, on the cache or, for an int8 cache, on its chunk's
// context in bfloat16 (Dequantized). Runs go in the order first, last, second, second to
// last, ...: the threads take contiguous shares of the tasks, and a causal chunk's later
// tiles read more keys than its earlier ones.
template <typename scalar_t, typename cache_t>
void attend_rows(const scalar_t* q, const cache_t* k_cache, const cache_t* v_cache,
                 const int64_t* block_tables, const int64_t* seq_lens, scalar_t* out,
                 const Shape& s, Prefill path) {
  constexpr bool int8 = std::is_same_v<cache_t, int8_t>;
  const int64_t group = s.heads / s.kv_heads;
  const int64_t row_size = s.head_dim + (int8 ? kInt8ScaleBytes : 0);
  const int64_t most = std::is_same_v<scalar_t, float> ? prefill_tile_tokens_f32(path, group)
                                                       : prefill_tile_tokens(path, group);
  const std::vector<Run> all = runs(block_tables, seq_lens, s, most);
  const int64_t count = static_cast<int64_t>(all.size());
  std::optional<Dequantized> copies;  // the bfloat16 tiles' copy of an int8 cache
  if constexpr (int8 && std::is_same_v<scalar_t, at::BFloat16>) {
    if (most > 1) copies.emplace(k_cache, v_cache, block_tables, seq_lens, s);
  }
  at::parallel_for(0, count * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / s.kv_heads, kvh = task % s.kv_heads;
      const Run run = all[i % 2 == 0 ? i / 2 : count - 1 - i / 2];
      const int64_t offset = (run.row * s.heads + kvh * group) * s.head_dim;
      const cache_t* k_head = k_cache + kvh * s.slots * row_size;
      const cache_t* v_head = v_cache + kvh * s.slots * row_size;
      const int64_t* table = block_tables + run.row * s.max_blocks;
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        if (run.tokens > 1) {
          const int64_t len = seq_lens[run.row], stride = s.heads * s.head_dim;
          if constexpr (int8) {
            const int64_t c = copies->chunk_of(run.row);
            const int64_t span = Dequantized::padded(copies->chunks[c], seq_lens, s);
            const int64_t at = copies->offsets[c] + kvh * span * s.head_dim;
            prefill_tile_bf16(path, q + offset, copies->keys.get() + at,
                              copies->values.get() + at, copies->identity.data(), len,
                              run.tokens, stride, out + offset, s, group);
          } else {
            prefill_tile_bf16(path, q + offset, k_head, v_head, table, len, run.tokens, stride,
                              out + offset, s, group);
          }
          continue;
        }
      } else if (run.tokens > 1) {  // float32 queries: the float32 tile
        prefill_tile_f32(q + offset, k_head, v_head, table, seq_lens[run.row], run.tokens,
                         s.heads * s.head_dim, out + offset, s, group);
        continue;
      }
      attend_row(q + offset, k_head, v_head, table, seq_lens[run.row], out + offset, s, group);
    }
  });
}

}  // namespace

// What takes a prompt chunk's rows of this shape here: with bfloat16 queries "amx",
// "vector" or "rows" (prefill_path's choice), with float32 ones "vector" or "rows"
// (prefill_path_f32's).
std::string prefill_kernel(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                           const std::string& dtype) {
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(dtype == "bfloat16" || dtype == "float32", "dtype: bfloat16 or float32, not '",
              dtype, "'");
  const Shape s{0, heads, kv_heads, head_dim, 0, 0, block_size, 1.f};
  const Prefill path = dtype == "float32" ? prefill_path_f32("", s, heads / kv_heads)
                                          : prefill_path("", s, heads / kv_heads);
  switch (path) {
    case Prefill::kTiles:
    case Prefill::kTilesEmulated:
      return "amx";
    case Prefill::kVector:
      return "vector";
    case Prefill::kRows:
      break;
  }
  return "rows";
}

// q [B, H, D]; k_cache, v_cache [Hkv, S, D] (one layer), or an int8 cache's [Hkv, S, D + 4]
// (rows of codes and their scale, kernels.h); block_tables [B, max_blocks] int64; seq_lens
// [B] int64 -> [B, H, D], each query row attending to its own context.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              int64_t block_size, double scale, const std::string& prefill) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong);
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes());
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || q.scalar_type() == k_cache.scalar_type(), "q and the cache differ in dtype");
  auto query = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const Shape s{query.size(0), query.size(1), k_cache.size(0), query.size(2), k_cache.size(1),
                tables.size(1), block_size, static_cast<float>(scale)};
  TORCH_CHECK(s.heads % s.kv_heads == 0, "heads must be a multiple of the cache's kv heads");
  TORCH_CHECK(k_cache.size(2) == s.head_dim + (int8 ? kInt8ScaleBytes : 0),
              "the cache's rows do not fit the head dim");
  TORCH_CHECK(block_tables.dim() == 2 && tables.size(0) == s.batch && lens.dim() == 1 &&
                  lens.size(0) == s.batch,
              "block_tables [rows, blocks] and seq_lens [rows] must have a row per query row");
  TORCH_CHECK(block_size >= 1, "block_size must be >= 1");
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < s.batch; ++b)  // a row sees at least itself, within its table
    TORCH_CHECK(len[b] >= 1 && len[b] <= s.max_blocks * s.block_size, "row ", b, "'s context of ",
                len[b], " tokens is not within 1 and its block table's ",
                s.max_blocks * s.block_size);
  auto out = torch::empty_like(query);
  const int64_t group = s.heads / s.kv_heads;
  const int64_t* table = tables.data_ptr<int64_t>();
  if (query.scalar_type() == at::kBFloat16) {
    using bf16 = at::BFloat16;
    const Prefill path = prefill_path(prefill, s, group);
    if (int8)
      attend_rows<bf16, int8_t>(query.data_ptr<bf16>(), k_cache.data_ptr<int8_t>(),
                                v_cache.data_ptr<int8_t>(), table, len, out.data_ptr<bf16>(), s,
                                path);
    else
      attend_rows<bf16, bf16>(query.data_ptr<bf16>(), k_cache.data_ptr<bf16>(),
                              v_cache.data_ptr<bf16>(), table, len, out.data_ptr<bf16>(), s, path);
    return out;
  }
  TORCH_CHECK(query.scalar_type() == at::kFloat, "float32 or bfloat16 only");
  const Prefill path = prefill_path_f32(prefill, s, group);
  if (int8)
    attend_rows<float, int8_t>(query.data_ptr<float>(), k_cache.data_ptr<int8_t>(),
                               v_cache.data_ptr<int8_t>(), table, len, out.data_ptr<float>(), s,
                               path);
  else
    attend_rows<float, float>(query.data_ptr<float>(), k_cache.data_ptr<float>(),
                              v_cache.data_ptr<float>(), table, len, out.data_ptr<float>(), s,
                              path);
  return out;
}
