"""SamplingParams validation: every bad value names its field."""

from __future__ import annotations

from typing import Any

import pytest

from sendpath.errors import InvalidSamplingParamsError
from sendpath.request import Request, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "7"}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_values_raise_with_param(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert info.value.status_code == 400
    assert param in info.value.message


def test_defaults_and_greedy() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (16, 1.0, 1.0, None)
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert SamplingParams(stop="END").stop == ["END"]  # type: ignore[arg-type]


def test_token_ids_slices_prompt_then_output_without_joining_them() -> None:
    request = Request("r", [1, 2, 3], SamplingParams(), output_token_ids=[4, 5])
    for start in range(6):
        for end in range(start, 7):
            assert request.token_ids(start, end) == request.all_token_ids[start:end]
