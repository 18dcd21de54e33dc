"""Block hashes: the C build (``kv_native.c``) against the Python reference, which is
hashlib's BLAKE2b, on any tokens, block size, salt, start and parent."""

from __future__ import annotations

from types import ModuleType

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
    """A block of 40 tokens is 336 bytes with its link: three BLAKE2b blocks, the last
    one partial; 14 tokens and a 16-byte link fill exactly one."""
    tokens = list(range(400))
    for block_size in (14, 40, 16):
        got = native_kv.block_hashes(tokens, block_size, "tenant-a")
        assert got[0] == hash_block(None, tokens[:block_size], "tenant-a")
        assert got == python_block_hashes(tokens, block_size, "tenant-a")


def test_bad_input_is_refused_as_python_refuses_it(native_kv: ModuleType) -> None:
    with pytest.raises(TypeError, match="token ids must be int"):
        native_kv.block_hashes([1, 2.0], 2)
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
