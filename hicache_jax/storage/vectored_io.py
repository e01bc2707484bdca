"""Vectored file I/O that finishes what it starts: ``preadv`` / ``pwritev`` over lists of buffers.

A regular file's ``preadv`` returns less than asked only at end of file (or when a signal
interrupts it), and either call takes at most ``IOV_MAX`` buffers; these helpers loop over
both, so a caller hands over a host page's runs (``host_pages.PageRuns.views``) plus a header
and gets every byte or a clear answer.

Threading: pure functions; the GIL is released inside each system call.
"""

from __future__ import annotations

import errno
import os

try:
    IOV_MAX = max(16, os.sysconf("SC_IOV_MAX"))
except (AttributeError, OSError, ValueError):  # pragma: no cover - non-POSIX
    IOV_MAX = 16


def _advance(bufs: list, n: int) -> list:
    """``bufs`` less the first ``n`` bytes (whole buffers dropped, a partly used one trimmed)."""
    i = 0
    while i < len(bufs) and n >= len(bufs[i]):
        n -= len(bufs[i])
        i += 1
    bufs = bufs[i:]
    if bufs and n:
        bufs = [bufs[0][n:]] + bufs[1:]
    return bufs


def preadv_upto(fd: int, bufs: list, offset: int, want: int | None = None) -> int:
    """Read from ``offset`` into ``bufs`` (writable buffers, in order) until ``want`` bytes
    (default: all of them) arrived or the file ended; returns the bytes read."""
    total = sum(len(b) for b in bufs)
    want = total if want is None else min(want, total)
    got = 0
    while got < want:
        n = os.preadv(fd, bufs[:IOV_MAX], offset + got)
        if n <= 0:
            break  # end of file
        got += n
        bufs = _advance(bufs, n)
    return got


def pwritev_full(fd: int, bufs: list, offset: int) -> int:
    """Write every byte of ``bufs`` (in order) at ``offset``; returns the bytes written."""
    total = sum(len(b) for b in bufs)
    done = 0
    while bufs:
        n = os.pwritev(fd, bufs[:IOV_MAX], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n
        bufs = _advance(bufs, n)
    assert done == total
    return done
