"""Each architecture as a GGUF file, written with the gguf package's writer under
llama.cpp's tensor names and metadata keys (q/k rows permuted for Llama-architecture files
as llama.cpp's converter does, Llama 3.1's RoPE as a ``rope_freqs`` tensor), loads in
sendpath and matches transformers' own class on the same weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sendpath.llm import LLM
from sendpath.model import gguf_reader
from sendpath.model.loader import builtin_model_path
from sendpath.model.tokenizer import Tokenizer
from tests.conftest import write_tiny_llama
from tests.model.test_llama import check_against_reference

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _permute(w: np.ndarray[Any, Any], heads: int) -> np.ndarray[Any, Any]:
    """llama.cpp's converter: Hugging Face's (head, 2, Dh/2) rows -> (head, Dh/2, 2)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(directory: Path, out: Path, hf_model: Any, pre: str | None = None) -> Path:
    """The Hugging Face directory's model as llama.cpp's converter would write it, with the
    built-in model's tokenizer metadata (the tiny models use that tokenizer; ``pre``: say
    another pre-tokenizer)."""
    gguf = pytest.importorskip("gguf")
    raw = json.loads((directory / "config.json").read_text())
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[
        raw["model_type"]
    ]
    state = {k.removeprefix("model."): v.float().numpy() for k, v in hf_model.state_dict().items()}
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(raw["num_hidden_layers"])
    writer.add_context_length(raw["max_position_embeddings"])
    writer.add_embedding_length(raw["hidden_size"])
    writer.add_feed_forward_length(raw["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(raw["head_dim"])
    writer.add_value_length(raw["head_dim"])
    writer.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    theta = raw.get("rope_theta") or raw["rope_parameters"]["rope_theta"]
    writer.add_rope_freq_base(theta)
    source = gguf_reader.read(builtin_model_path()).fields

    def field(name: str) -> Any:
        return source[name]

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or field("tokenizer.ggml.pre"))
    writer.add_token_list(field("tokenizer.ggml.tokens"))
    writer.add_token_types(field("tokenizer.ggml.token_type"))
    writer.add_token_merges(field("tokenizer.ggml.merges"))
    writer.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    writer.add_chat_template(field("tokenizer.chat_template"))
    tensors = {
        "token_embd.weight": state["embed_tokens.weight"],
        "output_norm.weight": state["norm.weight"],
    }
    if "lm_head.weight" in state and not raw.get("tie_word_embeddings"):
        tensors["output.weight"] = state["lm_head.weight"]
    rotary = hf_model.model.rotary_emb
    if raw.get("rope_scaling") or (raw.get("rope_parameters") or {}).get("rope_type") == "llama3":
        dim = raw["head_dim"]
        plain = 1.0 / (theta ** (np.arange(0, dim, 2) / dim))
        tensors["rope_freqs.weight"] = (plain / rotary.inv_freq.numpy()).astype(np.float32)
    names = {
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    }
    for i in range(raw["num_hidden_layers"]):
        src, dst = f"layers.{i}.", f"blk.{i}."
        q, k = state[src + "self_attn.q_proj.weight"], state[src + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = _permute(q, heads), _permute(k, kv_heads)
        tensors[dst + "attn_q.weight"], tensors[dst + "attn_k.weight"] = q, k
        for hf_name, name in names.items():
            if src + hf_name + ".weight" in state:
                tensors[dst + name + ".weight"] = state[src + hf_name + ".weight"]
        for n in "qkv":
            if src + f"self_attn.{n}_proj.bias" in state:
                tensors[dst + f"attn_{n}.bias"] = state[src + f"self_attn.{n}_proj.bias"]
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize(
    ("architecture", "rope_scaling"),
    [("llama", LLAMA3_ROPE), ("mistral", None), ("qwen2", None), ("qwen3", None)],
    ids=["llama3.1-rope-freqs", "mistral", "qwen2", "qwen3"],
)
def test_gguf_files_match_transformers(
    tmp_path: Path, smol_tokenizer: Tokenizer, architecture: str, rope_scaling: Any
) -> None:
    transformers = pytest.importorskip("transformers")
    directory = write_tiny_llama(
        tmp_path / "hf",
        smol_tokenizer,
        tie=False,
        architecture=architecture,
        rope_scaling=rope_scaling,
    )
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    path = write_gguf(directory, tmp_path / f"{architecture}.gguf", hf_model)
    llm = LLM(path, dtype="float32")
    cfg = llm.loaded.config
    assert cfg.qkv_bias is (architecture == "qwen2") and cfg.qk_norm is (architecture == "qwen3")
    if rope_scaling is not None:
        assert cfg.rope_scaling is not None and cfg.rope_scaling.kind == "factors"
    check_against_reference(llm, hf_model.eval())


@pytest.mark.parametrize(
    ("pre", "digits", "contraction"),
    [("qwen2", ["1", "2", "3", "4", "5"], "'S"), ("llama-bpe", ["123", "45"], "'S")],
)
def test_gguf_pre_tokenizers_split_as_their_models_do(
    tmp_path: Path, smol_tokenizer: Tokenizer, pre: str, digits: list[str], contraction: str
) -> None:
    """Qwen2's split keeps every digit alone, Llama 3's groups up to three; both take a
    contraction in any case as a piece of its own (the byte-level BPE then merges inside
    each piece only)."""
    transformers = pytest.importorskip("transformers")
    directory = write_tiny_llama(tmp_path / "hf", smol_tokenizer, architecture="qwen2")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = LLM(
        write_gguf(directory, tmp_path / "m.gguf", hf_model, pre), dtype="float32"
    ).tokenizer
    pieces = tokenizer.backend.pre_tokenizer.pre_tokenize_str("12345 HELLO'S")
    words = [piece for piece, _ in pieces]
    assert words[: len(digits)] == digits and contraction in words
