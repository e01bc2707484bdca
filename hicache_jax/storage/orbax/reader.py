"""Reads of indexed pages from orbax segments: the direct OCDBT path and the tensorstore path.

Direct (``read_path="direct"``, the default): the first read of a segment resolves every
page's byte range from the segment's OCDBT B-tree (``ocdbt_direct``). A read call then works
through its pages in the calling thread with up to ``read_concurrency`` of them requested from
the device ahead (``POSIX_FADV_WILLNEED``, asynchronous) of the one being read, so one thread
keeps that many pages in flight without a pool of blocking readers (no GIL handoffs between
readers: ~1.2 instead of ~1.6 ms of CPU per cold 2 MiB page on the project VM).
``read_into_host`` reads each page in place into its host page (``preadv`` straight into the
page's runs in the pool, ``host_pages.PageRuns``, no staging copy) and checks its CRC; a lone
page is requested in 256 KiB pieces (the device starts sooner and serves them in parallel) and,
where its CRC is checked, read and checksummed in 128 KiB groups (``ocdbt_direct.CHUNK_BYTES``).
A page whose read fails after it started (bad CRC, truncated file, damaged shard index) is
zero-filled: it is not loaded and its host page never keeps bytes that failed a
check; host pages of keys that are not stored are never touched.

Tensorstore: where a segment's layout is not the expected one it is read through tensorstore
instead (``read_path="tensorstore"`` forces that): ``{pool}.data`` opened once (zarr3 driver
over the ocdbt kvstore, handles cached in ``HandleCache``), single pages read with up to
``read_concurrency`` in flight.

Faults: a failed check, a truncated or vanished file, or a read error is a miss, and the
segment is quarantined (``SegmentIndex.segment_failed``: all its pages leave the index); an
unexpected exception (a bug) is a counted miss that quarantines nothing. A missing chunk is a
miss (direct) or reads as zeros (tensorstore) that the CRC rejects.

Where the time went (measured on the project's 2-vCPU VM, 2 MiB pages; benchmarks/bench_l3.py):
reads through tensorstore cost ~1.3 ms more per page than the bytes themselves (decode buffer,
copies, thread hops); direct reads disable readahead on the large OCDBT data files (8 MiB
here, which could fetch well beyond a 2 MiB page). A cold lone page took ~3.07 ms against
~2.64 ms for a plain ``read`` of the same bytes; of the ~0.4 ms, ~0.2 ms was Python run before
the page was requested (with a noisy neighbour on the other core, each step after a ~3 ms I/O
wait runs from cold caches), ~0.1 ms after it arrived, plus the CRC (~0.09 ms). Now the page
is requested first and its destination prepared while the device works, and the request goes
out in pieces: ~2.5 ms, faster than the plain ``read`` (which is one request); against a raw
reader that splits its requests the same way what is left is ~0.2 ms of CRC and Python per
page. The copy of the host page's old bytes that once let a failed read restore them (2 MiB
per page, ~0.3 ms of CPU) is gone: no caller needs those bytes (the cache's storage
controller reads through ``get_multi`` into host pages it has just reserved, and attaches only
the hit), and a failed page is zero-filled instead.

Threading: reads run in their caller's thread, any number at once; the reader keeps no
per-call state between calls. The descriptors a call holds (one per page requested ahead) are
its own and closed exactly once, however the call ends. ``HandleCache`` has its own lock (a
leaf, never held while opening an array). The CRC-32C here keeps the GIL (``integrity``'s
``release_gil=False``), on purpose: with the GIL released the cold reads of
``benchmarks/bench_l3.py`` (16 in flight) ran at 0.59 / 0.56 / 0.79 of the raw baseline
against 0.97 / 0.87 / 1.14 for the code that kept it, three A/B pairs on the project VM (2
vCPUs, load 8-11; google-crc32c then); with the GIL kept again, 0.87 against 0.84. A reader
that drops the GIL between its page reads and its CRCs plausibly waits to get it back from
other Python threads of the process (not investigated further).
The ``file`` and ``mooncake`` backends, whose CRCs run on pools of worker threads, use the
GIL-free CRC.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from typing import Callable, Sequence

import numpy as np
import tensorstore as ts

from .. import integrity
from ..base import PageCodec
from ..config import StorageConfig
from ..metrics import StorageMetrics
from . import ocdbt_direct
from .index import SegmentIndex
from .segment import Segment, array_spec

log = logging.getLogger("hicache_jax.storage")

_MAX_HANDLES = 512

# (i, segment, slot, crc): page i of a call is slot ``slot`` of ``segment``, with that CRC
PlannedPage = tuple[int, Segment, int, int]


def host_pieces(codec: PageCodec, host_id: int) -> list[np.ndarray]:
    """The host page ``host_id`` as 1-D uint8 views of the pool in page-byte order (per
    component, its slab; layer-first pools, per layer: ``host_pages.PageRuns``), which a read
    fills in place."""
    return codec.runs().arrays(host_id)


def _scatter(flat: np.ndarray, parts: list) -> None:
    """Copy ``flat`` (uint8[page_bytes]) into ``parts`` (1-D uint8 arrays, in page order)."""
    pos = 0
    for p in parts:
        p[...] = flat[pos : pos + p.nbytes]
        pos += p.nbytes


class HandleCache:
    """Open tensorstore handles of segments' ``{pool}.data`` arrays, least recently used
    dropped beyond ``_MAX_HANDLES``."""

    def __init__(self, pools: Sequence[str], ts_context: ts.Context) -> None:
        self._pools = list(pools)
        self._ts_ctx = ts_context
        self._lock = threading.Lock()
        self._handles: OrderedDict[tuple[str, str], object] = OrderedDict()

    def get(self, seg: Segment, pool: str, page_bytes: int):
        key = (seg.name, pool)
        with self._lock:
            h = self._handles.get(key)
            if h is not None:
                self._handles.move_to_end(key)
                return h
        h = ts.open(array_spec(seg.path, f"{pool}.data"), open=True, read=True, context=self._ts_ctx).result()
        want = (seg.counts[pool], page_bytes)
        if tuple(h.shape) != want or h.dtype != ts.uint8:
            raise ValueError(f"data array {tuple(h.shape)} {h.dtype}, expected {want} uint8")
        with self._lock:
            self._handles[key] = h
            while len(self._handles) > _MAX_HANDLES:
                self._handles.popitem(last=False)
        return h

    def drop(self, name: str) -> None:
        """Forget the handles of segment ``name`` (it left the index)."""
        with self._lock:
            for p in self._pools:
                self._handles.pop((name, p), None)

    def clear(self) -> None:
        with self._lock:
            self._handles.clear()


class _TsRead:
    """A page read through tensorstore (unexpected layout): its pending read future."""

    __slots__ = ("future",)

    def __init__(self, future) -> None:
        self.future = future


class SegmentReader:
    """Reads planned pages (see ``PlannedPage``) out of segments, verifying their CRCs."""

    def __init__(
        self,
        index: SegmentIndex,
        handles: HandleCache,
        codecs: dict[str, PageCodec],
        config: StorageConfig,
        metrics: StorageMetrics,
    ) -> None:
        self.index = index
        self.handles = handles
        self.codecs = codecs
        self.config = config
        self.metrics = metrics

    # ---- what the store calls ------------------------------------------------------------------
    def read(self, pool: str, keys: list[bytes], plan: list[PlannedPage], out: list) -> None:
        """Set ``out[i]`` to a new verified ``uint8[page_bytes]`` for each page of ``plan`` that
        reads; misses stay None. Counts ``verified`` itself."""
        if self.config.read_path != "direct":
            self._read_tensorstore(pool, keys, plan, out)
            return
        # one allocation for the whole call (rows are touched only when read into)
        rows = np.empty((len(plan), self.codecs[pool].page_bytes), np.uint8) if plan else None
        row_of = {item[0]: r for r, item in enumerate(plan)}

        def done(i: int, dst, ok: bool) -> None:
            if ok:
                out[i] = dst

        self.metrics.add(verified=self.read_planned(pool, keys, plan, lambda i: rows[row_of[i]], done))

    def read_into_host(
        self, pool: str, keys: list[bytes], ids: Sequence[int], plan: list[PlannedPage], loaded: list[bool]
    ) -> int:
        """Read each page of ``plan`` straight into host page ``ids[i]`` (its runs in the pool:
        every host layout's runs are contiguous, so no staging copy) and set ``loaded[i]``; a
        page whose read failed is zero-filled. Returns how many pages had their CRC checked
        (the caller counts them)."""
        codec = self.codecs[pool]

        def dst_of(i: int):  # the host page itself: read in place
            return host_pieces(codec, int(ids[i]))

        def done(i: int, dst, ok: bool) -> None:
            if ok:
                loaded[i] = True
            elif dst is not None:  # a failed read into the host page: scrub it
                codec.runs().zero(int(ids[i]))

        return self.read_planned(pool, keys, plan, dst_of, done)

    # ---- the direct path ---------------------------------------------------------------------
    def read_planned(
        self, pool: str, keys: list[bytes], plan: list[PlannedPage], dst_of: Callable, done: Callable
    ) -> int:
        """Read the pages of ``plan`` in the calling thread, with up to ``read_concurrency`` of
        them requested from the device ahead of the one being read; returns how many passed a
        CRC check (the caller counts them).

        ``dst_of(i)`` gives page i's destination (a ``uint8[page_bytes]`` array or a list of
        1-D uint8 arrays taking the page's bytes in order); it is called once the page has
        been requested, so it overlaps the device's work. ``done(i, dst, ok)`` runs once per
        page, in plan order, ``dst`` None if the page was never read into (its segment failed
        or vanished first). A failure is a miss, counted, its segment quarantined where the
        segment is at fault; after a failed read ``dst`` holds unspecified bytes.

        One thread and asynchronous requests (``POSIX_FADV_WILLNEED``) instead of a pool of
        blocking readers: measured on the project's 2-vCPU VM (cold 2 MiB pages, 16 in
        flight), one thread read at ~1.1x the speed of raw reads by 16 threads where 16 reader
        threads managed ~0.9-1.0x, with ~1.2 instead of ~1.6 ms of CPU per page (GIL handoffs,
        and the backup copy this path no longer makes); two or four such threads were no
        faster than one."""
        if not plan:
            return 0
        lone = len(plan) == 1
        ahead = deque()
        nxt = verified = 0
        try:
            for _ in range(len(plan)):
                while nxt < len(plan) and len(ahead) < self.config.read_concurrency:
                    item = plan[nxt]
                    nxt += 1
                    ahead.append((item, self._request(pool, item, split=lone)))
                item, req = ahead.popleft()
                i = item[0]
                if req is not None and not self.index.is_live(item[1]):  # failed or evicted since requested
                    ocdbt_direct.release(req)
                    req = None
                if req is None:
                    done(i, None, False)
                    continue
                dst = None
                try:
                    dst = dst_of(i)
                    ok = self._finish(pool, keys[i], item, req, dst, lone)
                except Exception as e:  # our bug, not the segment's fault: a miss, never quarantine
                    log.warning("L3 orbax: reading page %d of %s (%s) failed: %r", item[2], item[1].name, pool, e)
                    self.metrics.add(read_errors=1)
                    ok = 0
                finally:
                    ocdbt_direct.release(req)  # idempotent: _finish normally released it
                if ok == 2:
                    verified += 1
                done(i, dst, bool(ok))
        finally:
            for _, req in ahead:  # left over only if done() raised
                ocdbt_direct.release(req)
        return verified

    def _request(self, pool: str, item: PlannedPage, split: bool):
        """Start reading one page: a handle for ``_finish``, or None (a miss, already counted)."""
        _, seg, slot, _ = item
        if not self.index.is_live(seg):  # quarantined or evicted meanwhile
            return None
        try:
            locs = self._locations(seg, pool)
            if locs is None:  # unexpected layout: through tensorstore (checked before dst is written)
                try:
                    return _TsRead(self.handles.get(seg, pool, self.codecs[pool].page_bytes)[slot].read())
                except Exception as e:  # tensorstore reports I/O and format errors as ValueError etc.
                    raise ocdbt_direct.DirectReadError(f"tensorstore open/read failed: {e!r}") from e
            return ocdbt_direct.request_page(locs[slot], self.codecs[pool].page_bytes, split)
        except Exception as e:
            self._page_failed(seg, slot, pool, e)
            return None

    def _finish(self, pool: str, key: bytes, item: PlannedPage, req, dst, lone: bool) -> int:
        """Read a requested page into ``dst`` (``req`` is released) and check it: 0 = miss
        (counted), 1 = hit unchecked, 2 = hit whose CRC was checked. A lone page is read and
        checksummed in ``CHUNK_BYTES`` groups (its CRC overlaps the device's work on the rest);
        with more requested ahead, or with no CRC to overlap, whole (one ``preadv``: fewer wake-ups;
        cold lone pages without a check: 3.90 ms whole against 4.07 ms in groups, project VM)."""
        _, seg, slot, crc = item
        check = self._check_this_page()
        try:
            if isinstance(req, _TsRead):
                try:
                    page = np.asarray(req.future.result()).reshape(-1)
                except Exception as e:  # tensorstore reports I/O and format errors as ValueError etc.
                    raise ocdbt_direct.DirectReadError(f"tensorstore read failed: {e!r}") from e
                got = integrity.crc32c(page, key) if check else None
                if got == crc or not check:
                    _scatter(page, dst if isinstance(dst, list) else [dst])
            else:
                got = ocdbt_direct.read_requested(
                    req,
                    dst,
                    integrity.crc32c_value(key) if check else None,
                    ocdbt_direct.CHUNK_BYTES if lone and check else None,
                )
        except Exception as e:
            self._page_failed(seg, slot, pool, e)
            return 0
        if not check:
            return 1
        if got != crc:
            self.metrics.add(verified=1)
            self.index.segment_failed(seg.name, f"CRC mismatch at slot {slot} ({pool})")
            return 0
        return 2

    def _check_this_page(self) -> bool:
        mode = self.config.integrity
        return mode == "full" or (mode == "sampled" and integrity.sample_hit(self.config.integrity_sample_rate))

    def _page_failed(self, seg: Segment, slot: int, pool: str, e: Exception) -> None:
        if isinstance(e, OSError):  # the segment's files: vanished, truncated, unreadable, malformed
            self.metrics.add(read_errors=1)
            self.index.segment_failed(seg.name, f"read of slot {slot} ({pool}) failed: {e!r}")
        else:  # our bug, not the segment's fault: a miss, but never quarantine
            log.warning("L3 orbax: reading slot %d of %s (%s) failed: %r", slot, seg.name, pool, e)
            self.metrics.add(read_errors=1)

    def _locations(self, seg: Segment, pool: str):
        locs = seg.locs
        if locs is None:
            locs = ocdbt_direct.load_locations(
                seg.path, dict(seg.counts), {p: self.codecs[p].page_bytes for p in seg.counts}
            )
            seg.locs = locs  # immutable once loaded; a racing load stores an equal dict
        return locs.get(pool)

    # ---- the tensorstore path ------------------------------------------------------------------
    def _read_tensorstore(self, pool: str, keys: list[bytes], plan: list[PlannedPage], out: list) -> None:
        inflight: deque = deque()

        def finish(item) -> None:
            i, seg, slot, crc, fut = item
            if fut is None:
                return
            try:
                page = np.asarray(fut.result()).reshape(-1)
            except Exception as e:
                self.metrics.add(read_errors=1)
                self.index.segment_failed(seg.name, f"read of slot {slot} failed: {e!r}")
                return
            if self._check_this_page():
                self.metrics.add(verified=1)
                if integrity.crc32c(page, keys[i]) != crc:
                    self.index.segment_failed(seg.name, f"CRC mismatch at slot {slot} ({pool})")
                    return
            out[i] = page

        for i, seg, slot, crc in plan:
            fut = None
            if self.index.is_live(seg):
                try:
                    fut = self.handles.get(seg, pool, self.codecs[pool].page_bytes)[slot].read()
                except Exception as e:
                    self.metrics.add(read_errors=1)
                    self.index.segment_failed(seg.name, f"open failed: {e!r}")
            inflight.append((i, seg, slot, crc, fut))
            if len(inflight) >= self.config.read_concurrency:
                finish(inflight.popleft())
        while inflight:
            finish(inflight.popleft())
