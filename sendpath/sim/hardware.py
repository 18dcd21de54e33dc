"""Accelerators and models the roofline cost model knows.

Hardware figures are the vendors' datasheet peaks: dense BF16 tensor throughput (no
sparsity) and memory bandwidth. ``cpu`` is this development machine (2 cores, float32),
measured: ~95 GFLOP/s in the engine's batched matmuls and ~20 GB/s effective when a
batch-1 decode streams the 540 MB of SmolLM2-135M's float32 weights in ~27 ms
(benchmarks/README.md). Prices are indicative on-demand $/GPU-hour; pass your own.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HARDWARE", "MODELS", "Hardware", "ModelSpec", "hardware", "model_spec"]


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # peak dense FLOP/s at the model's dtype
    bandwidth: float  # memory bytes/s
    memory: float  # bytes
    usd_per_hour: float
    link_bandwidth: float = 0.0  # bytes/s between devices for tensor parallelism
    step_overhead_s: float = 0.001  # launch/scheduling cost per step, even when empty
    fp8_flops: float = 0.0  # peak dense FP8 FLOP/s (0: no FP8 tensor cores)


HARDWARE = {
    # NVIDIA A100 SXM 80GB datasheet: 312 TFLOPS BF16, 2,039 GB/s, NVLink 600 GB/s
    "A100": Hardware("A100-80GB-SXM", 312e12, 2.039e12, 80e9, 1.8, 300e9),
    # NVIDIA H100 SXM datasheet: 989 TFLOPS BF16 dense (FP8 1,979), 3.35 TB/s, NVLink 900 GB/s
    "H100": Hardware("H100-SXM", 989e12, 3.35e12, 80e9, 2.5, 450e9, fp8_flops=1979e12),
    # NVIDIA H200 SXM datasheet: same compute as H100, 4.8 TB/s, 141 GB
    "H200": Hardware("H200-SXM", 989e12, 4.8e12, 141e9, 3.5, 450e9, fp8_flops=1979e12),
    # NVIDIA L4 datasheet: 121 TFLOPS BF16 dense (FP8 242), 300 GB/s, 24 GB, PCIe
    "L4": Hardware("L4", 121e12, 300e9, 24e9, 0.7, 32e9, fp8_flops=242e12),
    # this machine, measured (see the module docstring); float32, ~11 ms dispatch a step
    "cpu": Hardware("cpu-2core", 95e9, 20e9, 24e9, 0.1, 0.0, 0.011),
}


@dataclass(frozen=True)
class ModelSpec:
    """The shapes that set a Llama-family model's cost."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False
    bytes_per_param: int = 2  # bfloat16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params(self) -> int:
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * (2 * self.hidden + 2 * kv)
        mlp = 3 * self.hidden * self.intermediate
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * (attn + mlp) + embed

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


MODELS = {
    "smollm2-135m": ModelSpec("SmolLM2-135M", 30, 576, 9, 3, 1536, 49152, tied=True),
    "llama-3.1-8b": ModelSpec("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256),
    "llama-3.1-70b": ModelSpec("Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256),
    # Llama 2 (their config.json files): full multi-head attention below 70B
    "llama-2-7b": ModelSpec("Llama-2-7B", 32, 4096, 32, 32, 11008, 32000),
    "llama-2-13b": ModelSpec("Llama-2-13B", 40, 5120, 40, 40, 13824, 32000),
    "llama-2-70b": ModelSpec("Llama-2-70B", 80, 8192, 64, 8, 28672, 32000),
}


def hardware(name: str) -> Hardware:
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; use one of {', '.join(HARDWARE)}") from None


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; use one of {', '.join(MODELS)}") from None
