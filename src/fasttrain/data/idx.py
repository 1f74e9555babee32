"""IDX files (the MNIST family's format), read and written with NumPy.

Layout: a 4-byte magic ``0x00 0x00 <dtype> <ndim>``, then ``ndim`` big-endian uint32 sizes,
then the payload in C order. Only dtype 0x08 (unsigned byte) is used by MNIST-like data and
is the only one we accept. Files may be raw or gzip-compressed (``.gz``).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import zlib
from pathlib import Path

import numpy as np

from fasttrain.errors import DataError

UBYTE = 0x08


def read_idx_file(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(the file's bytes, its decompressed IDX content) for a raw or ``.gz`` file, read once."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    if path.suffix != ".gz":
        return raw, raw
    try:
        return raw, gzip.decompress(raw)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise DataError(f"{path}: truncated or corrupt gzip ({exc}); delete it and download again") from None


def read_idx_bytes(path: str | os.PathLike) -> bytes:
    """The decompressed content of an IDX file (raw or ``.gz``), with corrupt gzip reported."""
    return read_idx_file(path)[1]


def md5_hex(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def parse_idx(content: bytes, source: str = "<bytes>") -> np.ndarray:
    """Parse decompressed IDX content into a uint8 array, checking the header against the payload."""
    if len(content) < 4:
        raise DataError(f"{source}: too short to be an IDX file ({len(content)} bytes)")
    zero0, zero1, dtype_code, ndim = content[0], content[1], content[2], content[3]
    if zero0 != 0 or zero1 != 0 or dtype_code != UBYTE or not 1 <= ndim <= 4:
        magic = int.from_bytes(content[:4], "big")
        raise DataError(
            f"{source}: wrong magic number 0x{magic:08x} (expected 0x0000080N for unsigned-byte IDX); "
            "not an IDX file, or a different format"
        )
    header_len = 4 + 4 * ndim
    if len(content) < header_len:
        raise DataError(f"{source}: truncated IDX header")
    dims = tuple(int.from_bytes(content[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(dims, dtype=np.int64))
    payload = len(content) - header_len
    if payload != expected:
        raise DataError(
            f"{source}: payload has {payload} bytes but the header {dims} promises {expected}; "
            "the file is truncated or corrupt"
        )
    return np.frombuffer(content, dtype=np.uint8, offset=header_len).reshape(dims)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (raw or ``.gz``) into a uint8 array of the header's shape."""
    return parse_idx(read_idx_bytes(path), str(path))


def encode_idx(array: np.ndarray) -> bytes:
    array = np.ascontiguousarray(array)
    if array.dtype != np.uint8:
        raise ValueError("only uint8 IDX files are supported")
    header = bytes([0, 0, UBYTE, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.tobytes()


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write ``array`` (uint8) as an IDX file; gzip-compressed when the name ends in ``.gz``."""
    path = Path(path)
    content = encode_idx(array)
    if path.suffix == ".gz":
        content = gzip.compress(content, mtime=0)
    path.write_bytes(content)
