"""Loading errors a user can hit, each with a message that says what to do."""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from sendpath.errors import ModelLoadError, UnsupportedModelError
from sendpath.model.loader import (
    LoadedModel,
    builtin_model_path,
    load_model,
    random_model,
    resolve_device,
)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")


def test_garbage_file_is_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a model" * 100)
    with pytest.raises(ModelLoadError, match="as a GGUF file"):
        load_model(bad)


def tiny_gguf(path: Path, **metadata: object) -> Path:
    """A one-layer Llama GGUF (hidden 4, vocabulary 8) with ``metadata`` over the usual
    keys (``None`` leaves a key out; ``tensors=[...]`` names the tensors kept) and a
    tokenizer without its tokens."""
    import gguf

    keys: dict[str, object] = {
        "llama.attention.head_count": 1, "llama.attention.head_count_kv": 1,
        "llama.embedding_length": 4, "llama.feed_forward_length": 8, "llama.block_count": 1,
        "llama.context_length": 16, "llama.attention.layer_norm_rms_epsilon": 1e-5,
    }  # fmt: skip
    tensors: dict[str, tuple[int, ...]] = {"token_embd.weight": (8, 4), "output_norm.weight": (4,)}
    for name, shape in (("attn_q", (4, 4)), ("attn_k", (4, 4)), ("attn_v", (4, 4)),
                        ("attn_output", (4, 4)), ("ffn_gate", (8, 4)), ("ffn_up", (8, 4)),
                        ("ffn_down", (4, 8)), ("attn_norm", (4,)), ("ffn_norm", (4,))):  # fmt: skip
        tensors[f"blk.0.{name}.weight"] = shape
    kept = metadata.pop("tensors", list(tensors))
    keys.update(metadata)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in keys.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
    writer.add_tokenizer_model("gpt2")  # and no tokens
    for name in kept:  # type: ignore[attr-defined]
        writer.add_tensor(name, np.ones(tensors[name], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        (
            {"llama.attention.head_count": [1, 2]},
            "llama.attention.head_count is '\\[1, 2\\]', not a number",
        ),
        ({"llama.attention.head_count": 0}, "head_count is 0, not a positive whole number"),
        ({"llama.embedding_length": 2.5}, "embedding_length is 2.5, not a positive whole"),
        ({"llama.block_count": None}, "llama.block_count is missing"),
        ({"tensors": ["output_norm.weight"]}, "missing tensor token_embd.weight"),
        ({}, "the tokenizer's metadata is malformed"),
    ],
    ids=["a-list", "zero", "a-fraction", "missing", "no-embedding", "no-tokens"],
)
def test_malformed_gguf_metadata_names_the_key(
    tmp_path: Path, metadata: dict[str, object], message: str
) -> None:
    path = tiny_gguf(tmp_path / "tiny.gguf", **metadata)
    with pytest.raises(ModelLoadError, match=message):
        load_model(path)


def test_truncated_gguf(tmp_path: Path) -> None:
    src = builtin_model_path()
    cut = tmp_path / "cut.gguf"
    with src.open("rb") as f:
        cut.write_bytes(f.read(1_000_000))
    with pytest.raises(ModelLoadError):
        load_model(cut)


def test_unreadable_file(tmp_path: Path) -> None:
    # A socket exists but cannot be opened for reading, even by root (CI runs as root,
    # so a chmod 000 file would still be readable there).
    bad = tmp_path / "model.gguf"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(bad))
        with pytest.raises(ModelLoadError, match="Could not read"):
            load_model(bad)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"architecture 'gpt2' is not supported"):
        load_model(path)


def test_unsupported_hf_architecture(tiny_llama_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*Qwen3ForCausalLM"):
        load_model(other)


def test_a_sliding_window_caps_the_context(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Mistral's window: attention over the whole context is the same thing up to it."""
    other = tmp_path / "mistral"
    shutil.copytree(tiny_llama_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=256)
    (other / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(other)
    assert loaded.config.sliding_window == 256 and loaded.max_model_len == 256


def test_hf_directory_without_weights_or_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path)
    no_weights = tmp_path / "nw"
    shutil.copytree(tiny_llama_dir, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(no_weights)


def test_checkpoint_that_does_not_match_its_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "wrong"
    shutil.copytree(tiny_llama_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="does not match its config"):
        load_model(other)


def test_bad_dtype_and_device() -> None:
    with pytest.raises(ModelLoadError, match="dtype='int8'"):
        load_model(None, dtype="int8")
    with pytest.raises(ModelLoadError, match="not supported"):
        resolve_device("mps")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            resolve_device("cuda")


def test_builtin_model_config() -> None:
    loaded = load_model(None, dtype="bfloat16")
    cfg = loaded.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert loaded.max_model_len == 8192
    assert torch.equal(loaded.model.lm_head.weight_out_in, loaded.model.embed_tokens.weight)
    assert not loaded.model.lm_head.transposed  # bfloat16 keeps the checkpoint layout
    assert 134_000_000 < cfg.num_params < 135_000_000


def test_a_random_model_of_a_shape_runs_on_the_engine(tiny: LoadedModel) -> None:
    from sendpath.config import CacheConfig, EngineConfig
    from sendpath.engine.core import EngineCore
    from sendpath.request import SamplingParams

    def answer(seed: int) -> tuple[LoadedModel, list[int]]:
        loaded = random_model(tiny.config, tiny.tokenizer, "float32", "cpu", seed=seed)
        config = EngineConfig(max_model_len=256, cache=CacheConfig(num_blocks=32))
        core = EngineCore.from_loaded(loaded, config)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        request = core.add_request([5, 6, 7, 8], params)
        while core.has_unfinished_requests():
            core.step()
        return loaded, request.output_token_ids

    loaded, tokens = answer(1)
    assert len(tokens) == 6 and loaded.precision.reason == "random weights for timing"
    weights = loaded.model.state_dict()
    assert torch.equal(weights["norm.weight"], torch.ones_like(weights["norm.weight"]))
    assert 0.015 < float(weights["layers.0.mlp.down_proj.weight"].std()) < 0.025
    assert answer(1)[1] == tokens  # the seed makes the weights
    assert not torch.equal(answer(2)[0].model.embed_tokens.weight, loaded.model.embed_tokens.weight)


def test_a_random_model_needs_a_vocabulary_as_large_as_its_tokenizers(tiny: LoadedModel) -> None:
    small = dataclasses.replace(tiny.config, vocab_size=8)
    with pytest.raises(ModelLoadError, match="vocab_size of at least"):
        random_model(small, tiny.tokenizer, "float32", "cpu")
    with pytest.raises(ModelLoadError, match="dtype='int4'"):
        random_model(tiny.config, tiny.tokenizer, "int4", "cpu")
