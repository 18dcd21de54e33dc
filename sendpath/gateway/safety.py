"""Safety checks on the input (before queueing) and on the streamed output.

A check maps text to the category it breaks, or ``None``. The default is a rules filter:
regular expressions per category from a TOML file (``[categories]`` name = [patterns]),
matched against the text normalised the way a reader sees it (``normalize``: Unicode NFKC,
so fullwidth and other compatibility forms become plain letters; invisible format
characters such as zero-width spaces and joiners removed; case-folded), so that
fullwidth "bomb" (U+FF42...), "bo\u200bmb" and "BOMB" all read as "bomb". Matching a
text over ``CONCURRENT_CHARS`` releases the GIL (``concurrent=True``), so a large prompt
checked on a worker thread does not stall the event loop.

On a stream, ``OutputGuard`` holds back only text that could still become a blocked
phrase: the rules filter asks each pattern for a *partial* match reaching the end of what
has been generated (the ``regex`` module's ``partial=True``), and everything before the
earliest such match is safe to send now. So a phrase split across chunks is caught before
any of it is sent, while ordinary text streams with no delay. A hard cap (``window``)
bounds how much may be held back; checks that cannot say hold back the whole window.
"""

from __future__ import annotations

import tomllib
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import regex

__all__ = [
    "DEFAULT_RULES",
    "OutputGuard",
    "RulesFilter",
    "SafetyCheck",
    "SafetyRulesError",
    "normalize",
]

DEFAULT_RULES = Path(__file__).with_name("safety_rules.toml")
_INVISIBLE = regex.compile(r"\p{Cf}+")  # format characters: zero-width space/joiners, bidi marks


def normalize(text: str) -> str:
    """``text`` as a filter should read it: NFKC, format characters removed, case-folded."""
    if text.isascii():  # NFKC keeps ASCII as it is, none of it is a format character,
        return text.lower()  # and ASCII case-folds to its lower case
    return _INVISIBLE.sub("", unicodedata.normalize("NFKC", text)).casefold()


class SafetyRulesError(ValueError):
    """The rules file cannot be used as given."""


class SafetyCheck(Protocol):
    def check(self, text: str) -> str | None:
        """The category ``text`` breaks, or ``None`` if it is allowed."""
        ...

    def hold_from(self, text: str, start: int = 0) -> int:
        """The earliest index of ``text`` from ``start`` on where a match could still
        start if more text followed (``len(text)`` when none could). What comes before
        ``start`` is context only (lookbehinds, word boundaries)."""
        ...


# What keeps a pattern from joining the others in one alternation: a backreference (group
# numbers shift), or inline flags (they would apply to every pattern)
_NOT_JOINABLE = regex.compile(r"\\[1-9]|\(\?P=|\(\?[a-zA-Z]+[):]|\\g<|\(\?[+-]?\d|\(\?\(\d")
_FLAGS = regex.IGNORECASE | regex.DOTALL
# Longer texts are matched with the GIL released; a stream's window, far shorter, is
# matched on the event loop, where releasing it is only a cost (a tenth of a check)
CONCURRENT_CHARS = 4096


class RulesFilter:
    """Categories of case-insensitive regular expressions.

    Where they allow it (no backreferences, no inline flags), every pattern is also joined
    into one alternation, so a check is one search of the text instead of one per pattern
    (a stream's guard runs one check and one partial search per token). The category
    reported is then that of the leftmost match."""

    def __init__(self, categories: dict[str, list[str]]) -> None:
        self.categories: dict[str, list[regex.Pattern[str]]] = {}
        for name, patterns in categories.items():
            if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
                raise SafetyRulesError(f"category {name!r} must be a list of regular expressions")
            try:
                self.categories[name] = [regex.compile(p, _FLAGS) for p in patterns]
            except regex.error as exc:
                raise SafetyRulesError(f"category {name!r}: bad regular expression: {exc}") from exc
        sources = [(n, p.pattern) for n, ps in self.categories.items() for p in ps]
        self._joined: regex.Pattern[str] | None = None
        self._names = [name for name, _ in sources]  # category of group _r{i}
        if sources and not any(_NOT_JOINABLE.search(p) for _, p in sources):
            self._joined = regex.compile(
                "|".join(f"(?P<_r{i}>{p})" for i, (_, p) in enumerate(sources)), _FLAGS
            )

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
        normal = normalize(text)
        concurrent = len(normal) > CONCURRENT_CHARS
        if self._joined is not None:
            m = self._joined.search(normal, concurrent=concurrent)
            if m is None:
                return None
            return next(n for i, n in enumerate(self._names) if m.group(f"_r{i}") is not None)
        for name, patterns in self.categories.items():
            if any(p.search(normal, concurrent=concurrent) for p in patterns):
                return name
        return None

    def hold_from(self, text: str, start: int = 0) -> int:
        if self._joined is not None:
            m = self._joined.search(text, start, partial=True)
            if m is None:
                return len(text)
            if m.partial:  # the leftmost place any pattern could still match from
                return int(m.start())
            # a whole match (the output check reads normalised text, this the raw): each
        found = len(text)  # pattern's own first partial match, as without the alternation
        for patterns in self.categories.values():
            for p in patterns:
                m = p.search(text, start, partial=True)
                if m is not None and m.partial:
                    found = min(found, m.start())
        return found


