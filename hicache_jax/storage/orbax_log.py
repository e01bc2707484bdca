"""Default L3 backend: an orbax-managed segment log, read page by page (OCDBT byte ranges).

Needs orbax-checkpoint, tensorstore and google-crc32c (the ``jax`` extra); imported lazily by
``create_storage``. Design and measurements: REFERENCE.md section 6.

On disk (``{path}/segments-v1/``)::

    w0000/LOCK            flock'ed by the one live process writing into w0000
    w0000/{step}/default  one segment = one orbax CheckpointManager step (OCDBT + zarr3, no
                          compression); per pool present: ``{pool}.data uint8[S, page_bytes]``
                          (one zarr chunk per page: chunk_byte_size=page_bytes, shard_axes=(0,)),
                          ``{pool}.keys uint8[S, 32]`` and ``{pool}.crc uint32[S]``
                          (CRC-32C of key || page bytes)
    quarantine/           segments that failed a check (moved aside, never read again)
    trash/                evicted segments on their way to deletion

Writers: each process claims a writer directory by ``flock`` (reusing one whose owner died,
after orbax clears that directory's half-written temp steps) and saves steps only there, so
two processes never write the same step. Orbax publishes a step by renaming its temp
directory: a segment directory named by a bare step number is complete; anything else is
ignored by readers. A process killed mid-save leaves only a temp directory.

Index: key -> (segment, slot) per pool, rebuilt at start-up from every segment's ``keys``
array (all writer directories), and refreshed every ``refresh_interval_s`` to pick up
segments other processes wrote. Pages are content-addressed, so the same key in two
segments is harmless: either copy is right.

Reads (``read_path="direct"``, the default): the first read of a segment resolves every
page's byte range from the segment's OCDBT B-tree (``ocdbt_direct``). A read call then works
through its pages in the calling thread with up to ``read_concurrency`` of them requested from
the device ahead (``POSIX_FADV_WILLNEED``, asynchronous) of the one being read, so one thread
keeps that many pages in flight without a pool of blocking readers (no GIL handoffs between
readers: ~1.2 instead of ~1.6 ms of CPU per cold 2 MiB page on the project VM). ``batch_get``
reads each page in place into its host page (``preadv`` straight into the page's slabs, no
staging copy) and checks its CRC; a lone page is requested in 256 KiB pieces (the device starts sooner and
serves them in parallel) and read and checksummed in 512 KiB groups. A page whose read fails
after it started (bad CRC, truncated file, damaged shard index) is zero-filled: its flag is
False and its host page never keeps bytes that failed a check; host pages of keys that are
not stored are never touched. ``get_multi`` over ``ALL_PAGES`` pools (the controller's
prefetch) reads each pool in place the same way; with a trailing-window pool it reads into
one new array per call and publishes once every pool is in.
Where the layout is not the expected one the segment is read through tensorstore instead
(``read_path="tensorstore"`` forces that): ``{pool}.data`` opened once (zarr3 driver over the
ocdbt kvstore, handles cached), single pages read with up to ``read_concurrency`` in flight.
A failed check, a truncated or vanished file, or a read error is a miss, and the segment is
quarantined (all its pages leave the index); an unexpected exception (a bug) is a counted
miss that quarantines nothing. A missing chunk is a miss (direct) or reads as zeros
(tensorstore) that the CRC rejects.

Writes: ``batch_set`` packs host pages straight into the pool's open segment buffer (a
``uint8[segment_pages, page_bytes]`` array, ``StorageConfig.segment_pages_for(page_bytes)``
rows, reused across saves up to ``write_buffer_bytes``; visible to reads at once) and returns;
one writer thread saves a segment when a buffer is full, on ``flush()``, or ``flush_interval_s``
after the oldest pending page arrived. Orbax saves the
buffer without its defensive deep copy (the save is synchronous and the buffer is not touched
until it returns). A failed save (disk full, read-only directory) drops that segment's pages
(counted, logged); the next save tries again. A capacity bound evicts whole segments, oldest
commit first.

Threading: public methods may be called from any threads. One lock (``_lock``) guards the
index, the segment table, the handle cache and the pending pages; it is never held across
I/O (copies of pending pages happen under it). ``_fill_lock`` serialises packing into the open
segment buffers (taken before ``_lock``, never after). The writer thread is the only caller of
the orbax CheckpointManager. Reads run in their caller's thread; the descriptors they hold
(one per page requested ahead) are theirs alone and closed exactly once.

Where the time went (measured on the project's 2-vCPU VM, 2 MiB pages, segments of 64;
benchmarks/bench_l3.py): memory the process has not touched recently costs about as much as
the disk write itself there (the hypervisor takes freed guest pages back after ~2 s and
refaults them at 0.3-0.5 GB/s), so orbax's defensive deep copy per save (save CPU 1.0 s ->
0.2 s per 128 MiB without it) and a fresh pack buffer per ``batch_set`` each cost as much as
the I/O; reads through tensorstore cost ~1.3 ms more per page than the bytes themselves
(decode buffer, copies, thread hops); direct reads disable readahead on the large OCDBT
data files (8 MiB here, which could fetch well beyond a 2 MiB page). A cold lone page took
~3.07 ms against ~2.64 ms for a plain ``read`` of the same bytes; of the ~0.4 ms, ~0.2 ms was
Python run before the page was requested (with a noisy neighbour on the other core, each
step after a ~3 ms I/O wait runs from cold caches), ~0.1 ms after it arrived, plus the CRC
(~0.09 ms). Now the page is requested first and its destination prepared while the device
works, and the request goes out in pieces: ~2.5 ms, faster than the plain ``read``
(which is one request); against a raw reader that splits its requests the same way what
is left is ~0.2 ms of CRC and Python per page. The copy of the host page's old bytes
that once let a failed read restore them (2 MiB per page, ~0.3 ms of CPU) is gone: no
caller needs those bytes (the cache's storage controller reads through ``get_multi`` into
host pages it has just reserved, and attaches only the hit), and a failed page is
zero-filled instead.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ..host_pool import HostKVPool
from ..workers import lower_thread_priority
from . import integrity
from .base import HiCacheStorage, HitResult, PageCodec, PoolHitPolicy, PoolSpec, PoolTransfer, consecutive
from .config import StorageConfig
from .keys import KEY_BYTES, keys_to_array

import orbax.checkpoint as ocp  # noqa: E402  (module is imported lazily by create_storage)
import tensorstore as ts  # noqa: E402

from . import ocdbt_direct  # noqa: E402  (needs tensorstore)
import google_crc32c as _gcrc  # noqa: E402

if not integrity.HAVE_CRC32C:  # pragma: no cover - google-crc32c ships with the jax extra
    raise ImportError("the orbax L3 backend needs google-crc32c (pip install google-crc32c)")

log = logging.getLogger("hicache_jax.storage")


class _ChunkSizeWarningFilter(logging.Filter):
    """Drops orbax's "target_byte_size too small" warning: one chunk per page is this store's
    design (pages are read one at a time), so it fired on every segment save for pages < 1 MiB."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "target_byte_size too small" not in str(record.msg)


