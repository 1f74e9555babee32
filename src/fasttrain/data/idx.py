"""IDX files (the MNIST family's format), read and written with NumPy.

Layout: a 4-byte magic ``0x00 0x00 <dtype> <ndim>``, then ``ndim`` big-endian uint32 sizes,
then the payload in C order. Only dtype 0x08 (unsigned byte) is used by MNIST-like data and
is the only one we accept. Files may be raw or gzip-compressed (``.gz``).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import math
import os
import stat
import zlib
from pathlib import Path

import numpy as np

from fasttrain.errors import DataError

UBYTE = 0x08


# The largest IDX payload accepted: the MNIST family's biggest file (60000 x 28 x 28 training images)
# is 47 MB; a header that promises more is corrupt or not this kind of data, and is refused before
# anything that large is allocated or decompressed.
MAX_IDX_BYTES = 256 * 2**20


def _regular_file(path: Path) -> os.stat_result:
    """stat of ``path``, refusing what is not a regular file: reading a FIFO would wait forever, a
    device could be endless."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode) else "not a regular file"
        raise DataError(f"{path}: is {kind}, not a data file; put the dataset's IDX files (.gz or raw) there")
    return info


def _header_size(head: bytes, source: str, max_bytes: int) -> tuple[int, int]:
    """(header length, payload bytes the header promises) from an IDX file's first bytes, computed
    with Python integers (no overflow) and checked against ``max_bytes`` before any large read."""
    if len(head) < 4:
        raise DataError(f"{source}: too short to be an IDX file ({len(head)} bytes)")
    zero0, zero1, dtype_code, ndim = head[0], head[1], head[2], head[3]
    if zero0 != 0 or zero1 != 0 or dtype_code != UBYTE or not 1 <= ndim <= 4:
        magic = int.from_bytes(head[:4], "big")
        raise DataError(
            f"{source}: wrong magic number 0x{magic:08x} (expected 0x0000080N for unsigned-byte IDX); "
            "not an IDX file, or a different format"
        )
    header_len = 4 + 4 * ndim
    if len(head) < header_len:
        raise DataError(f"{source}: truncated IDX header")
    dims = [int.from_bytes(head[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = math.prod(dims)
    if expected > max_bytes:
        raise DataError(f"{source}: the header's dimensions {tuple(dims)} promise {expected:,} bytes, more than the "
                        f"{max_bytes:,} any MNIST-like file has; the file is corrupt, delete it and download again")
    return header_len, expected


def read_idx_file(path: str | os.PathLike, max_bytes: int = MAX_IDX_BYTES) -> tuple[bytes, bytes]:
    """(the file's bytes, its decompressed IDX content) for a raw or ``.gz`` file, read once.

    Never reads more than the header promises: a raw file's size is checked against its header
    before its payload is read, and a ``.gz`` is decompressed only up to the header's size plus one
    byte, so a small file that would decompress to gigabytes is refused after a few bytes."""
    path = Path(path)
    info = _regular_file(path)
    if info.st_size > max_bytes + 64:
        raise DataError(f"{path}: {info.st_size:,} bytes, more than any MNIST-like file; not a dataset file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from None
    if path.suffix != ".gz":
        _header_size(raw[:20], str(path), max_bytes)  # the magic and a sane size before anything else
        return raw, raw
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw)) as stream:
            head = stream.read(4)
            head += stream.read(4 * head[3]) if len(head) == 4 else b""
            header_len, expected = _header_size(head, str(path), max_bytes)
            payload = stream.read(expected + 1)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise DataError(f"{path}: truncated or corrupt gzip ({exc}); delete it and download again") from None
    if len(payload) > expected:
        raise DataError(f"{path}: decompresses to more than the {expected:,} bytes its header promises; "
                        "the file is corrupt, delete it and download again")
    return raw, head + payload


def read_idx_bytes(path: str | os.PathLike) -> bytes:
    """The decompressed content of an IDX file (raw or ``.gz``), with corrupt gzip reported."""
    return read_idx_file(path)[1]


def md5_hex(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def parse_idx(content: bytes, source: str = "<bytes>") -> np.ndarray:
    """Parse decompressed IDX content into a uint8 array, checking the header against the payload."""
    if len(content) < 4:
        raise DataError(f"{source}: too short to be an IDX file ({len(content)} bytes)")
    header_len, expected = _header_size(content[:20], source, MAX_IDX_BYTES)
    dims = tuple(int.from_bytes(content[4 + 4 * i : 8 + 4 * i], "big") for i in range(content[3]))
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
    from fasttrain.files import atomic_write_bytes

    atomic_write_bytes(path, content)
