"""The KV cache asks Linux for transparent huge pages before it is written: the advice is
on its memory (the kernel's own record of the range says so), the cache is zeros as
before, and what cannot be advised is left alone or refused with a reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from sendpath.model.loader import LoadedModel
from sendpath.runner.huge_pages import HUGE_PAGE, advise_huge_pages, zeros_on_huge_pages
from sendpath.runner.model_runner import ModelRunner

linux = pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc are Linux's")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: its range
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def thp_offered() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[never]" not in path.read_text()


@linux
def test_a_large_tensor_is_zeros_on_memory_advised_for_huge_pages() -> None:
    if not thp_offered():
        pytest.skip("this kernel offers no transparent huge pages (never, or not built in)")
    t = zeros_on_huge_pages((4, 3, 2**20), torch.int8, torch.device("cpu"))  # 12 MiB
    assert t.shape == (4, 3, 2**20) and t.dtype == torch.int8
    assert not t.any()
    assert "hg" in vm_flags(t.data_ptr() + t.numel() // 2)  # MADV_HUGEPAGE's flag


@linux
def test_the_runner_s_cache_is_advised(tiny: LoadedModel) -> None:
    if not thp_offered():
        pytest.skip("this kernel offers no transparent huge pages (never, or not built in)")
    runner = ModelRunner(tiny, 4096, 16)  # a few MiB a tensor
    for cache in (runner.k_cache, runner.v_cache):
        assert cache.numel() * cache.element_size() >= 2 * HUGE_PAGE
        assert "hg" in vm_flags(cache.data_ptr() + cache.numel() * cache.element_size() // 2)
        assert not cache.any()


def test_what_gains_nothing_is_not_advised_and_a_strided_view_is_refused() -> None:
    assert not advise_huge_pages(torch.zeros(1024))  # under one huge page
    assert not advise_huge_pages(torch.zeros(2**20, device="meta"))  # not in this memory
    with pytest.raises(ValueError, match="contiguous"):
        advise_huge_pages(torch.zeros(2**20, 4).t())
