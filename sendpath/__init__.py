"""sendpath: an LLM serving stack that shows what happens after a user presses send."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from sendpath.llm import LLM
    from sendpath.request import SamplingParams


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; import it only when asked so `sendpath --help` stays fast.
    if name == "LLM":
        from sendpath.llm import LLM

        return LLM
    # imported when asked too: `sendpath sim` loads the compiled request module instead
    # (sim/compiled.py), which it can only do before anything imported the source's
    if name == "SamplingParams":
        from sendpath.request import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'sendpath' has no attribute {name!r}")
