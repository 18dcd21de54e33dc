"""Build a ``tokenizers.Tokenizer`` from the vocabulary a GGUF file carries.

Two kinds of vocabulary:

- byte-level BPE (``tokenizer.ggml.model == "gpt2"``: Llama 3, Qwen, SmolLM): tokens, token
  types and merges, plus a pre-tokenizer name (``tokenizer.ggml.pre``) for the split rules
  llama.cpp applies before BPE. Each supported name maps to the Hugging Face pre-tokenizer
  that produces the same pieces, so encoding matches the original tokenizer.json.
- SentencePiece BPE (``"llama"``: Llama 2, Mistral 7B, TinyLlama): tokens with scores and
  no merges. SentencePiece merges, at each step, the adjacent pair whose joined piece
  scores highest, which is BPE with the merges ranked by that score; spaces become ``▁``
  with one before the text (and after each special token, as llama.cpp does), and a
  character outside the vocabulary falls back to its UTF-8 bytes (``<0xE2>`` tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from sendpath.errors import UnsupportedModelError
from sendpath.model.tokenizer import Tokenizer

__all__ = ["tokenizer_from_gguf"]

# llama.cpp's token types (llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6
_SPACE = "\u2581"  # SentencePiece's visible space
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's (its tokenizer.json): Llama 3's, but every digit alone
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # llama.cpp: "\p{N}" (each digit alone), then the GPT-2 split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    splits = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}
    splits["qwen2"] = _QWEN2_SPLIT
    if pre in splits:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(splits[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise UnsupportedModelError(
        f"GGUF pre-tokenizer {pre!r} is not supported (smollm, gpt2, llama-bpe, qwen2); "
        "load the model from a Hugging Face directory with its tokenizer.json instead."
    )


def _sentencepiece(
    tokens: list[str], scores: list[float], types: list[int], space_prefix: bool
) -> HFTokenizer:
    """A SentencePiece BPE vocabulary as a ``tokenizers`` BPE (see the module's docstring)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pieces = {
        tok: scores[i] for i, tok in enumerate(tokens) if types[i] in (_NORMAL, _USER_DEFINED)
    }
    ranked = []
    for piece, score in pieces.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in pieces and right in pieces:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unk = next((tokens[i] for i, t in enumerate(types) if t == _UNKNOWN), None)
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    steps = [normalizers.Prepend(_SPACE)] if space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            *([decoders.Strip(" ", 1, 0)] if space_prefix else []),
        ]
    )
    return backend


def tokenizer_from_gguf(fields: Mapping[str, Any], name: str) -> Tokenizer:
    """The tokenizer, chat template and EOS ids stored in a GGUF file's metadata (its
    ``gguf_reader.read(...).fields``)."""

    def get(key: str, default: Any = None) -> Any:
        return fields.get(key, default)

    kind = get("tokenizer.ggml.model")
    tokens: list[str] = get("tokenizer.ggml.tokens")
    types: list[int] = get("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
        backend.pre_tokenizer = _pre_tokenizer(get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores: list[float] = get("tokenizer.ggml.scores", [0.0] * len(tokens))
        backend = _sentencepiece(
            tokens, scores, types, get("tokenizer.ggml.add_space_prefix", True)
        )
    else:
        raise UnsupportedModelError(
            f"{name}: GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2', "
            "SentencePiece 'llama')."
        )
    backend.add_tokens(
        [
            AddedToken(tok, special=types[i] == _CONTROL, normalized=False)
            for i, tok in enumerate(tokens)
            if types[i] in (_CONTROL, _USER_DEFINED)
        ]
    )

    def token(key: str) -> str | None:
        idx = get(key)
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    if get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_id = vocab[bos]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    eos_ids = [vocab[eos]] if eos is not None else []
    eot = get("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    specials = {
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
    }
    return Tokenizer(
        backend=backend,
        chat_template=get("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=eos,
        eos_token_ids=eos_ids,
        special_tokens={k: v for k, v in specials.items() if v is not None},
    )
