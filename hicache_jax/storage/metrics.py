"""Counters for the L3 store.

Threading: every update takes one lock, so the writer thread, reader threads and the owner
may all count concurrently; ``snapshot()`` returns a consistent copy and ``reset()`` zeroes
every counter at once (counting starts again from that moment, e.g. after a benchmark's
warm-up; a call already counting is counted before or after it, never lost).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, fields


@dataclass
class _Counters:
    hits: int = 0  # pages found and returned (verified when integrity is on)
    misses: int = 0  # pages asked for and not returned (absent, corrupt or unreadable)
    corrupt: int = 0  # pages that failed a check (CRC, length, header, missing chunk)
    read_errors: int = 0  # reads that raised (I/O errors, vanished segment files)
    quarantined: int = 0  # segments / files moved aside after a failed check
    verified: int = 0  # pages whose CRC was checked
    bytes_read: int = 0
    read_seconds: float = 0.0
    pages_written: int = 0  # pages durably committed
    bytes_written: int = 0
    write_seconds: float = 0.0
    write_errors: int = 0  # failed commits (disk full, read-only, ...)
    pages_dropped: int = 0  # pages accepted or offered but never committed
    sets_skipped: int = 0  # sets of pages already stored or in flight (content-addressed)
    segments_written: int = 0
    segments_evicted: int = 0
    pages_evicted: int = 0
    index_rebuild_seconds: float = 0.0


class StorageMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c = _Counters()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self._c, k, getattr(self._c, k) + v)

    def add_read(self, hits: int, misses: int, bytes_read: int, seconds: float, verified: int = 0) -> None:
        """``add`` for the counters of one read call (the hot path: no keyword dict, no loop)."""
        c = self._c
        with self._lock:
            c.hits += hits
            c.misses += misses
            c.bytes_read += bytes_read
            c.read_seconds += seconds
            c.verified += verified

    def reset(self) -> None:
        """Every counter back to zero (in place: ``add_read`` holds the counters object)."""
        zero = _Counters()
        with self._lock:
            for f in fields(_Counters):
                setattr(self._c, f.name, getattr(zero, f.name))

    def snapshot(self) -> dict:
        with self._lock:
            return asdict(self._c)

    def __getattr__(self, name: str):
        # Convenience read access: metrics.hits etc.
        if name.startswith("_"):
            raise AttributeError(name)
        with self.__dict__["_lock"]:
            return getattr(self.__dict__["_c"], name)

    def __repr__(self) -> str:
        return f"StorageMetrics({self.snapshot()})"
