"""Prefill and batch-1 decode speed of the built-in model: sendpath vs transformers.

Both run in this process on the same weights (the SmolLM2-135M-Instruct GGUF, dequantized),
same threads, same prompts, greedy, EOS ignored. Prefill tokens/s = prompt tokens / time to
the first token; decode tokens/s = (tokens - 1) / (last token time - first token time).
Each figure is the median of ``--repeats`` runs after one warm-up.

    .venv/bin/python benchmarks/model_speed.py [--prompt-len 512] [--decode-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from sendpath.llm import LLM
from sendpath.model.loader import builtin_model_path
from sendpath.request import SamplingParams

RESULTS = Path(__file__).parent / "results" / "model_speed.json"


def ours(llm: LLM, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """(seconds to first token, seconds from first to last token)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    stamps: list[float] = []
    start = time.perf_counter()
    llm.engine.add_request(ids, params)
    while llm.engine.has_unfinished_requests():
        if llm.engine.step():
            stamps.append(time.perf_counter())
    assert len(stamps) == new_tokens
    return stamps[0] - start, stamps[-1] - stamps[0]


class _Stamps:
    """A transformers streamer that notes when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def reference(model: Any, ids: list[int], new_tokens: int) -> tuple[float, float]:
    stamps = _Stamps()
    start = time.perf_counter()
    model.generate(
        torch.tensor([ids]),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        streamer=stamps,
    )
    assert len(stamps.times) == new_tokens
    return stamps.times[0] - start, stamps.times[-1] - stamps.times[0]


def measure(fn: Any, target: Any, ids: list[int], new: int, repeats: int) -> tuple[float, float]:
    fn(target, ids, new)  # warm-up
    runs = [fn(target, ids, new) for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    path = builtin_model_path()
    rows = []
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, device="cpu", enable_prefix_caching=False)  # runs repeat prompts
        hf: Any = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
        )
        hf.eval()
        text = "The quick brown fox jumps over the lazy dog. " * 200
        long_ids = llm.tokenizer.encode(text)[: args.prompt_len]
        short_ids = llm.tokenizer.encode_chat([{"role": "user", "content": "Tell me a story."}])
        for name, fn, target in (("sendpath", ours, llm), ("transformers", reference, hf)):
            with torch.inference_mode():
                ttft, _ = measure(fn, target, long_ids, 2, args.repeats)
                _, decode = measure(fn, target, short_ids, args.decode_tokens, args.repeats)
            rows.append(
                {
                    "engine": name,
                    "dtype": dtype,
                    "prefill_tokens": len(long_ids),
                    "prefill_tokens_per_s": round(len(long_ids) / ttft, 1),
                    "decode_tokens_per_s": round((args.decode_tokens - 1) / decode, 1),
                    "tpot_ms": round(1000 * decode / (args.decode_tokens - 1), 2),
                }
            )
            print(rows[-1], flush=True)
    for dtype in ("float32", "bfloat16"):
        ours_row, ref_row = (r for r in rows if r["dtype"] == dtype)
        for key in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            ours_row[f"{key}_ratio_vs_transformers"] = round(ours_row[key] / ref_row[key], 2)
    result = {
        "benchmark": "model_speed",
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "decode_prompt_tokens": len(short_ids),
        "decode_tokens": args.decode_tokens,
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
