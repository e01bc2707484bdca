"""Page checksums.

CRC-32C (Castagnoli) through ``google-crc32c`` (Apache-2.0, hardware-accelerated C extension,
about 10-13 GB/s per core on the project's EPYC machines; ``zlib.crc32`` manages ~2-3 GB/s).
``google-crc32c`` ships with the ``jax`` extra. Where it is missing (the Python 3.11 torch env
installs only ``dev``), new records fall back to zlib's CRC-32 and say so: every record stores
its algorithm id, so a reader always verifies with the algorithm that wrote it, and a record
whose algorithm is unavailable is a miss (never trusted unchecked).

The orbax segment log always uses CRC-32C (it needs the ``jax`` extra anyway).

Threading: pure functions (the C extension releases the GIL on large buffers).
"""

from __future__ import annotations

import random
import zlib

import numpy as np

ALGO_CRC32C = 1
ALGO_ZLIB_CRC32 = 2
ALGO_NAMES = {ALGO_CRC32C: "crc32c", ALGO_ZLIB_CRC32: "crc32"}

try:  # optional: fast CRC-32C
    import google_crc32c as _gcrc

    HAVE_CRC32C = True
except ImportError:  # pragma: no cover - depends on the environment
    _gcrc = None
    HAVE_CRC32C = False

DEFAULT_ALGO = ALGO_CRC32C if HAVE_CRC32C else ALGO_ZLIB_CRC32


class ChecksumUnavailable(RuntimeError):
    """The record was written with an algorithm this process cannot compute."""


def _buffer(data: object) -> object:
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        return data.reshape(-1).view(np.uint8)
    return data


def crc32c(data: object, prefix: bytes = b"") -> int:
    if _gcrc is None:
        raise ChecksumUnavailable("CRC-32C needs the google-crc32c package (pip install google-crc32c)")
    return int(_gcrc.extend(_gcrc.value(prefix), _buffer(data)))


def checksum(data: object, algo: int = DEFAULT_ALGO, key: bytes = b"") -> int:
    """CRC of ``key || data`` (``data``: bytes-like or numpy array, read as raw bytes).

    Stores pass the page key: the CRC then also binds the page to its key, so a damaged key
    array in a segment (or a file renamed under another key) cannot make the right checksum
    vouch for the wrong page.
    """
    if algo == ALGO_CRC32C:
        return crc32c(data, key)
    if algo == ALGO_ZLIB_CRC32:
        return zlib.crc32(_buffer(data), zlib.crc32(key)) & 0xFFFFFFFF
    raise ChecksumUnavailable(f"unknown checksum algorithm id {algo}")


def sample_hit(rate: float) -> bool:
    """Random per-read sampling for ``integrity='sampled'``. Per read, not per key: a corrupt
    page that escapes one read is caught on a later one (and its segment quarantined), where a
    per-key choice would never check some pages at all."""
    return rate >= 1.0 or random.random() < rate
