"""Binary array blobs round-trip exactly and refuse what they did not write."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.store.records import (
    ArrayFormatError,
    decode_array,
    encode_array,
    encode_ids,
    encode_logprobs,
    encode_routed_experts,
)


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300), st.sampled_from(["raw", "zlib", "zstd"]))
def test_token_ids_round_trip(ids, codec):
    out = decode_array(encode_array(ids, "i", codec=codec))
    assert out.dtype == np.dtype("<i4") and out.tolist() == ids


@given(st.sampled_from([("i", -(2**31), 2**31 - 1), ("H", 0, 2**16 - 1), ("B", 0, 255)]).flatmap(
    lambda t: st.tuples(st.just(t[0]), st.lists(st.integers(t[1], t[2]), max_size=300))), st.sampled_from(["raw", "zlib", "zstd"]))
def test_a_list_of_ints_is_written_as_numpy_writes_it(case, codec):
    """encode_array's path for lists (array.array, no numpy) gives the very bytes of its numpy
    path: readers of either see one format."""
    dtype, values = case
    assert encode_array(values, dtype, codec=codec) == encode_array(np.asarray(values), dtype, codec=codec)


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=300), st.sampled_from(["raw", "zlib", "zstd"]))
def test_a_list_of_floats_is_written_as_numpy_writes_it(values, codec):
    """Doubles (as a sampler returns logprobs) rounded to float32 by array.array as numpy
    rounds them, infinities and NaN included: the same bytes."""
    with np.errstate(over="ignore"):  # numpy warns where a double overflows float32; both give inf
        want = encode_array(np.asarray(values, dtype=np.float64), "f", codec=codec)
    assert encode_array(values, "f", codec=codec) == want


@given(st.lists(st.floats(width=32, allow_nan=False), max_size=300))
def test_logprobs_round_trip_bit_exact(logprobs):
    out = decode_array(encode_logprobs(logprobs))
    assert np.array_equal(out, np.asarray(logprobs, dtype=np.float32))


@pytest.mark.parametrize(("n_experts", "dtype"), [(8, np.uint8), (256, np.uint8), (384, np.uint16)])
def test_routed_experts_pick_the_smallest_dtype(n_experts, dtype):
    rng = np.random.default_rng(0)
    experts = rng.integers(0, n_experts, size=(17, 78, 8))
    out = decode_array(encode_routed_experts(experts))
    assert out.dtype == dtype and out.shape == (17, 78, 8)
    assert np.array_equal(out, experts)


def test_empty_arrays_keep_their_shape():
    assert decode_array(encode_ids([])).shape == (0,)
    assert decode_array(encode_routed_experts(np.zeros((0, 2, 2), dtype=np.int64))).shape == (0, 2, 2)


def test_blobs_are_compact():
    ids = np.arange(131_072) % 2048
    assert len(encode_ids(ids)) < 131_072 * 4 // 2  # compressed below raw int32


@pytest.mark.parametrize("blob", [b"", b"[1, 2, 3]", b"SWA\x01i\x09\x01\x00\x00\x00\x00\x00",
                                  encode_ids([1, 2, 3])[:-3]])
def test_foreign_or_damaged_blobs_are_refused(blob):
    with pytest.raises(ArrayFormatError):
        decode_array(blob)


def test_token_ids_are_written_as_zstd_and_ids_written_as_zlib_still_read():
    """Rows written before 2026-12-07 hold zlib: they read as ever beside the new ones."""
    from service.store.records import ZLIB, ZSTD

    ids = list(range(-5, 2000, 3))
    new, old = encode_ids(ids), encode_array(ids, "i", codec="zlib")
    assert new[5] == ZSTD and old[5] == ZLIB
    assert decode_array(new).tolist() == decode_array(old).tolist() == ids


def test_a_zstd_frame_of_another_size_than_its_shape_or_damaged_is_refused():
    """The frame's own content size is checked against the shape before anything is
    allocated: a blob cannot make a reader inflate more than its header says."""
    good = encode_ids(list(range(100)))
    other = encode_ids(list(range(1000)))
    with pytest.raises(ArrayFormatError, match="another size"):
        decode_array(good[:12] + other[12:])  # the shape of 100 ids, a frame of 1000
    damaged = bytearray(good)
    damaged[12:16] = b"\xff\xff\xff\xff"  # the frame's magic number
    with pytest.raises(ArrayFormatError, match="damaged"):
        decode_array(bytes(damaged))


def test_an_unknown_codec_is_refused_by_name():
    with pytest.raises(ValueError, match="codec 'lz4': one of raw, zlib, zstd"):
        encode_array([1], "i", codec="lz4")


def test_out_of_range_values_are_refused():
    with pytest.raises(ValueError, match="out of range"):
        encode_array([2**31], "i")
    with pytest.raises(ValueError, match="out of range"):
        encode_array([0, -1], "B")
