"""CPU kernels of our own, built from C++ with the machine's compiler on first use.

- ``paged_attention.cpp``: attention over the paged KV cache, read in place, for decodes
  and prompt chunks alike (the torch path copies every decoding sequence's whole context
  into a padded batch in every layer); ``paged_attention_bf16.cpp`` its bfloat16 task on
  AVX-512 BF16 dot products, ``paged_attention_int8.cpp`` its task on an int8 cache on
  AVX-512 VNNI's integer dot products, ``paged_prefill_bf16.cpp`` a prompt chunk's rows a tile at a
  time on them (where AMX's tiles run, ``paged_prefill_amx.h``'s flash-style kernel on
  bfloat16 tiles instead: ``paged_prefill_amx_impl.h``, built on the tiles and on their
  software model as the matmul's designs are), ``paged_prefill_f32.cpp`` a prompt chunk's
  rows a tile at a time with float32 activations (a CPU without bfloat16 arithmetic:
  AVX-512 or AVX2 with FMA), ``paged_attention_avx2.cpp`` its task on AVX2 (no AVX-512),
  and ``attention_simd.h`` and ``avx512_lanes.h`` what they share.
- ``fused_ops.cpp``: the small operations around a layer's matmuls (residual add + RMSNorm,
  RoPE, the cache write, SiLU and its product), one call each instead of about six torch
  ops each, over ``vec.h``'s registers (AVX-512 or AVX2).
- ``block_matmul.cpp``: products with block-quantized weights (the file's Q4_1 and Q8_0
  codes) as llama.cpp computes them, int8 activations and AVX-512 VNNI dot products
  (``model/quant.py``'s ``BlockWeights``); ``block_matmul_avx2.cpp`` the same on AVX2.
- ``matrix_engine.cpp``: where AMX's tiles run (the CPU has them and Linux grants the
  process their state, asked for once), block_matmul's products of 32 rows or more go to
  ``block_matmul_amx.h``'s bfloat16 tiles over a dequantized panel, of 16 to 31 rows to
  its int8 tiles (the VNNI loop's bits; their per-block fix-ups hold them to 1.1-1.5x it).
  ``block_matmul_amx_impl.h`` writes both once over ``amx_tiles.h``'s operations, built
  twice: on the tiles (``block_matmul_amx.cpp``) and on a software model of them
  (``block_matmul_amx_emulated.cpp``, loops ``amx-int8-emulated`` and
  ``amx-bf16-emulated``), which the tests check wherever AVX-512 BF16 runs.
- ``layer_stack.cpp``: every decoder layer of a step in one call, with those kernels, for a
  model whose layers all have block-quantized weights (``LlamaModel.use_kernels``): the
  Python between a layer's nine kernel calls cost about a third of a one-request step.

The kernels release the GIL while they compute, so a server's event loop streams tokens
beside a step. They are one module (``bindings.cpp``; ``kernels.h`` declares what each
source defines), built by ``torch.utils.cpp_extension`` (ninja and gcc, ``-O3
-march=native``) into ``$SENDPATH_CACHE_DIR/kernels`` (default
``~/.cache/sendpath/kernels``), once per torch version, environment and source: about a
minute the first time, a second after. Where it cannot be built (no compiler, no
headers), ``cpu_kernels()`` is ``None``, the model and the runner keep their torch
paths, and the reason is logged once; so too where the folder or the built module could
have been written by another user (``native.trusted``): it is not loaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

import torch

from sendpath.native import NativeBuildError, cache_dir, trusted

__all__ = ["cpu_kernels", "kernel_dir"]

logger = logging.getLogger("sendpath.model.kernels")
_NAME = "sendpath_cpu_kernels"
_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "bindings.cpp",
        "paged_attention.cpp",
        "paged_attention_bf16.cpp",
        "paged_attention_int8.cpp",
        "paged_attention_avx2.cpp",
        "paged_prefill_bf16.cpp",
        "paged_prefill_f32.cpp",
        "fused_ops.cpp",
        "block_matmul.cpp",
        "block_matmul_avx2.cpp",
        "matrix_engine.cpp",
        "block_matmul_amx.cpp",
        "block_matmul_amx_emulated.cpp",
        "paged_prefill_amx.cpp",
        "paged_prefill_amx_emulated.cpp",
        "layer_stack.cpp",
    )
]
# in the build's key, not compiled
_HEADERS = [
    Path(__file__).with_name(name)
    for name in (
        "amx_tiles.h",
        "attention_simd.h",
        "avx512_lanes.h",
        "block_matmul.h",
        "block_matmul_amx.h",
        "block_matmul_amx_impl.h",
        "kernels.h",
        "paged_prefill_amx.h",
        "paged_prefill_amx_impl.h",
        "vec.h",
    )
]
_lock = threading.Lock()
_built: dict[str, Any] = {}


def kernel_dir() -> Path:
    """Where built kernels are kept: one subfolder per torch version, Python environment
    and kernel source. Two checkouts (or venvs) share none, so neither rebuilds the
    other's (a build's command line names its venv's torch headers and the sources' paths,
    and ninja rebuilds everything when that changes: a minute and more on 2 cores)."""
    key = hashlib.sha256(sys.prefix.encode())
    for source in _SOURCES + _HEADERS:
        key.update(str(source).encode())
        key.update(source.read_bytes())
    return cache_dir() / "kernels" / f"torch-{torch.__version__}-{key.hexdigest()[:12]}"


def cpu_kernels() -> Any | None:
    """The built module (its functions are listed in ``bindings.cpp``), or ``None`` where
    it cannot be built."""
    with _lock:
        if "cpu" not in _built:
            _built["cpu"] = _build()
        return _built["cpu"]


def _build() -> Any | None:
    from torch.utils.cpp_extension import load

    scripts = sysconfig.get_path("scripts")  # the pip-installed ninja, off PATH in a venv
    if shutil.which("ninja") is None and (Path(scripts) / "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    target = kernel_dir()
    built = target / f"{_NAME}.so"
    try:
        target.mkdir(mode=0o755, parents=True, exist_ok=True)
        trusted(target, *([built] if built.exists() else []))
    except (OSError, NativeBuildError) as exc:
        logger.warning("CPU kernels not loaded (%s); the model uses its torch paths", exc)
        return None
    umask = os.umask(0o022)  # what ninja makes, nobody else can write (under _lock)
    try:
        return load(
            name=_NAME,
            sources=[str(source) for source in _SOURCES],
            build_directory=str(target),
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, no headers: the torch path stays
        logger.warning("CPU kernels not built (%s); the model uses its torch paths", exc)
        return None
    finally:
        os.umask(umask)
