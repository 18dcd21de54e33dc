"""CPU kernels of our own, built from C++ with the machine's compiler on first use.

``paged_attention.cpp``: decode attention over the paged KV cache, read in place (the torch
path copies every decoding sequence's whole context into a padded batch in every layer).
It is built by ``torch.utils.cpp_extension`` (ninja and gcc, ``-O3 -march=native``) into
``$SENDPATH_CACHE_DIR/kernels`` (default ``~/.cache/sendpath/kernels``), once per machine
and torch version: about 30 s the first time, a second after. Where it cannot be built
(no compiler, no headers), ``paged_attention()`` is ``None`` and the runner keeps the torch
path; the reason is logged once.
"""

from __future__ import annotations

import logging
import os
import shutil
import sysconfig
import threading
from pathlib import Path
from typing import Any

import torch

__all__ = ["kernel_dir", "paged_attention"]

logger = logging.getLogger("sendpath.kernels")
_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_lock = threading.Lock()
_built: dict[str, Any] = {}


def kernel_dir() -> Path:
    """Where built kernels are kept (one subfolder per torch version)."""
    base = os.environ.get("SENDPATH_CACHE_DIR") or str(Path.home() / ".cache" / "sendpath")
    return Path(base) / "kernels" / f"torch-{torch.__version__}"


def paged_attention() -> Any | None:
    """The built module (``paged_decode_attention(q, k, v, tables, lens, block_size,
    scale)``), or ``None`` where it cannot be built."""
    with _lock:
        if "paged" not in _built:
            _built["paged"] = _build()
        return _built["paged"]


def _build() -> Any | None:
    from torch.utils.cpp_extension import load

    scripts = sysconfig.get_path("scripts")  # the pip-installed ninja, off PATH in a venv
    if shutil.which("ninja") is None and (Path(scripts) / "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    target = kernel_dir()
    try:
        target.mkdir(parents=True, exist_ok=True)
        return load(
            name="sendpath_paged_attention",
            sources=[str(_SOURCE)],
            build_directory=str(target),
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, no headers: the torch path stays
        logger.warning("paged attention kernel not built (%s); decode uses the torch path", exc)
        return None
