"""OutputStream: EOS, stop tokens, stop strings (held back while streaming), length."""

from __future__ import annotations

from sendpath.engine.outputs import FinishReason, OutputStream
from sendpath.model.tokenizer import Tokenizer
from sendpath.request import SamplingParams


def feed(
    tok: Tokenizer, text: str, params: SamplingParams, max_model_len: int = 1000
) -> tuple[list[str], OutputStream]:
    stream = OutputStream(tok, params, prompt_len=10, max_model_len=max_model_len)
    deltas = []
    for token in tok.encode(text, add_special_tokens=False):
        deltas.append(stream.append(token))
        if stream.finished:
            break
    return deltas, stream


def test_stop_string_is_cut_and_never_streamed(smol_tokenizer: Tokenizer) -> None:
    params = SamplingParams(max_tokens=100, stop=["STOP HERE", "never"])
    deltas, stream = feed(smol_tokenizer, "Some words then STOP HERE and more", params)
    assert stream.finish_reason is FinishReason.STOP
    assert stream.stop_reason == "STOP HERE"
    assert stream.text == "Some words then "
    assert "".join(deltas) == "Some words then "
    assert all("STOP" not in d for d in deltas)


def test_earliest_stop_string_wins(smol_tokenizer: Tokenizer) -> None:
    params = SamplingParams(max_tokens=100, stop=["b c", "a b"])
    _, stream = feed(smol_tokenizer, "x a b c d", params)
    assert stream.text == "x " and stream.stop_reason == "a b"


def test_eos_stops_and_is_counted_but_not_shown(smol_tokenizer: Tokenizer) -> None:
    deltas, stream = feed(
        smol_tokenizer, "Hello there<|im_end|> ignored", SamplingParams(max_tokens=50)
    )
    assert stream.finish_reason is FinishReason.STOP and stream.stop_reason is None
    assert stream.text == "".join(deltas) == "Hello there"
    assert stream.token_ids[-1] == 2


def test_ignore_eos_and_stop_token_ids(smol_tokenizer: Tokenizer) -> None:
    _, stream = feed(
        smol_tokenizer, "a<|im_end|>b c", SamplingParams(max_tokens=50, ignore_eos=True)
    )
    assert stream.finish_reason is None and stream.text == "ab c"
    stop_id = smol_tokenizer.encode(" c", add_special_tokens=False)[0]
    _, stream = feed(
        smol_tokenizer, "a b c d", SamplingParams(max_tokens=50, stop_token_ids=[stop_id])
    )
    assert stream.finish_reason is FinishReason.STOP and stream.stop_reason == stop_id
    assert stream.text == "a b"


def test_length_by_max_tokens_and_by_context(smol_tokenizer: Tokenizer) -> None:
    deltas, stream = feed(smol_tokenizer, "one two three four five", SamplingParams(max_tokens=3))
    assert stream.finish_reason is FinishReason.LENGTH and len(stream.token_ids) == 3
    assert "".join(deltas) == stream.text == "one two three"
    _, stream = feed(
        smol_tokenizer, "one two three four", SamplingParams(max_tokens=50), max_model_len=12
    )
    assert stream.finish_reason is FinishReason.LENGTH and len(stream.token_ids) == 2
