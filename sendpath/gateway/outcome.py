"""Where one request's answer is recorded, whichever shape it takes.

``Outcome`` is the one writer of the context's answer side (which replica, when it got
the request, the answer's id, usage, timings, when each text chunk went out) and the one
place the router hears how a replica did: ``failed`` (it counts against the replica),
``started`` (a first token or a whole answer came), and at the end ``recorded``, where
the router learns the answer (now in the replica's prefix cache) and the request's trace
and metrics are kept (``done``). The proxy, each attempt and the stream relay report to
it; none of them writes the context's answer fields or calls the router themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sendpath.gateway.chunks import answer_text, numbers
from sendpath.gateway.context import AttemptRecord, GatewayContext
from sendpath.router.pool import Endpoint
from sendpath.router.route import Prediction, RouteRequest
from sendpath.router.router import Router
from sendpath.telemetry.trace_context import TraceParent

__all__ = ["Outcome"]


class Outcome:
    """One request's answer as the gateway records it (module docstring)."""

    def __init__(
        self,
        ctx: GatewayContext,
        router: Router,
        route: RouteRequest,
        done: Callable[[GatewayContext], None],
    ) -> None:
        self.ctx, self.router, self.route, self.done = ctx, router, route, done
        self.endpoint: Endpoint | None = None
        self.answer: list[str] = []  # choice 0's text: what the router's prefix cache learns
        self._replica_timings: Any = None  # the replica's, off the last chunk that had them

    def tried(self, endpoint: Endpoint, prediction: Prediction | None) -> dict[str, str]:
        """The router chose ``endpoint`` for the next attempt; the headers that carry the
        attempt's place in the trace (a ``traceparent``, if the request is traced)."""
        ctx = self.ctx
        now = ctx.clock.now()
        if ctx.attempts and ctx.attempts[-1].end is None:
            ctx.attempts[-1].end = now
        traced = TraceParent.child_of(ctx.trace) if ctx.trace is not None else None
        ctx.attempts.append(
            AttemptRecord(endpoint.name, endpoint.url, now, traced.span_id if traced else 0)
        )
        self.endpoint = endpoint
        ctx.routing = {
            "policy": self.router.policy.name,
            **(prediction.to_dict() if prediction is not None else {}),
            "runs_on": endpoint.where or None,
        }
        return {"traceparent": traced.header()} if traced is not None else {}

    def reached(self, status: int, headers: Mapping[str, str], arrival: float) -> None:
        """The replica answered (``status``) with ``headers``; it got the request at
        ``arrival`` on the context's clock."""
        ctx = self.ctx
        if ctx.attempts:
            ctx.attempts[-1].status = status
        ctx.replica_arrival = arrival
        ctx.replica_request_id = headers.get("x-request-id")

    def failed(self, why: str) -> None:
        """The replica let this request down, in a way that counts against it."""
        assert self.endpoint is not None
        attempts = self.ctx.attempts
        if attempts and attempts[-1].error is None:
            attempts[-1].error = why
        self.router.failed(self.endpoint, why)

    def cut(self, error_type: str, why: str | None) -> None:
        """A stream that had started ended without its answer (``error_type``); ``why``:
        it counts against the replica (``None``: the request's own fault)."""
        self.ctx.error_type = error_type
        if why is not None:
            self.failed(why)

    def started(self) -> None:
        """The replica answered: its first token, or its whole answer, is here."""
        assert self.endpoint is not None
        self.router.succeeded(self.endpoint)

    def noted(self, chunk: dict[str, Any]) -> Any:
        """What is kept of a chunk (or a whole answer): its id, usage, and the replica's
        timings, which are taken off it and returned (the answer's last event carries the
        stitched ones instead)."""
        ctx = self.ctx
        if ctx.response_id is None:  # the first id the replica sent, if it is text
            answer_id = chunk.get("id")
            ctx.response_id = answer_id if isinstance(answer_id, str) and answer_id else None
        timings = chunk.pop("timings", None)
        self._replica_timings = timings or self._replica_timings
        usage = chunk.get("usage")
        if usage:
            ctx.usage = (
                int(usage.get("prompt_tokens", 0)),
                int(usage.get("completion_tokens", 0)),
            )
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            ctx.cached_tokens = cached if isinstance(cached, int) else None
        return timings

    def whole(self, data: dict[str, Any]) -> None:
        """The replica's whole (non-streamed) answer: ``noted``, and choice 0's text."""
        self.noted(data)
        self.answer.append(answer_text(data))

    def generated(self, choice: int, text: str | None) -> None:
        """A streamed piece the replica generated, whether or not it goes out: a piece of
        choice ``choice``'s text, or of one of its tool calls (``None``)."""
        if choice == 0 and text is not None:
            self.answer.append(text)
        self.ctx.streamed_chunks += 1

    def relayed(self, guarded: bool) -> None:
        """A text chunk went out to the client now (the first: the client's first token;
        ``guarded``: the output filter may have held it)."""
        ctx = self.ctx
        ctx.relayed.append(ctx.clock.now())
        if ctx.first_token_at is None:
            ctx.first_token_at = ctx.relayed[-1]
            if guarded:
                ctx.first_token_held = ctx.streamed_chunks - 1

    def ended(self, finish_reasons: list[str]) -> dict[str, float]:
        """The answer ends now, its choices finished so (as sent on): the stitched
        timings it carries."""
        ctx = self.ctx
        ctx.finish_reasons = finish_reasons
        ctx.replica_timings = numbers(self._replica_timings)
        timings = ctx.finish()
        if ctx.attempts:
            ctx.attempts[-1].end = ctx.end
        return timings

    def recorded(self, whole: bool) -> None:
        """After the answer's last write: the router learns it if the replica gave it
        whole (``whole``; a cut answer is not in its cache as it was sent), and the
        request's trace and metrics are kept."""
        if whole:
            assert self.endpoint is not None
            self.router.answered(self.route, self.endpoint, "".join(self.answer))
        self.done(self.ctx)
