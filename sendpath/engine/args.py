"""The engine's command-line flags (vLLM's names, as its ``EngineArgs``), as `replica`,
`serve` (which passes them on to its replicas) and `profile` take them, and the
``EngineConfig`` they describe."""

from __future__ import annotations

import argparse
from typing import Any

from sendpath.config import CacheConfig, EngineConfig, SchedulerConfig
from sendpath.speculative_config import SpeculativeConfig

__all__ = [
    "ENGINE_FLAGS",
    "MODEL_HELP",
    "SPEC_HELP",
    "add_engine_args",
    "engine_argv",
    "engine_config",
]

MODEL_HELP = (
    "GGUF file or Hugging Face directory of a Llama, Mistral, Qwen2/2.5 or Qwen3 model (GGUF: "
    "F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1, K-quants; byte-level BPE or SentencePiece "
    "vocabulary); default: the built-in SmolLM2-135M-Instruct"
)
SPEC_HELP = (
    'speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": '
    '4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (prompt lookup: drafts from '
    "earlier text, verified in the same step; greedy output unchanged); "
    '"disable_by_batch_size": no drafts in steps with more decodes than this (4); '
    '\'{"model": PATH, "num_speculative_tokens": 3}\': a draft model sharing the tokenizer '
    '("draft_layers": N keeps its first N layers)'
)
# The replica's engine flags: (flag, argparse options). `serve` passes them on to replicas.
ENGINE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    (
        "--model",
        {"help": MODEL_HELP},
    ),
    ("--served-model-name", {"help": "the model id clients send (default: from the path)"}),
    (
        "--dtype",
        {
            "default": "auto",
            "choices": ["auto", "float32", "bfloat16", "float16"],
            "help": "activations and dense weights (auto: bfloat16 on CUDA and on CPUs that "
            "compute it natively, else float32)",
        },
    ),
    (
        "--quantization",
        {
            "default": "auto",
            "choices": ["auto", "none", "int8", "int4"],
            "help": "low-precision weights for small steps (auto: the model's own four-bit "
            "weights on a CPU with bfloat16, where the file ships them)",
        },
    ),
    ("--device", {"help": "cpu or cuda (default: cuda if available)"}),
    ("--max-model-len", {"type": int, "help": "context window (default: the model's)"}),
    ("--max-num-seqs", {"type": int, "default": 64, "help": "most requests in one batch"}),
    (
        "--max-num-batched-tokens",
        {"type": int, "default": 512, "help": "token budget of one engine step"},
    ),
    ("--max-queued-requests", {"type": int, "help": "past this many waiting, answer 503"}),
    (
        "--long-prefill-token-threshold",
        {"type": int, "help": "cap one prompt's prefill chunk per step (mixed loads)"},
    ),
    ("--block-size", {"type": int, "default": 16, "help": "KV cache block size in tokens"}),
    (
        "--kv-cache-memory-gib",
        {"type": float, "default": 1.0, "help": "memory for the KV cache"},
    ),
    ("--no-prefix-caching", {"action": "store_true", "help": "turn prefix caching off"}),
    (
        "--kv-cache-dtype",
        {
            "default": "auto",
            "help": "the KV cache's dtype: auto (the model's), bfloat16, float32 or int8 "
            "(codes and a scale per token and kv head: half bfloat16's bytes, so twice the "
            "tokens in --kv-cache-memory-gib)",
        },
    ),
    ("--speculative-config", {"metavar": "JSON", "help": SPEC_HELP}),
    (
        "--scheduling-policy",
        {"default": "fcfs", "choices": ["fcfs", "priority"], "help": "engine queue order"},
    ),
    (
        "--stuck-step-timeout",
        {
            "type": float,
            "default": 120.0,
            "metavar": "S",
            "help": "an engine step running longer than S seconds means the engine is stuck: "
            "the replica reports it on /health and /ready and exits (120)",
        },
    ),
]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    for flag, options in ENGINE_FLAGS:
        p.add_argument(flag, **options)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` as a replica command line (only those not at default)."""
    out: list[str] = []
    for flag, options in ENGINE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None or value == options.get("default") or value is False:
            continue
        out += [flag] if value is True else [flag, str(value)]
    return out


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine flags describe (raises ValueError on a bad value)."""
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        max_model_len=args.max_model_len,
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_queued_requests=args.max_queued_requests,
            policy=args.scheduling_policy,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_gib=args.kv_cache_memory_gib,
            enable_prefix_caching=not args.no_prefix_caching,
            cache_dtype=args.kv_cache_dtype,
        ),
        speculative=(
            None
            if args.speculative_config is None
            else SpeculativeConfig.parse(args.speculative_config)
        ),
    )
