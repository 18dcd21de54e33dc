"""Weights kept in the precision the model ships, multiplied by kernels made for them.

A GGUF ``Q4_1`` tensor holds, for every 32 consecutive inputs of a row, a scale ``d`` and a
minimum ``m`` (float16) and 32 four-bit codes ``q``: ``w = d * q + m``. torch's CPU int4
kernel (``aten._weight_int4pack_mm_for_cpu``) multiplies by groups of four-bit codes with a
scale and a zero per group, ``w = (q - 8) * scale + zero``: the same weights when
``scale = d`` and ``zero = m + 8 d``. So ``Int4Weights.from_q4_1`` hands the kernel the
model's own codes, not a second approximation (only ``d`` and ``zero`` are rounded to the
activations' bfloat16).

That kernel reads each weight once per row of input, so it wins where a step has few
rows (decoding a handful of sequences: the weights' bytes dominate) and loses where it has
many (a prompt's chunk: arithmetic dominates, and a dense bfloat16 matmul does it
faster). ``Linear`` therefore uses it for at most ``INT4_MAX_ROWS`` rows and its dense
weight beyond (measured on a 2-core AVX-512 BF16 host: 2.5-3.5x faster than bfloat16 at
one row, even at about 8, 1.5-2.5x slower at 32 and more).

Where the CPU has AVX-512 VNNI or AVX2, ``BlockWeights`` multiplies the same codes as
llama.cpp does (``kernels/block_matmul.cpp``): the activations are quantized to int8 per
block of 32 as well and each block is an integer dot product, 16 output rows at a time.
Measured on SmolLM2's layers (2-core Zen 4, VNNI): 3-4x faster than torch's int4 kernel at
every row count, 4x faster than dense bfloat16 (oneDNN, blocked layout) at one row,
1.4-1.6x at 8, 1.3-1.5x from 32 to 512 rows (eight activation rows a pass over the weights,
the activations quantized in AVX-512); the output head's Q8_0 codes 3x faster than torch's
int8 kernel at one row. On a 2-core Zen 3 (AVX2, no bfloat16): 5-7x faster than dense
float32 at one row, 2-3.5x at 32, 1.5-1.9x at 256. So they serve every step, a prompt's
chunks too, and no dense copy is kept.

``cpu_features()`` says what this CPU computes natively, for ``--dtype auto`` and
``--quantization auto``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sendpath.model.kernels import cpu_kernels

__all__ = [
    "GROUP",
    "INT4_MAX_ROWS",
    "BlockWeights",
    "Int4Weights",
    "Int8Weights",
    "block_kernels",
    "block_loop",
    "cpu_features",
    "cpu_model",
    "int4_supported",
    "matrix_engine",
    "native_bf16",
    "q4_0_codes",
    "q4_1_codes",
]

GROUP = 32  # inputs per scale: Q4_0 / Q4_1's block, and the kernel's group size
INT4_MAX_ROWS = 4  # above this many rows a step's matmul is faster dense (see the docstring)
_INNER_K_TILES = 8  # the packing's tile (ignored by the CPU kernel's own layout)


def cpu_features() -> dict[str, bool]:
    """Which of the CPU's features the kernels care about are present."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return {
        name: bool(caps.get(name, False))
        for name in ("avx2", "avx512_f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    }


def cpu_model() -> str:
    """The CPU's model name and family as /proc/cpuinfo gives them (a virtual machine may
    name only the vendor: the family tells Zen 4 (25) from Zen 5 (26))."""
    facts: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        facts.setdefault(key.strip(), value.strip())
    name = facts.get("model name", "unknown")
    family, model = facts.get("cpu family"), facts.get("model")
    return f"{name} (family {family}, model {model})" if family and model else name


def native_bf16() -> bool:
    """True when this CPU computes bfloat16 in hardware (AVX-512 BF16 or AMX)."""
    found = cpu_features()
    return found["avx512_bf16"] or found["amx_bf16"]


def block_kernels() -> Any | None:
    """The CPU kernels where ``BlockWeights`` can use them (built, with AVX-512 VNNI's or
    AVX2's loop), else None."""
    kernels = cpu_kernels()
    return kernels if kernels is not None and block_loop(kernels) != "portable" else None


def block_loop(kernels: Any) -> str:
    """The loop ``BlockWeights`` multiply with here: avx512-vnni, avx2 or portable."""
    loops: list[str] = kernels.block_loops()
    return loops[0]


def matrix_engine(kernels: Any | None) -> str:
    """What multiplies ``BlockWeights``' larger steps here: the AMX loops and the rows from
    which each takes a product (``kernels/block_matmul_amx.h``), or ``none`` and why."""
    if kernels is None:
        return "none: the CPU kernels are not built"
    loops: list[str] = kernels.matrix_loops()
    if not loops:
        return f"none: {kernels.matrix_unavailable()}"
    rows: list[int] = kernels.matrix_min_rows()
    (first, *others), (most, *fewer) = loops, rows
    tail = "".join(f", {loop} from {n}" for loop, n in zip(others, fewer, strict=True))
    return f"{first} tiles from {most} rows a step{tail}"


def int4_supported() -> bool:
    """True when torch has the CPU int4 kernel (and it runs here)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def q4_0_codes(raw: np.ndarray[Any, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q4_0 tensor's bytes [N, K/32 * 18] -> (codes, d, m) as ``q4_1_codes`` gives
    them: Q4_0's ``w = d * (q - 8)`` is Q4_1 with ``m = -8 d``."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, 18)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 2:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(-8 * d)


def q4_weight(
    codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, q4_0: bool = False
) -> np.ndarray[Any, Any]:
    """A four-bit tensor's float32 values [N, K] from its ``q4_1_codes`` /
    ``q4_0_codes``, to the bit as gguf's ``dequantize`` computes them: Q4_1's ``d * q +
    m``, Q4_0's ``d * (q - 8)`` (the same values as ``d * q - 8 d``, but where ``d`` is 0
    a code below 8 gives -0.0)."""
    n, k = codes.shape
    q = codes.numpy().reshape(n, k // 32, 32).astype(np.float32)
    scale = d.numpy()[..., None]
    out: np.ndarray[Any, Any] = (
        scale * (q - np.float32(8)) if q4_0 else scale * q + m.numpy()[..., None]
    )
    return out.reshape(n, k)


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dense [N, K] weight -> (codes, d, m) by each group's min and max: an
    approximation, for a model that does not ship four-bit weights (asked for with
    ``--quantization int4``)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    d = ((high - low) / 15).clamp(min=1e-12)
    codes = ((groups - low[..., None]) / d[..., None]).round().clamp(0, 15).to(torch.uint8)
    return codes.reshape(n, k), d, low


def q4_1_codes(raw: np.ndarray[Any, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q4_1 tensor's bytes [N, K/32 * 20] -> (codes [N, K] uint8 in 0..15, d and m
    [N, K/32] float32). A block is d (f16), m (f16), then 16 bytes: byte j holds code j in
    its low nibble and code j + 16 in its high one."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]  # [N, K/32, 16]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)  # [N, K]
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m)


@dataclass
class Int4Weights:
    """A [N, K] weight as the CPU int4 kernel takes it: packed codes and per-group
    (scale, zero) pairs [K/32, N, 2] in the activations' dtype."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    out_features: int
    in_features: int

    @classmethod
    def from_q4_1(
        cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype
    ) -> Int4Weights:
        """From Q4_1's codes [N, K] and its d, m [N, K/32] (``q4_1_codes``), exactly."""
        n, k = codes.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), _INNER_K_TILES
        )
        pairs = torch.stack([d, m + 8 * d], dim=-1)  # [N, K/32, 2]
        return cls(packed, pairs.transpose(0, 1).contiguous().to(dtype), n, k)

    def dequantize(self) -> torch.Tensor:
        """The weight as [N, K] float32 (for checks): what the kernel multiplies by."""
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
        return self.matmul(eye).t().float()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> x W^T [T, N]."""
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, GROUP, self.scales_and_zeros
        )
        return out


@dataclass
class Int8Weights:
    """A [N, K] weight as int8 codes [N, K] with one scale a row (the CPU kernel
    ``aten._weight_int8pack_mm``): w = code * scale."""

    codes: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def from_dense(cls, weight: torch.Tensor, dtype: torch.dtype) -> Int8Weights:
        """By each row's largest magnitude (an approximation of any finer format)."""
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        codes = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        return cls(codes.contiguous(), scales.to(dtype))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> x W^T [T, N]."""
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)
        return out


@dataclass
class BlockWeights:
    """A [N, K] weight in blocks of 32 inputs, ``w = d * code + m`` per block (the file's
    own Q4_1 or Q8_0 codes), in ``kernels/block_matmul.cpp``'s layout: multiplied with the
    activations quantized to int8 per block, as llama.cpp multiplies them."""

    kernels: Any  # block_kernels()
    codes: torch.Tensor  # [N/16, K/32, 256 or 512] uint8
    d: torch.Tensor  # [N/16, K/32, 16] float16, as the file stores it
    m: torch.Tensor
    out_features: int
    in_features: int

    @classmethod
    def from_q4_1(
        cls, kernels: Any, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor
    ) -> BlockWeights:
        """From Q4_1's codes [N, K] and its d, m [N, K/32] (``q4_1_codes``), exactly."""
        packed, scales, offsets = kernels.pack_q4(codes.to(torch.uint8), d.float(), m.float())
        return cls(kernels, packed, scales, offsets, codes.shape[0], codes.shape[1])

    @classmethod
    def q8_0(cls, kernels: Any, weight: torch.Tensor) -> BlockWeights:
        """Eight-bit codes and a scale per block of 32, by each block's largest magnitude:
        the codes themselves when the weight came from a Q8_0 tensor."""
        n, k = weight.shape
        padded = torch.zeros(n, -(-k // GROUP) * GROUP)
        padded[:, :k] = weight.float()
        blocks = padded.view(n, -1, GROUP)
        d = (blocks.abs().amax(-1) / 127).half().float()  # [N, K/32], as stored: float16
        codes = (blocks / d.clamp(min=1e-30)[..., None]).round().clamp(-127, 127)
        packed, scales, offsets = kernels.pack_q8(
            codes.to(torch.int8).view(n, -1)[:, :k].contiguous(), d
        )
        return cls(kernels, packed, scales, offsets, n, k)

    def dequantize(self) -> torch.Tensor:
        """The weight as [N, K] float32 (for checks), up to the activations' own int8
        rounding, which the identity matrix's rows do not have (on the vector loop: the
        matrix engine would take K rows in bfloat16)."""
        return self.matmul(torch.eye(self.in_features), block_loop(self.kernels)).t()

    def matmul(self, x: torch.Tensor, loop: str = "") -> torch.Tensor:
        """x [T, K] (float32 or bfloat16) -> x W^T [T, N], on ``loop`` ("": the kernel's
        choice by rows)."""
        out: torch.Tensor = self.kernels.block_matmul(
            x, self.codes, self.d, self.m, self.out_features, loop
        )
        return out