@dataclass
class OutputGuard:
    """Streams text through a check, holding back what could still become a blocked phrase
    (at most ``window`` characters)."""

    check: SafetyCheck
    window: int = 256
    _seen: str = ""  # released text's tail: context for lookbehinds and word boundaries
    _pending: str = ""
    _forced: bool = False  # the window released text a match might still have started in
    blocked: str | None = None

    def push(self, delta: str) -> str:
        """Add generated text; return what can be sent now. The push that blocks returns
        the held text before where the phrase could start (``safe_part``), so a whole
        text pushed at once and the same text pushed in pieces release the same; every
        push after it returns ""."""
        if self.blocked is not None:
            return ""
        self._pending += delta
        text = self._seen + self._pending
        if (category := self.check.check(text)) is not None:
            out = self._safe_part()
            self.blocked, self._pending = category, ""
            return out
        # a match cannot start in released text (it would have been a partial match there,
        # and held back), so only the pending text is searched and the released is context;
        # unless the window forced text out: from then on all of it is searched
        held = self.check.hold_from(text, 0 if self._forced else len(self._seen))
        hold = max(held - len(self._seen), len(self._pending) - self.window)
        self._forced |= hold > held - len(self._seen)
        cut = min(len(self._pending), max(0, hold))
        out, self._pending = self._pending[:cut], self._pending[cut:]
        self._seen = (self._seen + out)[-self.window :]
        return out

    def _safe_part(self) -> str:
        """Of the pending text (which, after the released text, is blocked): the longest
        start that passes the check (found by halving), less what could still become a
        phrase in it (``hold_from``)."""
        seen, pending = self._seen, self._pending
        low, high = 0, len(pending)  # seen + pending[:low] passes, + pending[:high] not
        while high - low > 1:
            mid = (low + high) // 2
            if self.check.check(seen + pending[:mid]) is None:
                low = mid
            else:
                high = mid
        passing = seen + pending[:low]
        held = self.check.hold_from(passing, 0 if self._forced else len(seen))
        return pending[: max(0, min(low, held - len(seen)))]

    def push_each(self, deltas: Sequence[str]) -> list[str] | None:
        """Several deltas that arrived together, judged as one text (one check and one
        search instead of two per delta): what goes out with each, in order. What is
        released goes to the deltas it came from (the first also takes what was held
        before it), so a delta released whole goes as it came; what could still become a
        phrase is held after the last, as ``push`` holds it. ``None``, with nothing
        changed, when the text would be blocked: then push them one at a time, which
        releases what came before the phrase as ``push`` does."""
        if self.blocked is not None:
            return ["" for _ in deltas]
        before = (self._seen, self._pending, self._forced)
        held = len(self._pending)
        out = self.push("".join(deltas))
        if self.blocked is not None:
            self._seen, self._pending, self._forced = before
            self.blocked = None
            return None
        each, at = [], 0
        for i, delta in enumerate(deltas):
            end = at + len(delta) + (held if i == 0 else 0)
            each.append(out[at:end])
            at = end
        return each

    def flush(self) -> str:
        """At the end of the stream: the held-back text, if it passes."""
        if self.blocked is not None:
            return ""
        out, self._pending = self._pending, ""
        return out
