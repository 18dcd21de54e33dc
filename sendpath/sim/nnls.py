"""Non-negative least squares: ``argmin ||A x - b||`` subject to ``x >= 0``.

Lawson and Hanson's active-set method ("Solving Least Squares Problems", 1974, ch. 23),
written here because scipy is not a dependency. ``passive`` holds the coefficients that
are free (> 0); the others are pinned at 0. Each outer step frees the pinned coefficient
whose gradient most wants to grow; the inner loop solves the unconstrained problem on the
free set and, while that solution has a coefficient <= 0, steps back towards the previous
feasible point until one reaches 0 and pins it again. It ends when no pinned coefficient
would lower the residual (the KKT conditions hold within ``tol``).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["nnls"]

Array = NDArray[np.float64]


def nnls(a: Array, b: Array, max_iter: int | None = None) -> Array:
    """The non-negative ``x`` that minimises ``||a @ x - b||``; ``a`` is [m, n], ``b`` [m]."""
    m, n = a.shape
    if b.shape != (m,):
        raise ValueError(f"b has shape {b.shape}, expected ({m},)")
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * float(np.abs(a).sum(axis=0).max(initial=0.0)) * max(m, n)
    for _ in range(max_iter or 3 * n + 10):
        w = a.T @ (b - a @ x)  # minus the gradient: > 0 where growing x lowers the residual
        if passive.all() or float(w[~passive].max()) <= tol:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        while True:
            s = np.zeros(n)
            if passive.any():
                s[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if not passive.any() or float(s[passive].min()) > 0:
                break
            # step from x towards s as far as stays feasible; what reaches 0 is pinned again
            bad = passive & (s <= 0)
            gap = x[bad] - s[bad]  # >= 0: x >= 0 and s <= 0 there
            alpha = float(np.divide(x[bad], gap, out=np.zeros_like(gap), where=gap > 0).min())
            x = x + alpha * (s - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = s
    return x
