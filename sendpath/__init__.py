"""sendpath: an LLM serving stack that shows what happens after a user presses send."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sendpath.request import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from sendpath.llm import LLM


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; import it only when asked so `sendpath --help` stays fast.
    if name == "LLM":
        from sendpath.llm import LLM

        return LLM
    raise AttributeError(f"module 'sendpath' has no attribute {name!r}")
