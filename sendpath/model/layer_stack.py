"""Every decoder layer of a step in one C++ call, where a model's layers allow it.

``kernels/layer_stack.cpp`` runs the layers with the same kernels, in the same order, as
``LlamaModel.forward``'s modules call them (the same results to the bit), without the
Python between them: about 70 microseconds a layer, a third of a one-request step of
the built-in model. It takes layers whose every product uses block-quantized weights
(``BlockWeights``: the file's Q4_1 / Q8_0 codes, on AVX-512 VNNI or AVX2) and no per-head norms
(Qwen3's); any other model keeps the modules' path.
"""

from __future__ import annotations

from typing import Any

from sendpath.model.linear import Linear
from sendpath.model.llama import DecoderLayer, LlamaModel
from sendpath.model.quant import BlockWeights

__all__ = ["layer_stack", "use_kernels"]


def use_kernels(model: LlamaModel, kernels: Any) -> None:
    """``model`` runs on ``kernels`` (``LlamaModel.use_kernels``), every layer in one call
    where its layers allow it. Call it once the weights are in their final form."""
    model.use_kernels(kernels)
    model.stack = layer_stack(model, kernels)


def layer_stack(model: LlamaModel, kernels: Any) -> Any | None:
    """The kernels' ``LayerStack`` over ``model``'s layers, or None where a layer is not
    of its form (or the kernels have no stack)."""
    decoders = [layer for layer in model.layers if isinstance(layer, DecoderLayer)]
    if kernels is None or not hasattr(kernels, "LayerStack") or not decoders:
        return None
    layers = []
    for layer in decoders:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        products = [p for p in map(_block, linears) if p is not None]
        if attn.q_norm is not None or len(products) < len(linears):
            return None
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        tensors = [*norms, *(t for p in products for t in (p.codes, p.d, p.m))]
        if attn.qkv_bias is not None:
            tensors.append(attn.qkv_bias)
        layers.append([t.detach() for t in tensors])
    config = model.config
    return kernels.LayerStack(
        layers,
        [p.out_features for p in products],  # the same in every layer
        config.rms_norm_eps,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
    )


def _block(linear: Linear) -> BlockWeights | None:
    """The linear's block weights if they serve every product, else None."""
    weights = linear.quantized
    if isinstance(weights, BlockWeights) and linear.quantized_rows is None:
        return weights
    return None
