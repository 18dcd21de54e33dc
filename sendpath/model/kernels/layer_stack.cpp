// Every decoder layer of a step in one call: the CPU model's path for block-quantized weights.
//
// Between its kernels a decode step of a small model pays for Python: each layer made
// about nine kernel calls through modules, views and checks, about 70 microseconds a
// layer, 2-2.5 ms a step of SmolLM2's 30 layers (a third of a one-request step). A
// `LayerStack` holds every layer's weights (as `BlockWeights` packs them) and runs the
// layers here, with Python's lock released, so that the server's other threads run
// meanwhile. It calls the same kernels in the same order as `LlamaModel.forward`'s modules
// do, so its results are the same to the bit:
//
//   x = rms_norm(embeddings); residual = embeddings
//   per layer: qkv = x Wqkv (+ bias); RoPE on q and k; o = attention(q, k, v) Wo;
//              residual += o, x = rms_norm(residual); x = down(silu(gate) * up)
//              residual += x, x = rms_norm(residual)   (the next layer's input norm)
//
// Attention: `paged` holds the paged cache, the step's slots and every row's block table
// and context length (decodes and prompt chunks alike), and the cache is written and read
// in place here; without it (another attention backend) `attend(layer, q, k, v)`, the
// Python backend, is called once a layer with the lock taken for it.

#include "kernels.h"

#include <cmath>
#include <optional>
#include <vector>

namespace py = pybind11;

namespace {

struct BlockLinear {  // BlockWeights' packed codes, d, m and its output width
  torch::Tensor codes, d, m;
  int64_t n_out;
  torch::Tensor operator()(const torch::Tensor& x) const {
    return block_matmul(x, codes, d, m, n_out, "");
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  BlockLinear qkv, o, gate_up, down;
  std::optional<torch::Tensor> qkv_bias;  // Qwen2
};

struct Paged {  // the step's attention, read in place
  torch::Tensor k_cache, v_cache, slots, block_tables, seq_lens;  // caches: [L, Hkv, S, Dh]
  int64_t block_size;
};

}  // namespace

class LayerStack {
 public:
  // layers: per layer [input_norm, post_norm, then codes, d, m of qkv, o, gate_up and down,
  // then optionally the qkv bias]; widths: the four products' output widths.
  LayerStack(const std::vector<std::vector<torch::Tensor>>& layers, std::vector<int64_t> widths,
             double eps, int64_t heads, int64_t kv_heads, int64_t head_dim)
      : eps_(eps), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim) {
    TORCH_CHECK(widths.size() == 4, "widths: qkv, o, gate_up, down");
    for (const auto& t : layers) {
      TORCH_CHECK(t.size() == 14 || t.size() == 15, "a layer is 14 tensors (15 with a qkv bias)");
      Layer layer{t[0], t[1], {t[2], t[3], t[4], widths[0]}, {t[5], t[6], t[7], widths[1]},
                  {t[8], t[9], t[10], widths[2]}, {t[11], t[12], t[13], widths[3]}, std::nullopt};
      if (t.size() == 15) layer.qkv_bias = t[14];
      layers_.push_back(std::move(layer));
    }
  }

  // x: the step's embeddings [T, D] (taken as the residual stream: written to); cos, sin:
  // [T, 1, Dh] as `LlamaModel.rope` gives them -> the hidden states after `final_norm`.
  torch::Tensor forward(torch::Tensor x, torch::Tensor final_norm, torch::Tensor cos,
                        torch::Tensor sin, py::object attend, py::object paged_step) {
    std::optional<Paged> paged;
    if (!paged_step.is_none()) {
      auto t = paged_step.cast<py::tuple>();
      paged = Paged{t[0].cast<torch::Tensor>(), t[1].cast<torch::Tensor>(),
                    t[2].cast<torch::Tensor>(), t[3].cast<torch::Tensor>(),
                    t[4].cast<torch::Tensor>(), t[5].cast<int64_t>()};
    }
    py::gil_scoped_release unlocked;
    torch::Tensor residual = x;
    torch::Tensor hidden = at::rms_norm(x, {x.size(1)}, layers_.empty() ? final_norm
                                        : layers_[0].input_norm, eps_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      if (i > 0) fused_add_rms_norm(hidden, residual, layer.input_norm, eps_);
      hidden = attention(static_cast<int64_t>(i), layer, hidden, cos, sin, attend, paged);
      fused_add_rms_norm(hidden, residual, layer.post_norm, eps_);
      hidden = layer.down(silu_and_mul(layer.gate_up(hidden)));
    }
    if (!layers_.empty()) fused_add_rms_norm(hidden, residual, final_norm, eps_);
    return hidden;
  }

 private:
  torch::Tensor attention(int64_t i, const Layer& layer, const torch::Tensor& x,
                          const torch::Tensor& cos, const torch::Tensor& sin,
                          const py::object& attend, const std::optional<Paged>& paged) {
    const int64_t tokens = x.size(0);
    torch::Tensor qkv = layer.qkv(x);  // [T, (H + 2 Hkv) Dh]
    if (layer.qkv_bias) qkv = qkv + *layer.qkv_bias;
    rotary_(qkv, cos, sin, heads_ + kv_heads_, head_dim_);
    auto parts = qkv.view({tokens, -1, head_dim_}).split_with_sizes({heads_, kv_heads_, kv_heads_}, 1);
    torch::Tensor out;  // [T, H, Dh]
    if (paged) {
      auto k_cache = paged->k_cache[i], v_cache = paged->v_cache[i];
      write_kv(parts[1], parts[2], k_cache, v_cache, paged->slots);
      out = paged_attention(parts[0], k_cache, v_cache, paged->block_tables, paged->seq_lens,
                            paged->block_size, std::pow(static_cast<double>(head_dim_), -0.5));
    } else {
      py::gil_scoped_acquire locked;
      out = attend(i, parts[0], parts[1], parts[2]).cast<torch::Tensor>();
    }
    return layer.o(out.reshape({tokens, heads_ * head_dim_}));
  }

  std::vector<Layer> layers_;
  double eps_;
  int64_t heads_, kv_heads_, head_dim_;
};

void bind_layer_stack(py::module_& m) {
  py::class_<LayerStack>(m, "LayerStack", "every decoder layer of a step in one call")
      .def(py::init<const std::vector<std::vector<torch::Tensor>>&, std::vector<int64_t>, double,
                    int64_t, int64_t, int64_t>(),
           py::arg("layers"), py::arg("widths"), py::arg("eps"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"))
      .def("forward", &LayerStack::forward, py::arg("x"), py::arg("final_norm"), py::arg("cos"),
           py::arg("sin"), py::arg("attend"), py::arg("paged"));
}
