// What block_matmul.cpp (the layout, the AVX-512 VNNI loop, the portable loop) and
// block_matmul_avx2.cpp (the AVX2 loop) share: the packed weights and the quantized
// activations (block_matmul.cpp's comment describes both).

#pragma once

#include <torch/extension.h>

#include <cstdint>
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

// Whether this build has the AVX2 loop (compiled for a CPU with AVX2, FMA and F16C).
bool has_avx2_loop();

// Every activation row against weight group g (its 16 output rows) on AVX2; nothing where
// the build has no AVX2 loop.
void group_avx2(const Packed& w, const Quantized& x, float* out, int64_t n_out, int64_t g);
void group_avx2(const Packed& w, const Quantized& x, at::BFloat16* out, int64_t n_out, int64_t g);

}  // namespace sendpath_blocks
