"""A SentencePiece vocabulary in a GGUF file (``tokenizer.ggml.model == "llama"``: Llama 2,
Mistral 7B), written as llama.cpp's converter writes one (pieces, scores, token types, no
merges), encodes and decodes exactly as SentencePiece itself does: a real SentencePiece BPE
model with byte fallback, trained here on a small text, is the reference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sendpath.model import gguf_reader
from sendpath.model.gguf_tokenizer import tokenizer_from_gguf
from sendpath.model.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

CORPUS = """A chat message travels over the network to a gateway.
The gateway asks who you are, whether you are within your limits, and whether the safety
filter allows the message. Then the message waits in a queue, because thousands of people
pressed send in the same second. It gets a slot on a model replica, where it is tokenized
and rendered through the chat template. Prefill reads the whole prompt in one parallel
pass; decode writes one token at a time, each streamed back the moment it exists.
Beautiful is better than ugly. Explicit is better than implicit. Simple is better than
complex. Readability counts. Special cases are not special enough to break the rules.
In front of many replicas a load balancer picks the one that already holds the start of
the conversation in its cache. Which stage dominates depends on traffic, prompt length and
answer length: a quiet day with a short question is mostly decode; an overloaded service
is mostly queue; a pasted document of three hundred pages makes prefill bite.
"""
TEXTS = [
    "Beautiful is better than ugly.",
    "Explicit is better than implicit, 2024 times over.",
    "  two leading spaces, and  two  inside",
    "new\nlines\n\nand\ttabs",
    "naïve café — 東京 🙂 ünïcödé the model never saw",
    "Readability counts.Special cases aren't special enough",
    "x",
    " ",
]


def _types(sp: Any) -> list[int]:
    """llama.cpp's token type of each piece (normal 1, unknown 2, control 3, unused 5, byte 6)."""
    out = []
    for i in range(sp.get_piece_size()):
        if sp.is_unknown(i):
            out.append(2)
        elif sp.is_control(i):
            out.append(3)
        elif sp.is_unused(i):
            out.append(5)
        elif sp.is_byte(i):
            out.append(6)
        else:
            out.append(1)
    return out


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Tokenizer]]:
    """The trained SentencePiece model, and sendpath's tokenizer of it read from a GGUF."""
    d: Path = tmp_path_factory.mktemp("spm")
    (d / "corpus.txt").write_text(CORPUS)
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"),
        model_prefix=str(d / "m"),
        vocab_size=420,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",  # as Llama 2's and Mistral's
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        hard_vocab_limit=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        num_threads=1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(d / "m.model"))
    writer = gguf.GGUFWriter(str(d / "vocab.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    writer.add_token_types(_types(sp))
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    yield sp, tokenizer_from_gguf(gguf_reader.read(d / "vocab.gguf").fields, "spm-test")


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_and_decodes_as_sentencepiece(
    sentencepiece: tuple[Any, Tokenizer], text: str
) -> None:
    sp, ours = sentencepiece
    expected = sp.encode(text)
    assert ours.encode(text, add_special_tokens=False) == expected
    assert ours.encode(text) == [sp.bos_id(), *expected]  # add_bos_token
    assert ours.decode(expected) == sp.decode(expected) == text


def test_unknown_characters_fall_back_to_bytes(sentencepiece: tuple[Any, Tokenizer]) -> None:
    sp, ours = sentencepiece
    ids = ours.encode("東", add_special_tokens=False)
    assert [sp.id_to_piece(i) for i in ids][-3:] == ["<0xE6>", "<0x9D>", "<0xB1>"]
    assert ours.eos_token_ids == [sp.eos_id()] and ours.bos_token == "<s>"
