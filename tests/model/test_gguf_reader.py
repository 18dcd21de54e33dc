"""Our GGUF reader against the ``gguf`` package's, on the built-in model and on a file of
every value and tensor type; and bad files (cut short anywhere, lying lengths, the wrong
magic, version or byte order) refused with ``GGUFError`` saying why."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from sendpath.model.gguf_reader import GGUFError, GGUFFile, read
from sendpath.model.loader import builtin_model_path


def assert_same_as_gguf(path: Path, ours: GGUFFile) -> None:
    theirs = GGUFReader(path)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == fields
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(b.shape.tolist()), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name
        assert not a.data.flags.writeable


def test_the_built_in_model_reads_as_the_gguf_package_reads_it() -> None:
    path = builtin_model_path()
    ours = read(path)
    assert ours.version == 3 and len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert_same_as_gguf(path, ours)


def every_kind(path: Path) -> Path:
    """A small file with a value of each type and tensors of several types."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 255)
    w.add_int8("t.i8", -128)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -32768)
    w.add_uint32("t.u32", 2**32 - 1)
    w.add_int32("t.i32", -(2**31))
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "é ✓ \U0001f600")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.bools", [True, False])
    w.add_key_value("t.u16s", [1, 2, 65535], GGUFValueType.ARRAY, GGUFValueType.UINT16)
    f32 = rng.standard_normal((3, 64), dtype=np.float32)
    w.add_tensor("f32", f32)
    w.add_tensor("f16", f32.astype(np.float16))
    w.add_tensor("i32", np.arange(5, dtype=np.int32))
    for kind in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.BF16):
        w.add_tensor(kind.name, quantize(f32, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_value_and_tensor_type_reads_as_the_gguf_package_reads_it(tmp_path: Path) -> None:
    path = every_kind(tmp_path / "kinds.gguf")
    ours = read(path)
    assert ours.fields["t.u64"] == 2**64 - 1 and ours.fields["t.bool"] is True
    assert ours.fields["t.strs"] == ["a", "", "ü"]
    assert_same_as_gguf(path, ours)


def test_a_file_cut_short_anywhere_is_refused(tmp_path: Path) -> None:
    whole = every_kind(tmp_path / "kinds.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for n in range(len(whole)):
        cut.write_bytes(whole[:n])
        with pytest.raises(GGUFError):
            read(cut)


def header(version: int = 3, tensors: int = 0, fields: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, fields)


def key(name: str, kind: int) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", kind)


BAD_HEADERS = [
    "empty", "magic", "version", "big-endian", "field-count", "key-length", "string-length",
    "string-count", "number-count", "value-type", "utf-8", "duplicate-key", "nesting",
    "alignment", "alignment-type",
]  # fmt: skip


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"GGML" + bytes(20), "magic"),
        (header(version=1), "version 1; sendpath reads versions 2-3"),
        (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
        (header(fields=2**62), "more than the"),
        (header() + struct.pack("<Q", 2**63) + b"k", "more than the"),
        (header() + key("s", 8) + struct.pack("<Q", 2**40) + b"ab", "more than the"),
        (header() + key("a", 9) + struct.pack("<IQ", 8, 2**59) + bytes(64), "more than the"),
        (header() + key("a", 9) + struct.pack("<IQ", 4, 2**61) + bytes(64), "more than the"),
        (header() + key("x", 13) + bytes(8), "unknown value type 13"),
        (header() + key("tokenizer.s", 8) + struct.pack("<Q", 2) + b"\xff\xfe", "not UTF-8"),
        (header(fields=2) + (key("k", 4) + bytes(4)) * 2, "appears twice"),
        (header() + key("a", 9) + struct.pack("<IQ", 9, 1) * 9 + bytes(64), "nested more"),
        (header() + key("general.alignment", 4) + struct.pack("<I", 24), "power of two"),
        (header() + key("general.alignment", 7) + b"\x01", "not UINT32"),
    ],
    ids=BAD_HEADERS,
)
def test_a_bad_header_or_metadata_says_what_is_wrong(
    tmp_path: Path, data: bytes, message: str
) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError, match=message):
        read(path)


def tensor_info(name: str, shape: tuple[int, ...], kind: int, offset: int = 0) -> bytes:
    dims = struct.pack(f"<I{len(shape)}Q", len(shape), *shape)
    return struct.pack("<Q", len(name)) + name.encode() + dims + struct.pack("<IQ", kind, offset)


@pytest.mark.parametrize(
    ("infos", "message"),
    [
        (tensor_info("t", (4,), 0) * 2, "appears twice"),
        (tensor_info("t", (1, 1, 1, 1, 1), 0), "5 dimensions"),
        (tensor_info("t", (4,), 99), "type 99"),
        (tensor_info("t", (31,), 2), "block size"),  # Q4_0 rows are whole 32-blocks
        (tensor_info("t", (2**40,), 0), "runs past the end"),
        (tensor_info("t", (4,), 0, offset=2**63), "runs past the end"),
        (tensor_info("t", (0, 2**64 - 1), 0), "a dimension of"),
        (tensor_info("t", (0, 2**40, 2**40), 0), "of shape"),  # empty, but numpy cannot
    ],
    ids=["duplicate", "dims", "type", "blocks", "size", "offset", "huge-dim", "empty-huge"],
)
def test_a_bad_tensor_says_what_is_wrong(tmp_path: Path, infos: bytes, message: str) -> None:
    count = infos.count(b"\x01\x00\x00\x00\x00\x00\x00\x00t")  # each info's name
    path = tmp_path / "bad.gguf"
    path.write_bytes(header(tensors=count, fields=0) + infos + bytes(64))
    with pytest.raises(GGUFError, match=message):
        read(path)


def test_an_empty_array_and_a_nested_one(tmp_path: Path) -> None:
    """Values the gguf package's writer does not make: read as lists all the same."""
    path = tmp_path / "arrays.gguf"
    empty = key("empty", 9) + struct.pack("<IQ", 4, 0)
    nested = key("nested", 9) + struct.pack("<IQ", 9, 2)
    nested += struct.pack("<IQ", 8, 1) + struct.pack("<Q", 1) + b"x" + struct.pack("<IQ", 7, 0)
    path.write_bytes(header(fields=2) + empty + nested)
    assert read(path).fields == {"empty": [], "nested": [["x"], []]}


def test_a_string_that_is_not_utf8_is_kept_with_replacements_outside_the_tokenizer(
    tmp_path: Path,
) -> None:
    path = tmp_path / "latin1.gguf"
    path.write_bytes(header() + key("general.description", 8) + struct.pack("<Q", 4) + b"caf\xe9")
    assert read(path).fields == {"general.description": "caf\ufffd"}


def test_tensor_data_outlives_the_reader(tmp_path: Path) -> None:
    data: Any = read(every_kind(tmp_path / "kinds.gguf")).tensors[0].data
    assert data.shape == (3, 64) and np.isfinite(data).all()  # the mapping is still open
