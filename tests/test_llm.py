"""The offline API end to end on the built-in model."""

from __future__ import annotations

import pytest

from sendpath.errors import InvalidRequestError, InvalidSamplingParamsError, PromptTooLongError
from sendpath.llm import LLM
from sendpath.request import SamplingParams

JAPAN = [{"role": "user", "content": "What is the capital of Japan?"}]


def test_generate_plain_prompt(builtin_llm: LLM) -> None:
    outs = builtin_llm.generate(
        ["The capital of France is", "1, 2, 3,"], SamplingParams(temperature=0, max_tokens=8)
    )
    assert len(outs) == 2
    assert outs[0].prompt == "The capital of France is"
    assert "Paris" in outs[0].outputs[0].text
    assert outs[1].outputs[0].finish_reason == "length"
    assert len(outs[1].outputs[0].token_ids) == 8


def test_chat_batch_and_stream_agree(builtin_llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=24)
    batch = builtin_llm.chat([JAPAN, JAPAN], params)
    assert batch[0].outputs[0].text == batch[1].outputs[0].text
    streamed = "".join(builtin_llm.stream_chat(JAPAN, params))
    assert streamed == batch[0].outputs[0].text


def test_seeded_sampling_is_reproducible(builtin_llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    a = builtin_llm.chat(JAPAN, params)[0].outputs[0].token_ids
    b = builtin_llm.chat(JAPAN, params)[0].outputs[0].token_ids
    assert a == b and len(a) == 20


def test_stop_string_in_real_generation(builtin_llm: LLM) -> None:
    out = builtin_llm.chat(JAPAN, SamplingParams(temperature=0, max_tokens=32, stop=["Tokyo"]))[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Tokyo"
    assert "Tokyo" not in out.text and out.text.startswith("The capital of Japan is")


def test_prompt_longer_than_context_names_both_numbers() -> None:
    llm = LLM(max_model_len=64)
    with pytest.raises(PromptTooLongError) as info:
        llm.generate([[1345] * 100])
    assert info.value.prompt_tokens == 100 and info.value.max_model_len == 64
    assert "100 tokens" in info.value.message and "64 tokens" in info.value.message
    # a prompt that fits generates until the context is full
    out = llm.generate([[1345] * 60], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert out[0].outputs[0].finish_reason == "length"
    assert len(out[0].outputs[0].token_ids) == 4


def test_invalid_requests(builtin_llm: LLM) -> None:
    with pytest.raises(InvalidSamplingParamsError, match="temperature"):
        builtin_llm.chat(JAPAN, SamplingParams(temperature=-1))
    with pytest.raises(InvalidRequestError, match="empty"):
        builtin_llm.chat([])
    with pytest.raises(InvalidRequestError, match="empty"):
        builtin_llm.generate([[]])
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        LLM(max_model_len=10**6)
