// The Python module of sendpath's CPU kernels: one module for all the sources beside it.

#include "kernels.h"

void bind_layer_stack(pybind11::module_& m);

// Tensor work only: the GIL is let go for the call, so the server's event loop (streaming
// the last step's tokens) runs beside a step's kernels called from Python (the LM head's
// product is about a tenth of a 32-decode step).
const auto kUnlocked = py::call_guard<py::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, kUnlocked,
        "each query row's attention over its own context in the paged KV cache, read in place; "
        "`prefill` names what takes a prompt chunk's rows on a bfloat16 cache ('': the fastest "
        "here, rows, vector, amx, amx-emulated)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("block_size"), py::arg("scale"), py::arg("prefill") = "");
  m.def("prefill_kernel", &prefill_kernel,
        "what takes a prompt chunk's rows of this shape here: amx, vector or rows (bfloat16 "
        "queries), vector or rows (float32)", py::arg("heads"), py::arg("kv_heads"),
        py::arg("head_dim"), py::arg("block_size"), py::arg("dtype") = "bfloat16");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, kUnlocked,
        "residual += x; x = rms_norm(residual) * weight, in place");
  m.def("rotary_", &rotary_, kUnlocked, "RoPE in place on the first `heads` heads of each row");
  m.def("write_kv", &write_kv, kUnlocked, "each token's k and v into its cache slot");
  m.def("silu_and_mul", &silu_and_mul, kUnlocked, "silu(gate) * up");
  m.def("block_loops", &block_loops,
        "the loops block_matmul runs on this CPU, the fastest first (avx512-vnni, avx2, portable)");
  m.def("matrix_loops", &matrix_loops,
        "the matrix-engine loops block_matmul runs on this CPU (amx-bf16, amx-int8), or none");
  m.def("matrix_unavailable", &matrix_unavailable, "why matrix_loops() is empty here, or ''");
  m.def("matrix_min_rows", &matrix_min_rows,
        "the rows from which block_matmul's default takes each of matrix_loops()");
  m.def("pack_q4", &pack_q4, "Q4_1 codes, d and m in block_matmul's layout");
  m.def("pack_q8", &pack_q8, "Q8_0 codes and d in block_matmul's layout");
  m.def("block_matmul", &block_matmul, kUnlocked,
        "x W^T for block-quantized weights, int8 activations", py::arg("x"), py::arg("codes"),
        py::arg("d"), py::arg("m"), py::arg("n_out"), py::arg("loop") = "");
  bind_layer_stack(m);
}
