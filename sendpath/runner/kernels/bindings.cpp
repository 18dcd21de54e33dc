// The Python module of sendpath's CPU kernels: one module for all the sources beside it.

#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     int64_t block_size, double scale);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim);
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slots);
torch::Tensor silu_and_mul(torch::Tensor gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over the paged KV cache, read in place");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "residual += x; x = rms_norm(residual) * weight, in place");
  m.def("rotary_", &rotary_, "RoPE in place on the first `heads` heads of each row");
  m.def("write_kv", &write_kv, "each token's k and v into its cache slot");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
}
