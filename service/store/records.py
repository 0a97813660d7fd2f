"""The turn record, and compact binary arrays for its token ids, logprobs and routed experts
(the turns table's blobs).

Layout: b"SWA" | version 1 | dtype code | codec | ndim | reserved | ndim x uint32 LE | payload.
Payloads are little-endian; codec 0 is raw, 1 is zlib, 2 is a zstd frame (with its content size).
Token ids are written as zstd since 2026-12-07 (zlib before: rows written then read as ever).
Light module: no FastAPI, no Celery.
"""

from __future__ import annotations

import math
import struct
import sys
import threading
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

MAGIC = b"SWA\x01"
DTYPES: dict[str, np.dtype] = {
    "i": np.dtype("<i4"), "f": np.dtype("<f4"), "B": np.dtype("u1"), "H": np.dtype("<u2"),
}  # fmt: skip
CODES = {dt: code for code, dt in DTYPES.items()}
RAW, ZLIB, ZSTD = 0, 1, 2
Codec = Literal["raw", "zlib", "zstd"]
_CODECS = {"raw": RAW, "zlib": ZLIB, "zstd": ZSTD}
ZSTD_LEVEL = 1


class _Zstd(threading.local):
    """zstd's contexts, one pair per thread (a context serves one operation at a time), made on
    the thread's first use: a context reused saves its set-up on every array."""

    def __init__(self) -> None:
        import zstandard

        self.error = zstandard.ZstdError
        self.frame_size = zstandard.frame_content_size
        self.compress = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress
        self.decompress = zstandard.ZstdDecompressor().decompress


_ZSTD = _Zstd()


class ArrayFormatError(ValueError):
    """A blob is not an array this module wrote."""


_LIST_DTYPES = frozenset(k for k in DTYPES if sys.byteorder == "little" and array(k).itemsize == DTYPES[k].itemsize)
"""The dtypes whose array.array typecode (the same letter) has their size and byte order."""


def encode_array(values, dtype: str, *, codec: Codec = "zlib", level: int = 1) -> bytes:
    """Encode a sequence or ndarray; dtype is one of "i" int32, "f" float32, "B" uint8, "H" uint16.
    A list goes through array.array: a turn's ids or logprobs in one pass, where numpy's asarray,
    range check and cast cost about as much as the compression (2026-12-06); the same bytes."""
    payload = None
    if type(values) is list and dtype in _LIST_DTYPES:
        try:
            payload, shape = array(dtype, values).tobytes(), (len(values),)
        except (TypeError, OverflowError):  # not all numbers of the kind, or out of range: numpy's path
            pass
    if payload is None:
        dt = DTYPES[dtype]
        arr = np.asarray(values)
        if arr.dtype != dt:
            if dt.kind in "iu" and arr.size and (arr.min() < np.iinfo(dt).min or arr.max() > np.iinfo(dt).max):
                raise ValueError(f"values out of range for {dt}")
            arr = arr.astype(dt)
        payload, shape = np.ascontiguousarray(arr).tobytes(), arr.shape
    code = _CODECS.get(codec)
    if code is None:
        raise ValueError(f"codec {codec!r}: one of {', '.join(_CODECS)}")
    if code == ZSTD:
        payload = _ZSTD.compress(payload)
    elif code == ZLIB:
        payload = zlib.compress(payload, level)
    header = MAGIC + struct.pack("<BBBB", ord(dtype), code, len(shape), 0)
    return header + struct.pack(f"<{len(shape)}I", *shape) + payload


_HEADER = struct.Struct("<4sBBBB")
_SHAPES = [struct.Struct(f"<{n}I") for n in range(256)]  # ndim is one byte


