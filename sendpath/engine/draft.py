"""Drafts from a draft model: a small model sharing the target's tokenizer, run greedily a
few tokens ahead of each request on a paged KV cache of its own.

Each request has a mirror here: a ``Request`` whose tokens are the target request's known
tokens followed by the drafts last proposed, and whose computed tokens are those this
model holds KV for. Before a proposal the mirror is brought in line with the request: its
tokens from the first one the request does not share are dropped (the refused drafts),
its computed tokens too, and the blocks only those filled go back (``KVCacheManager.trim``).
Then the draft model computes, for all requests at once, what it has not seen (the token
the target added, or the whole prompt the first time) and takes its greedy token, and
again one token a pass until each request has its ``k``. A draft that is one token for
sure keeps the target's sampling exact (``engine/speculative.py``).

A proposal computes at most ``max_tokens`` tokens of the draft model (the target's step
budget): a long prompt is caught up over several steps, a chunk a step, and drafts for
it only once it is. Where the cache has no room for a request, the mirrors of requests
not drafting now (preempted, waiting) give their blocks back first; if there is still
no room, that request gets the drafts made so far and its mirror starts again from
nothing next time.
"""

from __future__ import annotations

from sendpath.config import EngineConfig
from sendpath.engine.scheduler import ScheduledRequest, SchedulerOutput
from sendpath.errors import InvalidRequestError, ModelLoadError
from sendpath.kvcache.manager import KVCacheManager
from sendpath.model.loader import LoadedModel, load_model
from sendpath.request import Request, SamplingParams
from sendpath.runner.model_runner import ModelRunner

__all__ = ["DraftProposer", "load_draft"]

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


class DraftProposer:
    """A draft model's runner and KV cache, and a mirror of each request it drafts for."""

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, block_size: int, max_tokens: int = 512
    ) -> None:
        self.loaded = loaded
        self.max_tokens = max_tokens
        self.runner = ModelRunner(loaded, num_blocks, block_size)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self._mirrors: dict[str, Request] = {}
        self._shared: dict[str, int] = {}  # leading tokens known to be the request's own

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        goal = {request.request_id: k for request, k in wanted}
        drafts: dict[str, list[int]] = {rid: [] for rid in goal}
        mirrors = [self._sync(request) for request, _ in wanted]
        budget = self.max_tokens
        while True:
            items = []
            for mirror in mirrors:
                rid = mirror.request_id
                if len(drafts[rid]) >= goal[rid]:
                    continue
                start, end = mirror.num_computed_tokens, mirror.num_tokens
                whole = end - start <= budget
                end = end if whole else start + budget  # a long catch-up: a chunk a step
                if not whole:
                    goal[rid] = 0
                if end == start or not self._room(mirror, end - start, goal):
                    continue
                table = self.kv.block_ids(rid)
                items.append(
                    ScheduledRequest(rid, mirror.token_ids(start, end), start, table, whole)
                )
                budget -= end - start
            if not items:
                return drafts
            result = self.runner.execute(SchedulerOutput(items))
            for item in items:
                mirror = self._mirrors[item.request_id]
                mirror.num_computed_tokens += item.num_tokens
                if not item.sample:
                    continue
                token = result.sampled.get(item.request_id)
                if token is None:  # its logits could not be sampled: no more drafts
                    goal[item.request_id] = 0
                    continue
                mirror.prompt_token_ids.append(token)
                drafts[item.request_id].append(token)

    def _sync(self, request: Request) -> Request:
        """The request's mirror, its tokens and KV cut back to what it shares with it."""
        tokens, rid = request.all_token_ids, request.request_id
        mirror = self._mirrors.get(rid)
        if mirror is None:
            mirror = self._mirrors[rid] = Request(rid, list(tokens), _GREEDY)
            self.runner.add_request(mirror)
        else:
            have = mirror.prompt_token_ids
            same = self._shared[rid]
            while same < min(len(have), len(tokens)) and have[same] == tokens[same]:
                same += 1
            del have[same:]
            have += tokens[same:]
            # the last token is computed again whatever: its logits give the next draft
            mirror.num_computed_tokens = min(mirror.num_computed_tokens, same, len(tokens) - 1)
            self.kv.trim(mirror)
        self._shared[rid] = len(tokens)
        return mirror

    def _room(self, mirror: Request, n: int, drafting: dict[str, int]) -> bool:
        """Slots for ``n`` more of the mirror's tokens: where none are free, the mirrors
        not among ``drafting`` give theirs back first; else this one starts over (and
        has no more drafts this time)."""
        if self.kv.allocate_slots(mirror, n) is not None:
            return True
        for other in self._mirrors.values():
            if other.request_id not in drafting:
                self._restart(other)
        if self.kv.allocate_slots(mirror, n) is not None:
            return True
        self._restart(mirror)
        drafting[mirror.request_id] = 0
        return False

    def _restart(self, mirror: Request) -> None:
        self.kv.free(mirror)
        mirror.num_computed_tokens = 0

    def remove(self, request_id: str) -> None:
        mirror = self._mirrors.pop(request_id, None)
        self._shared.pop(request_id, None)
        if mirror is not None:
            self.kv.free(mirror)
            self.runner.remove_request(request_id)


def load_draft(
    config: EngineConfig, target: LoadedModel, num_blocks: int, max_len: int
) -> DraftProposer | None:
    """The draft model ``config.speculative`` names, loaded as the target was (same dtype,
    device and quantization rule), on a cache of as many blocks (memory beside the
    target's); ``None`` where it names none. A draft that does not share the target's
    vocabulary and end tokens, or holds a shorter context than ``max_len``, is refused."""
    spec = config.speculative
    if spec is None or spec.model is None:
        return None
    try:
        draft = load_model(
            spec.model,
            config.dtype,
            config.device,
            quantization=config.quantization,
            num_layers=spec.draft_layers,
        )
    except ModelLoadError as exc:
        raise ModelLoadError(f"the draft model (speculative config): {exc.message}") from exc
    mine, theirs = target.tokenizer, draft.tokenizer
    why = None
    if theirs.vocab_size != mine.vocab_size or draft.config.vocab_size > target.config.vocab_size:
        why = (
            f"has a vocabulary of {theirs.vocab_size} tokens ({draft.config.vocab_size} "
            f"outputs), the model {mine.vocab_size} ({target.config.vocab_size})"
        )
    elif set(theirs.eos_token_ids) != set(mine.eos_token_ids):
        why = "ends its answers with other tokens than the model"
    elif draft.max_model_len < max_len:
        why = f"holds a context of {draft.max_model_len} tokens, the model {max_len}"
    if why is not None:
        raise InvalidRequestError(
            f"the draft model {spec.model!r} {why}: a draft must share the model's tokenizer "
            "and context (or lower max_model_len).",
            param="speculative_config",
        )
    limit = config.scheduler.max_num_batched_tokens
    return DraftProposer(draft, num_blocks, config.cache.block_size, limit)
