"""Property tests: random arrivals, prompt lengths, shared prefixes, aborts, tiny KV caches.

Whatever the mix: every request finishes or is aborted, no KV block leaks, and each
finished request's output is what it would be running alone (batching invariance).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sendpath.clock import VirtualClock
from sendpath.config import SchedulerConfig
from sendpath.engine.core import EngineCore, Runner
from sendpath.engine.outputs import OutputStream
from sendpath.errors import PromptTooLongError
from sendpath.kvcache.manager import KVCacheManager
from sendpath.model.loader import LoadedModel, load_model
from sendpath.model.tokenizer import Tokenizer
from sendpath.request import SamplingParams
from sendpath.runner.fake_runner import FakeRunner
from sendpath.runner.model_runner import ModelRunner
from sendpath.runner.sequence_runner import SequenceRunner
from sendpath.speculative_config import SpeculativeConfig

PREFIXES = [list(range(1000, 1012)), list(range(2000, 2009)), []]
BLOCK = 4


@dataclass
class Arrival:
    step: int
    prefix: int
    suffix: list[int]
    max_tokens: int
    abort_after: int | None  # abort this many steps after arrival (None: never)

    @property
    def prompt(self) -> list[int]:
        return PREFIXES[self.prefix] + self.suffix

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)


arrivals = st.lists(
    st.builds(
        Arrival,
        step=st.integers(0, 12),
        prefix=st.integers(0, len(PREFIXES) - 1),
        suffix=st.lists(st.integers(3000, 3050), min_size=1, max_size=14),
        max_tokens=st.integers(1, 8),
        abort_after=st.one_of(st.none(), st.integers(0, 6)),
    ),
    min_size=1,
    max_size=10,
)
schedulers = st.builds(
    SchedulerConfig,
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 24),
    policy=st.sampled_from(["fcfs", "priority"]),
)


def drive(core: EngineCore, plan: list[Arrival]) -> dict[str, list[int]]:
    """Run arrivals and aborts step by step; return each finished request's tokens."""
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    aborted: set[str] = set()
    rejected: set[str] = set()
    pending = sorted(enumerate(plan), key=lambda p: p[1].step)
    aborts: dict[int, list[str]] = {}
    step = 0
    while pending or core.has_unfinished_requests():
        while pending and pending[0][1].step <= step:
            i, a = pending.pop(0)
            try:
                core.add_request(a.prompt, a.params, request_id=f"r{i}", priority=i % 3)
            except PromptTooLongError:
                assert len(a.prompt) >= core.max_model_len
                rejected.add(f"r{i}")
                continue
            if a.abort_after is not None:
                aborts.setdefault(step + a.abort_after, []).append(f"r{i}")
        for rid in aborts.pop(step, []):
            if core.abort(rid) is not None:
                aborted.add(rid)
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
        step += 1
        assert step < 2000, "the engine made no progress"
    assert finished | aborted | rejected == {f"r{i}" for i in range(len(plan))}
    assert not finished & aborted
    return {rid: tokens[rid] for rid in finished}


def make_core(
    runner: Runner,
    tokenizer: Tokenizer,
    config: SchedulerConfig,
    blocks: int,
    max_model_len: int | None = None,
    speculative: SpeculativeConfig | None = None,
) -> EngineCore:
    """An engine over ``blocks`` KV blocks; max_model_len defaults to all of them."""
    kv = KVCacheManager(blocks, block_size=BLOCK)
    max_len = max_model_len or blocks * BLOCK
    core = EngineCore(runner, tokenizer, kv, config, max_len, VirtualClock())
    core.speculate(speculative)
    return core


def assert_no_leaks(core: EngineCore, blocks: int) -> None:
    pool = core.scheduler.kv.pool
    assert pool.num_free_blocks == blocks
    assert all(pool.ref_cnt(b) == 0 for b in range(pool.num_blocks))


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(plan=arrivals, config=schedulers, blocks=st.integers(6, 14))
def test_fake_engine_finishes_everything_without_leaks(
    smol_tokenizer: Tokenizer, plan: list[Arrival], config: SchedulerConfig, blocks: int
) -> None:
    core = make_core(FakeRunner(5000), smol_tokenizer, config, blocks)
    got = drive(core, plan)
    assert_no_leaks(core, blocks)
    for rid, tokens in got.items():
        a = plan[int(rid[1:])]
        alone = make_core(FakeRunner(5000), smol_tokenizer, SchedulerConfig(), 64, blocks * BLOCK)
        assert tokens == drive(alone, [Arrival(0, a.prefix, a.suffix, a.max_tokens, None)])["r0"]


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(tiny_llama_dir, dtype="float32")


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(plan=arrivals, config=schedulers, blocks=st.integers(10, 16))
def test_tiny_model_batched_greedy_equals_alone(
    tiny_model: LoadedModel, plan: list[Arrival], config: SchedulerConfig, blocks: int
) -> None:
    core = make_core(ModelRunner(tiny_model, blocks, BLOCK), tiny_model.tokenizer, config, blocks)
    got = drive(core, plan)
    assert_no_leaks(core, blocks)
    reference = SequenceRunner(tiny_model)
    for rid, tokens in got.items():
        a = plan[int(rid[1:])]
        stream = OutputStream(tiny_model.tokenizer, a.params, len(a.prompt), blocks * BLOCK)
        alone = [t.token_id for t in reference.generate(a.prompt, a.params, stream)]
        assert tokens == alone, (rid, a)
