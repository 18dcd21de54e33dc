"""Our Llama against transformers' on the same weights: logits and greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sendpath.llm import LLM
from sendpath.model.loader import load_model
from sendpath.model.tokenizer import Tokenizer
from sendpath.request import SamplingParams
from sendpath.runner.sequence_runner import SequenceRunner
from tests.conftest import CHAT_PROMPTS, write_tiny_llama

# float32, same weights, same op order up to BLAS blocking: logits (|logit| up to ~40 on
# SmolLM2) agree to 1e-3 absolute; observed 6e-5 on SmolLM2 and ~1e-6 on the tiny model.
LOGIT_ATOL = 1e-3
NEW_TOKENS = 64


def reference_logits(hf_model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of ``ids``, in one pass."""
    with torch.no_grad():
        logits: torch.Tensor = hf_model(torch.tensor([ids])).logits[0].float()
    return logits


def check_against_reference(llm: LLM, hf_model: Any) -> None:
    """Every conversation's prompt logits agree with transformers', and our greedy answer
    (the conversations batched, EOS not stopping it) is transformers' greedy answer: its
    argmax at each step given the same tokens before, read from one teacher-forced pass
    over the prompt and our answer (what its own greedy generate picks, step by step)."""
    runner = SequenceRunner(llm.loaded)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [llm.tokenizer.encode_chat(conv) for conv in CHAT_PROMPTS]
    answers = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    for conv, ids, ours in zip(CHAT_PROMPTS, prompts, answers, strict=True):
        assert len(ours) == NEW_TOKENS, conv
        ref_logits = reference_logits(hf_model, ids + ours[:-1])
        diff = (runner.prompt_logits(ids) - ref_logits[: len(ids)]).abs().max().item()
        assert diff < LOGIT_ATOL, f"max |logit diff| {diff} for {conv}"
        theirs = ref_logits[len(ids) - 1 :].argmax(-1).tolist()
        assert ours == theirs, conv


def test_builtin_matches_transformers(builtin_llm: LLM, hf_builtin: Any) -> None:
    check_against_reference(builtin_llm, hf_builtin)


@pytest.mark.parametrize(
    ("tie", "rope_scaling"),
    [
        (True, None),
        (
            False,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        (False, {"rope_type": "linear", "factor": 2.0}),
    ],
    ids=["tied", "untied-llama3-rope", "untied-linear-rope"],
)
def test_tiny_random_model_matches_transformers(
    tmp_path: Path, smol_tokenizer: Tokenizer, tie: bool, rope_scaling: dict[str, Any] | None
) -> None:
    transformers = pytest.importorskip("transformers")
    directory = write_tiny_llama(tmp_path, smol_tokenizer, tie=tie, rope_scaling=rope_scaling)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    llm = LLM(directory, dtype="float32")
    assert llm.loaded.config.tie_word_embeddings is tie
    check_against_reference(llm, hf_model.eval())


@pytest.mark.parametrize("architecture", ["mistral", "qwen2", "qwen3"])
def test_other_architectures_match_transformers(
    tmp_path: Path, smol_tokenizer: Tokenizer, architecture: str
) -> None:
    """Each architecture's own transformers class, saved as a Hugging Face directory: our
    one model file with its switches gives the same logits and greedy tokens (the paged
    engine generates them)."""
    transformers = pytest.importorskip("transformers")
    directory = write_tiny_llama(tmp_path, smol_tokenizer, tie=False, architecture=architecture)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    llm = LLM(directory, dtype="float32")
    cfg = llm.loaded.config
    assert cfg.architecture == architecture
    assert cfg.qkv_bias is (architecture == "qwen2") and cfg.qk_norm is (architecture == "qwen3")
    assert cfg.num_params == sum(p.numel() for p in hf_model.parameters())
    check_against_reference(llm, hf_model.eval())


def test_param_count_matches_the_weights(tiny_llama_dir: Path) -> None:
    loaded = load_model(tiny_llama_dir, dtype="float32")
    total = sum(p.numel() for p in loaded.model.parameters())
    head = loaded.model.lm_head.weight.numel()  # a transposed copy when tied
    assert loaded.config.num_params == total - (head if loaded.config.tie_word_embeddings else 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_builtin_knows_the_capital_of_japan(dtype: str, builtin_llm: LLM) -> None:
    llm = builtin_llm if dtype == "float32" else LLM(dtype=dtype)
    assert llm.loaded.model.dtype == getattr(torch, dtype)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of Japan?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
    )[0].outputs[0]
    assert "Tokyo" in out.text
    assert out.finish_reason == "stop"


def test_cuda_is_used_when_asked_and_available() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine (the GPU path runs on a lent GPU only)")
    llm = LLM(device="cuda")
    assert llm.loaded.model.device.type == "cuda"
    assert llm.loaded.model.dtype == torch.bfloat16
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of Japan?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
    )[0].outputs[0]
    assert "Tokyo" in out.text
