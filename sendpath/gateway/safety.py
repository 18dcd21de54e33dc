"""Safety checks on the input (before queueing) and on the streamed output.

A check maps text to the category it breaks, or ``None``. The default is a rules filter:
regular expressions per category from a TOML file (``[categories]`` name = [patterns]).
On a stream, ``OutputGuard`` holds back the last ``window`` characters of what it has seen,
so a blocked phrase split across chunks is still caught before any of it is sent.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = ["DEFAULT_RULES", "OutputGuard", "RulesFilter", "SafetyCheck", "SafetyRulesError"]

DEFAULT_RULES = Path(__file__).with_name("safety_rules.toml")


class SafetyRulesError(ValueError):
    """The rules file cannot be used as given."""


class SafetyCheck(Protocol):
    def check(self, text: str) -> str | None:
        """The category ``text`` breaks, or ``None`` if it is allowed."""
        ...


class RulesFilter:
    """Categories of case-insensitive regular expressions."""

    def __init__(self, categories: dict[str, list[str]]) -> None:
        self.categories: dict[str, list[re.Pattern[str]]] = {}
        for name, patterns in categories.items():
            if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
                raise SafetyRulesError(f"category {name!r} must be a list of regular expressions")
            try:
                self.categories[name] = [re.compile(p, re.IGNORECASE | re.DOTALL) for p in patterns]
            except re.error as exc:
                raise SafetyRulesError(f"category {name!r}: bad regular expression: {exc}") from exc

    @classmethod
    def from_toml(cls, path: Path = DEFAULT_RULES) -> RulesFilter:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SafetyRulesError(f"cannot read safety rules {str(path)!r}: {exc}") from exc
        categories = data.get("categories")
        if not isinstance(categories, dict):
            raise SafetyRulesError(f"{path}: needs a [categories] table of name = [patterns]")
        return cls(categories)

    def check(self, text: str) -> str | None:
        for name, patterns in self.categories.items():
            if any(p.search(text) for p in patterns):
                return name
        return None


@dataclass
class OutputGuard:
    """Streams text through a check, holding back ``window`` characters until they are safe."""

    check: SafetyCheck
    window: int = 256
    _seen: str = ""  # released text's tail (context for matches that straddle it)
    _pending: str = ""
    blocked: str | None = None

    def push(self, delta: str) -> str:
        """Add generated text; return what can be sent now ("" once blocked)."""
        if self.blocked is not None:
            return ""
        self._pending += delta
        if (category := self.check.check(self._seen + self._pending)) is not None:
            self.blocked, self._pending = category, ""
            return ""
        cut = max(0, len(self._pending) - self.window)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        self._seen = (self._seen + out)[-self.window :]
        return out

    def flush(self) -> str:
        """At the end of the stream: the held-back text, if it passes."""
        if self.blocked is not None:
            return ""
        out, self._pending = self._pending, ""
        return out
