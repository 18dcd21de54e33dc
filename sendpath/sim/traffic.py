"""Simulated traffic: when requests arrive, how long their prompts and answers are, and
which ones continue a conversation.

Arrivals are a Poisson process at ``rate`` (``bursty``: the same mean, in bursts of
``burst`` requests at once; ``diurnal``: the same mean, rising and falling over a day of
``period_s`` seconds between a night trough and a midday peak ``peak_ratio`` times
higher, drawn by thinning a Poisson process at the peak rate). A conversation of
``turns`` turns sends its next turn ``think_s`` seconds (exponential) after the previous
answer, with the whole history as its prompt. Every prompt may start with a
``shared_prefix`` of system-prompt tokens, the same for everyone; ``tenants`` keys each
get their own cache salt. A prompt's token ids are random: its first ``HEAD`` drawn for
it, the rest a slice of one long random text at a random place.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from sendpath.bench.workload import LengthSpec

__all__ = ["PATTERNS", "SimRequest", "Traffic"]

PATTERNS = ("poisson", "bursty", "diurnal")
VOCAB = (100, 30000)  # prompt token ids are drawn from this range
HEAD = 16  # a prompt's first tokens are its own
MATERIAL = 1 << 16  # tokens of the one random text the rest of a prompt comes from


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
    # text chunks the output filter holds the first one for, where known (a replay of
    # measured requests); None: drawn from ``SimConfig.first_token_hold``
    held: int | None = None

    def next_turn(self, answer: list[int], arrival: float) -> SimRequest:
        """The conversation's next request: everything so far, the answer, the next
        question (``followups`` must not be empty)."""
        question, out_len = self.followups[0]
        prompt = self.prompt + answer + question
        return SimRequest(f"s{self.session}-{self.turn + 1}", arrival, prompt, out_len,
                          self.session, self.turn + 1, self.tenant, self.followups[1:])  # fmt: skip


@dataclass(frozen=True)
class Traffic:
    rate: float  # arrivals (first turns) per second
    num_requests: int  # requests in all, every turn counted
    input_len: LengthSpec = field(default_factory=lambda: LengthSpec(128, 128))
    output_len: LengthSpec = field(default_factory=lambda: LengthSpec(128, 128))
    pattern: str = "poisson"  # or "bursty", "diurnal"
    burst: int = 8
    period_s: float = 86_400.0  # diurnal: one day
    peak_ratio: float = 4.0  # diurnal: busiest rate / quietest rate
    shared_prefix: int = 0
    turns: int = 1
    think_s: float = 0.0
    tenants: int = 1
    seed: int = 0
    # a closed loop instead of arrivals at ``rate``: this many clients, each sending its next
    # request as its answer ends (`vllm bench serve --max-concurrency`, every request ready)
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.num_requests < 1 or self.turns < 1 or self.tenants < 1:
            raise ValueError("rate > 0, requests >= 1, turns >= 1 and tenants >= 1, please")
        if self.concurrency is not None and (self.concurrency < 1 or self.turns != 1):
            raise ValueError("a closed loop (concurrency) has >= 1 clients and one-turn requests")
        if self.pattern not in PATTERNS:
            raise ValueError(f"pattern is one of {', '.join(PATTERNS)}; got {self.pattern!r}")
        if self.period_s <= 0 or self.peak_ratio < 1:
            raise ValueError("period_s > 0 and peak_ratio >= 1, please")

    @property
    def longest_request(self) -> int:
        """The most tokens one request holds at its end: the shared prefix, then each
        turn's question and answer at their longest (a turn resends the history)."""
        turn = self.input_len.high + self.output_len.high
        return self.shared_prefix + self.turns * turn

    def rate_at(self, t: float) -> float:
        """The arrival rate at ``t`` seconds (constant unless diurnal; t = 0 is the trough)."""
        if self.pattern != "diurnal":
            return self.rate
        swing = (self.peak_ratio - 1) / (self.peak_ratio + 1)
        return self.rate * (1 - swing * math.cos(2 * math.pi * t / self.period_s))

    def _next_arrival(self, t: float, s: int, rng: random.Random) -> float:
        if self.pattern == "poisson":
            return t + rng.expovariate(self.rate)
        if self.pattern == "bursty":
            return t + rng.expovariate(self.rate / self.burst) if s % self.burst == 0 else t
        peak = self.rate * 2 * self.peak_ratio / (self.peak_ratio + 1)
        while True:  # thinning: candidates at the peak rate, kept with rate(t) / peak
            t += rng.expovariate(peak)
            if rng.random() * peak <= self.rate_at(t):
                return t

    def first_turns(self) -> list[SimRequest]:
        """The conversations' first requests, in arrival order, each carrying its later
        turns (question tokens and answer length) to send when it is answered."""
        return list(self.arrivals())

    def arrivals(self) -> Iterator[SimRequest]:
        """``first_turns``, made one at a time (a million prompts never sit in memory)."""
        rng = random.Random(self.seed)
        ids = np.random.default_rng(self.seed)  # token ids: random, and drawn in bulk
        # each id's int object made once: a prompt's list then shares them (a million
        # prompts' tokens would otherwise each be an int of its own, made and freed)
        table = np.array(range(VOCAB[0], VOCAB[1]), dtype=object)
        pool: list[int] = []
        at = 0

        def fresh(n: int) -> list[int]:
            nonlocal pool, at
            if at + n > len(pool):  # drawn 64k at a time: a prompt is then one slice
                drawn = ids.integers(VOCAB[0], VOCAB[1], max(n, MATERIAL))
                pool = table[drawn - VOCAB[0]].tolist()
                at = 0
            at += n
            return pool[at - n : at]

        # a prompt is HEAD fresh tokens, then a slice of one random text at a random
        # place: its first block is then like no other prompt's (so are its block hashes
        # and its path in a router's prefix tree), and drawing it costs a slice, not a
        # random draw per token
        material, where = fresh(MATERIAL), random.Random(self.seed + 1)

        def tokens(n: int) -> list[int]:
            body = n - HEAD
            if body <= 0 or body > MATERIAL:
                return fresh(n)
            out = fresh(HEAD)
            start = where.randrange(MATERIAL - body + 1)
            out += material[start : start + body]
            return out

        prefix = tokens(self.shared_prefix)
        sessions = -(-self.num_requests // self.turns)
        t, left = 0.0, self.num_requests
        for s in range(sessions):
            t = self._next_arrival(t, s, rng)
            turns = min(self.turns, left)
            left -= turns
            ask = [(tokens(self.input_len.sample(rng)), self.output_len.sample(rng))
                   for _ in range(turns)]  # fmt: skip
            first, out_len = ask[0]
            yield SimRequest(f"s{s}-0", t, prefix + first, out_len, s, 0, s % self.tenants, ask[1:])
