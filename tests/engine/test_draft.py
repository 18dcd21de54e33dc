"""Speculative decoding with a draft model (``engine/draft.py``) on tiny random models:
greedy output token for token as without it, whether the draft agrees with the model
(the model itself as its draft: nearly every draft kept) or not (another random model);
preemption in a small cache; every block of both caches returned; a truncated self-draft
through ``--speculative-config``'s keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sendpath.config import CacheConfig, EngineConfig, SchedulerConfig
from sendpath.engine.core import EngineCore
from sendpath.engine.draft import DraftProposer
from sendpath.engine.scheduler import RunnerOutput, SchedulerOutput
from sendpath.errors import InvalidRequestError, ModelLoadError
from sendpath.model.loader import LoadedModel, load_model
from sendpath.model.tokenizer import Tokenizer
from sendpath.request import Request, SamplingParams
from sendpath.runner.model_runner import ModelRunner
from sendpath.speculative_config import SpeculativeConfig
from tests.conftest import write_tiny_llama
from tests.engine.test_engine_property import BLOCK, assert_no_leaks, make_core

DRAFT = SpeculativeConfig("draft_model", 4, model="draft", disable_by_batch_size=8)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[7, 8, 9, 7, 8], [3000 + i % 5 for i in range(23)], list(range(100, 140)), [42]]


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory, smol_tokenizer: Tokenizer) -> LoadedModel:
    """Another random model of the same shape and vocabulary: a draft that rarely agrees."""
    path = write_tiny_llama(tmp_path_factory.mktemp("other-llama"), smol_tokenizer, seed=7)
    return load_model(path, dtype="float32")


def answers(
    target: LoadedModel, blocks: int, draft: LoadedModel | None
) -> tuple[list[list[int]], EngineCore]:
    speculative = DRAFT if draft is not None else None
    core = make_core(
        ModelRunner(target, blocks, BLOCK), target.tokenizer, SchedulerConfig(), blocks,
        speculative=speculative,
    )  # fmt: skip
    if draft is not None:
        assert core.speculator is not None
        core.speculator.proposer = DraftProposer(draft, blocks, BLOCK)
    requests = [core.add_request(p, PARAMS) for p in PROMPTS]
    while core.has_unfinished_requests():
        core.step()
    assert_no_leaks(core, blocks)
    return [r.output_token_ids for r in requests], core


def draft_pool_is_free(core: EngineCore) -> bool:
    assert core.speculator is not None and isinstance(core.speculator.proposer, DraftProposer)
    pool = core.speculator.proposer.kv.pool
    return pool.num_free_blocks == pool.num_blocks and all(
        pool.ref_cnt(b) == 0 for b in range(pool.num_blocks)
    )


def test_the_model_as_its_own_draft_keeps_nearly_every_draft(tiny: LoadedModel) -> None:
    want, _ = answers(tiny, 64, None)
    got, core = answers(tiny, 64, tiny)
    assert got == want
    assert core.speculator is not None
    stats = core.speculator.stats
    assert stats.num_draft_tokens > 40
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
    assert draft_pool_is_free(core)


def test_a_draft_that_disagrees_changes_nothing_but_speed(
    tiny: LoadedModel, other: LoadedModel
) -> None:
    want, _ = answers(tiny, 64, None)
    got, core = answers(tiny, 64, other)
    assert got == want
    assert core.speculator is not None
    stats = core.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert draft_pool_is_free(core)


def test_drafts_under_preemption_and_a_full_draft_cache(tiny: LoadedModel) -> None:
    """A target cache that cannot hold all four (preemptions) and a draft cache of the
    same size: the answers of a roomy cache without drafts, every block back."""
    want, _ = answers(tiny, 64, None)
    got, core = answers(tiny, 18, tiny)  # 72 tokens: the longest answer fits alone
    assert got == want
    assert core.stats().num_preemptions > 0
    assert core.speculator is not None and core.speculator.stats.num_accepted_tokens > 0
    assert draft_pool_is_free(core)


def test_a_truncated_self_draft_from_the_config(tiny_llama_dir: Path) -> None:
    speculative = SpeculativeConfig.parse(
        {"model": str(tiny_llama_dir), "num_speculative_tokens": 3, "draft_layers": 1}
    )
    assert speculative.method == "draft_model"
    config = EngineConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        max_model_len=256,
        cache=CacheConfig(num_blocks=64, block_size=BLOCK),
        speculative=speculative,
    )
    core = EngineCore.from_config(config)
    assert core.speculator is not None
    proposer = core.speculator.proposer
    assert isinstance(proposer, DraftProposer) and proposer.loaded.config.num_layers == 1
    assert core.loaded is not None and core.loaded.config.num_layers > 1
    request = core.add_request([7, 8, 9, 7, 8], PARAMS)
    while core.has_unfinished_requests():
        core.step()
    assert len(request.output_token_ids) == 24 and request.num_draft_tokens > 0
    assert draft_pool_is_free(core)


def test_draft_config_errors_name_the_key() -> None:
    for bad, says in [
        ({"method": "draft_model"}, 'takes the draft\'s path in "model"'),
        ({"method": "ngram", "model": "x.gguf"}, '"model" goes with that method only'),
        ({"draft_layers": 2}, "goes with a draft model only"),
        ({"model": 3}, "model must be a string"),
    ]:
        with pytest.raises(ValueError, match=says):
            SpeculativeConfig.parse(bad)  # type: ignore[arg-type]


def test_a_long_prompt_is_caught_up_a_chunk_a_step(tiny: LoadedModel) -> None:
    """A draft proposal computes at most its budget: the 40-token prompt is drafted for
    once the draft model has seen it, 16 tokens a step; the answers do not change."""
    want, _ = answers(tiny, 64, None)
    core = make_core(
        ModelRunner(tiny, 64, BLOCK), tiny.tokenizer, SchedulerConfig(), 64, speculative=DRAFT
    )
    assert core.speculator is not None
    proposer = core.speculator.proposer = DraftProposer(tiny, 64, BLOCK, max_tokens=16)
    seen: list[int] = []
    execute = proposer.runner.execute

    def counted(plan: SchedulerOutput) -> RunnerOutput:
        seen.append(sum(i.num_tokens for i in plan.requests))
        return execute(plan)

    proposer.runner.execute = counted  # type: ignore[method-assign]
    requests = [core.add_request(p, PARAMS) for p in PROMPTS]
    while core.has_unfinished_requests():
        core.step()
    assert [r.output_token_ids for r in requests] == want
    assert max(seen) <= 16 and requests[2].num_accepted_tokens > 0
    assert draft_pool_is_free(core)


def test_a_draft_that_fails_costs_only_its_drafts(tiny: LoadedModel) -> None:
    want, _ = answers(tiny, 64, None)
    core = make_core(
        ModelRunner(tiny, 64, BLOCK), tiny.tokenizer, SchedulerConfig(), 64, speculative=DRAFT
    )

    class Broken(DraftProposer):
        def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
            super().propose(wanted)
            raise RuntimeError("the draft's device went away")

    assert core.speculator is not None
    core.speculator.proposer = Broken(tiny, 64, BLOCK)
    requests = [core.add_request(p, PARAMS) for p in PROMPTS]
    while core.has_unfinished_requests():
        core.step()
    assert [r.output_token_ids for r in requests] == want
    assert core.speculator.stats.num_draft_tokens == 0
    assert draft_pool_is_free(core)


def test_a_draft_with_a_shorter_context_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    short = tmp_path / "short-draft"
    shutil.copytree(tiny_llama_dir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32}))
    engine = EngineConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        max_model_len=256,
        cache=CacheConfig(num_blocks=64, block_size=BLOCK),
        speculative=SpeculativeConfig.parse({"model": str(short)}),
    )
    with pytest.raises(InvalidRequestError, match="holds a context of 32 tokens, the model 256"):
        EngineCore.from_config(engine)


def test_a_missing_draft_says_it_is_the_draft(tiny_llama_dir: Path, tmp_path: Path) -> None:
    engine = EngineConfig(
        model=str(tiny_llama_dir),
        dtype="float32",
        max_model_len=256,
        cache=CacheConfig(num_blocks=64, block_size=BLOCK),
        speculative=SpeculativeConfig.parse({"model": str(tmp_path / "none.gguf")}),
    )
    with pytest.raises(ModelLoadError, match=r"the draft model \(speculative config\): Model path"):
        EngineCore.from_config(engine)
