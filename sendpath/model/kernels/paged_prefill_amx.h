// A prompt chunk's attention on AMX's bfloat16 tiles: what paged_prefill_bf16.cpp hands
// paged_prefill_amx_impl.h's two builds (on the tiles, and on amx_tiles.h's software model
// of them), in plain types: the AMX sources include no torch header (see amx_tiles.h).
//
// A task is up to kPrefillTokens consecutive tokens of one sequence against one kv head,
// its `group` query heads each a run of 16-row tiles (16 tokens of one head: the causal
// limit rises by one a row). Keys are taken kSegment at a time, flash-attention style:
//   scores  S = Q K^T with tdpbf16ps (A: 16 query rows x 32 dims; B: 16 keys' dims in
//           pairs, the segment's keys transposed once for every row tile of the task);
//   softmax in float32 on AVX-512 over each row's keys in the segment (its causal limit,
//           a running max and sum), the weights rounded to bfloat16 as the vector tile does;
//   values  O_seg = P V with tdpbf16ps (A: 16 rows x 32 keys' weights; B: 16 key pairs x 16
//           dims, the segment's values interleaved by pairs once), summed in float32 over
//           the segment in the tiles, then folded into the row's accumulator (rescaled by
//           e^(old max - new max)) once a segment, not once a key block.

#pragma once

#include <cstdint>

namespace sendpath_amx {

struct PrefillRows {
  const uint16_t* q;  // the task's first token's first query head of the kv head (bfloat16)
  uint16_t* out;      // laid out as q
  int64_t row_stride;  // elements from one token's queries (and outputs) to the next's
  const uint16_t* k_head;  // this kv head's cache [slots, head_dim] (bfloat16)
  const uint16_t* v_head;
  const int64_t* table;  // the sequence's block table
  int64_t block_size;    // a multiple of 16
  int64_t first_len;     // the context of the task's first token (itself included)
  int64_t tokens, group, head_dim;  // head_dim 64 or 128
  float scale;
};

constexpr int64_t kPrefillTokens = 64;  // tokens a task takes at most

namespace hw {
void prefill_bf16(const PrefillRows& rows);
}  // namespace hw
namespace emulated {
void prefill_bf16(const PrefillRows& rows);
}  // namespace emulated

}  // namespace sendpath_amx
