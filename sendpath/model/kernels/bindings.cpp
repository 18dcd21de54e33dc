// The Python module of sendpath's CPU kernels: one module for all the sources beside it.

#include "kernels.h"

void bind_layer_stack(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "each query row's attention over its own context in the paged KV cache, read in place");
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "residual += x; x = rms_norm(residual) * weight, in place");
  m.def("rotary_", &rotary_, "RoPE in place on the first `heads` heads of each row");
  m.def("write_kv", &write_kv, "each token's k and v into its cache slot");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("block_loops", &block_loops,
        "the loops block_matmul runs on this CPU, the fastest first (avx512-vnni, avx2, portable)");
  m.def("pack_q4", &pack_q4, "Q4_1 codes, d and m in block_matmul's layout");
  m.def("pack_q8", &pack_q8, "Q8_0 codes and d in block_matmul's layout");
  m.def("block_matmul", &block_matmul, "x W^T for block-quantized weights, int8 activations",
        py::arg("x"), py::arg("codes"), py::arg("d"), py::arg("m"), py::arg("n_out"),
        py::arg("loop") = "");
  bind_layer_stack(m);
}
