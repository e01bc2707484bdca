"""In-memory L3 backend: a dict of page bytes per pool, oldest-first eviction by capacity.

For tests and for single-process setups that want an L3 without a disk. Pages carry a CRC
like the on-disk backends (checked on read per ``config.integrity``), so bit flips injected by
tests are caught the same way.

Contents listeners (``HiCacheStorage.add_listener``): ``stored`` for the pages a write adds,
``removed`` for the pages it evicts for capacity and for a page dropped after a CRC mismatch,
each called under the lock from the thread that writes or reads.

Threading: one lock guards the dicts; reads copy the page out under the lock.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Mapping, Sequence

import numpy as np

from ..host_pool import HostKVPool
from . import integrity
from .base import HiCacheStorage, PoolSpec
from .config import StorageConfig

log = logging.getLogger("hicache_jax.storage")


class MemoryStorage(HiCacheStorage):
    backend_name = "memory"

    def __init__(
        self, config: StorageConfig, pools: Mapping[str, HostKVPool], specs: Sequence[PoolSpec] | None = None
    ) -> None:
        super().__init__(config, pools, specs)
        self._lock = threading.Lock()
        # (pool, key) -> (page bytes, crc, algo); insertion order = age for eviction.
        self._pages: OrderedDict[tuple[str, bytes], tuple[np.ndarray, int, int]] = OrderedDict()
        self._bytes = 0

    def _contains(self, pool: str, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [(pool, k) in self._pages for k in keys]

    def _read(self, pool: str, keys: list[bytes]) -> list[np.ndarray | None]:
        out: list[np.ndarray | None] = []
        for k in keys:
            with self._lock:
                rec = self._pages.get((pool, k))
                page = None if rec is None else rec[0].copy()
            if rec is None:
                out.append(None)
                continue
            if self.config.integrity == "full" or (
                self.config.integrity == "sampled" and integrity.sample_hit(self.config.integrity_sample_rate)
            ):
                self.metrics.add(verified=1)
                if integrity.checksum(page, rec[2], k) != rec[1]:
                    log.warning("L3 memory: CRC mismatch for %s/%s; dropping the page", pool, k.hex())
                    self.metrics.add(corrupt=1, quarantined=1)
                    with self._lock:
                        old = self._pages.pop((pool, k), None)
                        if old is not None:
                            self._bytes -= old[0].nbytes
                            if self._notify is not None:
                                self._notify("removed", pool, [k])
                    page = None
            out.append(page)
        return out

    def _write(self, pool: str, keys: list[bytes], pages: np.ndarray) -> list[bool]:
        algo = integrity.DEFAULT_ALGO
        recs = [
            (np.array(pages[i], copy=True), integrity.checksum(pages[i], algo, keys[i]), algo) for i in range(len(keys))
        ]
        cap = self.config.capacity_bytes
        evicted = 0
        with self._lock:
            notify = self._notify
            added = [] if notify is not None else None
            for k, rec in zip(keys, recs):
                if (pool, k) not in self._pages:
                    self._pages[(pool, k)] = rec
                    self._bytes += rec[0].nbytes
                    if added is not None:
                        added.append(k)
            if added:
                notify("stored", pool, added)
            gone: list[tuple[str, bytes]] | None = [] if notify is not None else None
            while cap and self._bytes > cap and self._pages:
                pk, old = self._pages.popitem(last=False)
                self._bytes -= old[0].nbytes
                evicted += 1
                if gone is not None:
                    gone.append(pk)
            if gone:
                _notify_removed(notify, gone)
        self.metrics.add(pages_written=len(keys), bytes_written=int(pages.nbytes), pages_evicted=evicted)
        return [True] * len(keys)

    # ---- test hooks --------------------------------------------------------------------------
    def _corrupt_for_test(self, pool: str, key: bytes, offset: int = 0) -> None:
        """Flip one byte of a stored page (fault injection)."""
        with self._lock:
            self._pages[(pool, key)][0][offset] ^= 0xFF

    @property
    def stored_bytes(self) -> int:
        with self._lock:
            return self._bytes


def _notify_removed(notify, gone: list[tuple[str, bytes]]) -> None:
    """One ``removed`` call per run of one pool in ``gone`` ((pool, key), eviction order)."""
    start = 0
    for i in range(1, len(gone) + 1):
        if i == len(gone) or gone[i][0] != gone[start][0]:
            notify("removed", gone[start][0], [k for _, k in gone[start:i]])
            start = i
