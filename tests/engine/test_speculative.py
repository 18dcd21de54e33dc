"""Speculative decoding (n-gram prompt lookup): the proposer, the acceptance rule, and the
engine with it on: greedy output token for token as without it, KV blocks all returned,
sampled output distributed as without it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sendpath.config import SchedulerConfig
from sendpath.engine.core import EngineCore, Runner
from sendpath.engine.scheduler import RunnerOutput, SchedulerOutput
from sendpath.engine.speculative import NgramIndex, accept, can_speculate
from sendpath.llm import LLM
from sendpath.model.loader import LoadedModel
from sendpath.model.sampler import make_generator, sample
from sendpath.model.tokenizer import Tokenizer
from sendpath.request import Request, SamplingParams
from sendpath.runner.fake_runner import FakeRunner
from sendpath.runner.model_runner import ModelRunner
from sendpath.speculative_config import SpeculativeConfig
from tests.engine.test_engine_property import (
    BLOCK,
    Arrival,
    arrivals,
    assert_no_leaks,
    drive,
    make_core,
)

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


def spec_core(
    runner: Runner,
    tokenizer: Tokenizer,
    config: SchedulerConfig,
    blocks: int,
    speculative: SpeculativeConfig | None = NGRAM,
) -> EngineCore:
    return make_core(runner, tokenizer, config, blocks, speculative=speculative)


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # "6 7" ended at 2 and at 6; the latest is followed by 9, 2, 6
    assert index.propose(tokens, 3) == [9, 2, 6]
    tokens += [9, 2]  # now "7 9 2" matches at 6..8, followed by 6, 7, 9
    assert index.propose(tokens, 4) == [6, 7, 9, 2]
    assert NgramIndex(2, 3).propose([1, 2, 3, 4], 3) == []  # "3 4" never came before
    assert index.propose([*tokens, 42], 2) == []  # nor did 42


def test_accept_keeps_drafts_up_to_the_first_the_model_did_not_produce() -> None:
    assert accept([4, 5, 6], [4, 5, 6, 7]) == ([4, 5, 6], 7)
    assert accept([4, 5, 6], [4, 9, 6, 7]) == ([4], 9)
    assert accept([4, 5, 6], [1, 5, 6, 7]) == ([], 1)


def test_requests_whose_sampling_reads_their_history_do_not_speculate() -> None:
    assert can_speculate(SamplingParams(temperature=0.0), 0)
    assert can_speculate(SamplingParams(temperature=0.7, top_p=0.9), 3)
    assert not can_speculate(SamplingParams(presence_penalty=0.5), 3)
    assert not can_speculate(SamplingParams(repetition_penalty=1.2), 3)
    assert not can_speculate(SamplingParams(logprobs=2), 3)
    assert not can_speculate(SamplingParams(min_tokens=5, max_tokens=9), 3)
    assert can_speculate(SamplingParams(min_tokens=5, max_tokens=9), 5)


def test_config_is_checked_as_vllm_names_it() -> None:
    parsed = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}'
    )
    assert parsed == SpeculativeConfig("ngram", 5, 4, 2)
    for bad, says in [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"num_speculative_token": 3}', "unknown key(s) num_speculative_token"),
        ('{"method": "eagle"}', "'eagle' is not available"),
        ('{"num_speculative_tokens": 0}', "1 to 16"),
        ('{"num_speculative_tokens": "3"}', "must be an integer"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "min <= max"),
    ]:
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
            SpeculativeConfig.parse(bad)


class Oracle:
    """Drafts from a run without speculation: the true continuation, with every third
    proposal's second draft wrong, so steps keep all, some and none of their drafts."""

    def __init__(self, reference: dict[str, list[int]], k: int = 4) -> None:
        self.reference, self.k, self.calls = reference, k, 0

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        out = {}
        for request, k in wanted:
            done = len(request.output_token_ids)
            drafts = list(self.reference.get(request.request_id, [])[done : done + min(k, self.k)])
            self.calls += 1
            if self.calls % 3 == 0 and len(drafts) > 1:
                drafts[1] = (drafts[1] + 1) % 1000
            out[request.request_id] = drafts
        return out

    def remove(self, request_id: str) -> None:
        pass


def with_oracle(core: EngineCore, reference: dict[str, list[int]]) -> EngineCore:
    assert core.speculator is not None
    core.speculator.proposer = Oracle(reference)
    return core


PROMPTS = [[7, 8, 9, 7, 8], [3000 + i % 5 for i in range(23)], list(range(100, 140))]


