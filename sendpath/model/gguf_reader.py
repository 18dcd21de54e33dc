"""A GGUF file's metadata and tensors, as llama.cpp writes them (GGUF versions 2 and 3,
little-endian).

The metadata is parsed in one pass over the mapped bytes: a value is a Python value (a
string, a number, a list of them) made straight from its bytes. The ``gguf`` package's
reader makes numpy views of every part of every value instead, which for the built-in
model's 49,152 tokens and 48,900 merges takes about 5 s of a 9 s load on a Zen 3 core;
this takes a tenth of a second. Tensors are views of the mapped file, shaped and typed
as that reader shapes them (floats and integers by element, quantized types as bytes a
row), so ``gguf.quants.dequantize`` reads them unchanged.

A file is not trusted: every length and count is checked against the bytes that remain
before it is used, and a file that is cut short, lies about a length or nests arrays
without end raises ``GGUFError`` saying what is wrong and where. Strings are UTF-8, as the
format says; outside the tokenizer's keys a string that is not keeps its bad bytes as
U+FFFD. An array of arrays (which no writer we know makes) is a list of lists.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

__all__ = ["GGUFError", "GGUFFile", "Tensor", "read"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_DIM = 2**63  # a dimension is an int64 in ggml
MAX_NESTING = 8  # arrays of arrays: far more than any writer uses
UINT32, STRING, ARRAY = 4, 8, 9
# the GGUF value types with a fixed size: their struct format
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
# tensor types read by element (the rest as bytes a row, as gguf's reader does)
ELEMENTS = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFError(ValueError):
    """The file is not a GGUF file this reader can read; the message says why."""


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the dimension that moves fastest first
    data: np.ndarray[Any, Any]  # read-only, numpy's order (gguf's reader's shape)


@dataclass(frozen=True)
class GGUFFile:
    version: int
    fields: dict[str, Any]  # each metadata key's value
    tensors: list[Tensor]  # in the file's order


class _Bytes:
    """A cursor over the file's bytes that refuses to read past their end."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.size, self.at = buffer, len(buffer), 0

    def take(self, n: int, what: str) -> int:
        """Where ``n`` bytes of ``what`` start (the cursor moves past them)."""
        start = self.at
        if n < 0 or n > self.size - start:
            raise GGUFError(
                f"{what} at byte {start} needs {n} bytes, but the file has "
                f"{self.size - start} left: it is cut short or corrupt"
            )
        self.at = start + n
        return start

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack_from(fmt, self.buffer, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, each: int) -> int:
        """A uint64 count of items of at least ``each`` bytes, checked against what is left
        (so a huge count fails here, not after a long loop or a huge allocation)."""
        n: int = self.scalar("<Q", what)
        if n * each > self.size - self.at:
            raise GGUFError(
                f"{what} at byte {self.at - 8} says {n} items, more than the "
                f"{self.size - self.at} bytes left can hold: the file is corrupt"
            )
        return n

    def string(self, what: str, strict: bool = True) -> str:
        """A string; not UTF-8 is an error where ``strict``, else its bad bytes become
        U+FFFD."""
        n = self.count(what, 1)
        start = self.take(n, what)
        try:
            return self.buffer[start : start + n].decode("utf-8", "strict" if strict else "replace")
        except UnicodeDecodeError as exc:
            raise GGUFError(f"{what} at byte {start} is not UTF-8 ({exc.reason})") from exc

    def value(self, kind: int, what: str, strict: bool = True, depth: int = 0) -> Any:
        fmt = SCALARS.get(kind)
        if fmt is not None:
            return self.scalar(fmt, what)
        if kind == STRING:
            return self.string(what, strict)
        if kind != ARRAY:
            raise GGUFError(f"{what}: unknown value type {kind}")
        if depth >= MAX_NESTING:
            raise GGUFError(f"{what}: arrays nested more than {MAX_NESTING} deep")
        item: int = self.scalar("<I", what)
        fmt = SCALARS.get(item)
        if fmt is not None:  # numbers: one numpy read
            size = struct.calcsize(fmt)
            n = self.count(what, size)
            start = self.take(n * size, what)
            return np.frombuffer(self.buffer, np.dtype(fmt), n, start).tolist()
        if item == STRING:
            return [self.string(what, strict) for _ in range(self.count(what, 8))]
        return [self.value(item, what, strict, depth + 1) for _ in range(self.count(what, 12))]


