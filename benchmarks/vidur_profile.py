"""The synthetic H100 profile for Llama-3-8B that `vidur_run.py` points Vidur at.

Vidur 0.0.26 downloads its profiling data from HuggingFace at run time, which cannot be
reached from here, so this writes the same CSV schema Vidur's profiler produces from a
roofline model (GEMMs at 600 TFLOP/s, attention at 400 TFLOP/s, 2.6 TB/s HBM, small fixed
kernel overheads). Imported by `vidur_run.py` in Vidur's own virtualenv (pandas there).
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL_NAME = "meta-llama/Llama-3-8B"
DEVICE = "h100"
NETWORK_DEVICE = "h100_dgx"
PROFILE_NAME = "synthetic-roofline-llama-3-8b-h100-v1"
NETWORK_PROFILE_NAME = "synthetic-h100-dgx-v1"

# Llama-3-8B shapes (must match vidur's Llama38BModelConfig).
N_HEAD, N_KV_HEAD, N_EMBD, N_FFN, VOCAB = 32, 8, 4096, 14336, 128256
HEAD_DIM = N_EMBD // N_HEAD
KV_DIM = N_KV_HEAD * HEAD_DIM

# Synthetic H100 SXM (bf16) roofline constants.
GEMM_FLOPS = 600e12
ATTN_FLOPS = 400e12
HBM_BPS = 2.6e12
GEMM_OVERHEAD_MS = 0.008
ELEM_OVERHEAD_MS = 0.004
ATTN_OVERHEAD_MS = 0.010


# --------------------------------------------------------------------------
# synthetic profile (vidur profiler CSV schema)
# --------------------------------------------------------------------------


def _gemm_ms(n: int, k: int, m: int) -> float:
    flops = 2.0 * n * k * m
    nbytes = 2.0 * (k * m + n * k + n * m)
    return max(flops / GEMM_FLOPS, nbytes / HBM_BPS) * 1e3 + GEMM_OVERHEAD_MS


def _elem_ms(nbytes: float) -> float:
    return nbytes / HBM_BPS * 1e3 + ELEM_OVERHEAD_MS


def _attn_prefill_ms(kv: int, chunk: int) -> float:
    flops = 4.0 * N_HEAD * HEAD_DIM * chunk * (kv + chunk / 2.0)
    nbytes = (kv + chunk) * KV_DIM * 2 * 2 + chunk * N_EMBD * 2 * 2
    return max(flops / ATTN_FLOPS, nbytes / HBM_BPS) * 1e3 + ATTN_OVERHEAD_MS


def _attn_decode_ms(batch: int, kv: int) -> float:
    nbytes = batch * kv * KV_DIM * 2 * 2 + batch * N_EMBD * 2 * 2
    flops = 4.0 * N_HEAD * HEAD_DIM * batch * kv
    return max(flops / ATTN_FLOPS, nbytes / HBM_BPS) * 1e3 + ATTN_OVERHEAD_MS


def write_synthetic_profile(root: Path, block_size: int) -> tuple[str, str, str, str]:
    import pandas as pd

    compute_dir = root / "profiling_data" / PROFILE_NAME
    network_dir = root / "profiling_data" / NETWORK_PROFILE_NAME
    paths = (
        compute_dir / "mlp.csv.xz",
        compute_dir / "attention.csv.xz",
        network_dir / "all_reduce.csv.xz",
        network_dir / "send_recv.csv.xz",
    )
    if all(p.exists() for p in paths):
        return tuple(str(p) for p in paths)
    compute_dir.mkdir(parents=True, exist_ok=True)
    network_dir.mkdir(parents=True, exist_ok=True)

    shape = dict(
        n_head=N_HEAD,
        n_kv_head=N_KV_HEAD,
        n_embd=N_EMBD,
        n_expanded_embd=N_FFN,
        vocab_size=VOCAB,
        use_gated_mlp=True,
        num_tensor_parallel_workers=1,
    )
    tokens = (
        list(range(1, 129))
        + list(range(136, 1025, 8))
        + list(range(1088, 8193, 64))
        + list(range(8448, 32769, 256))
    )
    rows = []
    for n in tokens:
        rows.append(
            {
                **shape,
                "num_tokens": n,
                "time_stats.attn_pre_proj.median": _gemm_ms(n, N_EMBD, N_EMBD + 2 * KV_DIM),
                "time_stats.attn_post_proj.median": _gemm_ms(n, N_EMBD, N_EMBD),
                "time_stats.mlp_up_proj.median": _gemm_ms(n, N_EMBD, 2 * N_FFN),
                "time_stats.mlp_down_proj.median": _gemm_ms(n, N_FFN, N_EMBD),
                "time_stats.mlp_act.median": _elem_ms(n * N_FFN * 2 * 3),
                "time_stats.input_layernorm.median": _elem_ms(n * N_EMBD * 2 * 2),
                "time_stats.post_attention_layernorm.median": _elem_ms(n * N_EMBD * 2 * 2),
                "time_stats.attn_rope.median": _elem_ms(n * (N_EMBD + KV_DIM) * 2 * 2),
                "time_stats.add.median": _elem_ms(n * N_EMBD * 2 * 3),
            }
        )
    pd.DataFrame(rows).to_csv(paths[0], index=False, compression="xz")

    attn_shape = dict(
        n_embd=N_EMBD,
        n_q_head=N_HEAD,
        n_kv_head=N_KV_HEAD,
        block_size=block_size,
        num_tensor_parallel_workers=1,
    )
    kv_sizes = [0, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768]
    rows = []
    chunks = list(range(32, 1025, 32)) + list(range(1152, 8193, 128))
    for kv in kv_sizes:
        for chunk in chunks:
            if kv + chunk > 32768 + 8192:
                continue
            rows.append(
                {
                    **attn_shape,
                    "batch_size": 1,
                    "prefill_chunk_size": chunk,
                    "kv_cache_size": kv,
                    "time_stats.attn_prefill.median": _attn_prefill_ms(kv, chunk),
                    "time_stats.attn_decode.median": 0.0,
                    "time_stats.attn_kv_cache_save.median": _elem_ms(chunk * KV_DIM * 2 * 2 * 2),
                }
            )
    batches = list(range(1, 9)) + list(range(12, 129, 4))
    for kv in kv_sizes[1:]:
        for b in batches:
            rows.append(
                {
                    **attn_shape,
                    "batch_size": b,
                    "prefill_chunk_size": 0,
                    "kv_cache_size": kv,
                    "time_stats.attn_prefill.median": 0.0,
                    "time_stats.attn_decode.median": _attn_decode_ms(b, kv),
                    "time_stats.attn_kv_cache_save.median": _elem_ms(b * KV_DIM * 2 * 2 * 2),
                }
            )
    pd.DataFrame(rows).to_csv(paths[1], index=False, compression="xz")

    # Only read by vidur when TP>1 / PP>1 (not used here); NVLink-ish numbers.
    net = []
    for w in (1, 2, 4, 8):
        for size in [2**i for i in range(10, 31)]:
            net.append(
                {
                    "collective": "all_reduce",
                    "num_workers": w,
                    "devices_per_node": w,
                    "size": size,
                    "time_stats.all_reduce.median": 0.01 + size / 300e9 * 1e3,
                }
            )
    pd.DataFrame(net).to_csv(paths[2], index=False, compression="xz")
    net = []
    for dpn in (1, 2):
        for size in [2**i for i in range(10, 31)]:
            net.append(
                {
                    "collective": "send_recv",
                    "num_workers": 2,
                    "devices_per_node": dpn,
                    "size": size,
                    "time_stats.send_recv.median": 0.01
                    + size / (300e9 if dpn == 2 else 40e9) * 1e3,
                }
            )
    pd.DataFrame(net).to_csv(paths[3], index=False, compression="xz")

    for d, cfg in (
        (compute_dir, {"model": MODEL_NAME, "device_sku": DEVICE}),
        (network_dir, {"sku": NETWORK_DEVICE}),
    ):
        (d / "config.json").write_text(
            json.dumps({**cfg, "synthetic": True, "generator": "benchmarks/vidur_run.py"})
        )
    return tuple(str(p) for p in paths)
