"""Pick the next token of each row from its logits, each row with its own parameters and RNG.

Each row's logits are first adjusted by what its request asked for, in vLLM's order:
``min_tokens`` (its end tokens masked until enough were generated), ``logit_bias`` (added,
OpenAI's -100..100), the repetition penalty (a seen token's logit divided by it when
positive, multiplied when negative; over prompt and output, as vLLM and transformers do),
then the frequency and presence penalties (OpenAI's: minus ``frequency * count`` and
``presence`` for every token already in the output), then a grammar's mask where the
request has one (structured output: the tokens it disallows go to -inf). Greedy rows then
take the argmax.
Sampled rows apply temperature, then top-k, then top-p (the smallest set of tokens whose
probability reaches ``top_p``, as vLLM does), then min-p (tokens below ``min_p`` times the
likeliest one's probability), and draw with a ``torch.Generator`` that belongs to the
request, so a seeded request gives the same tokens whatever else shares its batch.

All of it is one batch, each row with its own values: temperature and top-k
(``filter_logits``), then every row's softmax, and the token where the row's running sum
of probability passes its own uniform draw (the inverse of its distribution). A row with
top-p partly sorts its likeliest tokens and draws among those it keeps; it sorts its
whole vocabulary only where they hold too little (``_nucleus_draws``). A request's
penalties read its ``TokenCounts``, kept up to date a token at a time. At 32 rows of a
49,152-token vocabulary: ``torch.multinomial`` row by row took 40 ms (an exponential per
token), a sort per row for top-p 150 ms, and penalties counted from a 2,000-token context
every step 15-20 ms; now a step's sampling takes 3-8 ms on the built-in model's logits,
with top-p too (up to 75 ms where every row is flat enough to need its whole sort).

``logprobs`` are the model's own (log-softmax of the raw logits, as vLLM reports them by
default), for the chosen token and the ``logprobs`` likeliest ones, all rows at once.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sendpath.request import SamplingParams, TokenLogprobs

__all__ = [
    "NUCLEUS_TRIES",
    "History",
    "Sampled",
    "TokenCounts",
    "filter_logits",
    "make_generator",
    "sample",
]


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A request's own RNG: seeded when asked, otherwise from fresh entropy."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else random.getrandbits(63))
    return gen


class TokenCounts:
    """What a request's penalties look at, kept from step to step: the distinct tokens of
    its prompt and output (``seen_ids``, the repetition penalty's), those of its output
    (``output_ids``) and how often each is there (``output_counts``, [vocab]; the
    frequency and presence penalties'), on the CPU whatever the logits' device. Each step
    adds only its new output tokens: built from the whole context every step, they took
    about 0.6 ms a row at 2,000 tokens."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self.prompt = prompt
        self._start(0)  # none counted yet: the first update counts the prompt

    def _start(self, vocab: int) -> None:
        self.vocab, self.counted = vocab, 0  # output tokens counted
        self._seen: set[int] = set()
        self._in_output: set[int] = set()
        self.seen_ids = self.output_ids = torch.zeros(0, dtype=torch.long)
        self.output_counts = torch.zeros(vocab, dtype=torch.int32)
        self.seen_ids = self._add(self._seen, self.seen_ids, self.prompt)

    def update(self, output: Sequence[int], vocab: int) -> TokenCounts:
        """Count ``output``'s tokens past those counted: a request's output only grows
        (all are counted again when it is shorter than those counted)."""
        if vocab != self.vocab or len(output) < self.counted:
            self._start(vocab)
        new = [t for t in output[self.counted :] if 0 <= t < vocab]
        if new:
            self.seen_ids = self._add(self._seen, self.seen_ids, new)
            self.output_ids = self._add(self._in_output, self.output_ids, new)
            ids = torch.tensor(new, dtype=torch.long)
            self.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self.counted = len(output)
        return self

    def _add(self, known: set[int], ids: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
        fresh = [t for t in dict.fromkeys(tokens) if t not in known and 0 <= t < self.vocab]
        known.update(fresh)
        return torch.cat([ids, torch.tensor(fresh, dtype=torch.long)]) if fresh else ids


@dataclass(frozen=True)
class History:
    """What a row's penalties and ``min_tokens`` look at: its request's tokens so far, and
    the ids that end it (EOS and the stop token ids). ``counts``: the request's own
    ``TokenCounts``, kept across its steps (without one, they are counted afresh)."""

    prompt: Sequence[int]
    output: Sequence[int]
    end_ids: Sequence[int] = ()
    counts: TokenCounts | None = None


@dataclass
class Sampled:
    """One row's result: the token (``None``: the row cannot be sampled) and, when asked
    for, its logprobs."""

    token: int | None
    logprobs: TokenLogprobs | None = None


def _adjust(logits: torch.Tensor, params: SamplingParams, history: History) -> None:
    """A row's logits [V] after min_tokens, logit_bias and the penalties, in place."""
    vocab = logits.shape[-1]
    if len(history.output) < params.min_tokens:
        ends = [t for t in history.end_ids if 0 <= t < vocab]
        if ends:
            logits[ends] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=ids.device)
        logits.index_add_(0, ids, bias)
    frequency, presence, rp = (
        params.frequency_penalty,
        params.presence_penalty,
        params.repetition_penalty,
    )
    if rp == 1.0 and not ((frequency or presence) and history.output):
        return
    counted = (history.counts or TokenCounts(history.prompt)).update(history.output, vocab)
    if rp != 1.0:
        seen = counted.seen_ids.to(logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / rp, picked * rp)
    if (frequency or presence) and history.output:
        counts = counted.output_counts[counted.output_ids].to(logits.device, logits.dtype)
        logits[counted.output_ids.to(logits.device)] -= frequency * counts + presence


# How many of a row's likeliest tokens top-p looks at first: a chat model's nucleus mostly
# lies in the first 256 (a partial sort of 32 rows in about 4 ms, where sorting them whole
# takes about 60); a row whose first ones hold less than ``top_p`` of its mass looks at
# 4,096, then at its whole vocabulary. Decoding the built-in model's answers at
# temperature 0.8, top_p 0.9: 73% of rows settled among 256, 25% among 4,096.
NUCLEUS_TRIES = (256, 4096)


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Those rows of ``logits`` (distinct, in order): the tensor itself when they are as
    many as its rows (no copy), else a copy of them."""
    return (
        logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=logits.device)]
    )


def _drop(logits: torch.Tensor, rows: list[int], sub: torch.Tensor, drop: torch.Tensor) -> None:
    """``sub`` (those rows of ``logits``, from ``_rows``) to -inf where ``drop``, in
    place, and written back to ``logits`` when it is a copy."""
    sub.masked_fill_(drop, float("-inf"))
    if sub is not logits:
        logits[torch.tensor(rows, device=logits.device)] = sub


def _top_k(logits: torch.Tensor, ks: Sequence[int | None]) -> None:
    """Each row's logits [R, V] below its ``top_k``-th largest to -inf, in place."""
    vocab = logits.shape[-1]
    rows = [i for i, k in enumerate(ks) if k is not None and 0 < k < vocab]
    if rows:
        k, sub = torch.tensor([ks[i] for i in rows], device=logits.device), _rows(logits, rows)
        kth = sub.topk(int(k.max())).values.gather(1, k[:, None] - 1)
        _drop(logits, rows, sub, sub < kth)


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Adjusted logits [R, V] -> each row's temperature-scaled logits with the tokens its
    top-k drops at -inf; all rows at once, in place (top-p and min-p: ``_draw``)."""
    dtype, device = logits.dtype, logits.device
    logits.div_(torch.tensor([p.temperature for p in params], dtype=dtype, device=device)[:, None])
    _top_k(logits, [p.top_k for p in params])
    return logits


def _uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform draw from each row's own generator (``None``: torch's global one)."""
    return torch.cat([torch.rand(1, generator=g, device=device) for g in generators])


def _draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int | None]:
    """One token per row of filtered logits [R, V]: where the row's running sum of
    probability passes its own uniform draw, among the tokens min-p keeps (at least
    ``min_p`` times the likeliest one's probability). Rows with top-p draw among their
    nucleus (``_nucleus_draws``). ``None`` for a row with nothing to draw (every logit
    -inf, or NaN). The running sums are torch's (float64 inside, float32 out)."""
    tokens: list[int | None] = [None] * logits.shape[0]
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        found = _nucleus_draws(
            _rows(logits, nucleus), [params[i] for i in nucleus], [generators[i] for i in nucleus]
        )
        for i, token in zip(nucleus, found, strict=True):
            tokens[i] = token
    whole = [i for i, p in enumerate(params) if p.top_p >= 1.0]
    if not whole:
        return tokens
    rows = _rows(logits, whole)
    min_p = torch.tensor([params[i].min_p for i in whole], dtype=rows.dtype, device=rows.device)
    if bool((min_p > 0).any()):
        peak = rows.max(-1, keepdim=True).values
        rows.masked_fill_(rows < peak + min_p[:, None].log(), float("-inf"))
    # torch's softmax: its own exp of -inf and of underflows is fast (exp_ takes 3-40x longer)
    found = _pick(rows.softmax(-1), [generators[i] for i in whole])
    for i, at in zip(whole, found, strict=True):
        tokens[i] = None if at is None else int(at)
    return tokens


def _pick(weights: torch.Tensor, generators: Sequence[torch.Generator | None]) -> list[int | None]:
    """Per row of weights [R, N] (probabilities, or any share of them; their running sums
    overwrite them): the position where its running sum passes its own uniform draw times
    its total; ``None`` where there is nothing to draw (a total of 0, or NaN)."""
    cdf = weights.cumsum_(-1)
    total = cdf[:, -1]
    draws = _uniforms(generators, weights.device) * total
    at = torch.searchsorted(cdf, draws[:, None], right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)
    ok = (torch.isfinite(total) & (total > 0)).tolist()
    return [int(a) if good else None for a, good in zip(at.tolist(), ok, strict=True)]


def _nucleus_draws(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int | None]:
    """A token per row of filtered logits [R, V] from its nucleus: a token stays while the
    likelier tokens hold less than ``top_p`` of the probability (the likeliest always
    stays), as vLLM's sort keeps them; min-p then keeps those at least ``min_p`` times the
    likeliest one's probability. Each row partly sorts its ``NUCLEUS_TRIES`` likeliest
    tokens first, and where they hold at least ``top_p`` it draws among them (the running
    sum taken likeliest first): no pass over its whole vocabulary but the softmax."""
    vocab, device = logits.shape[-1], logits.device
    probs = logits.softmax(-1)
    tokens: list[int | None] = [None] * logits.shape[0]
    pending = list(range(logits.shape[0]))
    for tries in (*NUCLEUS_TRIES, vocab):
        if not pending:
            break
        top = _rows(probs, pending).topk(min(tries, vocab))  # sorted, likeliest first
        p = torch.tensor([params[i].top_p for i in pending], device=device)[:, None]
        min_p = torch.tensor([params[i].min_p for i in pending], device=device)[:, None]
        mass = top.values.cumsum(-1)
        keep = (mass - top.values < p) & (top.values >= min_p * top.values[:, :1])
        keep[:, 0] = True
        # settled: its tokens past those looked at have at least their mass before them
        settled = ((mass[:, -1] >= p[:, 0]) | (tries >= vocab)).tolist()
        done = [row for row, s in enumerate(settled) if s]
        if done:
            found = _pick(top.values[done] * keep[done], [generators[pending[r]] for r in done])
            for row, at in zip(done, found, strict=True):
                tokens[pending[row]] = None if at is None else int(top.indices[row, at])
        pending = [i for i, s in zip(pending, settled, strict=True) if not s]
    return tokens


def _logprobs(
    raw: torch.Tensor, rows: list[int], tokens: list[int], ks: list[int]
) -> list[TokenLogprobs]:
    """For each of ``rows`` of the raw logits: the log-probability of its token and its
    ``k`` likeliest tokens', all rows at once."""
    logp = raw[rows].float().log_softmax(-1)
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    top = logp.topk(max(ks)) if max(ks) else None
    ids = top.indices.tolist() if top is not None else [[]] * len(rows)
    values = top.values.tolist() if top is not None else [[]] * len(rows)
    return [
        TokenLogprobs(c, list(zip(i[:k], v[:k], strict=True)))
        for c, i, v, k in zip(chosen, ids, values, ks, strict=True)
    ]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[History] | None = None,
    allowed: Sequence[torch.Tensor | None] | None = None,
) -> list[Sampled]:
    """logits [N, V] float32 -> one ``Sampled`` per row. ``allowed``: per row, None or a
    [V] bool mask of the tokens it may take (a grammar's, ``model/structured.py``)."""
    # each row's largest logit and its index, checked once; a row with a NaN: the NaN's
    # (NaN is the max), ties: the first (as argmax; max takes a third of argmax's time on
    # a 32-row step's logits here, where argmax was 6% of the step)
    top, best = logits.max(dim=-1)
    tokens: list[int | None] = best.tolist()
    nan_rows, dead = torch.isnan(top).tolist(), torch.isneginf(top).tolist()
    work = logits  # the logits as adjusted: a copy, made when the first row changes
    for i, p in enumerate(params):
        mask = allowed[i] if allowed is not None and not nan_rows[i] else None
        adjust = p.adjusts_logits and histories is not None and not nan_rows[i]
        if adjust or mask is not None:
            work = logits.clone() if work is logits else work
            if adjust and histories is not None:
                _adjust(work[i], p, histories[i])
            if mask is not None:
                work[i].masked_fill_(~mask, float("-inf"))
    if work is not logits:  # the greedy rows' choice from their adjusted logits
        top, best = work.max(dim=-1)
        dead = torch.isneginf(top).tolist()
        tokens = best.tolist()
    drawn = [i for i, p in enumerate(params) if not p.greedy and not nan_rows[i]]
    if drawn:
        rows = work if len(drawn) == len(params) and work is not logits else work[drawn]
        own = [params[i] for i in drawn]
        found = _draw(filter_logits(rows, own), own, [generators[i] for i in drawn])
        for i, token in zip(drawn, found, strict=True):
            tokens[i] = token
    out = [
        Sampled(None if nan_rows[i] or (p.greedy and dead[i]) else token)
        for i, (p, token) in enumerate(zip(params, tokens, strict=True))
    ]  # None: a NaN, or every token masked out (a bias of -inf cannot be asked for)
    asked = {
        i: (s.token, p.logprobs)
        for i, (p, s) in enumerate(zip(params, out, strict=True))
        if s.token is not None and p.logprobs is not None
    }
    if asked:
        chosen, ks = [t for t, _ in asked.values()], [k for _, k in asked.values()]
        for i, logprobs in zip(asked, _logprobs(logits, list(asked), chosen, ks), strict=True):
            out[i].logprobs = logprobs
    return out
