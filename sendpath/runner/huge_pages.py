"""The KV cache on transparent huge pages, where Linux offers them.

A busy replica's decodes read their blocks scattered over the whole cache (hundreds of
MB): on 4 KB pages nearly every block a step touches is a TLB miss and a page walk. Most
Linux systems set transparent huge pages to ``madvise`` (only memory that asks gets them),
so the cache asks (``madvise(MADV_HUGEPAGE)``) before its pages are first written: its
zeroing then faults every whole, aligned 2 MB stretch of it in as one huge page (up to
2 MB at either end, where the allocation is not aligned to one, stays on small pages).
It is zeroed either way, so this takes no more memory. Measured in benchmarks/README.md
(a 32-decode step's attention over scattered blocks).
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch

__all__ = ["advise_huge_pages", "zeros_on_huge_pages"]

logger = logging.getLogger("sendpath.runner")

HUGE_PAGE = 2 * 2**20  # smaller tensors would gain no huge page


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages under ``t``'s memory (CPU, contiguous, Linux): whether the kernel
    took the advice. Pages already written stay as they are; later faults get huge ones."""
    if not t.is_contiguous():
        raise ValueError("only a contiguous tensor's memory is one range to advise")
    nbytes = t.numel() * t.element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux's (its number differs by CPU)
    if advice is None or t.device.type != "cpu" or nbytes < HUGE_PAGE:
        return False
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page  # whole pages inside the tensor
    end = (t.data_ptr() + nbytes) // page * page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, end - start, advice) != 0:
        logger.debug("no huge pages for the KV cache: madvise: errno %d", ctypes.get_errno())
        return False
    return True


def zeros_on_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``torch.zeros(shape)``, its memory advised onto huge pages before it is written."""
    t = torch.empty(shape, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t.zero_()