def test_tiny_model_greedy_with_drafts_equals_without(tiny: LoadedModel) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs: dict[bool, dict[str, list[int]]] = {}
    for speculate in (False, True):
        core = spec_core(
            ModelRunner(tiny, 64, BLOCK),
            tiny.tokenizer,
            SchedulerConfig(),
            64,
            NGRAM if speculate else None,
        )
        if speculate:
            with_oracle(core, outputs[False])
        requests = [core.add_request(p, params, f"r{i}") for i, p in enumerate(PROMPTS)]
        while core.has_unfinished_requests():
            core.step()
        outputs[speculate] = {r.request_id: r.output_token_ids for r in requests}
        assert_no_leaks(core, 64)
        if speculate:
            assert core.speculator is not None
            stats = core.speculator.stats
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
            assert sum(r.num_accepted_tokens for r in requests) == stats.num_accepted_tokens
            assert sum(r.num_draft_tokens for r in requests) == stats.num_draft_tokens
            assert stats.accepted_per_pos[0] >= stats.accepted_per_pos[-1] > 0
            # fewer steps than tokens: kept drafts came out of the same forward passes
            assert len(core.steps.since(0)) < 40 // 2
    assert outputs[True] == outputs[False]


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    plan=arrivals,
    config=st.builds(
        SchedulerConfig,
        max_num_seqs=st.integers(1, 6),
        max_num_batched_tokens=st.integers(1, 24),
        policy=st.sampled_from(["fcfs", "priority"]),
    ),
    blocks=st.integers(10, 16),
)
def test_tiny_model_with_drafts_preempted_and_aborted_equals_without(
    tiny: LoadedModel, plan: list[Arrival], config: SchedulerConfig, blocks: int
) -> None:
    """Batches, chunked prefill, shared cached prefixes, preemption in a tiny cache,
    aborts, budgets too small for every draft: with drafts the same tokens as without,
    and no block kept."""
    plan = [Arrival(a.step, a.prefix, a.suffix, a.max_tokens + 6, a.abort_after) for a in plan]
    without = drive(
        spec_core(ModelRunner(tiny, blocks, BLOCK), tiny.tokenizer, config, blocks, None), plan
    )
    # the oracle knows each request's answer alone; aborted ones get no drafts
    speculative = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=6)
    core = spec_core(ModelRunner(tiny, blocks, BLOCK), tiny.tokenizer, config, blocks, speculative)
    got = drive(with_oracle(core, without), plan)
    assert_no_leaks(core, blocks)
    for rid in got.keys() & without.keys():
        assert got[rid] == without[rid], rid


