"""The KV cache on transparent huge pages, where Linux offers them.

A busy replica's decodes read their blocks scattered over the whole cache (hundreds of
MB): on 4 KB pages nearly every block a step touches is a TLB miss and a page walk. Most
Linux systems set transparent huge pages to ``madvise`` (only memory that asks gets them),
so the cache asks (``madvise(MADV_HUGEPAGE)``) before its pages are first written: its
zeroing then faults it in 2 MB pages. It is zeroed either way, so this takes no more
memory. Measured in benchmarks/README.md (a 32-decode step's attention, blocks scattered).
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

__all__ = ["advise_huge_pages", "zeros_on_huge_pages"]

logger = logging.getLogger("sendpath.runner")

MADV_HUGEPAGE = 14  # Linux's, on every architecture
PAGE = 4096
HUGE_PAGE = 2 * 2**20  # smaller tensors would gain no huge page


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages under ``t``'s memory (CPU, contiguous, Linux): whether the kernel
    took the advice. Pages already written stay as they are; later faults get huge ones."""
    nbytes = t.numel() * t.element_size()
    if sys.platform != "linux" or t.device.type != "cpu" or nbytes < HUGE_PAGE:
        return False
    if not t.is_contiguous():
        raise ValueError("only a contiguous tensor's memory is one range to advise")
    start = -(-t.data_ptr() // PAGE) * PAGE  # whole pages inside the tensor
    end = (t.data_ptr() + nbytes) // PAGE * PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(start, end - start, MADV_HUGEPAGE) != 0:
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
