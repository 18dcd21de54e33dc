"""The fused layer kernels (``kernels/fused_ops.cpp``) against the torch ops they replace,
in float32 and bfloat16, on row counts that take the single-thread and pooled paths and a
width that leaves a tail after the 16-wide vectors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn import functional as F

from sendpath.model.rope import rotate_half

DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Equal up to one rounding of the dtype (the kernels round once, torch after each op)."""
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    return got.dtype == dtype and torch.allclose(
        got.float(), want.float(), atol=tolerance, rtol=tolerance
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (3, 40), (200, 576)])
def test_fused_add_rms_norm_is_the_add_then_the_norm(
    kernel: Any, dtype: torch.dtype, rows: int, dim: int
) -> None:
    torch.manual_seed(0)
    x, residual = torch.randn(rows, dim).to(dtype), torch.randn(rows, dim).to(dtype)
    weight = torch.randn(dim).to(dtype)
    want_residual = residual + x
    want = F.rms_norm(want_residual, (dim,), weight=weight, eps=1e-5)
    kernel.fused_add_rms_norm(x, residual, weight, 1e-5)  # in place
    assert torch.equal(residual, want_residual)  # the stream exactly as torch rounds it
    assert close(x, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rotary_rotates_queries_and_keys_and_leaves_values(
    kernel: Any, dtype: torch.dtype, rows: int
) -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).to(dtype)
    angles = torch.randn(rows, dim // 2).repeat(1, 2)
    cos = angles.cos().to(dtype)
    sin = torch.cat([-angles[:, : dim // 2].sin(), angles[:, dim // 2 :].sin()], -1).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, -1, dim)
    want = qk * cos[:, None] + rotate_half(qk, sin[:, None])
    values = qkv[:, (heads + kv_heads) * dim :].clone()
    kernel.rotary_(qkv, cos, sin, heads + kv_heads, dim)
    assert close(qkv[:, : (heads + kv_heads) * dim].view(rows, -1, dim), want, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], values)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (5, 40), (64, 1536)])
def test_silu_and_mul_is_silu_of_the_gate_times_up(
    kernel: Any, dtype: torch.dtype, rows: int, width: int
) -> None:
    torch.manual_seed(0)
    gate_up = (torch.randn(rows, 2 * width) * 4).to(dtype)
    gate, up = torch.split(gate_up, width, dim=-1)
    assert close(kernel.silu_and_mul(gate_up), F.silu(gate.float()) * up.float(), dtype)


def test_silu_saturates_without_nan(kernel: Any) -> None:
    gate_up = torch.tensor([[-1e4, 1e4, -100.0, 100.0] * 4 + [1.0] * 16])
    assert torch.equal(kernel.silu_and_mul(gate_up), F.silu(gate_up[:, :16]) * gate_up[:, 16:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_puts_each_tokens_heads_in_its_slot(kernel: Any, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    kv_heads, dim, slots = 3, 8, 32
    qkv = torch.randn(5, (4 + 2 * kv_heads) * dim).to(dtype)  # k and v are strided views
    _, k, v = torch.split(qkv.view(5, -1, dim), [4, kv_heads, kv_heads], dim=1)
    k_cache, v_cache = (
        torch.zeros(kv_heads, slots, dim, dtype=dtype),
        torch.zeros(kv_heads, slots, dim, dtype=dtype),
    )
    where = torch.tensor([7, 0, 31, 12, 13])
    kernel.write_kv(k, v, k_cache, v_cache, where)
    assert torch.equal(k_cache[:, where], k.transpose(0, 1))
    assert torch.equal(v_cache[:, where], v.transpose(0, 1))
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[where] = False
    assert not k_cache[:, untouched].any() and not v_cache[:, untouched].any()
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.write_kv(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, 3, slots]))
