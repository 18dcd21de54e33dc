"""Constrained decoding: answers that must be JSON matching a schema (OpenAI's
``response_format``), with llguidance (a maintained grammar engine vLLM uses too).

A schema becomes an llguidance grammar once (``GrammarCompiler.grammar``, cached by the
schema's text), checked when the request arrives so a bad schema is a 400, never a failed
step. Each request then gets its own ``Matcher``: before each token it gives the tokens the
grammar allows next (a mask the sampler applies to the logits, greedy or not), after it the
token is consumed. Once the JSON is complete only the end token is allowed.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import numpy as np
import torch

from sendpath.errors import InvalidRequestError
from sendpath.model.tokenizer import Tokenizer
from sendpath.request import StructuredOutput

__all__ = ["GrammarCompiler", "Matcher", "grammar_compiler"]

CACHED_GRAMMARS = 256  # distinct schemas kept compiled


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        self._matcher = matcher
        self.vocab = vocab

    def allowed(self, logits_width: int) -> torch.Tensor:
        """[logits_width] bool: the tokens the grammar allows next (ids past the
        tokenizer's vocabulary never are)."""
        bits = np.unpackbits(
            np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little"
        )
        out = torch.zeros(logits_width, dtype=torch.bool)
        n = min(logits_width, self.vocab, len(bits))
        out[:n] = torch.from_numpy(bits[:n].astype(bool))
        return out

    def consume(self, token: int) -> None:
        """Advance past a sampled token (one the mask allowed)."""
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")


class GrammarCompiler:
    """Schemas -> llguidance grammars for one tokenizer (its ``LLTokenizer`` is built on
    first use: about a second)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[str, str] = OrderedDict()

    def _llt(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltokenizer is None:
                tok = self.tokenizer
                self._lltokenizer = llguidance.LLTokenizer(
                    tok.backend.to_str(),
                    n_vocab=tok.vocab_size,
                    eos_token=tok.eos_token_ids[0] if tok.eos_token_ids else None,
                )
            return self._lltokenizer

    def grammar(self, structured: StructuredOutput) -> str:
        """The grammar for ``structured``; ``InvalidRequestError`` if the schema has none."""
        key = json.dumps(structured.json_schema, sort_keys=True)
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                structured.json_schema, defaults={"whitespace_flexible": False}
            )
            error = llguidance.LLMatcher.validate_grammar(grammar, self._llt())
        except Exception as exc:
            error = str(exc)
        if error:
            raise InvalidRequestError(
                f"{structured.source}'s JSON schema cannot be used: {error}",
                param=structured.source,
            )
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return grammar

    def matcher(self, structured: StructuredOutput) -> Matcher:
        matcher = llguidance.LLMatcher(self._llt(), self.grammar(structured), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"{structured.source}'s JSON schema cannot be used: {matcher.get_error()}",
                param=structured.source,
            )
        return Matcher(matcher, self.tokenizer.vocab_size)


_compilers: dict[int, GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def grammar_compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    """The compiler of this tokenizer (one per tokenizer object, shared by the engine,
    which checks schemas, and the runner, which matches them)."""
    with _compilers_lock:
        found = _compilers.get(id(tokenizer))
        if found is None or found.tokenizer is not tokenizer:
            found = _compilers[id(tokenizer)] = GrammarCompiler(tokenizer)
        return found
