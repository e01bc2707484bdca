"""The default L3 backend: an orbax-managed segment log, read page by page (OCDBT byte ranges).

Needs orbax-checkpoint, tensorstore and a CRC-32C engine (``crc32c`` or ``google-crc32c``; the
``storage`` extra); imported lazily by
``create_storage``. Design and measurements: the modules this one
composes, each with one job:

* ``segment``: the log's layout on disk and the table entry of one segment;
* ``claim``: the writer directory this process saves into (``flock``);
* ``index``: key -> (segment, slot) per pool, the live segments, refresh and quarantine;
* ``reader``: reads of indexed pages (direct OCDBT byte ranges, or through tensorstore);
* ``writer``: segment buffers, the writer and publisher threads, saves and the capacity bound;
* ``ocdbt_direct``: the OCDBT parsing and page requests the direct reads use.

``OrbaxSegmentStorage`` implements ``HiCacheStorage``'s hooks over them; the base class keeps
the public methods (argument checks, metrics, hit policies, faults as misses). It reads in
place (``_read_into_host``, also for ``get_multi`` over ``ALL_PAGES`` pools) when
``read_path="direct"`` and packs host pages straight into the open segment buffer
(``_write_from_host``, one copy into reused memory, instead of a new array per call).

A page is in one of two places: pending in a segment buffer (``SegmentWriter``) or indexed in
a saved segment (``SegmentIndex``). The writer adds a saved segment to the index before its
pages stop being pending, so every lookup asks the writer first and the index second: a page
on its way from one to the other is found in at least one of them, with no lock over both.

Threading: public methods may be called from any threads. The components' locks are
independent and never nested in one another: the index's lock (key maps, segment table), the
handle cache's lock, and the writer's ``_fill_lock`` -> writer lock pair (pending pages and
buffers); none is held across I/O. The writer thread is the only caller of the orbax
Checkpointer; its publisher thread names and indexes each saved segment. Reads run in their
caller's thread. ``refresh`` (explicit, or every ``refresh_interval_s`` from a lookup) runs in
its caller's thread and then applies the capacity bound, as the publisher does after each
segment it indexes.

Contents listeners (``HiCacheStorage.add_listener``): the writer reports pages as ``stored`` when
they become pending and ``removed`` when a failed save (or sync) drops them; the index reports
the keys a forgotten segment (evicted, quarantined, vanished) takes with it, and the keys a refresh finds in
other processes' segments. A segment another process evicts is reported once a refresh sees it
gone (``refresh_interval_s``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Mapping, Sequence

import numpy as np
import tensorstore as ts

from ...host_pool import HostKVPool
from .. import integrity
from ..base import HiCacheStorage, PoolSpec
from ..config import StorageConfig, prepare_store_dir
from .claim import WriterClaim, claim_writer_dir
from .index import SegmentIndex
from .reader import HandleCache, SegmentReader
from .segment import LOG_DIR
from .writer import SegmentWriter, evict_to_capacity, pack_into

if not integrity.HAVE_CRC32C:  # every page of the log is CRC-32C checked: no engine, no backend
    raise ImportError("the orbax L3 backend needs a CRC-32C engine: the crc32c or google-crc32c package")

log = logging.getLogger("hicache_jax.storage")


def _check_single_process() -> None:
    """Orbax saves host (numpy) arrays from JAX process 0 only, and coordinates every save across
    the processes of a ``jax.distributed`` run (barriers from the writer thread): a segment log
    per process cannot be written there. Several tensor-parallel ranks use ``file``, ``memory`` or
    ``mooncake`` (each rank stores its own shard of every page)."""
    import jax

    if jax.distributed.is_initialized() and jax.process_count() > 1:
        raise ValueError(
            "config.backend: 'orbax' cannot be used by several jax.distributed processes (orbax "
            "writes host arrays from process 0 only); use 'file', 'memory' or 'mooncake'"
        )


class OrbaxSegmentStorage(HiCacheStorage):
    backend_name = "orbax"

    def __init__(
        self, config: StorageConfig, pools: Mapping[str, HostKVPool], specs: Sequence[PoolSpec] | None = None
    ) -> None:
        _check_single_process()
        super().__init__(config, pools, specs)
        self.root = os.path.join(os.path.abspath(config.path), LOG_DIR)
        # Raises StorageSetupError naming `path` for a store that cannot be used; False: a
        # read-only store (strict=False) serving its pages, storing nothing.
        writable = prepare_store_dir(config, LOG_DIR)
        if not writable:
            log.warning("L3 orbax: %s is not writable; serving its pages, storing disabled (strict=False)", self.root)
        ts_ctx = ts.Context({"file_io_concurrency": {"limit": max(16, config.read_concurrency)}})
        self._handles = HandleCache(list(self.codecs), ts_ctx)
        self._index = SegmentIndex(
            self.root,
            {p: c.page_bytes for p, c in self.codecs.items()},
            self.metrics,
            ts_ctx,
            on_forget=self._handles.drop,
        )
        self._reader = SegmentReader(self._index, self._handles, self.codecs, config, self.metrics)
        self._writer = SegmentWriter(
            self._claim() if writable else None, self._index, self.codecs, config, self.metrics, after_save=self._evict
        )
        t0 = time.perf_counter()
        self.refresh()
        self.metrics.add(index_rebuild_seconds=time.perf_counter() - t0)

    def _claim(self) -> WriterClaim | None:
        try:
            return claim_writer_dir(self.root)
        except Exception as e:  # read-only or broken store: still serve reads
            log.warning("L3 orbax: no writable writer directory under %s (%r); storing disabled", self.root, e)
            return None

    # ---- read-only views of the components (tests, diagnostics) ------------------------------
    @property
    def index(self) -> SegmentIndex:
        return self._index

    @property
    def reader(self) -> SegmentReader:
        return self._reader

    @property
    def writer(self) -> SegmentWriter:
        return self._writer

    @property
    def stored_bytes(self) -> int:
        return self._index.stored_bytes

    @property
    def writer_dir(self) -> str | None:
        return self._writer.directory

    def segment_names(self) -> list[str]:
        return self._index.segment_names()

    def _set_listeners(self, fns: tuple) -> None:
        super()._set_listeners(fns)
        self._index.notify = self._writer.notify = self._notify  # they report the changes they make

    # ---- index upkeep ----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Index segments written since the last scan (by any process), forget vanished ones,
        then apply the capacity bound."""
        self._index.refresh()
        self._evict()

    def _maybe_refresh(self) -> None:
        if self._index.refresh_due(self.config.refresh_interval_s):
            self.refresh()

    def _evict(self) -> None:
        evict_to_capacity(self._index, self.config.capacity_bytes, self.metrics)

    # ---- HiCacheStorage hooks --------------------------------------------------------------------
    def _contains(self, pool: str, keys: list[bytes]) -> list[bool]:
        self._maybe_refresh()
        pending = self._writer.pending_flags(pool, keys)  # the writer first: see the module docstring
        stored = self._index.contains(pool, keys)
        return [a or b for a, b in zip(pending, stored)]

    def _plan(self, pool: str, keys: list[bytes], take_pending):
        """Pending pages go to ``take_pending(i, row)`` (a view valid only during the call); the
        indexed rest is returned as the reader's plan."""
        served = self._writer.serve_pending(pool, keys, take_pending)
        return self._index.locate(pool, keys, served)

    def _read(self, pool: str, keys: list[bytes]) -> list[np.ndarray | None]:
        self._maybe_refresh()
        out: list[np.ndarray | None] = [None] * len(keys)

        def take_pending(i: int, row: np.ndarray) -> None:
            out[i] = row.copy()

        self._reader.read(pool, keys, self._plan(pool, keys, take_pending), out)
        return out

    def _reads_in_place(self) -> bool:
        return self.config.read_path == "direct"

    def _read_into_host(self, pool: str, keys: list[bytes], ids: Sequence[int], loaded: list[bool]) -> int:
        if not self._reads_in_place():
            return super()._read_into_host(pool, keys, ids, loaded)
        self._maybe_refresh()
        codec = self.codecs[pool]

        def take_pending(i: int, row: np.ndarray) -> None:
            codec.unpack_one(int(ids[i]), row)
            loaded[i] = True

        plan = self._plan(pool, keys, take_pending)
        return self._reader.read_into_host(pool, keys, ids, plan, loaded)

    def _write(self, pool: str, keys: list[bytes], pages: np.ndarray) -> list[bool]:
        return self._writer.enqueue(pool, keys, lambda dst, sel: np.copyto(dst, pages[sel]))

    def _write_from_host(self, pool: str, keys: list[bytes], ids: np.ndarray) -> list[bool]:
        codec = self.codecs[pool]
        src = ids.astype(np.intp)
        return self._writer.enqueue(pool, keys, lambda dst, sel: pack_into(codec, src[sel], dst))

    def _writes_pending(self) -> bool:
        return self._writer.writes_pending()

    def _flush(self, timeout: float | None) -> bool:
        return self._writer.flush(timeout)

    def _close(self) -> None:
        self._writer.close()
        self._handles.clear()