def decode_array(blob: bytes) -> np.ndarray:
    """Decode a blob written by encode_array. Raises ArrayFormatError. A trainer's load decodes
    four per turn: the header goes through precompiled structs and the size through math.prod
    (numpy's prod of a tuple cost more than the payload's read, 2026-12-05)."""
    if len(blob) < 8:
        raise ArrayFormatError("not a swerve array (bad magic)")
    magic, dtype_code, codec, ndim, _ = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise ArrayFormatError("not a swerve array (bad magic)")
    dt = DTYPES.get(chr(dtype_code))
    if dt is None or codec not in (RAW, ZLIB, ZSTD):
        raise ArrayFormatError(f"unknown dtype {dtype_code} or codec {codec}")
    start = 8 + 4 * ndim
    if len(blob) < start:
        raise ArrayFormatError(f"header of {ndim} dimensions does not fit {len(blob)} bytes")
    shape = _SHAPES[ndim].unpack_from(blob, 8)
    size = dt.itemsize * math.prod(shape)
    if codec == ZSTD:
        frame = memoryview(blob)[start:]
        try:  # the frame's own size first: a damaged or foreign one is refused before any allocation
            if _ZSTD.frame_size(frame) != size:
                raise ArrayFormatError(f"a zstd frame of another size than shape {shape} needs")
            payload, start = _ZSTD.decompress(frame), 0
        except _ZSTD.error as e:
            raise ArrayFormatError(f"damaged payload: {e}") from e
    elif codec == ZLIB:
        try:
            # wbits 0: the window the stream's header names (small for a turn's ids), not 32 kB
            payload, start = zlib.decompress(memoryview(blob)[start:], 0), 0
        except zlib.error as e:
            raise ArrayFormatError(f"damaged payload: {e}") from e
    else:
        payload = blob  # read in place: slicing bytes would copy every payload once more
    if len(payload) - start != size:
        raise ArrayFormatError(f"payload of {len(payload) - start} bytes does not fit shape {shape}")
    return np.frombuffer(payload, dtype=dt, offset=start).reshape(shape)


def encode_ids(ids) -> bytes:
    """zstd at level 1: against zlib at level 1, 2.3-4x faster to write and 2-3.5x to read, and
    a few percent smaller, on 600 ids of a tokenizer's or random over 150k (2026-12-07)."""
    return encode_array(ids, "i", codec="zstd")


def encode_logprobs(logprobs) -> bytes:
    """Raw: a float32's mantissa is noise to zlib (random logprobs compressed to 0.9 of their
    bytes, at a deflate stream's set-up per turn on the worker and an inflate per turn on the
    trainer's load)."""
    return encode_array(logprobs, "f", codec="raw")


def encode_routed_experts(experts: np.ndarray, codec: Codec = "raw") -> bytes:
    """[tokens, layers, top_k] expert ids as uint8 (up to 256 experts) or uint16. Raw by
    default: expert ids barely compress, and zlib would cost more than the bytes it saves."""
    experts = np.asarray(experts)
    if experts.ndim != 3:
        raise ValueError(f"routed experts must be [tokens, layers, top_k], got shape {experts.shape}")
    return encode_array(experts, "B" if experts.size == 0 or experts.max() < 256 else "H", codec=codec)


@dataclass
class TurnRecord:
    """One model call, as the agent loop stores it and Buffer.load gives it back. Loaded for
    training, the token arrays are numpy arrays and the display fields (text, tool call,
    observation, timings) are left at their defaults: training reads tokens only."""

    idx: int
    segment: int
    input_ids: Sequence[int]
    """The tokens the environment and chat template added since the previous turn (not trained on)."""
    output_ids: Sequence[int]
    """Sampled tokens, exactly as the inference server returned them."""
    output_logprobs: Sequence[float] | None
    policy_version: int | None
    """The policy version of the server that sampled this turn."""
    finish_reason: str | None = None
    text: str | None = None
    tool_call: dict | None = None
    observation: str | None = None
    generation_s: float | None = None
    tool_s: float | None = None
    policy_version_end: int | None = None
    routed_experts: Any = None
    """uint8/uint16 [len(input_ids)+len(output_ids), layers, top_k], or None."""
    called: bool | None = None
    """Loaded for training: whether the turn made a well-formed tool call (None: not known)."""
    malformed_at: int | None = None
    """For a turn without a well-formed tool call: the index in output_ids of the first sampled
    token to blame (agent.break_of: where the call broke, or where a loop cut at max_tokens began
    repeating). None: well formed, or the whole turn is to blame."""
