"""The built-in model on its fast path (the file's own four-bit weights, an int8 head,
bfloat16 activations) against float32 on the same file: the same answers where it matters,
nearly the same next-token choices everywhere, nearly the same likelihood.

Thresholds, from measurements on SmolLM2-135M (teacher-forced, one token at a time, so
every product takes the quantized kernels): top-1 agreement with float32 was 98.1% with
llama.cpp's way (int8 activations per block against the Q4_1 and Q8_0 codes, on AVX-512
VNNI), 97.8% with torch's int4 kernel and an int8 head, against 95.9% for plain bfloat16
weights (which round the dequantized Q4_1 values again); the text's log-likelihood moved
0.02% and 0.2-0.5%. The test asks for at least plain bfloat16's agreement (95%) and 1% on
the likelihood.
"""

from __future__ import annotations

import pytest
import torch

from sendpath.llm import LLM
from sendpath.model.loader import LoadedModel, load_model
from sendpath.model.quant import int4_supported
from sendpath.request import SamplingParams
from sendpath.runner.sequence_runner import ContiguousKVCache

pytestmark = pytest.mark.skipif(not int4_supported(), reason="this torch has no CPU int4 kernel")

TEXT = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century and spread "
    "to continental Europe and North America. It replaced hand production with machines, new "
    "chemical processes and iron production, and it changed how people lived and worked."
)
PROMPTS = ["What is the capital of Japan?", "Explain photosynthesis briefly."]


@pytest.fixture(scope="module")
def fast() -> LoadedModel:
    return load_model(None, dtype="bfloat16", quantization="int4")


@torch.inference_mode()
def one_at_a_time(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Logits [P, V] of each position, computed as decode steps of one token."""
    cache = ContiguousKVCache(loaded.config, len(ids), loaded.model.dtype, loaded.model.device)
    rows = []
    for position, token in enumerate(ids):
        hidden = loaded.model(torch.tensor([token]), torch.tensor([position]), cache)
        cache.advance(1)
        rows.append(loaded.model.compute_logits(hidden))
    return torch.cat(rows)


@torch.inference_mode()
def one_pass(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Logits [P, V] of each position, computed as one prompt pass: every product has P
    rows (where AMX's tiles run, the bfloat16 tile design takes them)."""
    cache = ContiguousKVCache(loaded.config, len(ids), loaded.model.dtype, loaded.model.device)
    hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache)
    return loaded.model.compute_logits(hidden)


def test_the_fast_paths_prompt_pass_agrees_with_float32_as_its_decodes_do(
    builtin_llm: LLM, fast: LoadedModel
) -> None:
    """The same thresholds as one token at a time, for products of many rows (on an AMX
    CPU the bfloat16 tiles, elsewhere the vector loop), against float32 one at a time."""
    reference = builtin_llm.loaded
    tok = reference.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": PROMPTS[1]}])
    ids += tok.encode(TEXT, add_special_tokens=False)
    a, b = one_at_a_time(reference, ids), one_pass(fast, ids)
    agree = int((a.argmax(-1) == b.argmax(-1)).sum())
    assert agree / len(ids) >= 0.95, f"top-1 agreement {agree / len(ids):.3f}"
    target = torch.tensor(ids[1:])[:, None]
    want, got = (
        float(torch.log_softmax(logits[:-1].float(), -1).gather(1, target).sum())
        for logits in (a, b)
    )
    assert abs(got - want) <= 0.01 * abs(want), (got, want)


def test_the_fast_path_agrees_with_float32(builtin_llm: LLM, fast: LoadedModel) -> None:
    reference = builtin_llm.loaded
    tok = reference.tokenizer
    agree = total = 0
    for prompt in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        ids += tok.encode(TEXT, add_special_tokens=False)
        a, b = one_at_a_time(reference, ids), one_at_a_time(fast, ids)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= 0.95, f"top-1 agreement {agree / total:.3f}"
    ids = tok.encode(TEXT)
    target = torch.tensor(ids[1:])[:, None]

    def loglik(loaded: LoadedModel) -> float:
        logp = torch.log_softmax(one_at_a_time(loaded, ids)[:-1].float(), -1)
        return float(logp.gather(1, target).sum())

    want, got = loglik(reference), loglik(fast)
    assert abs(got - want) <= 0.01 * abs(want), (got, want)


def test_the_fast_path_still_says_tokyo() -> None:
    llm = LLM(dtype="bfloat16", quantization="int4")
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of Japan?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )
    assert "Tokyo" in out[0].outputs[0].text
    assert llm.loaded.precision.quantization == "int4"


@torch.inference_mode()
def through_the_cache(loaded: LoadedModel, ids: list[int], cache: torch.dtype) -> torch.Tensor:
    """Logits [P, V] of each position as decode steps of one token on the engine's paged
    cache of dtype ``cache`` (the kernels' write and read of it)."""
    from sendpath.engine.scheduler import ScheduledRequest
    from sendpath.runner.model_runner import ModelRunner

    blocks = -(-len(ids) // 16)
    runner = ModelRunner(loaded, blocks, 16, cache)
    rows = []
    for position, token in enumerate(ids):
        item = ScheduledRequest("text", [token], position, list(range(blocks)), True)
        runner.attention.prepare([item], loaded.model.device)
        hidden = loaded.model(torch.tensor([token]), torch.tensor([position]), runner.attention)
        rows.append(loaded.model.compute_logits(hidden))
    return torch.cat(rows).float()


def test_an_int8_kv_cache_agrees_with_the_models_own(fast: LoadedModel) -> None:
    """`--kv-cache-dtype int8` against the bfloat16 cache, teacher-forced on a longer text
    (116 tokens). Measured on a 2-core AMX Xeon: 96.6% top-1 agreement, the text's
    log-likelihood 0.24% apart (one prompt pass: 97.4%, 0.34%); an fp8 e4m3 cache, for
    comparison, 94% and 0.55% (and a scale-less e5m2 one 1.6%). With the decodes on
    AVX-512 VNNI's integer dots (queries rounded to int16; int8 queries moved it 0.8%):
    95.8% and 0.03%, where the float32 task gave 95.8% and 0.14% the same hour.
    Asked: 94% and 0.5%."""
    text = (
        TEXT + " The steam engine, improved by James Watt, powered factories, mines and "
        "locomotives. Cities grew quickly as workers moved from farms, and new problems of "
        "housing, sanitation and child labour followed. Reformers campaigned for laws that "
        "limited working hours and required schooling."
    )
    ids = fast.tokenizer.encode(text)
    ours = through_the_cache(fast, ids, torch.bfloat16)
    int8 = through_the_cache(fast, ids, torch.int8)
    agreement = (int8.argmax(-1) == ours.argmax(-1)).float().mean().item()
    target = torch.tensor(ids[1:])

    def likelihood(logits: torch.Tensor) -> float:
        return float(torch.log_softmax(logits[:-1], -1).gather(1, target[:, None]).sum())

    assert agreement >= 0.94
    assert abs(likelihood(int8) - likelihood(ours)) <= 0.005 * abs(likelihood(ours))
