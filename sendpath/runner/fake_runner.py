"""A runner without a model: deterministic tokens, no torch. For scheduler and engine tests.

The next token depends only on the last token and its position, so it is the same whether a
request runs alone, in a batch, or is recomputed after a preemption.
"""

from __future__ import annotations

from sendpath.engine.scheduler import RunnerOutput, SchedulerOutput
from sendpath.engine.speculative import accept
from sendpath.request import Request

__all__ = ["FakeRunner", "fake_next_token"]


def fake_next_token(last_token: int, position: int, vocab_size: int) -> int:
    """The token a fake model emits after ``last_token`` at ``position``."""
    return (last_token * 31 + position * 7 + 3) % vocab_size


class FakeRunner:
    """Implements the runner interface; records every plan it executed."""

    def __init__(self, vocab_size: int = 1000) -> None:
        self.vocab_size = vocab_size
        self.executed: list[SchedulerOutput] = []

    def add_request(self, request: Request) -> None:
        pass

    def remove_request(self, request_id: str) -> None:
        pass

    def probe(self) -> None:
        """The device check: a fake one always computes."""

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        self.executed.append(plan)
        out = RunnerOutput()
        for item in plan.requests:
            if item.num_drafts:  # every row's token, then the drafts kept
                first = item.num_tokens - 1 - item.num_drafts
                tokens = [
                    fake_next_token(item.token_ids[i], item.start_pos + i, self.vocab_size)
                    for i in range(first, item.num_tokens)
                ]
                kept, out.sampled[item.request_id] = accept(item.token_ids[first + 1 :], tokens)
                out.accepted[item.request_id] = kept
            elif item.sample:
                position = item.start_pos + item.num_tokens - 1
                out.sampled[item.request_id] = fake_next_token(
                    item.token_ids[-1], position, self.vocab_size
                )
        return out