logging.getLogger("absl").addFilter(_ChunkSizeWarningFilter())

_WRITER_RE = re.compile(r"w\d{4,}")
_MAX_HANDLES = 512


def _type_handler_registry():
    """orbax's default handlers, but numpy arrays are saved without a defensive deep copy.

    Safe here: saves are synchronous (``enable_async_checkpointing=False``) and a segment
    buffer is neither written nor recycled until the save has returned. The deep copy costs
    a fresh ``page_bytes * segment_pages`` allocation per save (measured: save CPU 1.0 s ->
    0.2 s for 128 MiB on the project VM)."""
    th = ocp.type_handlers
    handlers = []
    for ty in th.supported_types():
        h = th.NumpyHandler(deepcopy_host_arrays=False) if ty is np.ndarray else th.get_type_handler(ty)
        handlers.append((ty, h))
    return th.create_type_handler_registry(*handlers)


def _pack_into(codec: PageCodec, ids: np.ndarray, out: np.ndarray) -> None:
    """``codec.pack(ids)`` written into ``out`` (``uint8[n, page_bytes]``, C-contiguous rows)
    instead of a new array: the same few large gathers, which release the GIL."""
    n = len(ids)
    comps = codec.geom.components
    out3 = out.view(codec.geom.container_dtype).reshape((n, len(comps)) + codec._slab)
    for i, c in enumerate(comps):
        view = codec.pool.component_view(c)
        if codec.layer_first:  # (L, pages, ...) gathered along axis 1 into (n, L, ...)
            np.take(view, ids, axis=1, out=np.moveaxis(out3[:, i], 0, 1), mode="clip")
        else:
            np.take(view, ids, axis=0, out=out3[:, i], mode="clip")


def _copy_parts(parts: list, flat: np.ndarray, into_parts: bool) -> None:
    """Copy between ``parts`` (1-D uint8 arrays, in page order) and ``flat`` (uint8[page_bytes])."""
    pos = 0
    for p in parts:
        if into_parts:
            p[...] = flat[pos:pos + p.nbytes]
        else:
            flat[pos:pos + p.nbytes] = p
        pos += p.nbytes


def _host_pieces(codec: PageCodec, host_id: int) -> list[np.ndarray] | None:
    """The host page ``host_id`` as 1-D uint8 views in page-byte order (what
    ``codec.unpack_one`` writes: per component, its slab; layer-first pools, per layer), or
    None if any piece is not C-contiguous."""
    pieces = []
    for c in codec.geom.components:
        view = codec.pool.component_view(c)
        slabs = [view[l, host_id] for l in range(view.shape[0])] if codec.layer_first else [view[host_id]]
        for s in slabs:
            if not s.flags.c_contiguous:
                return None
            pieces.append(s.reshape(-1).view(np.uint8))
    if sum(p.nbytes for p in pieces) != codec.page_bytes:
        return None
    return pieces


@dataclass
class _Segment:
    name: str                      # "w0000/17"
    path: str                      # absolute step directory
    order: tuple                   # (commit time, name): eviction order
    counts: dict[str, int]         # pool -> pages
    crcs: dict[str, np.ndarray] = field(default_factory=dict)
    keys: dict[str, list[bytes]] = field(default_factory=dict)
    nbytes: int = 0
    locs: dict | None = None       # pool -> per-slot page locations (direct reads), loaded lazily


class _TsRead:
    """A page read through tensorstore (unexpected layout): its pending read future."""

    __slots__ = ("future",)

    def __init__(self, future) -> None:
        self.future = future


class _SegBuf:
    """Pages of one pool waiting for a save: rows ``[0, n)`` of ``data`` hold ``keys``."""

    __slots__ = ("pool", "data", "keys", "n", "view_ref")

    def __init__(self, pool: str, data: np.ndarray) -> None:
        self.pool, self.data, self.keys, self.n, self.view_ref = pool, data, [], 0, None


