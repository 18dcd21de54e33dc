"""Shared fixtures: the built-in model (loaded once), a tiny random Llama directory, references."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

# Ray keeps every node it starts on 127.0.0.1 (else it moves them to the machine's network
# address); read when Ray is first imported, so set before any test imports it.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# The tests run the simulator from its sources (some replace its objects' methods, which a
# mypyc-compiled class does not allow); tests/sim/test_compiled.py runs the compiled one.
os.environ["SENDPATH_SIM_COMPILED"] = "0"

from sendpath.llm import LLM
from sendpath.model.kernels import cpu_kernels
from sendpath.model.loader import LoadedModel, builtin_model_path, load_model
from sendpath.model.tokenizer import Tokenizer

CHAT_PROMPTS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of Japan?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers."},
    ],
    [
        {"role": "user", "content": "Hi! Who are you?"},
        {"role": "assistant", "content": "I am SmolLM, a small language model."},
        {"role": "user", "content": "What can you do for me in 2024?"},
    ],
    [{"role": "user", "content": "Explain in one sentence why the sky is blue."}],
]


@pytest.fixture(scope="session")
def builtin_llm() -> LLM:
    """The built-in SmolLM2-135M-Instruct in float32 on the CPU."""
    return LLM(dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smol_tokenizer(builtin_llm: LLM) -> Tokenizer:
    return builtin_llm.tokenizer


@pytest.fixture(scope="session")
def hf_builtin() -> Any:
    """transformers' own loading of the same GGUF file: the reference implementation."""
    transformers = pytest.importorskip("transformers")
    path = builtin_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def write_tiny_llama(
    directory: Path,
    tokenizer: Tokenizer,
    *,
    tie: bool = True,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
    architecture: str = "llama",
) -> Path:
    """Save a randomly initialised 2-layer GQA model of a Llama-family ``architecture``
    (llama, mistral, qwen2, qwen3; transformers' own class) with a real tokenizer."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[architecture]
    config = config_class(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = model_class(config)
    with torch.no_grad():  # larger weights than the default init: sharper, less tie-prone logits
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif name.endswith("bias") or name.endswith("_norm.weight"):
                p.normal_(0.5 if name.endswith("weight") else 0.0, 0.2)  # not all zero / one
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": tokenizer.chat_template,
                "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token,
            }
        )
    )
    return directory


@pytest.fixture(scope="session")
def tiny_llama_dir(
    tmp_path_factory: pytest.TempPathFactory, smol_tokenizer: Tokenizer
) -> Iterator[Path]:
    yield write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smol_tokenizer)


@pytest.fixture(scope="session")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    """The tiny random Llama, loaded once in float32."""
    return load_model(tiny_llama_dir, dtype="float32")


def wait_for(cond: Callable[[], object], timeout: float = 20.0) -> None:
    """Poll ``cond`` until it is true; a miss while other threads change what it reads
    (IndexError, RuntimeError) is just "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except (IndexError, RuntimeError):
            pass
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def require_program(name: str, package: str) -> str:
    """The path of a program the test needs; skip without it, except in CI, where it fails."""
    path = shutil.which(name)
    if path is None:
        reason = f"{name} is not installed (Debian package {package}; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must not skip: {reason}")
        pytest.skip(reason)
    return path


def built(build: Callable[[], ModuleType], what: str) -> ModuleType:
    """A C extension of ours built here: skip where it cannot be, except in CI, where it
    fails (the machine's C compiler builds the kernels too)."""
    from sendpath.native import NativeBuildError

    try:
        return build()
    except NativeBuildError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must build {what}: {exc}")
        pytest.skip(f"{what} cannot be built here: {exc}")


@pytest.fixture(scope="session")
def native() -> ModuleType:
    """The C OTLP encoder (telemetry/otlp_native.c)."""
    from sendpath.telemetry.otlp import native_encoder

    return built(native_encoder, "the C encoder")


@pytest.fixture(scope="session")
def native_spans() -> ModuleType:
    """The gateway's spans in one C call (gateway/spans_native.c)."""
    from sendpath.gateway.spans import native_spans

    return built(native_spans, "the gateway's C span builder")


@pytest.fixture(scope="session")
def native_kv() -> ModuleType:
    """The prefix cache's block hashes and block pool in C (kvcache/kv_native.c)."""
    from sendpath.kvcache.native import build

    return built(build, "the C block pool")


@dataclass
class Served:
    """`sendpath serve` started by a test: its process, URL, output so far and first key."""

    proc: subprocess.Popen[str]
    url: str
    lines: list[str]
    secret: str | None


def start_serve(
    model_dir: Path, data_dir: Path, *flags: str, replicas: int = 2, session: bool = False
) -> Served:
    """Start `sendpath serve` on the tiny model and wait until it says it serves (the CPU
    kernels built here first: its replicas find them instead of each building them). It
    takes a free port itself (--port 0) before its replicas take theirs, and prints it."""
    cpu_kernels()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "sendpath.cli", "serve", "--port", "0",
            "--replicas", str(replicas), "--data-dir", str(data_dir), "--model", str(model_dir),
            "--served-model-name", "tiny", "--kv-cache-memory-gib", "0.05", *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=session,  # its own process group, as a terminal would start it
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while not (up := [line for line in lines if "Ctrl-C stops everything" in line]):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        lines.append(proc.stdout.readline())
    secret = next((line.strip() for line in lines if line.startswith("sk-sp-")), None)
    return Served(proc, up[0].split()[2].removesuffix("/v1"), lines, secret)
