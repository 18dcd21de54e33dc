"""Peak memory while loading a model: how close it stays to the loaded model's own size.

Writes a randomly initialised Llama-shaped GGUF file (F16 weights, the built-in model's
vocabulary; about 0.4 GB at the default size), then loads it in a fresh process per
setting with ``load_model`` and reads that process's peak resident memory (``ru_maxrss``).
Both are counted from just before ``load_model`` (Linux's ``VmHWM``, reset there, and
``VmRSS``), so Python and torch themselves are in neither: the peak while loading against
what the loaded model keeps resident (its weights in the layouts the engine runs).

    .venv/bin/python benchmarks/load_memory.py [--layers 12] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results" / "load_memory.json"

CHILD = """
import gc, sys, torch
from sendpath.model.loader import load_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
before = status("VmRSS")
path, dtype, quantization = sys.argv[1:4]
loaded = load_model(path, dtype=dtype, device="cpu", quantization=quantization)
gc.collect()
print(status("VmHWM") - before, status("VmRSS") - before)
"""


def write_model(path: Path, layers: int, hidden: int) -> None:
    """A random Llama-shaped GGUF (F16), with the built-in model's tokenizer metadata."""
    import gguf

    from sendpath.model import gguf_reader
    from sendpath.model.loader import builtin_model_path

    source = gguf_reader.read(builtin_model_path()).fields

    def field(name: str) -> Any:
        return source[name]

    vocab = len(field("tokenizer.ggml.tokens"))
    heads, kv_heads, ffn = hidden // 64, hidden // 256, hidden * 11 // 4
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(field("tokenizer.ggml.tokens"))
    writer.add_token_types(field("tokenizer.ggml.token_type"))
    writer.add_token_merges(field("tokenizer.ggml.merges"))
    writer.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float16))

    tensor("token_embd.weight", vocab, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    kv = kv_heads * 64
    for i in range(layers):
        b = f"blk.{i}."
        for name, shape in (
            ("attn_q", (hidden, hidden)),
            ("attn_k", (kv, hidden)),
            ("attn_v", (kv, hidden)),
            ("attn_output", (hidden, hidden)),
            ("ffn_gate", (ffn, hidden)),
            ("ffn_up", (ffn, hidden)),
            ("ffn_down", (hidden, ffn)),
        ):
            tensor(b + name + ".weight", *shape)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(b + norm + ".weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def peak(path: str, dtype: str, quantization: str) -> tuple[int, int]:
    """(peak resident bytes added while loading, resident bytes added once loaded) of a
    fresh process loading ``path``."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, path, dtype, quantization],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return int(out[0]), int(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "random-llama-f16.gguf"
        write_model(path, args.layers, args.hidden)
        file_bytes = path.stat().st_size
        rows = []
        for dtype, quantization in (("float32", "none"), ("bfloat16", "none")):
            rss, kept = peak(str(path), dtype, quantization)
            rows.append(
                {
                    "dtype": dtype,
                    "quantization": quantization,
                    "peak_added_mb": round(rss / 2**20, 1),
                    "loaded_mb": round(kept / 2**20, 1),
                    "peak_over_loaded": round(rss / kept, 2),
                }
            )
    result = {
        "machine": platform.processor() or platform.machine(),
        "file_mb": round(file_bytes / 2**20, 1),
        "layers": args.layers,
        "hidden": args.hidden,
        "rows": rows,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"file {result['file_mb']} MB")
    print("dtype     peak while loading MB  resident once loaded MB  peak / loaded")
    for r in rows:
        print(
            f"{r['dtype']:9} {r['peak_added_mb']:21} {r['loaded_mb']:24} {r['peak_over_loaded']:6}"
        )


if __name__ == "__main__":
    main()
