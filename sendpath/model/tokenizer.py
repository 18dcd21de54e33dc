"""The tokenizer and chat template a model ships with, used exactly as Hugging Face uses them.

A ``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (built from GGUF metadata or read from
tokenizer.json) and the model's Jinja chat template, rendered in a sandbox with the same
environment transformers' ``apply_chat_template`` sets up. ``IncrementalDetokenizer`` turns
a growing list of token ids into text deltas without splitting a multi-byte character.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from sendpath.errors import InvalidRequestError
from sendpath.model.tool_prompt import with_tools_described

__all__ = ["Chat", "ChatMessage", "IncrementalDetokenizer", "Tokenizer", "render_chat_template"]

ChatMessage = Mapping[str, Any]


@dataclass(frozen=True)
class Chat:
    """A conversation with the tools its answer may call (OpenAI's ``tools``)."""

    messages: Sequence[ChatMessage]
    tools: list[dict[str, Any]] | None = None


@dataclass
class Tokenizer:
    """Text <-> token ids, chat template rendering, and the ids that end a turn."""

    backend: HFTokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int]
    special_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS where the model wants it."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template renders ``tools`` itself."""
        return self.chat_template is not None and "tools" in _variables(self.chat_template)

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for a conversation, as ``transformers`` renders it; where the
        template takes no tools, they and past calls are written into the messages
        (``tool_prompt.with_tools_described``)."""
        if self.chat_template is None:
            raise InvalidRequestError(
                "This model has no chat template, so it cannot take chat messages; "
                "send a plain prompt (completions) instead.",
                param="messages",
            )
        calls = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if (tools or calls) and not self.takes_tools:
            messages, tools = with_tools_described(messages, tools), None
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens={
                "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or "",
                **self.special_tokens,
            },
        )

    def encode_chat(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a rendered conversation; the template supplies any BOS itself."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (assistant masks) and renders the body."""

    tags = {"generation"}  # noqa: RUF012 - jinja's own class attribute

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_compiled: dict[str, jinja2.Template] = {}
_variables_of: dict[str, set[str]] = {}


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile(template: str) -> jinja2.Template:
    if template not in _compiled:
        _compiled[template] = _environment().from_string(template)
    return _compiled[template]


def _variables(template: str) -> set[str]:
    """The variables a template reads from its caller (``messages``, ``tools``, ...)."""
    if template not in _variables_of:
        try:
            parsed = _environment().parse(template)
            _variables_of[template] = set(jinja2.meta.find_undeclared_variables(parsed))
        except jinja2.TemplateError:
            _variables_of[template] = set()
    return _variables_of[template]


def render_chat_template(
    template: str,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    special_tokens: Mapping[str, str] | None = None,
) -> str:
    """Render a chat template with the variables and sandbox transformers uses."""
    try:
        return _compile(template).render(
            messages=[dict(m) for m in messages],
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **(special_tokens or {}),
        )
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(
            f"The model's chat template rejected these messages: {exc}", param="messages"
        ) from exc


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas.

    Decodes a short window ``ids[prefix:]`` and emits only what extends the text already
    emitted, holding back output that ends in an incomplete UTF-8 character (U+FFFD), so
    every delta is stable and the deltas concatenate to ``decode(ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start: text of ids[_prefix:_read] is already emitted
        self._read = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new ids; return the newly finished text (maybe empty)."""
        self.ids.extend(token_ids)
        decode = self._tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], self._skip)
        after = decode(self.ids[self._prefix :], self._skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a sequence: emit whatever is still held back, replacement chars too."""
        rest = self._tokenizer.decode(self.ids, self._skip)[len(self.text) :]
        self.text += rest
        self._read = len(self.ids)
        return rest
