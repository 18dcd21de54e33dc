"""Speculative decoding (n-gram prompt lookup) on the built-in model: how much faster the
words come, on answers that quote their prompt and on free chat, in one run.

Three engines in one process, the same weights (``--dtype auto --quantization auto``, as
`sendpath serve` runs): without speculation; with ``{"method": "ngram"}`` at its defaults
(drafts only in steps with at most ``disable_by_batch_size`` decodes); and with drafts in
every step whatever the batch (to show where the auto-off line lies). Each workload is
greedy, ``max_tokens`` 128, and runs once on each engine to warm it, then on each in
turn, ``--rounds`` times, each round in another order; at concurrency 1 the prompts run
one at a time, at 8 and 32 that many at once (the prompt set repeated). Reported per
workload: output tokens/s of each engine (the median over rounds), the ratios to the
engine without speculation, the share of drafts kept, and whether every greedy answer is
token for token the one without speculation.

    .venv/bin/python benchmarks/speculative.py [--rounds 3] [--concurrency 1 8 32]
    .venv/bin/python benchmarks/speculative.py --draft-layers 8 15 --concurrency 1

Aims (issue 42): at least 1.6x at one request on the quoting prompts, never below 0.95x
on free chat, identical greedy text. Results: ``benchmarks/results/speculative.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from sendpath.llm import LLM
from sendpath.model.loader import builtin_model_path
from sendpath.model.quant import cpu_features, cpu_model
from sendpath.request import SamplingParams

RESULTS = Path(__file__).parent / "results" / "speculative.json"

DOCUMENT = (
    "The town council met on Tuesday evening to review the budget for the new public "
    "library. After a long discussion, members agreed to increase funding for children's "
    "books by ten percent, to extend opening hours on Saturdays and Sundays, and to hire "
    "two additional librarians before the end of the year. A proposal to build a small "
    "cafe inside the library was rejected because of its cost, estimated at two hundred "
    "thousand dollars. The council will meet again next month to discuss parking."
)
CODE = """def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    total = total + total * tax_rate
    return total
"""
QUOTING = [
    f"Here is a report:\n\n{DOCUMENT}\n\nRewrite the report above word for word, but "
    "change 'library' to 'museum'.",
    f"Here is a report:\n\n{DOCUMENT}\n\nCopy the first three sentences of the report.",
    f"Here is some Python code:\n\n{CODE}\nRename the function to compute_total and "
    "return the whole code.",
    f"Answer from this document only.\n\n{DOCUMENT}\n\nWhat did the council agree to? "
    "Quote the document.",
    f"Fix the spelling in this text and return it in full:\n\n{DOCUMENT.replace('the ', 'teh ')}",
    f"Here is some Python code:\n\n{CODE}\nAdd a docstring to the function and return the "
    "whole code.",
]
FREE = [
    "Write a short story about a robot who learns to paint.",
    "What are three good ways to stay focused while studying?",
    "Explain how a rainbow forms, for a ten-year-old.",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "Why do cats purr? Answer in a few sentences.",
    "Describe a walk through a forest in autumn.",
]


def engines(draft_layers: list[int]) -> dict[str, LLM]:
    """The engines to compare: without speculation, then prompt lookup (at its defaults
    and in every step), or with ``draft_layers``, the built-in model's own first layers
    as its draft model (3 drafts a step)."""
    if draft_layers:
        path = str(builtin_model_path())
        drafts = {
            f"self_draft_{n}_layers": LLM(
                speculative_config={"model": path, "draft_layers": n, "num_speculative_tokens": 3}
            )
            for n in draft_layers
        }
        return {"off": LLM(), **drafts}
    ngram: dict[str, object] = {"method": "ngram"}
    return {
        "off": LLM(),
        "ngram": LLM(speculative_config=ngram),
        "ngram_every_batch": LLM(speculative_config={**ngram, "disable_by_batch_size": 1024}),
    }


def run(llm: LLM, prompts: list[str], concurrency: int, params: SamplingParams) -> dict[str, Any]:
    """Output tokens/s of ``prompts`` at ``concurrency``; their token ids and the drafts."""
    speculator = llm.engine.speculator
    before = (0, 0) if speculator is None else (
        speculator.stats.num_draft_tokens, speculator.stats.num_accepted_tokens
    )  # fmt: skip
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    start = time.perf_counter()
    if concurrency == 1:
        outputs = [llm.chat(c, params)[0] for c in conversations]
    else:
        wanted = (conversations * (concurrency // len(conversations) + 1))[:concurrency]
        outputs = llm.chat(wanted, params)
    seconds = time.perf_counter() - start
    ids = [o.outputs[0].token_ids for o in outputs]
    drafts = kept = 0
    if speculator is not None:
        drafts = speculator.stats.num_draft_tokens - before[0]
        kept = speculator.stats.num_accepted_tokens - before[1]
    tokens = sum(len(i) for i in ids)
    return {"tokens_per_s": tokens / seconds, "ids": ids, "drafts": drafts, "kept": kept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--draft-layers",
        type=int,
        nargs="+",
        default=[],
        metavar="N",
        help="instead of prompt lookup: the built-in model's first N layers as its draft "
        "model (results in speculative_draft.json)",
    )
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llms = engines(args.draft_layers)
    rows = []
    for kind, prompts in (("quoting", QUOTING), ("free chat", FREE)):
        for concurrency in args.concurrency:
            got: dict[str, list[dict[str, Any]]] = {name: [] for name in llms}
            for llm in llms.values():  # warm: each engine's prefix cache holds the prompts
                run(llm, prompts, concurrency, params)
            names = list(llms)
            for n in range(args.rounds):  # each round in another order: drift hits all alike
                for name in names[n % len(names) :] + names[: n % len(names)]:
                    got[name].append(run(llms[name], prompts, concurrency, params))
            speed = {n: statistics.median(r["tokens_per_s"] for r in rs) for n, rs in got.items()}
            same = all(r["ids"] == got["off"][0]["ids"] for rs in got.values() for r in rs)
            row: dict[str, Any] = {"prompts": kind, "concurrency": concurrency}
            row["tokens_per_s"] = {n: round(v, 1) for n, v in speed.items()}
            row["ratio"] = {n: round(v / speed["off"], 3) for n, v in speed.items() if n != "off"}
            for name in names[1:]:
                drafts = sum(r["drafts"] for r in got[name])
                kept = sum(r["kept"] for r in got[name])
                row[f"kept_share_{name}"] = round(kept / drafts, 3) if drafts else None
                row[f"drafts_{name}"] = drafts
            row["identical_greedy_text"] = same
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "cpu_features": cpu_features(),
        "model": "built-in SmolLM2-135M-Instruct (Q4_1 GGUF), dtype and quantization auto",
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "rows": rows,
    }
    out = RESULTS.with_name("speculative_draft.json") if args.draft_layers else RESULTS
    out.write_text(json.dumps(result, indent=2) + "\n")
    others = list(llms)[1:]
    print(f"\n{'prompts':<11}{'at':>4}{'off tok/s':>11}" + "".join(f"{n:>24}" for n in others))
    for row in rows:
        cells = ""
        for name in others:
            share = row[f"kept_share_{name}"]
            kept = "" if share is None else f" ({share:.0%} kept)"
            cells += f"{str(row['ratio'][name]) + 'x' + kept:>24}"
        differs = "" if row["identical_greedy_text"] else "  TEXT DIFFERS"
        head = f"{row['prompts']:<11}{row['concurrency']:>4}{row['tokens_per_s']['off']:>11}"
        print(head + cells + differs)


if __name__ == "__main__":
    main()
