"""Reading a GGUF file (``gguf_reader.py``): its config, its weights (dequantized to
float32: Q4_0 / Q4_1 from their codes, the other types with the ``gguf`` package, the same
bits either way; q/k rows permuted back from llama.cpp's interleaved-RoPE layout to the
Hugging Face one), its tokenizer, and the four-bit codes of its Q4_0 / Q4_1 tensors as
they ship (for ``precision.py``'s int4 weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from sendpath.errors import ModelLoadError, UnsupportedModelError
from sendpath.model import gguf_reader
from sendpath.model.gguf_tokenizer import tokenizer_from_gguf
from sendpath.model.llama import LlamaConfig
from sendpath.model.precision import Codes
from sendpath.model.quant import q4_0_codes, q4_1_codes, q4_weight
from sendpath.model.rope import RopeScaling
from sendpath.model.tokenizer import Tokenizer

__all__ = ["read_gguf"]

_ARCHS = ("llama", "qwen2", "qwen3")  # general.architecture values (Mistral files say llama)

_GGUF_QUANTS = {
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q8_K",
    "Q2_K",
    "Q3_K",
}


def read_gguf(
    path: Path, dtype: torch.dtype = torch.float32
) -> tuple[LlamaConfig, dict[str, torch.Tensor], Tokenizer, str, dict[str, Codes]]:
    """The file's config, weights (each dequantized and turned into ``dtype`` one tensor at
    a time, so no float32 copy of the whole model exists), tokenizer, name, and the
    four-bit tensors' own codes."""
    from gguf.quants import dequantize

    try:
        reader = gguf_reader.read(path)
    except (gguf_reader.GGUFError, OSError) as exc:
        raise ModelLoadError(
            f"Could not read {str(path)!r} as a GGUF file ({type(exc).__name__}: {exc}). "
            "Check that the file is complete and really a GGUF model."
        ) from exc
    meta = {k: v for k, v in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedModelError(
            f"{path.name}: architecture {arch!r} is not supported; sendpath runs GGUF files "
            f"of {', '.join(sorted(_ARCHS))} (general.architecture)."
        )

    def key(name: str, default: Any = None) -> Any:  # the architecture's own keys
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path.name}: metadata {arch}.{name} is missing.")
        return value

    def number(name: str, default: float | None = None) -> float:
        value = key(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelLoadError(
                f"{path.name}: metadata {arch}.{name} is {str(value)[:60]!r}, not a number."
            )
        return value

    def whole(name: str, default: int | None = None) -> int:
        value = number(name, default)
        if not 1 <= value < 2**63 or value != int(value):  # not NaN, infinite, 0 or 2.5
            raise ModelLoadError(
                f"{path.name}: metadata {arch}.{name} is {value!r}, not a positive whole number."
            )
        return int(value)

    n_heads = whole("attention.head_count")
    n_kv = whole("attention.head_count_kv", n_heads)
    hidden = whole("embedding_length")
    tensors: dict[str, torch.Tensor] = {}
    freq_factors = None  # Llama 3.1's rope_freqs, kept in float32
    four_bit: dict[str, Codes] = {}  # the Q4_0 / Q4_1 tensors' own codes, by GGUF name
    for t in reader.tensors:
        if t.tensor_type.name not in _GGUF_QUANTS:
            raise UnsupportedModelError(
                f"{path.name}: tensor {t.name} uses quantization {t.tensor_type.name}, "
                f"which sendpath cannot dequantize; supported: {sorted(_GGUF_QUANTS)}."
            )
        q4_0 = t.tensor_type.name == "Q4_0"
        if (q4_0 or t.tensor_type.name == "Q4_1") and len(t.data.shape) == 2:
            four_bit[t.name] = (q4_0_codes if q4_0 else q4_1_codes)(t.data)
            values = q4_weight(*four_bit[t.name], q4_0)  # from the codes: one pass
        else:
            values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not values.flags.writeable:  # an F32 tensor's values: a view of the mapped file
            values = values.copy()
        if t.name == "rope_freqs.weight":
            freq_factors = values
        tensors[t.name] = torch.from_numpy(values).to(dtype)  # float32: the same memory
        del values
    for name in ("token_embd.weight", "output_norm.weight"):
        if name not in tensors:
            raise ModelLoadError(f"{path.name}: missing tensor {name}; the file is incomplete.")
    vocab = whole("vocab_size", tensors["token_embd.weight"].shape[0])
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=whole("feed_forward_length"),
        num_layers=whole("block_count"),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=whole("attention.key_length", hidden // n_heads),
        rms_norm_eps=float(number("attention.layer_norm_rms_epsilon")),
        rope_theta=float(number("rope.freq_base", 10000.0)),
        max_position_embeddings=whole("context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        rope_scaling=_gguf_rope_scaling(meta, arch, freq_factors),
        architecture=arch,
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
    )
    # llama.cpp permutes the q/k rows of Llama-architecture files only (its RoPE there
    # pairs neighbours); Qwen's keep Hugging Face's order
    permuted = arch == "llama"

    def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
        # llama.cpp stored rows as (head, Dh/2, 2); HF's rotate-half layout is (head, 2, Dh/2).
        rows = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:])
        return rows.transpose(1, 2).contiguous().reshape(w.shape)

    weights = {
        "embed_tokens.weight": tensors.pop("token_embd.weight"),
        "norm.weight": tensors.pop("output_norm.weight"),
    }
    if "output.weight" in tensors:
        weights["lm_head.weight"] = tensors.pop("output.weight")
    names = {
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_v": "self_attn.v_proj",
    }
    try:
        for i in range(config.num_layers):
            src, dst = f"blk.{i}.", f"layers.{i}."
            for g, h, heads in (("attn_q", "q_proj", n_heads), ("attn_k", "k_proj", n_kv)):
                w = tensors.pop(src + g + ".weight")
                weights[dst + f"self_attn.{h}.weight"] = unpermute(w, heads) if permuted else w
            for g, h in names.items():
                weights[dst + h + ".weight"] = tensors.pop(src + g + ".weight")
            if config.qkv_bias:
                for n in "qkv":
                    weights[dst + f"self_attn.{n}_proj.bias"] = tensors.pop(src + f"attn_{n}.bias")
            if config.qk_norm:
                for n in "qk":
                    norm = tensors.pop(src + f"attn_{n}_norm.weight")
                    weights[dst + f"self_attn.{n}_norm.weight"] = norm
    except KeyError as exc:
        raise ModelLoadError(
            f"{path.name}: missing tensor {exc.args[0]}; the file is incomplete."
        ) from exc
    try:
        tokenizer = tokenizer_from_gguf(reader.fields, path.name)
    except (TypeError, ValueError, KeyError, IndexError) as exc:  # ours are ModelLoadErrors
        raise ModelLoadError(
            f"{path.name}: the tokenizer's metadata is malformed ({type(exc).__name__}: {exc})."
        ) from exc
    codes = _fused_codes(four_bit, config.num_layers, n_heads, n_kv, permuted)
    return config, weights, tokenizer, str(meta.get("general.name") or path.stem), codes


