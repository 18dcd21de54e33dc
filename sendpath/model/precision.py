"""What a loaded model computes in, and with which weights: chosen, then applied.

``quantization`` (vLLM's name) adds low-precision weights for small steps (``quant.py``):
``int4`` (the file's own four-bit codes where it ships Q4_0 / Q4_1, else codes made here),
``int8`` (one scale a row), ``none``; ``auto`` takes int4 when the file ships four-bit
weights: multiplied llama.cpp's way (``BlockWeights``) on a CPU with AVX-512 VNNI or AVX2,
with bfloat16 or float32 activations (whichever ``--dtype`` gave), else by torch's int4
kernel with bfloat16 activations only; otherwise none. The output head gets eight bits
with either (per block of 32 with ``BlockWeights``, else per row). ``BlockWeights``
serve every step, prompt chunks too, and the layers' dense weights are freed; torch's int4
and int8 kernels serve small steps only, and on a CPU that computes bfloat16 natively the
dense bfloat16 weights (used by larger steps) go to oneDNN's blocked layout
(``Linear.use_packed_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sendpath.errors import ModelLoadError
from sendpath.model.linear import Linear
from sendpath.model.llama import LlamaModel
from sendpath.model.quant import (
    INT4_MAX_ROWS,
    BlockWeights,
    Int4Weights,
    Int8Weights,
    block_kernels,
    block_loop,
    int4_supported,
    matrix_engine,
    native_bf16,
    quantize_q4,
)

__all__ = [
    "FLOAT32",
    "QUANTIZATIONS",
    "Codes",
    "Precision",
    "apply_precision",
    "choose_precision",
]

QUANTIZATIONS = ("auto", "none", "int8", "int4")
INT8_MAX_ROWS = 4  # int8's kernel beats dense bfloat16 up to about four rows (measured)
# A Q4 tensor's four-bit codes and per-32 (d, m), in our layout: w = d * code + m
Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Precision:
    """What a model computes in, and why: shown by `sendpath replica`, /load and /metrics."""

    dtype: str
    quantization: str  # none, int8 or int4
    reason: str


FLOAT32 = Precision("float32", "none", "")  # a model made in tests without a reason


def choose_precision(
    asked: str, dtype: str, dev: torch.device, ships_q4: bool, dtype_asked: bool = True
) -> Precision:
    """The quantization to use and why (``asked``: the flag; ``dtype_asked``: ``dtype`` was
    asked for, not what ``--dtype auto`` chose: float32 asked for keeps float32 weights)."""
    if asked == "none":
        return Precision(dtype, "none", "asked for")
    if asked in ("int4", "int8"):
        kernels = block_kernels() if asked == "int4" and dev.type == "cpu" else None
        if dev.type != "cpu" or (dtype != "bfloat16" and kernels is None):
            raise ModelLoadError(
                f"quantization={asked!r} runs on the CPU with bfloat16 activations "
                f"(here: {dev.type}, {dtype}); use --dtype bfloat16 or auto, or leave it out."
            )
        if asked == "int4" and kernels is None and not int4_supported():
            raise ModelLoadError("this torch has no CPU int4 kernel; use --quantization int8")
        return Precision(dtype, asked, "asked for" + (_blocks(kernels) if kernels else ""))
    if dev.type != "cpu":
        return Precision(dtype, "none", f"auto: {dev.type} runs {dtype} weights")
    if not ships_q4:
        return Precision(dtype, "none", "auto: the model ships no four-bit weights")
    if dtype == "float32" and dtype_asked:
        return Precision(dtype, "none", "auto: float32 asked for keeps float32 weights")
    found = block_kernels()
    if found is not None and dtype in ("bfloat16", "float32"):
        return Precision(
            dtype,
            "int4",
            f"auto: the model's own four-bit weights and eight-bit head{_blocks(found)}, "
            f"for every step ({dtype} activations)",
        )
    if dtype != "bfloat16":  # no integer dot products here either: full precision
        return Precision(dtype, "none", f"auto: {dtype} activations keep {dtype} weights")
    if not int4_supported():
        return Precision(dtype, "none", "auto: this torch has no CPU int4 kernel")
    return Precision(
        dtype,
        "int4",
        f"auto: the model's own four-bit weights (and an int8 head), for steps of up to "
        f"{INT4_MAX_ROWS} rows; bfloat16 beyond",
    )


def _blocks(kernels: Any) -> str:
    """How the block-quantized weights multiply here, for a precision's reason."""
    loop = {"avx512-vnni": "AVX-512 VNNI", "avx2": "AVX2"}[block_loop(kernels)]
    amx = f"; larger steps on AMX: {matrix_engine(kernels)}" if kernels.matrix_loops() else ""
    return f" (times int8 activations per block of 32 on {loop}, as llama.cpp{amx})"


def apply_precision(
    model: LlamaModel, precision: Precision, codes: dict[str, Codes], dev: torch.device
) -> None:
    """Give the model's linear layers the weights ``precision`` says (``codes``: the
    file's own four-bit ones, by parameter name)."""
    dtype = getattr(torch, precision.dtype)
    _quantize(model, precision.quantization, codes, dtype)
    if dev.type == "cpu" and dtype == torch.bfloat16 and native_bf16() and _mkldnn():
        for module in model.modules():
            if isinstance(module, Linear):
                module.use_packed_layout()  # after _quantize, which reads the dense weights


def _quantize(
    model: LlamaModel, quantization: str, codes: dict[str, Codes], dtype: torch.dtype
) -> None:
    """Give each linear layer its low-precision weights (none: nothing). The output head
    gets eight bits either way: a head in four bits loses too much (teacher-forced top-1
    agreement with float32 fell to 85% on SmolLM2, against 98% with int8)."""
    if quantization == "none":
        return
    blocks = block_kernels() if quantization == "int4" else None
    head = model.lm_head
    if blocks is not None:
        head.use_quantized(BlockWeights.q8_0(blocks, head.weight_out_in), None)
        if not model.config.tie_word_embeddings:  # tied, it is the embedding: it stays
            head.drop_dense()
    else:
        head.use_quantized(Int8Weights.from_dense(head.weight_out_in, dtype), INT8_MAX_ROWS)
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or not name.startswith("layers."):
            continue
        if quantization == "int8":
            module.use_quantized(Int8Weights.from_dense(module.weight_out_in, dtype), INT8_MAX_ROWS)
            continue
        found = codes.get(name + ".weight") or quantize_q4(module.weight_out_in)
        if blocks is not None:
            module.use_quantized(BlockWeights.from_q4_1(blocks, *found), None)
            module.drop_dense()
        else:
            module.use_quantized(Int4Weights.from_q4_1(*found, dtype), INT4_MAX_ROWS)


def _mkldnn() -> bool:
    return bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
