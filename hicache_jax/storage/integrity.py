"""Page checksums.

CRC-32C (Castagnoli) through ``google-crc32c`` (Apache-2.0, hardware-accelerated C extension,
about 10-13 GB/s per core on the project's EPYC machines; ``zlib.crc32`` manages ~2-3 GB/s).
``google-crc32c`` ships with the ``jax`` extra. Where it is missing (the Python 3.11 torch env
installs only ``dev``), new records fall back to zlib's CRC-32 and say so: every record stores
its algorithm id, so a reader always verifies with the algorithm that wrote it, and a record
whose algorithm is unavailable is a miss (never trusted unchecked).

The orbax segment log always uses CRC-32C (it needs the ``jax`` extra anyway).

Releasing the GIL: ``google_crc32c``'s C extension releases it only for ``bytes`` objects of
1 MiB or more, never for numpy arrays or memoryviews (checked in its source, 1.9.0), so CRCs of
host pages on several worker threads would run one at a time. This module therefore calls the
extension's own ``crc32c_extend`` through ``ctypes`` (which drops the GIL for the call) for
buffers of ``NOGIL_MIN_BYTES`` or more: measured on the project VM (2 vCPUs), two threads
checksummed 8.3 GB/s this way against 4.7 GB/s through ``google_crc32c.extend`` (one thread:
4.5-4.8 GB/s either way). Where that symbol cannot be found (a pure-Python build of the
package) it falls back to ``google_crc32c.extend`` (correct, but holding the GIL).
``zlib.crc32`` releases the GIL by itself. Releasing it pays where several threads checksum
at once (the ``file`` backend's pools, ``mooncake``'s CRC threads); a lone thread that would
then wait to get it back (orbax's reader and segment writer) keeps it (``release_gil=False``
or ``google_crc32c`` directly).

Threading: pure functions; the ``*_at`` variants read raw addresses, so their caller keeps the
memory alive (``host_pages.PageRuns`` holds its pool's array) and owns it for the call.
"""

from __future__ import annotations

import ctypes
import random
import zlib
from typing import Iterable, Sequence

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

# Below this a ctypes call (~1 us of overhead) is not worth it and the GIL is held only briefly.
NOGIL_MIN_BYTES = 16 << 10


def _load_nogil_extend():
    """``crc32c_extend(uint32, const uint8 *, size_t)`` of the library ``google_crc32c``'s
    extension links (found through the extension's own handle: ``dlsym`` searches its
    dependencies), as a ctypes function (the GIL is released for the call); None if absent."""
    if _gcrc is None:
        return None
    try:
        from google_crc32c import _crc32c

        fn = ctypes.CDLL(_crc32c.__file__).crc32c_extend
    except (ImportError, OSError, AttributeError):  # pragma: no cover - depends on the build
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    probe = b"123456789"  # the CRC-32C check value (RFC 3720): never trust a foreign symbol unchecked
    return fn if fn(0, probe, len(probe)) == 0xE3069283 == int(_gcrc.value(probe)) else None


_nogil_extend = _load_nogil_extend()
NOGIL_CRC32C = _nogil_extend is not None


class ChecksumUnavailable(RuntimeError):
    """The record was written with an algorithm this process cannot compute."""


def _buffer(data: object) -> object:
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        return data.reshape(-1).view(np.uint8)
    return data


def crc32c(data: object, prefix: bytes = b"", release_gil: bool = True) -> int:
    """CRC-32C of ``prefix || data``; the GIL is released over a large numpy ``data`` unless
    ``release_gil`` is False (a thread that would wait to get it back, see ``orbax.reader``)."""
    if _gcrc is None:
        raise ChecksumUnavailable("CRC-32C needs the google-crc32c package (pip install google-crc32c)")
    if not release_gil:
        return int(_gcrc.extend(_gcrc.value(prefix), _buffer(data)))
    return crc32c_extend(int(_gcrc.value(prefix)), data)


def crc32c_extend(crc: int, data: object) -> int:
    """``crc`` (a CRC-32C so far) extended over ``data``; the GIL is released over a large
    numpy ``data`` (``google_crc32c.extend`` keeps it)."""
    data = _buffer(data)
    if isinstance(data, np.ndarray) and _nogil_extend is not None and data.nbytes >= NOGIL_MIN_BYTES:
        return int(_nogil_extend(crc, data.ctypes.data, data.nbytes))
    return int(_gcrc.extend(crc, data))


def _extend_at(algo: int, crc: int, address: int, nbytes: int) -> int:
    if algo == ALGO_CRC32C and _nogil_extend is not None and nbytes >= NOGIL_MIN_BYTES:
        return int(_nogil_extend(crc, address, nbytes))
    buf = (ctypes.c_char * nbytes).from_address(address)
    if algo == ALGO_CRC32C:
        return int(_gcrc.extend(crc, buf))
    return zlib.crc32(buf, crc)


def checksum_at(runs: Iterable[tuple[int, int]], algo: int = DEFAULT_ALGO, key: bytes = b"") -> int:
    """``checksum`` of ``key`` followed by the bytes at each ``(address, nbytes)`` of ``runs``,
    in order (a host page's runs: no gather copy). The caller keeps that memory alive."""
    if algo == ALGO_CRC32C:
        if _gcrc is None:
            raise ChecksumUnavailable("CRC-32C needs the google-crc32c package (pip install google-crc32c)")
        crc = int(_gcrc.value(key))
    elif algo == ALGO_ZLIB_CRC32:
        crc = zlib.crc32(key)
    else:
        raise ChecksumUnavailable(f"unknown checksum algorithm id {algo}")
    for address, nbytes in runs:
        crc = _extend_at(algo, crc, address, nbytes)
    return crc & 0xFFFFFFFF


def checksum_parts(parts: Sequence[object], algo: int = DEFAULT_ALGO, key: bytes = b"") -> int:
    """``checksum`` of ``key || parts[0] || parts[1] ...`` (bytes-like objects or numpy arrays)
    without concatenating them."""
    if algo == ALGO_CRC32C:
        crc = crc32c(b"", key)
        for p in parts:
            crc = crc32c_extend(crc, p)
        return crc
    if algo == ALGO_ZLIB_CRC32:
        crc = zlib.crc32(key)
        for p in parts:
            crc = zlib.crc32(_buffer(p), crc)
        return crc & 0xFFFFFFFF
    raise ChecksumUnavailable(f"unknown checksum algorithm id {algo}")


def checksum(data: object, algo: int = DEFAULT_ALGO, key: bytes = b"") -> int:
    """CRC of ``key || data`` (``data``: bytes-like or numpy array, read as raw bytes).

    Stores pass the page key: the CRC then also binds the page to its key, so a damaged key
    array in a segment (or a file renamed under another key) cannot make the right checksum
    vouch for the wrong page.
    """
    return checksum_parts([data], algo, key)


def sample_hit(rate: float) -> bool:
    """Random per-read sampling for ``integrity='sampled'``. Per read, not per key: a corrupt
    page that escapes one read is caught on a later one (and its segment quarantined), where a
    per-key choice would never check some pages at all."""
    return rate >= 1.0 or random.random() < rate
