"""Tokenizer and chat template against transformers, and incremental detokenization."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import pre_tokenizers

from sendpath.errors import InvalidRequestError
from sendpath.model.loader import builtin_model_path, load_model
from sendpath.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.conftest import CHAT_PROMPTS

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "Tabs\tand\nnewlines\n\n  indented",
    "Unicode: café, naïve, 東京, Привет, 🙂🚀",
    "Numbers 12345 and 3.14159, year 2024, 1,000,000.",
    "def f(x):\n    return x ** 2  # code\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
    "It's we're they've I'm you'll he'd",
    "",
]


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    """transformers' tokenizer for the same GGUF, with the original SmolLM2 pre-tokenizer.

    transformers' GGUF converter builds a plain byte-level pre-tokenizer; SmolLM2's
    tokenizer.json (and llama.cpp's ``smollm`` rule stored in the file) also split digits
    one by one, so the reference gets that split back.
    """
    transformers = pytest.importorskip("transformers")
    path = builtin_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return tok


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_reference(
    smol_tokenizer: Tokenizer, hf_tokenizer: Any, text: str
) -> None:
    expected = hf_tokenizer(text, add_special_tokens=True)["input_ids"]
    assert smol_tokenizer.encode(text) == expected
    assert smol_tokenizer.decode(expected) == hf_tokenizer.decode(
        expected, skip_special_tokens=True
    )


def test_digits_are_split_one_by_one(smol_tokenizer: Tokenizer) -> None:
    ids = smol_tokenizer.encode("2024", add_special_tokens=False)
    assert [smol_tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_special_tokens_are_single_ids_and_eos_is_im_end(smol_tokenizer: Tokenizer) -> None:
    assert smol_tokenizer.encode("<|im_start|><|im_end|>", add_special_tokens=False) == [1, 2]
    assert smol_tokenizer.eos_token == "<|im_end|>"
    assert smol_tokenizer.eos_token_ids == [2]
    assert smol_tokenizer.encode("hi") == smol_tokenizer.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", CHAT_PROMPTS)
def test_chat_template_matches_transformers(
    smol_tokenizer: Tokenizer,
    hf_tokenizer: Any,
    conv: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    kwargs = {"add_generation_prompt": add_generation_prompt, "tokenize": False}
    expected = hf_tokenizer.apply_chat_template(conv, **kwargs)
    assert smol_tokenizer.apply_chat_template(conv, add_generation_prompt) == expected
    expected_ids = hf_tokenizer.apply_chat_template(
        conv, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert smol_tokenizer.encode_chat(conv, add_generation_prompt) == list(expected_ids)


def test_hf_directory_tokenizer_matches_transformers(tiny_llama_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    ours = load_model(tiny_llama_dir).tokenizer
    for conv in CHAT_PROMPTS:
        assert ours.apply_chat_template(conv) == ref.apply_chat_template(
            conv, add_generation_prompt=True, tokenize=False
        )
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"]
    assert ours.eos_token_ids == [2]


def test_template_sandbox_and_raise_exception(smol_tokenizer: Tokenizer) -> None:
    evil = Tokenizer(
        backend=smol_tokenizer.backend,
        chat_template="{{ messages.__class__.__mro__ }}",
        bos_token=None,
        eos_token=None,
        eos_token_ids=[],
    )
    with pytest.raises(InvalidRequestError, match="chat template"):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
    strict = Tokenizer(
        backend=smol_tokenizer.backend,
        chat_template="{{ raise_exception('roles must alternate') }}",
        bos_token=None,
        eos_token=None,
        eos_token_ids=[],
    )
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        strict.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_features_hf_templates_use(smol_tokenizer: Tokenizer) -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{{ '\\n' }}{% endfor %}"
    )
    tok = Tokenizer(
        backend=smol_tokenizer.backend,
        chat_template=template,
        bos_token=None,
        eos_token=None,
        eos_token_ids=[],
    )
    msgs = [{"role": "user", "content": "東京"}] * 3
    assert tok.apply_chat_template(msgs) == '{"role": "user", "content": "東京"}\n' * 2


def test_no_template_gives_a_clear_error(smol_tokenizer: Tokenizer) -> None:
    tok = Tokenizer(
        backend=smol_tokenizer.backend,
        chat_template=None,
        bos_token=None,
        eos_token=None,
        eos_token_ids=[],
    )
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("text", ["Unicode: café, 東京, 🙂🚀 done", "plain ascii words here"])
def test_incremental_detokenizer_deltas_concatenate(smol_tokenizer: Tokenizer, text: str) -> None:
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smol_tokenizer)
    deltas = [detok.push([i]) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # a multi-byte emoji is split over several byte-level tokens: some pushes emit nothing
    if "🙂" in text:
        assert "" in deltas[:-1]
