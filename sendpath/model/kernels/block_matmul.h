// What block_matmul.cpp (the layout, the AVX-512 VNNI loop, the portable loop),
// block_matmul_avx2.cpp (the AVX2 loop) and matrix_engine.cpp (AMX) share: the packed
// weights and the quantized activations (block_matmul.cpp's comment describes both).

#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

namespace sendpath_blocks {

constexpr int64_t kBlock = 32;  // inputs per block (Q4_1's and Q8_0's)
constexpr int64_t kLanes = 16;  // output rows per group

// The activations quantized per block: q [M, blocks * 32], e and e * sum(q) [M, blocks].
struct Quantized {
  int64_t rows, blocks;
  std::vector<int8_t> q;
  std::vector<float> scale, scaled_sum;
};

struct Packed {  // pointers into the packed tensors, and their shape
  const uint8_t* codes;
  const at::Half* d;
  const at::Half* m;
  int64_t blocks, block_bytes;  // 256 (four-bit) or 512
  bool four_bit;
};

// x's rows quantized per block of 32 (block_matmul.cpp): `padded_rows` (at least `rows`)
// kept, those past `rows` all zero (AMX tiles take 16 at a time).
Quantized quantize(const float* x, int64_t rows, int64_t k, int64_t padded_rows);
Quantized quantize(const at::BFloat16* x, int64_t rows, int64_t k, int64_t padded_rows);

// Where the tiles are usable, a product of kAmxBf16MinRows rows or more goes to their
// bfloat16 design, one of kAmxInt8MinRows or more to their int8 design (the VNNI loop's
// bits), and fewer rows to the VNNI loop. Measured by `benchmarks/matrix_matmul.py` on a
// 2-core AMX Xeon (Sapphire Rapids class) on SmolLM2's four products: below 16 rows the
// VNNI loop wins (the weights' bytes and each call's unpacking bound a few rows); from 16
// the int8 tiles beat it on every product (1.1-1.3x), from 32 the bfloat16 tiles beat both
// (1.3-1.6x the VNNI loop at 32, 2.5-3.5x from 256), their per-block fix-ups holding the
// int8 tiles to 1.1-1.5x.
constexpr int64_t kAmxInt8MinRows = 16;
constexpr int64_t kAmxBf16MinRows = 32;

enum class Amx { kInt8, kBf16 };  // block_matmul_amx.h's two designs

// matrix_engine.cpp: why AMX's tiles cannot be used in this process ("" where they can);
// whether the AMX sources' other code (AVX-512 BF16), and so the tiles' model, runs here;
// and x [rows, k] times the weights on the tiles (or their model: `emulated`) -> out
// [rows, n_out] of x's type (float32 sums; bfloat16 rounded to nearest even).
const std::string& amx_unavailable();
bool amx_emulation_runs();
void run_amx(const Packed& w, const float* x, int64_t rows, int64_t k, float* out, int64_t n_out,
             Amx design, bool emulated);
void run_amx(const Packed& w, const at::BFloat16* x, int64_t rows, int64_t k, at::BFloat16* out,
             int64_t n_out, Amx design, bool emulated);

// Whether this build has the AVX2 loop (compiled for a CPU with AVX2, FMA and F16C).
bool has_avx2_loop();

// Every activation row against weight group g (its 16 output rows) on AVX2; nothing where
// the build has no AVX2 loop.
void group_avx2(const Packed& w, const Quantized& x, float* out, int64_t n_out, int64_t g);
void group_avx2(const Packed& w, const Quantized& x, at::BFloat16* out, int64_t n_out, int64_t g);

}  // namespace sendpath_blocks
