"""The model's linear layer: y = x W^T, with W in whichever layout serves this step best
(checkpoint order, transposed, oneDNN-packed, or a low-precision copy from ``quant.py``
for products of few rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from sendpath.model.quant import BlockWeights, Int4Weights, Int8Weights

__all__ = ["Linear"]


class Linear(nn.Module):
    """y = x W^T without bias, W stored [out, in] as in checkpoints, or [in, out] when faster.

    ``use_transposed_layout()`` keeps W^T ([in, out]) and computes ``x @ W^T`` as a plain
    gemm: on CPU in float32 this makes batch-1 decode's one-row products ~1.6x faster and
    costs nothing at larger batches. (In bfloat16 on CPU the same layout is ~20x slower,
    so it is used for float32 only.)

    ``use_quantized(weights, max_rows)`` adds the weight in a low-precision form
    (``quant.py``: the model's own four-bit codes, or int8): a product of at most
    ``max_rows`` rows uses it, a larger one the dense weight, whichever is faster there
    (``None``: every product uses it; ``drop_dense()`` then frees the dense weight).

    ``use_packed_layout()`` (bfloat16 on a CPU that computes it natively) hands W to oneDNN
    once, in the blocked layout its matmul wants, instead of on every call: measured on
    SmolLM2's layers, 1.6x faster at 8 rows and 1.2x at 32, the same results. The dense
    weight is then only a shape (on the meta device): the packed copy replaces it.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.transposed = False
        self.quantized: Int4Weights | Int8Weights | BlockWeights | None = None
        self.quantized_rows: int | None = 0
        self.packed: torch.Tensor | None = None  # oneDNN's layout (use_packed_layout)

    def use_quantized(
        self, weights: Int4Weights | Int8Weights | BlockWeights, max_rows: int | None
    ) -> None:
        self.quantized, self.quantized_rows = weights, max_rows

    def drop_dense(self) -> None:
        """Free the dense weight, where the low-precision one serves every product."""
        if self.serves_dense:
            raise ValueError("only a weight quantized for every product can drop its dense one")
        meta = torch.empty_like(self.weight, device="meta")
        self.weight = nn.Parameter(meta, requires_grad=False)
        self.packed = None

    @property
    def serves_dense(self) -> bool:
        """Whether some product still uses the dense weight."""
        return self.quantized is None or self.quantized_rows is not None

    def use_packed_layout(self) -> None:
        if self.packed is None and self.serves_dense:
            w = self.weight.detach()
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w)
            self.weight = nn.Parameter(torch.empty_like(w, device="meta"), requires_grad=False)

    def use_transposed_layout(self) -> None:
        if not self.transposed:
            self.weight = nn.Parameter(self.weight.detach().t().contiguous(), requires_grad=False)
            self.transposed = True

    @property
    def weight_out_in(self) -> torch.Tensor:
        """W as [out, in], whatever the storage layout (a copy when packed)."""
        if self.weight.is_meta and self.packed is None:
            raise ValueError("the dense weight was dropped (drop_dense)")
        if self.packed is not None:
            return self.packed.to_dense()
        return self.weight.t() if self.transposed else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.quantized_rows
        if self.quantized is not None and (rows is None or x.shape[0] <= rows):
            return self.quantized.matmul(x)
        if self.packed is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.packed, None, "none", [], ""
            )
            return out
        return x @ self.weight if self.transposed else F.linear(x, self.weight)