def read(path: Path | str) -> GGUFFile:
    """The file's metadata and tensors; ``GGUFError`` (or ``OSError``) where it cannot
    be read. The tensors' data stay valid while any of them is referenced (they keep the
    mapping open)."""
    with open(path, "rb") as f:
        try:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:  # an empty file cannot be mapped
            raise GGUFError("the file is empty") from exc
    b = _Bytes(buffer)
    at = b.take(4, "the magic number")
    magic = buffer[at : at + 4]
    if magic != MAGIC:
        raise GGUFError(f"it starts with {magic!r}, not GGUF's magic number {MAGIC!r}")
    version: int = b.scalar("<I", "the version")
    if version not in VERSIONS:
        if version & 0xFFFF == 0:  # a byte-swapped small number
            raise GGUFError("it is a big-endian GGUF file; sendpath reads little-endian ones")
        raise GGUFError(
            f"GGUF version {version}; sendpath reads versions {VERSIONS[0]}-{VERSIONS[-1]} "
            "(convert the model with a current llama.cpp)"
        )
    n_tensors = b.count("the tensor count", 8 + 4 + 4 + 8)
    n_fields = b.count("the metadata count", 8 + 4)
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = b.string("a metadata key")
        if key in fields:
            raise GGUFError(f"metadata key {key!r} appears twice")
        kind: int = b.scalar("<I", f"metadata {key}")
        if key == "general.alignment" and kind != UINT32:
            raise GGUFError(f"general.alignment has value type {kind}, not UINT32 ({UINT32})")
        # the tokenizer's strings must be exact; elsewhere a writer's stray bytes are kept
        # as U+FFFD (a model's description is no reason to refuse it)
        fields[key] = b.value(kind, f"metadata {key}", strict=key.startswith("tokenizer."))
    infos = [_tensor_info(b) for _ in range(n_tensors)]
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"general.alignment {alignment!r} is not a power of two")
    start = -(-b.at // alignment) * alignment
    names: set[str] = set()
    tensors = []
    for name, shape, kind, offset in infos:
        if name in names:
            raise GGUFError(f"tensor {name!r} appears twice")
        names.add(name)
        tensors.append(_tensor(buffer, start, name, shape, kind, offset))
    return GGUFFile(version, fields, tensors)


def _tensor_info(b: _Bytes) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = b.string("a tensor name")
    n_dims: int = b.scalar("<I", f"tensor {name}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"tensor {name!r} has {n_dims} dimensions (1-{MAX_DIMS} are possible)")
    shape = struct.unpack_from(f"<{n_dims}Q", b.buffer, b.take(8 * n_dims, f"tensor {name}"))
    if max(shape) >= MAX_DIM:
        raise GGUFError(f"tensor {name!r} has a dimension of {max(shape)} (at most {MAX_DIM - 1})")
    code: int = b.scalar("<I", f"tensor {name}")
    try:
        kind = GGMLQuantizationType(code)
    except ValueError:
        raise GGUFError(f"tensor {name!r} has type {code}, which ggml does not define") from None
    offset: int = b.scalar("<Q", f"tensor {name}")
    return name, shape, kind, offset


def _tensor(
    buffer: mmap.mmap,
    start: int,
    name: str,
    shape: tuple[int, ...],
    kind: GGMLQuantizationType,
    offset: int,
) -> Tensor:
    n = 1
    for d in shape:
        n *= d
    block, size = GGML_QUANT_SIZES[kind]
    dims = tuple(reversed(shape))
    element = ELEMENTS.get(kind)
    try:
        if element is None:
            dims = quant_shape_to_byte_shape(dims, kind)
    except ValueError as exc:
        raise GGUFError(f"tensor {name!r}: {exc}") from None
    n_bytes = n * size // block
    at = start + offset
    if at + n_bytes > len(buffer):
        raise GGUFError(
            f"tensor {name!r} ({n_bytes} bytes at byte {at}) runs past the end of the "
            f"file ({len(buffer)} bytes): the file is cut short"
        )
    dtype = np.dtype(element) if element is not None else np.dtype(np.uint8)
    try:
        data = np.frombuffer(buffer, dtype, n_bytes // dtype.itemsize, at).reshape(dims)
    except ValueError as exc:  # an empty tensor with dimensions numpy cannot shape
        raise GGUFError(f"tensor {name!r} of shape {shape}: {exc}") from None
    return Tensor(name, kind, shape, data)