def test_tiny_model_with_drafts_under_preemption_equals_without(tiny: LoadedModel) -> None:
    """Four requests in a cache too small for all of them: requests are preempted and
    recomputed, from cached prefixes where they still are, while others verify drafts;
    every answer is the one a roomy cache gives without speculation, and every block
    comes back."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [[500 + i, 7, 8, 9, 10, 11] * 2 for i in range(4)]
    roomy = spec_core(ModelRunner(tiny, 64, BLOCK), tiny.tokenizer, SchedulerConfig(), 64, None)
    want = {f"r{i}": roomy.add_request(p, params, f"r{i}") for i, p in enumerate(prompts)}
    while roomy.has_unfinished_requests():
        roomy.step()
    blocks = 24  # 4 x (12 + 30) tokens need 44 blocks of 4
    speculative = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=8)
    core = spec_core(
        ModelRunner(tiny, blocks, BLOCK), tiny.tokenizer, SchedulerConfig(), blocks, speculative
    )
    with_oracle(core, {rid: r.output_token_ids for rid, r in want.items()})
    got = [core.add_request(p, params, f"r{i}") for i, p in enumerate(prompts)]
    while core.has_unfinished_requests():
        core.step()
    assert core.stats().num_preemptions > 0
    assert core.speculator is not None and core.speculator.stats.num_accepted_tokens > 0
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want.values()]
    assert_no_leaks(core, blocks)


def test_builtin_model_quoting_prompt_greedy_with_ngram_equals_without(
    builtin_llm: LLM,
) -> None:
    """The built-in model repeating a pasted text: prompt lookup's drafts are mostly
    kept, and the answer is the one without speculation, token for token."""
    text = (
        "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, "
        "and the clocks were striking thirteen. Call me Ishmael."
    )
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = builtin_llm.chat(messages, params)[0].outputs[0]
    fast = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    spec = fast.chat(messages, params)[0].outputs[0]
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert fast.engine.speculator is not None
    stats = fast.engine.speculator.stats
    assert stats.num_accepted_tokens >= len(plain.token_ids) // 3, stats
    pool = fast.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


class Periodic(FakeRunner):
    """Says 1, 2, 3, 1, 2, 3, ...: prompt lookup's drafts hit. ``fail_batches``: a step of
    more than one request raises (the engine then runs each request alone)."""

    def __init__(self, fail_batches: bool = False) -> None:
        super().__init__(5000)
        self.fail_batches = fail_batches

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        if self.fail_batches and len(plan.requests) > 1:
            raise RuntimeError("this batch cannot be computed")
        self.executed.append(plan)
        out = RunnerOutput()
        for item in (i for i in plan.requests if i.sample):
            rows = range(item.start_pos + item.num_tokens - 1 - item.num_drafts,
                         item.start_pos + item.num_tokens)  # fmt: skip
            said = [(pos + 1) % 3 + 1 for pos in rows]
            drafts = item.token_ids[item.num_tokens - item.num_drafts :]
            kept, out.sampled[item.request_id] = accept(drafts, said)
            if item.num_drafts:
                out.accepted[item.request_id] = kept
        return out


PERIODIC = [1, 2, 3, 1, 2, 3, 1, 2]


def test_fake_engine_with_drafts_finishes_at_max_tokens(smol_tokenizer: Tokenizer) -> None:
    """A request ends at its max_tokens even where a step kept several tokens."""
    core = spec_core(Periodic(), smol_tokenizer, SchedulerConfig(), 32)
    params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    request = core.add_request(PERIODIC, params)
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()
    assert len(request.output_token_ids) == 11
    assert sum(len(o.new_token_ids) for o in outputs) == 11
    assert outputs[-1].num_output_tokens == 11 and str(outputs[-1].finish_reason) == "length"
    assert any(len(o.new_token_ids) > 2 for o in outputs)
    assert_no_leaks(core, 32)


def test_a_stop_inside_kept_drafts_ends_there_and_counts_only_what_was_kept(
    smol_tokenizer: Tokenizer,
) -> None:
    core = spec_core(Periodic(), smol_tokenizer, SchedulerConfig(), 32)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[1])
    request = core.add_request([*PERIODIC, 3, 1, 2, 3], params)  # says 1 first: stops
    stopper = core.add_request(PERIODIC, params)  # says 3, then drafts 1, 2, 3, 1: 3 and 1
    while core.has_unfinished_requests():
        core.step()
    assert request.output_token_ids == [1]
    assert stopper.output_token_ids == [3, 1]
    assert stopper.num_accepted_tokens == 1 and stopper.num_draft_tokens >= 1
    assert_no_leaks(core, 32)


def test_a_failed_batch_run_again_alone_keeps_its_drafts(smol_tokenizer: Tokenizer) -> None:
    """The engine reruns a failing batch a request at a time: each keeps the drafts its
    own run kept, and the tokens are those of a run that never failed."""
    params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    got = {}
    for fail in (False, True):
        core = spec_core(Periodic(fail), smol_tokenizer, SchedulerConfig(), 32)
        requests = [core.add_request(p, params) for p in (PERIODIC, [*PERIODIC, 3])]
        while core.has_unfinished_requests():
            core.step()
        got[fail] = [r.output_token_ids for r in requests]
        assert core.speculator is not None and core.speculator.stats.num_accepted_tokens > 0
        assert_no_leaks(core, 32)
    assert (
        got[True]
        == got[False]
        == [[3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]]
    )


def test_drafts_never_preempt_anyone(smol_tokenizer: Tokenizer) -> None:
    """In a cache with no room for the drafts' slots, a decode goes without them instead
    of preempting (itself or another): no more preemptions than without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    preemptions = {}
    for speculative in (None, NGRAM):
        core = spec_core(Periodic(), smol_tokenizer, SchedulerConfig(), 6, speculative)
        requests = [core.add_request(p, params) for p in (PERIODIC[:4], PERIODIC[:5])]
        while core.has_unfinished_requests():
            core.step()
        preemptions[speculative is not None] = core.stats().num_preemptions
        assert all(len(r.output_token_ids) == 14 for r in requests)
        assert_no_leaks(core, 6)
    assert preemptions[True] <= preemptions[False]


def test_seeded_sampled_requests_decode_without_drafts() -> None:
    assert not can_speculate(SamplingParams(temperature=0.7, seed=1), 3)
    assert can_speculate(SamplingParams(temperature=0.0, seed=1), 3)  # greedy: no draws


def test_sampled_rows_verified_keep_the_models_distribution() -> None:
    """Rejection sampling with a one-token-for-sure draft: each output token is drawn as
    without speculation. Fixed logits over 4 tokens, a draft of two tokens; 20,000 seeded
    trials: the first token follows row 0's distribution, the second (where the first
    draft was kept) row 1's."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.4], [0.1, 0.9, 0.3, -1.0], [0.0, 0.0, 2.0, 0.0]])
    want = [logits[0].softmax(-1), logits[1].softmax(-1)]
    drafts = [3, 1]  # row 0 is likeliest to say 0: the draft 3 is kept about 1/5 of the time
    params = SamplingParams(temperature=1.0)
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    trials = 20_000
    for seed in range(trials):
        generator = make_generator(seed, torch.device("cpu"))
        rows = sample(logits.clone(), [params] * 3, [generator] * 3)
        kept, token = accept(drafts, [r.token for r in rows])  # type: ignore[misc]
        tokens = [*kept, token]
        first[tokens[0]] += 1
        if kept:
            second[tokens[1]] += 1
    for counts, p in ((first, want[0]), (second, want[1])):
        n = sum(counts.values())
        chi2 = sum((counts[t] - n * float(p[t])) ** 2 / (n * float(p[t])) for t in range(4))
        assert chi2 < 27.9, (counts, p)  # 3 degrees of freedom: p = 4e-6
    assert 0.15 < first[3] / trials < 0.25