class OrbaxSegmentStorage(HiCacheStorage):
    backend_name = "orbax"

    def __init__(self, config: StorageConfig, pools: Mapping[str, HostKVPool],
                 specs: Sequence[PoolSpec] | None = None) -> None:
        super().__init__(config, pools, specs)
        self.root = os.path.join(os.path.abspath(config.path), "segments-v1")
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._fill_lock = threading.Lock()
        self._index: dict[str, dict[bytes, tuple[str, int]]] = {p: {} for p in self.codecs}
        self._segments: dict[str, _Segment] = {}
        self._bad: set[str] = set()  # segment names never to index again in this process
        self._bytes = 0
        self._handles: OrderedDict[tuple[str, str], object] = OrderedDict()
        # pending: (pool, key) -> (segment buffer, row); insertion order = arrival order
        self._pending: dict[tuple[str, bytes], tuple[_SegBuf, int]] = {}
        self._open: dict[str, _SegBuf] = {}       # pool -> buffer being filled
        self._sealed: deque[_SegBuf] = deque()    # full (or flushed) buffers, oldest first
        self._free: dict[str, list[np.ndarray]] = {p: [] for p in self.codecs}
        self._seg_pages = {p: config.segment_pages_for(c.page_bytes) for p, c in self.codecs.items()}
        self._free_bytes = 0
        self._pending_since = 0.0
        self._flush_requested = False
        self._saving = 0
        self._closed = False
        self._last_refresh = 0.0
        self._ts_ctx = ts.Context({"file_io_concurrency": {"limit": max(16, config.read_concurrency)}})
        self._tls = threading.local()
        self._lock_fd = -1
        self._wdir: str | None = None
        self._mgr = None
        self._next_step = 0
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            log.warning("L3 orbax: cannot create %s: %r (read-only store)", self.root, e)
        self._claim_writer_dir()
        t0 = time.perf_counter()
        self.refresh()
        self.metrics.add(index_rebuild_seconds=time.perf_counter() - t0)
        self._writer = threading.Thread(target=self._writer_loop, name="l3-orbax-writer", daemon=True)
        self._writer.start()

    # ---- writer directory ----------------------------------------------------------------------
    def _claim_writer_dir(self) -> None:
        """flock a writer directory (reuse a dead owner's, else create the next one)."""
        try:
            for _ in range(64):
                names = sorted(d for d in os.listdir(self.root) if _WRITER_RE.fullmatch(d))
                nxt = f"w{(max((int(n[1:]) for n in names), default=-1) + 1):04d}"
                for name in names + [nxt]:
                    d = os.path.join(self.root, name)
                    os.makedirs(d, exist_ok=True)
                    fd = os.open(os.path.join(d, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        os.close(fd)
                        continue
                    self._lock_fd, self._wdir = fd, d
                    self._open_manager()
                    return
        except Exception as e:  # read-only or broken store: still serve reads
            log.warning("L3 orbax: no writable writer directory under %s (%r); storing disabled", self.root, e)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
        self._lock_fd, self._wdir, self._mgr = -1, None, None

    def _open_manager(self) -> None:
        # We hold the flock, so no live process writes here: clear temp steps a killed owner
        # left (synchronously; orbax's own cleanup option runs in the background).
        for n in os.listdir(self._wdir):
            if n != "LOCK" and not n.isdigit():
                shutil.rmtree(os.path.join(self._wdir, n), ignore_errors=True)
        self._mgr = ocp.CheckpointManager(
            self._wdir,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None, create=True, enable_async_checkpointing=False, cleanup_tmp_directories=False,
                save_root_metadata=False, lightweight_initialize=True),
            item_handlers=ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=False,
                                                      type_handler_registry=_type_handler_registry()))
        steps = [int(m.group(1)) for n in os.listdir(self._wdir) if (m := re.match(r"(\d+)", n))]
        self._next_step = max(steps, default=-1) + 1

    # ---- index -----------------------------------------------------------------------------------
    def _list_segments(self) -> dict[str, str]:
        """name -> path of every committed segment on disk."""
        out = {}
        try:
            writers = [d for d in os.listdir(self.root) if _WRITER_RE.fullmatch(d)]
        except OSError:
            return out
        for w in writers:
            try:
                steps = os.listdir(os.path.join(self.root, w))
            except OSError:
                continue
            for s in steps:
                if s.isdigit():  # orbax renames a finished temp dir to the bare step number
                    out[f"{w}/{s}"] = os.path.join(self.root, w, s)
        return out

    def refresh(self) -> None:
        """Index segments written since the last scan (by any process); forget vanished ones."""
        self._last_refresh = time.monotonic()
        on_disk = self._list_segments()
        with self._lock:
            gone = [n for n in self._segments if n not in on_disk]
            new = [n for n in on_disk if n not in self._segments and n not in self._bad]
        for n in gone:
            self._forget(n)
        # Issue every segment's key/CRC reads before waiting on any (start-up over many
        # segments is bounded by I/O latency, not by one segment after another).
        started = [(n, self._start_load(n, on_disk[n])) for n in new]
        loaded = [seg for n, st in started if (seg := self._finish_load(n, on_disk[n], st)) is not None]
        loaded.sort(key=lambda s: s.order)
        with self._lock:
            for seg in loaded:
                self._add_segment(seg)
        self._evict()

    def _start_load(self, name: str, path: str):
        try:
            with open(os.path.join(path, "default", "_METADATA")) as f:
                meta = json.load(f)
            pools = {v["key_metadata"][0]["key"] for v in meta["tree_metadata"].values()}
            seg = _Segment(name, path, (os.stat(path).st_mtime, name), {})
            futs = {}
            for p in sorted(pools & set(self.codecs)):
                futs[p] = [ts.open(self._spec(path, f"{p}.{a}"), open=True, read=True, context=self._ts_ctx)
                           for a in ("keys", "crc")]
            return seg, futs
        except Exception as e:
            return e

    def _finish_load(self, name: str, path: str, started) -> _Segment | None:
        try:
            if isinstance(started, Exception):
                raise started
            seg, futs = started
            reads = {p: [f.result().read() for f in fs] for p, fs in futs.items()}
            for p, (fk, fc) in reads.items():
                keys, crcs = fk.result(), fc.result()
                n = keys.shape[0]
                if keys.shape != (n, KEY_BYTES) or keys.dtype != np.uint8 or crcs.shape != (n,):
                    raise ValueError(f"pool {p}: keys {keys.shape} / crc {crcs.shape} do not match")
                seg.counts[p] = n
                seg.keys[p] = [bytes(k) for k in keys]
                seg.crcs[p] = np.asarray(crcs, np.uint32)
                seg.nbytes += n * self.codecs[p].page_bytes
            return seg
        except FileNotFoundError:
            return None  # evicted between listing and loading
        except Exception as e:
            if not os.path.isdir(path):
                return None
            self._quarantine(name, path, f"unreadable segment metadata: {e!r}")
            return None

    def _spec(self, seg_path: str, array: str) -> dict:
        return {"driver": "zarr3",
                "kvstore": {"driver": "ocdbt", "base": f"file://{seg_path}/default/", "path": array}}

    def _add_segment(self, seg: _Segment) -> None:  # under _lock
        if seg.name in self._segments:
            return
        self._segments[seg.name] = seg
        self._bytes += seg.nbytes
        for p, keys in seg.keys.items():
            idx = self._index[p]
            for slot, k in enumerate(keys):
                idx[k] = (seg.name, slot)

    def _forget(self, name: str) -> _Segment | None:
        with self._lock:
            seg = self._segments.pop(name, None)
            if seg is None:
                return None
            self._bytes -= seg.nbytes
            for p, keys in seg.keys.items():
                idx = self._index[p]
                for k in keys:
                    if idx.get(k, (None,))[0] == name:
                        del idx[k]
                self._handles.pop((name, p), None)
        return seg

    def _quarantine(self, name: str, path: str, why: str) -> None:
        log.warning("L3 orbax: segment %s: %s; quarantined", name, why)
        with self._lock:
            if name in self._bad:
                return
            self._bad.add(name)
        self._forget(name)
        self.metrics.add(quarantined=1)
        try:
            qdir = os.path.join(self.root, "quarantine")
            os.makedirs(qdir, exist_ok=True)
            os.rename(path, os.path.join(qdir, f"{name.replace('/', '-')}-{uuid.uuid4().hex[:8]}"))
        except FileNotFoundError:
            pass
        except OSError as e:  # read-only store: remembered in-process only
            log.warning("L3 orbax: cannot move %s to quarantine: %r", path, e)

    def _maybe_refresh(self) -> None:
        iv = self.config.refresh_interval_s
        if iv and time.monotonic() - self._last_refresh > iv:
            self.refresh()

    # ---- primitives ----------------------------------------------------------------------------
    def _contains(self, pool: str, keys: list[bytes]) -> list[bool]:
        self._maybe_refresh()
        with self._lock:
            idx = self._index[pool]
            return [k in idx or (pool, k) in self._pending for k in keys]

    def _handle(self, seg: _Segment, pool: str):
        key = (seg.name, pool)
        with self._lock:
            h = self._handles.get(key)
            if h is not None:
                self._handles.move_to_end(key)
                return h
        h = ts.open(self._spec(seg.path, f"{pool}.data"), open=True, read=True, context=self._ts_ctx).result()
        want = (seg.counts[pool], self.codecs[pool].page_bytes)
        if tuple(h.shape) != want or h.dtype != ts.uint8:
            raise ValueError(f"data array {tuple(h.shape)} {h.dtype}, expected {want} uint8")
        with self._lock:
            self._handles[key] = h
            while len(self._handles) > _MAX_HANDLES:
                self._handles.popitem(last=False)
        return h

    def _segment_failed(self, name: str, why: str) -> None:
        with self._lock:
            seg = self._segments.get(name)
        if seg is None:
            return
        if not os.path.isdir(seg.path):  # evicted (by us or another process): a plain miss
            self._forget(name)
            return
        self.metrics.add(corrupt=1)
        self._quarantine(name, seg.path, why)

    def _plan(self, pool: str, keys: list[bytes], pending_hit) -> list:
        """Under the lock: pending pages go to ``pending_hit(i, row)`` (a view valid only during
        the call); returns ``(i, segment, slot, crc)`` for indexed pages."""
        plan = []
        with self._lock:
            idx = self._index[pool]
            for i, k in enumerate(keys):
                ent = self._pending.get((pool, k))
                if ent is not None:
                    pending_hit(i, ent[0].data[ent[1]])
                    continue
                loc = idx.get(k)
                if loc is not None:
                    seg = self._segments[loc[0]]
                    plan.append((i, seg, loc[1], seg.crcs[pool].item(loc[1])))
        return plan

    def _read(self, pool: str, keys: list[bytes]) -> list[np.ndarray | None]:
        self._maybe_refresh()
        out: list[np.ndarray | None] = [None] * len(keys)

        def pending_hit(i: int, row: np.ndarray) -> None:
            out[i] = row.copy()

        plan = self._plan(pool, keys, pending_hit)
        if self.config.read_path == "direct":
            # one allocation for the whole call (rows are touched only when read into)
            rows = np.empty((len(plan), self.codecs[pool].page_bytes), np.uint8) if plan else None
            row_of = {item[0]: r for r, item in enumerate(plan)}

            def dst_of(i: int) -> np.ndarray:
                return rows[row_of[i]]

            def done(i: int, dst, ok: bool) -> None:
                if ok:
                    out[i] = dst

            self.metrics.add(verified=self._read_pages(pool, keys, plan, dst_of, done))
        else:
            self._read_tensorstore(pool, keys, plan, out)
        return out

    def _read_tensorstore(self, pool: str, keys: list[bytes], plan: list, out: list) -> None:
        mode, rate = self.config.integrity, self.config.integrity_sample_rate
        inflight: deque = deque()

        def finish(item) -> None:
            i, seg, slot, crc, fut = item
            if fut is None:
                return
            try:
                page = np.asarray(fut.result()).reshape(-1)
            except Exception as e:
                self.metrics.add(read_errors=1)
                self._segment_failed(seg.name, f"read of slot {slot} failed: {e!r}")
                return
            if mode == "full" or (mode == "sampled" and integrity.sample_hit(rate)):
                self.metrics.add(verified=1)
                if integrity.crc32c(page, keys[i]) != crc:
                    self._segment_failed(seg.name, f"CRC mismatch at slot {slot} ({pool})")
                    return
            out[i] = page

        for i, seg, slot, crc in plan:
            with self._lock:
                live = seg.name in self._segments
            fut = None
            if live:
                try:
                    fut = self._handle(seg, pool)[slot].read()
                except Exception as e:
                    self.metrics.add(read_errors=1)
                    self._segment_failed(seg.name, f"open failed: {e!r}")
            inflight.append((i, seg, slot, crc, fut))
            if len(inflight) >= self.config.read_concurrency:
                finish(inflight.popleft())
        while inflight:
            finish(inflight.popleft())

    # ---- direct reads ----------------------------------------------------------------------------
    def get_multi(self, transfers: Sequence[PoolTransfer]) -> HitResult:
        """``HiCacheStorage.get_multi`` read in place, pool by pool (draft before target), through
        ``batch_get``, when every pool is ``ALL_PAGES`` (the storage controller's prefetch):
        no new array and no second copy per call. The hit and what it publishes are the base
        class's; the difference is that host pages in ``[hit, index hint)`` may hold one
        pool's bytes when another pool failed there (or zeros, where the read failed): the
        caller's own pages for this call, never reported as hits. Trailing-window pools go
        through the base class (read everything, then publish)."""
        if self.config.read_path != "direct" or not transfers or any(
                not isinstance(t, PoolTransfer) or t.pool not in self.specs
                or self.specs[t.pool].policy is not PoolHitPolicy.ALL_PAGES for t in transfers):
            return super().get_multi(transfers)  # also raises the argument errors
        keys, ids, _ = self._transfers(transfers, need_ids=True)
        for p in keys:
            self._check_used_ids(p, ids[p], unique=True)
        hit = self.exists_multi(transfers).hit_pages  # index only: never read what cannot be used
        for p in sorted(keys, key=lambda p: p == self.primary):
            if not hit:
                break
            hit = min(hit, consecutive(self.batch_get(keys[p][:hit], ids[p][:hit], p)))
        return HitResult(hit, {p: hit for p in keys})

    def batch_get(self, keys: Sequence[bytes], host_page_ids: object, pool: str | None = None) -> list[bool]:
        """``HiCacheStorage.batch_get``, streamed: each page is read straight into its host page
        (in place; into a per-thread scratch buffer, then copied, only for a layout whose page
        slabs are not contiguous), verified, with ``read_concurrency`` pages requested ahead.
        Same contract: faults are misses; keys not stored leave their host pages untouched; a
        page whose read failed is zero-filled (never left holding bytes that failed a check)."""
        if self.config.read_path != "direct":
            return super().batch_get(keys, host_page_ids, pool)
        pool = self._pool(pool)
        keys = self._keys(keys)
        ids = self._small_ids(pool, host_page_ids, len(keys))
        if ids is None:
            ids = self._ids(pool, host_page_ids, len(keys))
            self._check_used_ids(pool, ids, unique=True)
        if not keys:
            return []
        t0 = time.perf_counter()
        codec = self.codecs[pool]
        flags = [False] * len(keys)

        def publish(i: int, page: np.ndarray) -> None:
            codec.unpack_one(int(ids[i]), page)
            flags[i] = True

        verified = 0
        try:
            self._maybe_refresh()
            plan = self._plan(pool, keys, publish)
            pb = codec.page_bytes

            def dst_of(i: int):  # the host page itself (read in place), else scratch
                pieces = _host_pieces(codec, int(ids[i]))
                return pieces if pieces is not None else self._scratch(pb)

            def done(i: int, dst, ok: bool) -> None:
                if ok:
                    if not isinstance(dst, list):
                        publish(i, dst)
                    flags[i] = True
                elif isinstance(dst, list):  # a failed read into the host page: scrub it
                    for p in dst:
                        p.fill(0)

            verified = self._read_pages(pool, keys, plan, dst_of, done)
        except Exception as e:  # never escapes; pages already published keep their True flag
            log.warning("L3 orbax: read(%s, %d keys) failed: %r", pool, len(keys), e)
            self.metrics.add(read_errors=1)
        good = sum(flags)
        self.metrics.add_read(good, len(keys) - good, good * codec.page_bytes, time.perf_counter() - t0, verified)
        return flags

    def _small_ids(self, pool: str, host_page_ids: object, n: int) -> list[int] | None:
        """The ids of a small, plainly valid call (a list/tuple/range of distinct in-range
        Python ints) without numpy; None for anything else, which then goes through the base
        checks (and their errors). One-page reads are frequent: after a 2 MiB copy has
        flushed the CPU caches, the numpy checks cost ~0.1 ms of a ~3 ms read."""
        if n == 1 and type(host_page_ids) is list and len(host_page_ids) == 1:  # the common lone page
            v = host_page_ids[0]
            return [v] if type(v) is int and 0 <= v < self.codecs[pool].pool.num_pages else None
        if n > 16 or not isinstance(host_page_ids, (list, tuple, range)) or len(host_page_ids) != n:
            return None
        vals = list(host_page_ids)
        if not all(type(v) is int for v in vals):
            return None
        if vals and (min(vals) < 0 or max(vals) >= self.codecs[pool].pool.num_pages or len(set(vals)) != n):
            return None
        return vals

    def _scratch(self, nbytes: int) -> np.ndarray:
        bufs = getattr(self._tls, "bufs", None)
        if bufs is None:
            bufs = self._tls.bufs = {}
        buf = bufs.get(nbytes)
        if buf is None:
            buf = bufs[nbytes] = np.empty(nbytes, np.uint8)
        return buf

    def _locations(self, seg: _Segment, pool: str):
        locs = seg.locs
        if locs is None:
            locs = ocdbt_direct.load_locations(
                seg.path, dict(seg.counts), {p: self.codecs[p].page_bytes for p in seg.counts})
            seg.locs = locs  # immutable once loaded; a racing load stores an equal dict
        return locs.get(pool)

    def _read_pages(self, pool: str, keys: list[bytes], plan: list, dst_of, done) -> int:
        """Read the pages of ``plan`` (``(i, segment, slot, crc)``) in the calling thread, with up
        to ``read_concurrency`` of them requested from the device ahead of the one being read;
        returns how many passed a CRC check (the caller counts them).

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
                if req is not None:
                    with self._lock:
                        if item[1].name not in self._segments:  # failed or evicted since requested
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

    def _request(self, pool: str, item: tuple, split: bool):
        """Start reading one page: a handle for ``_finish``, or None (a miss, already counted)."""
        _, seg, slot, _ = item
        with self._lock:
            if seg.name not in self._segments:  # quarantined or evicted meanwhile
                return None
        try:
            locs = self._locations(seg, pool)
            if locs is None:  # unexpected layout: through tensorstore (checked before dst is written)
                try:
                    return _TsRead(self._handle(seg, pool)[slot].read())
                except Exception as e:  # tensorstore reports I/O and format errors as ValueError etc.
                    raise ocdbt_direct.DirectReadError(f"tensorstore open/read failed: {e!r}") from e
            return ocdbt_direct.request_page(locs[slot], self.codecs[pool].page_bytes, split)
        except Exception as e:
            self._read_failed(seg, slot, pool, e)
            return None

    def _finish(self, pool: str, key: bytes, item: tuple, req, dst, lone: bool) -> int:
        """Read a requested page into ``dst`` (``req`` is released) and check it: 0 = miss
        (counted), 1 = hit unchecked, 2 = hit whose CRC was checked. A lone page is read and
        checksummed in ``CHUNK_BYTES`` groups (its CRC overlaps the device's work on the rest);
        with more requested ahead, whole (one ``preadv``: the next pages' I/O is the overlap)."""
        _, seg, slot, crc = item
        mode = self.config.integrity
        check = mode == "full" or (mode == "sampled" and integrity.sample_hit(self.config.integrity_sample_rate))
        try:
            if isinstance(req, _TsRead):
                try:
                    page = np.asarray(req.future.result()).reshape(-1)
                except Exception as e:  # tensorstore reports I/O and format errors as ValueError etc.
                    raise ocdbt_direct.DirectReadError(f"tensorstore read failed: {e!r}") from e
                got = integrity.crc32c(page, key) if check else None
                if got == crc or not check:
                    _copy_parts(dst if isinstance(dst, list) else [dst], page, into_parts=True)
            else:
                got = ocdbt_direct.read_requested(req, dst, _gcrc.value(key) if check else None,
                                                  ocdbt_direct.CHUNK_BYTES if lone else None)
        except Exception as e:
            self._read_failed(seg, slot, pool, e)
            return 0
        if not check:
            return 1
        if got != crc:
            self.metrics.add(verified=1)
            self._segment_failed(seg.name, f"CRC mismatch at slot {slot} ({pool})")
            return 0
        return 2

    def _read_failed(self, seg: _Segment, slot: int, pool: str, e: Exception) -> None:
        if isinstance(e, OSError):  # the segment's files: vanished, truncated, unreadable, malformed
            self.metrics.add(read_errors=1)
            self._segment_failed(seg.name, f"read of slot {slot} ({pool}) failed: {e!r}")
        else:  # our bug, not the segment's fault: a miss, but never quarantine
            log.warning("L3 orbax: reading slot %d of %s (%s) failed: %r", slot, seg.name, pool, e)
            self.metrics.add(read_errors=1)

    # ---- writes --------------------------------------------------------------------------------
    def batch_set(self, keys: Sequence[bytes], host_page_ids: object, pool: str | None = None) -> list[bool]:
        """``HiCacheStorage.batch_set``, but host pages are packed straight into the open
        segment buffer (one copy, into reused memory) instead of a new array per call. Same
        contract: the bytes are copied out before this returns."""
        pool, keys, ids, plan = self._plan_set(pool, keys, host_page_ids)
        result, todo = plan.result, plan.todo
        if todo:
            codec = self.codecs[pool]
            src = ids[todo].astype(np.intp)
            try:
                ok = self._enqueue(pool, [keys[i] for i in todo], lambda dst, sel: _pack_into(codec, src[sel], dst))
            except Exception as e:  # never lose the caller's (backup) thread
                log.warning("L3 orbax: packing host pages failed: %r", e)
                self.metrics.add(write_errors=1, pages_dropped=len(todo))
                ok = [False] * len(todo)
            for i, o in zip(todo, ok):
                result[i] = o
        return plan.finish(keys)

    def _write(self, pool: str, keys: list[bytes], pages: np.ndarray) -> list[bool]:
        return self._enqueue(pool, keys, lambda dst, sel: np.copyto(dst, pages[sel]))

    def _new_buffer(self, pool: str) -> _SegBuf:  # under _fill_lock
        with self._lock:
            free = self._free[pool]
            data = free.pop() if free else None
            if data is not None:
                self._free_bytes -= data.nbytes
        if data is None:
            data = np.empty((self._seg_pages[pool], self.codecs[pool].page_bytes), np.uint8)
        return _SegBuf(pool, data)

    def _enqueue(self, pool: str, keys: list[bytes], fill) -> list[bool]:
        """Accept ``keys`` (distinct, not stored) into ``pool``'s open segment buffer;
        ``fill(dst_rows, sel)`` writes the pages ``sel`` (indices into keys) into ``dst_rows``."""
        S = self._seg_pages[pool]
        with self._fill_lock:
            with self._lock:
                if self._mgr is None or self._closed:
                    self.metrics.add(write_errors=1 if self._mgr is None else 0, pages_dropped=len(keys))
                    return [False] * len(keys)
                ok = []
                accept = []
                room = self.config.max_pending_pages - len(self._pending)
                for i, k in enumerate(keys):
                    if (pool, k) in self._pending:
                        ok.append(True)
                    elif room > 0:
                        accept.append(i)
                        room -= 1
                        ok.append(True)
                    else:  # back-pressure: L3 is best effort, the writer is behind
                        ok.append(False)
            dropped = ok.count(False)
            if dropped:
                self.metrics.add(pages_dropped=dropped)
            pos = 0
            while pos < len(accept):
                buf = self._open.get(pool)  # changed only under _fill_lock, which we hold
                if buf is None:
                    buf = self._new_buffer(pool)
                    with self._lock:
                        self._open[pool] = buf
                take = min(S - buf.n, len(accept) - pos)
                sel = np.asarray(accept[pos:pos + take], np.intp)
                fill(buf.data[buf.n:buf.n + take], sel)  # outside _lock: readers go on meanwhile
                with self._cond:
                    if not self._pending:
                        self._pending_since = time.monotonic()
                    for r, i in enumerate(sel):
                        self._pending[(pool, keys[i])] = (buf, buf.n + r)
                        buf.keys.append(keys[i])
                    buf.n += take
                    if buf.n >= S:
                        del self._open[pool]
                        self._sealed.append(buf)
                    self._cond.notify_all()
                pos += take
        return ok

    # ---- writer thread -------------------------------------------------------------------------
    def _writer_loop(self) -> None:
        # Below the scheduler's priority (StorageConfig.worker_nice); orbax's commit threads,
        # started from here, inherit it.
        lower_thread_priority(self.config.worker_nice)
        while True:
            seal = False
            with self._cond:
                while True:
                    if self._sealed:
                        break
                    if self._pending:
                        age = time.monotonic() - self._pending_since
                        if self._flush_requested or self._closed or age >= self.config.flush_interval_s:
                            seal = True
                            break
                        wait = max(0.001, self.config.flush_interval_s - age)
                    else:
                        if self._flush_requested:
                            self._flush_requested = False
                            self._cond.notify_all()
                        if self._closed:
                            return
                        wait = None
                    self._cond.wait(wait)
            if seal:  # hand over the partly filled buffers (waits for a fill in progress)
                with self._fill_lock:
                    with self._lock:
                        for p in list(self._open):
                            if self._open[p].n:
                                self._sealed.append(self._open.pop(p))
            with self._lock:
                if not self._sealed:
                    continue
                # one buffer per pool: the oldest, plus the oldest of every other pool
                segment = [self._sealed.popleft()]
                for b in list(self._sealed):
                    if all(b.pool != x.pool for x in segment):
                        segment.append(b)
                        self._sealed.remove(b)
                self._saving += 1
            try:
                self._save_segment(segment)
            except Exception as e:  # never let the writer thread die
                log.warning("L3 orbax: writer error: %r", e)
                self.metrics.add(write_errors=1)
            finally:
                with self._cond:
                    for b in segment:
                        for k in b.keys:
                            if self._pending.get((b.pool, k), (None,))[0] is b:
                                del self._pending[(b.pool, k)]
                        self._recycle(b)
                    self._pending_since = time.monotonic()
                    self._saving -= 1
                    self._cond.notify_all()

    def _recycle(self, buf: _SegBuf) -> None:  # under _lock; no pending page refers to buf any more
        data, buf.data = buf.data, None
        if buf.view_ref is not None and buf.view_ref() is not None:
            return  # something (orbax, tensorstore) still holds the saved view: never reuse it
        if self._closed or self._free_bytes + data.nbytes > self.config.write_buffer_bytes:
            return
        self._free[buf.pool].append(data)
        self._free_bytes += data.nbytes

    def _save_segment(self, segment: list[_SegBuf]) -> None:
        tree, save_args = {}, {}
        npages = 0
        for b in segment:
            data = b.data[:b.n]
            b.view_ref = weakref.ref(data)
            keys = b.keys
            crcs = np.array([integrity.crc32c(data[i], keys[i]) for i in range(b.n)], np.uint32)
            tree[b.pool] = {"data": data, "keys": keys_to_array(keys), "crc": crcs}
            # one zarr chunk per page: without shard_axes orbax splits a page over many chunks
            save_args[b.pool] = {"data": ocp.SaveArgs(chunk_byte_size=data.shape[1], shard_axes=(0,)),
                                 "keys": ocp.SaveArgs(), "crc": ocp.SaveArgs()}
            npages += b.n
            del data
        step = self._next_step
        self._next_step += 1
        nbytes = sum(t["data"].nbytes for t in tree.values())
        t0 = time.perf_counter()
        try:
            saved = self._mgr.save(step, args=ocp.args.PyTreeSave(tree, save_args=save_args))
            self._mgr.wait_until_finished()
            if saved is False:
                raise RuntimeError(f"orbax declined to save step {step}")
        except Exception as e:
            log.warning("L3 orbax: saving segment %s/%d (%d pages) failed: %r; pages dropped",
                        os.path.basename(self._wdir), step, npages, e)
            self.metrics.add(write_errors=1, pages_dropped=npages)
            self._cleanup_failed_step(step)
            return
        dt = time.perf_counter() - t0
        path = os.path.join(self._wdir, str(step))
        name = f"{os.path.basename(self._wdir)}/{step}"
        seg = _Segment(name, path, (time.time(), name), {b.pool: b.n for b in segment},
                       crcs={p: tree[p]["crc"] for p in tree},
                       keys={b.pool: list(b.keys) for b in segment}, nbytes=nbytes)
        tree.clear()  # drop our references to the buffers' views
        with self._lock:
            self._add_segment(seg)
        self.metrics.add(pages_written=npages, bytes_written=nbytes, write_seconds=dt, segments_written=1)
        log.debug("L3 orbax: saved segment %s: %d pages, %.1f MiB in %.3f s", name, npages, nbytes / 2**20, dt)
        self._evict()

    def _cleanup_failed_step(self, step: int) -> None:
        # A failed save may leave a temp dir (or, if it failed after the rename, a step that
        # readers must not trust: we never indexed it, so remove it too).
        try:
            for n in os.listdir(self._wdir):
                if n == str(step) or n.startswith(f"{step}."):
                    shutil.rmtree(os.path.join(self._wdir, n), ignore_errors=True)
        except OSError:
            pass
        try:  # the manager may have cached the failed step; start from a clean view
            self._mgr.close()
            self._open_manager()
            self._next_step = max(self._next_step, step + 1)
        except Exception as e:
            log.warning("L3 orbax: reopening the checkpoint manager failed: %r; storing disabled", e)
            self._mgr = None

    # ---- eviction ------------------------------------------------------------------------------
    def _evict(self) -> None:
        cap = self.config.capacity_bytes
        if not cap:
            return
        while True:
            with self._lock:
                if self._bytes <= cap or not self._segments:
                    return
                victim = min(self._segments.values(), key=lambda s: s.order)
            self._forget(victim.name)
            self.metrics.add(segments_evicted=1, pages_evicted=sum(victim.counts.values()))
            try:  # rename first so no reader ever sees a half-deleted segment
                trash = os.path.join(self.root, "trash")
                os.makedirs(trash, exist_ok=True)
                dst = os.path.join(trash, f"{victim.name.replace('/', '-')}-{uuid.uuid4().hex[:8]}")
                os.rename(victim.path, dst)
                shutil.rmtree(dst, ignore_errors=True)
            except FileNotFoundError:
                pass  # another process evicted it first
            except OSError as e:
                log.warning("L3 orbax: evicting %s failed: %r", victim.name, e)
                with self._lock:
                    self._bad.add(victim.name)  # do not re-index it on refresh

    # ---- lifecycle -----------------------------------------------------------------------------
    def writes_pending(self) -> bool:
        with self._cond:
            return bool(self._pending or self._saving)

    def flush(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._flush_requested = True
            self._cond.notify_all()
            while self._pending or self._saving:
                if not self._writer.is_alive():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 0.5)
            return True

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._writer.join()
        try:
            if self._mgr is not None:
                self._mgr.close()
        except Exception as e:
            log.warning("L3 orbax: closing the checkpoint manager: %r", e)
        with self._lock:
            self._handles.clear()
            self._free = {p: [] for p in self.codecs}
            self._free_bytes = 0
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    @property
    def stored_bytes(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def writer_dir(self) -> str | None:
        return self._wdir

    def segment_names(self) -> list[str]:
        with self._lock:
            return sorted(self._segments, key=lambda n: self._segments[n].order)
