"""Grammars from JSON schemas on the built-in tokenizer: the mask allows only what can
continue the JSON, consumed tokens move it on, a complete answer allows only the end
token, schemas compile once, and a schema without a grammar is a 400."""

from __future__ import annotations

import pytest

from sendpath.errors import InvalidRequestError
from sendpath.model.structured import grammar_compiler
from sendpath.model.tokenizer import Tokenizer
from sendpath.request import StructuredOutput

CITY = StructuredOutput(
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    }
)


def test_the_mask_follows_the_json(smol_tokenizer: Tokenizer) -> None:
    compiler = grammar_compiler(smol_tokenizer)
    assert grammar_compiler(smol_tokenizer) is compiler  # one per tokenizer
    matcher = compiler.matcher(CITY)
    width = smol_tokenizer.vocab_size + 7  # logits may be wider than the vocabulary
    first = matcher.allowed(width)
    assert first.shape == (width,) and not first[smol_tokenizer.vocab_size :].any()
    assert all(smol_tokenizer.decode([int(t)]).startswith("{") for t in first.nonzero())
    for token in smol_tokenizer.encode('{"city":"Tokyo"}', add_special_tokens=False):
        assert matcher.allowed(width)[token]
        matcher.consume(token)
    end = matcher.allowed(width).nonzero().flatten().tolist()
    assert end == smol_tokenizer.eos_token_ids[:1]  # complete: only the end token


def test_a_token_the_grammar_refuses_raises(smol_tokenizer: Tokenizer) -> None:
    matcher = grammar_compiler(smol_tokenizer).matcher(CITY)
    bad = smol_tokenizer.encode("hello", add_special_tokens=False)[0]
    assert not matcher.allowed(smol_tokenizer.vocab_size)[bad]
    with pytest.raises(RuntimeError, match="refused"):
        matcher.consume(bad)


def test_max_length_is_kept(smol_tokenizer: Tokenizer) -> None:
    matcher = grammar_compiler(smol_tokenizer).matcher(CITY)
    for token in smol_tokenizer.encode('{"city":"abcdefgh', add_special_tokens=False):
        matcher.consume(token)
    allowed = matcher.allowed(smol_tokenizer.vocab_size).nonzero().flatten().tolist()
    assert allowed and all(smol_tokenizer.decode([t]).startswith('"') for t in allowed)


def test_bad_schemas_are_invalid_requests(smol_tokenizer: Tokenizer) -> None:
    compiler = grammar_compiler(smol_tokenizer)
    with pytest.raises(InvalidRequestError, match="cannot be used") as err:
        compiler.grammar(StructuredOutput({"type": "frob"}))
    assert err.value.param == "response_format"
    assert compiler.grammar(CITY) is compiler.grammar(StructuredOutput(dict(CITY.json_schema)))
