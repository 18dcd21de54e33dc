"""Simulated traffic: when requests arrive, how long their prompts and answers are, and
which ones continue a conversation.

Arrivals are a Poisson process at ``rate`` (``bursty``: the same mean, in bursts of
``burst`` requests at once). A conversation of ``turns`` turns sends its next turn
``think_s`` seconds (exponential) after the previous answer, with the whole history as
its prompt. Every prompt may start with a ``shared_prefix`` of system-prompt tokens, the
same for everyone; ``tenants`` keys each get their own cache salt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from sendpath.bench.workload import LengthSpec

__all__ = ["SimRequest", "Traffic"]


@dataclass
class SimRequest:
    """One request of the simulation (a conversation's turns share ``session``)."""

    request_id: str
    arrival: float
    prompt: list[int]
    output_len: int
    session: int
    turn: int = 0
    tenant: int = 0
    followups: list[tuple[list[int], int]] = field(default_factory=list)  # later turns


@dataclass(frozen=True)
class Traffic:
    rate: float  # arrivals (first turns) per second
    num_requests: int  # requests in all, every turn counted
    input_len: LengthSpec = field(default_factory=lambda: LengthSpec(128, 128))
    output_len: LengthSpec = field(default_factory=lambda: LengthSpec(128, 128))
    pattern: str = "poisson"  # or "bursty"
    burst: int = 8
    shared_prefix: int = 0
    turns: int = 1
    think_s: float = 0.0
    tenants: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.num_requests < 1 or self.turns < 1 or self.tenants < 1:
            raise ValueError("rate > 0, requests >= 1, turns >= 1 and tenants >= 1, please")
        if self.pattern not in ("poisson", "bursty"):
            raise ValueError(f"pattern is 'poisson' or 'bursty', got {self.pattern!r}")

    def first_turns(self) -> list[SimRequest]:
        """The conversations' first requests, in arrival order, each carrying its later
        turns (question tokens and answer length) to send when it is answered."""
        rng = random.Random(self.seed)
        prefix = [rng.randrange(100, 30000) for _ in range(self.shared_prefix)]
        sessions = -(-self.num_requests // self.turns)
        out, t, left = [], 0.0, self.num_requests
        for s in range(sessions):
            if self.pattern == "poisson":
                t += rng.expovariate(self.rate)
            elif s % self.burst == 0:
                t += rng.expovariate(self.rate / self.burst)
            turns = min(self.turns, left)
            left -= turns
            ask = [
                ([rng.randrange(100, 30000) for _ in range(self.input_len.sample(rng))],
                 self.output_len.sample(rng))
                for _ in range(turns)
            ]  # fmt: skip
            first, out_len = ask[0]
            out.append(
                SimRequest(f"s{s}-0", t, prefix + first, out_len, s, 0, s % self.tenants, ask[1:])
            )
        return out
