"""Read the tokenizer of a Hugging Face model directory (tokenizer.json and its configs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from sendpath.errors import ModelLoadError
from sendpath.model.tokenizer import Tokenizer

__all__ = ["tokenizer_from_hf_dir"]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"Could not read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("content")) if value.get("content") is not None else None
    return str(value) if isinstance(value, str) else None


def _chat_template(path: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if template is None:
        template = _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def tokenizer_from_hf_dir(path: Path, config: dict[str, Any]) -> Tokenizer:
    """tokenizer.json + tokenizer_config.json (+ generation_config.json for EOS ids)."""
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelLoadError(
            f"{str(path)!r} has no tokenizer.json; sendpath needs the fast-tokenizer file."
        )
    try:
        backend = HFTokenizer.from_file(str(tok_file))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ModelLoadError(f"Could not read {tok_file}: {exc}") from exc
    tok_config = _read_json(path / "tokenizer_config.json")
    special_map = _read_json(path / "special_tokens_map.json")

    def special(name: str) -> str | None:
        return _token_text(tok_config.get(name)) or _token_text(special_map.get(name))

    eos_token = special("eos_token")
    eos_ids: list[int] = []
    for source in (_read_json(path / "generation_config.json"), config):
        value = source.get("eos_token_id")
        for idx in value if isinstance(value, list) else [value]:
            if isinstance(idx, int) and idx not in eos_ids:
                eos_ids.append(idx)
    eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
    if eos_id is not None and eos_id not in eos_ids:
        eos_ids.append(eos_id)
    extra = {n: t for n in ("unk_token", "pad_token") if (t := special(n)) is not None}
    return Tokenizer(
        backend=backend,
        chat_template=_chat_template(path, tok_config),
        bos_token=special("bos_token"),
        eos_token=eos_token,
        eos_token_ids=eos_ids,
        special_tokens=extra,
    )