def _fused_codes(
    found: dict[str, Codes], layers: int, heads: int, kv_heads: int, permuted: bool
) -> dict[str, Codes]:
    """The four-bit codes in our layout: q/k rows un-permuted as their weights are, q, k, v
    and gate, up stacked as the fused projections are (only where every part has codes)."""

    def rows(c: Codes, n: int) -> Codes:  # llama.cpp's (head, Dh/2, 2) rows -> (head, 2, Dh/2)
        if not permuted:
            return c
        return tuple(  # type: ignore[return-value]
            t.reshape(n, t.shape[0] // n // 2, 2, t.shape[1]).transpose(1, 2).reshape(t.shape)
            for t in c
        )

    def stack(*parts: Codes | None) -> Codes | None:
        if any(p is None for p in parts):
            return None
        return tuple(torch.cat([p[j] for p in parts if p is not None]) for j in range(3))  # type: ignore[return-value]

    out: dict[str, Codes] = {}
    for i in range(layers):
        b = f"blk.{i}."
        q, k = found.get(b + "attn_q.weight"), found.get(b + "attn_k.weight")
        fused = {
            "self_attn.qkv_proj": stack(
                rows(q, heads) if q else None,
                rows(k, kv_heads) if k else None,
                found.get(b + "attn_v.weight"),
            ),
            "self_attn.o_proj": found.get(b + "attn_output.weight"),
            "mlp.gate_up_proj": stack(
                found.get(b + "ffn_gate.weight"), found.get(b + "ffn_up.weight")
            ),
            "mlp.down_proj": found.get(b + "ffn_down.weight"),
        }
        out.update({f"layers.{i}.{n}.weight": c for n, c in fused.items() if c is not None})
    return out


def _gguf_rope_scaling(
    meta: dict[str, Any], arch: str, freq_factors: np.ndarray[Any, Any] | None
) -> RopeScaling | None:
    """Linear scaling from the metadata, or Llama 3.1's per-pair divisors, which llama.cpp
    writes as a ``rope_freqs`` tensor rather than as metadata."""
    if freq_factors is not None:
        return RopeScaling(kind="factors", factor=1.0, freq_factors=tuple(freq_factors.tolist()))
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported (only 'linear').")
    return RopeScaling(kind="linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))
