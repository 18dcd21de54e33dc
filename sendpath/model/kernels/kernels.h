// The kernels each source defines, for the bindings and for the layer stack, which calls
// them in C++ (their comments are at their definitions).

#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

// An int8 KV cache's row (`--kv-cache-dtype int8`): head_dim int8 codes, then their float32
// scale in these bytes (write_kv makes them, paged_attention reads them).
constexpr int64_t kInt8ScaleBytes = 4;

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              int64_t block_size, double scale, const std::string& prefill = "");
std::string prefill_kernel(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                           const std::string& dtype = "bfloat16");
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim);
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
std::vector<std::string> block_loops();
std::vector<std::string> matrix_loops();
std::string matrix_unavailable();
std::vector<int64_t> matrix_min_rows();
std::vector<torch::Tensor> pack_q4(torch::Tensor codes, torch::Tensor d, torch::Tensor m);
std::vector<torch::Tensor> pack_q8(torch::Tensor codes, torch::Tensor d);
torch::Tensor block_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m,
                           int64_t n_out, const std::string& loop);
