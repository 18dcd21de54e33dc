"""The input filter: 400 ``content_filter`` naming the category, before a request queues.

It reads what the model will read: each message's text as the replica renders it (one
shared function, ``api.prompt.prompt_text``), or the completion prompt; a prompt of token
ids is turned back into text by a replica's ``/detokenize`` (refused when no replica can,
since unread text cannot be let through). The check itself normalises the text
(``safety.normalize``). A prompt over ``OFF_LOOP_CHARS`` is checked on a worker thread, so
a multi-megabyte prompt never stalls the event loop that serves everyone else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from sendpath.api.errors import send_error
from sendpath.api.prompt import prompt_text
from sendpath.api.schema import CompletionBody
from sendpath.errors import ContentFilterError, InvalidRequestError, SendpathError
from sendpath.gateway.context import context
from sendpath.gateway.middleware import generates
from sendpath.gateway.safety import SafetyCheck
from sendpath.trace import Stage

__all__ = ["Detokenize", "SafetyMiddleware"]

OFF_LOOP_CHARS = 32 * 1024

# token ids -> their text, or None when no replica can say
Detokenize = Callable[[list[int]], Awaitable[str | None]]


class SafetyMiddleware:
    """Checks a generation request's input (module docstring)."""

    def __init__(self, app: ASGIApp, check: SafetyCheck, detokenize: Detokenize) -> None:
        self.app, self.check, self.detokenize = app, check, detokenize

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = context(scope) if generates(scope) else None
        if ctx is None or ctx.request is None:
            await self.app(scope, receive, send)
            return
        request = ctx.request
        param = "prompt" if isinstance(request, CompletionBody) else "messages"
        with ctx.span(Stage.GATEWAY_SAFETY):
            text = prompt_text(request)
            if text is None:  # token ids
                assert isinstance(request, CompletionBody)
                text = await self.detokenize(list(request.prompt))  # type: ignore[arg-type]
            error: SendpathError | None = None
            if text is None:
                error = InvalidRequestError(
                    "This gateway's safety filter cannot read a prompt of token ids here (no "
                    "replica can turn them into text); send the prompt as text.",
                    param="prompt",
                )
            else:
                if len(text) > OFF_LOOP_CHARS:
                    category = await asyncio.to_thread(self.check.check, text)
                else:
                    category = self.check.check(text)
                if category is not None:
                    error = ContentFilterError(category, param)
        if error is not None:
            await send_error(send, error)
            return
        await self.app(scope, receive, send)
