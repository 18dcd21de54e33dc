"""Block hashes: the C build (``kv_native.c``) against the Python reference, which is
hashlib's BLAKE2b, on any tokens, block size, salt, start and parent."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sendpath.kvcache.hashing import hash_block, python_block_hashes


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=70),
    block_size=st.integers(1, 20),
    salt=st.none() | st.text(max_size=40),
    start=st.integers(0, 5),
    parent=st.none() | st.binary(max_size=200),
)
def test_the_c_hashes_are_the_python_ones(
    native_kv: ModuleType,
    tokens: list[int],
    block_size: int,
    salt: str | None,
    start: int,
    parent: bytes | None,
) -> None:
    ours: list[bytes] = []
    theirs: list[bytes] = []
    expected = python_block_hashes(tokens, block_size, salt, start, parent, ours)
    assert native_kv.block_hashes(tokens, block_size, salt, start, parent, theirs) == expected
    assert theirs == ours
    assert native_kv.block_hashes(tokens, block_size, salt=salt) == python_block_hashes(
        tokens, block_size, salt
    )


def test_long_inputs_cross_blake2b_blocks(native_kv: ModuleType) -> None:
    """With its 16-byte link, a block of 14 tokens is exactly one BLAKE2b block (128
    bytes), 30 tokens exactly two, 40 tokens and a salt three, the last partial."""
    tokens = list(range(400))
    for block_size, salt in ((14, None), (30, None), (40, "tenant-a"), (16, "tenant-a")):
        got = native_kv.block_hashes(tokens, block_size, salt)
        assert got[0] == hash_block(None, tokens[:block_size], salt)
        assert got == python_block_hashes(tokens, block_size, salt)


def test_packed_may_be_the_token_list_and_an_error_appends_nothing(native_kv: ModuleType) -> None:
    tokens: list[Any] = [10**12 + i for i in range(5000)]  # ints, then packed bytes
    ours, theirs = list(tokens), list(tokens)
    assert native_kv.block_hashes(ours, 1, packed=ours) == python_block_hashes(
        theirs, 1, packed=theirs
    )
    assert ours == theirs
    packed: list[bytes] = []
    with pytest.raises(TypeError):
        native_kv.block_hashes([1, 2, "x"], 1, packed=packed)
    with pytest.raises(OverflowError):
        native_kv.block_hashes([1, 2, 3, 2**63], 1, packed=packed)
    assert packed == []


def test_token_ids_with_index_are_taken_as_array_takes_them(native_kv: ModuleType) -> None:
    import numpy as np

    ids = np.arange(32, dtype=np.int64)
    assert native_kv.block_hashes(list(ids), 16) == python_block_hashes(list(ids), 16)
    assert native_kv.block_hashes([True, False], 2) == python_block_hashes([1, 0], 2)


def test_bad_input_is_refused_as_python_refuses_it(native_kv: ModuleType) -> None:
    with pytest.raises(TypeError):
        native_kv.block_hashes([1, 2.0], 2)
    with pytest.raises(TypeError):
        python_block_hashes([1, 2.0], 2)  # type: ignore[list-item]
    with pytest.raises(OverflowError):
        native_kv.block_hashes([1, 2**63], 2)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        native_kv.block_hashes([1, 2], 0)
    with pytest.raises(TypeError, match="salt must be str"):
        native_kv.block_hashes([1, 2], 2, b"salt")
    with pytest.raises(UnicodeEncodeError):
        native_kv.block_hashes([1, 2], 2, "\ud800")
    with pytest.raises(UnicodeEncodeError):
        python_block_hashes([1, 2], 2, "\ud800")
    # nothing to hash: nothing else is looked at, in either
    assert native_kv.block_hashes([1], 2, "\ud800") == python_block_hashes([1], 2, "\ud800") == []
