// block_matmul on AMX tiles: what block_matmul.cpp hands block_matmul_amx_impl.h's two
// builds (on the tiles, and on amx_tiles.h's software model of them), in plain types: the
// AMX sources include no torch header (see amx_tiles.h).
//
// Two designs, both over block_matmul.cpp's packed weights, a thread's run of weight
// groups (16 output rows each) at a time:
//
// - int8 (`groups_int8`), llama.cpp's: the activations' int8 codes against the weights'
//   codes with tdpbsud, one tile product per block of 32 inputs (16 rows x 16 outputs),
//   then the block's scales applied to it in float32 exactly as the AVX-512 VNNI loop
//   applies them to its own integer sums. Integer sums are exact, so the results equal
//   the VNNI loop's to the bit, whatever the batch: a step's rows may take either path.
// - bfloat16 (`groups_bf16`), vLLM's int4 way: each group's weights dequantized once into
//   a bfloat16 panel (d * code + m, rounded to nearest even) in the tiles' pair layout,
//   then tdpbf16ps against the activations in bfloat16, float32 sums across all of K: no
//   per-block fix-up, so the most tile work a cycle, but results of bfloat16's precision
//   (not the VNNI loop's bits).

#pragma once

#include <cstdint>

namespace sendpath_amx {

struct Weights {  // block_matmul.h's Packed: [G, blocks, 256 or 512] codes, d and m float16
  const uint8_t* codes;
  const uint16_t* d;  // float16 bits, [G, blocks, 16]
  const uint16_t* m;
  int64_t blocks, block_bytes;
  bool four_bit;
};

struct Int8Rows {  // block_matmul's quantized activations, rows past `rows` all zero
  const int8_t* q;          // [padded_rows, blocks * 32]
  const float* scale;       // [padded_rows, blocks]
  const float* scaled_sum;  // [padded_rows, blocks]
  int64_t rows, padded_rows, blocks;
};

struct Bf16Rows {  // the activations in bfloat16 (bits), [rows, blocks * 32]
  const uint16_t* x;     // rows [0, tail_from): the input itself where it can be
  const uint16_t* tail;  // rows from tail_from, a copy zero past `rows` (and past K)
  int64_t tail_from, rows, padded_rows, blocks;
  const uint16_t* row(int64_t r) const {
    const int64_t width = blocks * 32;
    return r < tail_from ? x + r * width : tail + (r - tail_from) * width;
  }
};

struct Output {  // [rows, n_out]: float32, or bfloat16 bits rounded to nearest even
  float* f32;
  uint16_t* bf16;  // where f32 is null
};

constexpr int64_t kTileRows = 16;  // padded_rows is a multiple of this

// Every row against weight groups [g_begin, g_end) -> out [rows, n_out].
namespace hw {
void groups_int8(const Weights& w, const Int8Rows& x, const Output& out, int64_t n_out, int64_t g_begin,
                 int64_t g_end);
void groups_bf16(const Weights& w, const Bf16Rows& x, const Output& out, int64_t n_out, int64_t g_begin,
                 int64_t g_end);
}  // namespace hw
namespace emulated {
void groups_int8(const Weights& w, const Int8Rows& x, const Output& out, int64_t n_out, int64_t g_begin,
                 int64_t g_end);
void groups_bf16(const Weights& w, const Bf16Rows& x, const Output& out, int64_t n_out, int64_t g_begin,
                 int64_t g_end);
}  // namespace emulated

}  // namespace sendpath_amx
