"""Default L3 backend: an orbax-managed segment log, read page by page through tensorstore.

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

Reads: ``{pool}.data`` of a segment is opened once through tensorstore (zarr3 driver over the
ocdbt kvstore, handles cached) and single pages are read with up to ``read_concurrency`` reads
in flight. Each page's CRC is checked (per ``integrity``); a failed check, a truncated or
vanished file, or a read error is a miss, and the segment is quarantined (all its pages
leave the index). Missing zarr chunks read as zeros (the fill value): the CRC catches that.

Writes: ``batch_set`` copies pages into a pending buffer (visible to reads at once) and
returns; one writer thread saves a segment when ``segment_pages`` are pending, on ``flush()``,
or ``flush_interval_s`` after the oldest pending page arrived. A failed save (disk full,
read-only directory) drops that segment's pages (counted, logged); the next save tries again.
A capacity bound evicts whole segments, oldest commit first.

Threading: public methods may be called from any threads. One lock (``_lock``) guards the
index, the segment table, the handle cache and the pending buffer; it is never held across
I/O. The writer thread is the only caller of the orbax CheckpointManager.
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
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ..host_pool import HostKVPool
from . import integrity
from .base import HiCacheStorage, PoolSpec
from .config import StorageConfig
from .keys import KEY_BYTES, keys_to_array

import orbax.checkpoint as ocp  # noqa: E402  (module is imported lazily by create_storage)
import tensorstore as ts  # noqa: E402

if not integrity.HAVE_CRC32C:  # pragma: no cover - google-crc32c ships with the jax extra
    raise ImportError("the orbax L3 backend needs google-crc32c (pip install google-crc32c)")

log = logging.getLogger("hicache_jax.storage")

_WRITER_RE = re.compile(r"w\d{4,}")
_MAX_HANDLES = 512


@dataclass
class _Segment:
    name: str                      # "w0000/17"
    path: str                      # absolute step directory
    order: tuple                   # (commit time, name): eviction order
    counts: dict[str, int]         # pool -> pages
    crcs: dict[str, np.ndarray] = field(default_factory=dict)
    keys: dict[str, list[bytes]] = field(default_factory=dict)
    nbytes: int = 0


def _rows_as_block(rows: list) -> np.ndarray:
    """The rows as one ``[n, page_bytes]`` array: a view when they are consecutive rows of one
    C-contiguous 2-D array (the usual case: one ``batch_set`` packed them), else a copy."""
    base = rows[0].base
    if isinstance(base, np.ndarray) and base.ndim == 2 and base.flags.c_contiguous and base.dtype == np.uint8:
        pb = base.shape[1]
        start, rem = divmod(rows[0].__array_interface__["data"][0] - base.__array_interface__["data"][0], pb)
        if (rem == 0 and 0 <= start and start + len(rows) <= base.shape[0] and rows[0].size == pb
                and all(r.base is base and r.__array_interface__["data"][0] ==
                        rows[0].__array_interface__["data"][0] + j * pb for j, r in enumerate(rows))):
            return base[start:start + len(rows)]
    return np.stack(rows)


class OrbaxSegmentStorage(HiCacheStorage):
    backend_name = "orbax"

    def __init__(self, config: StorageConfig, pools: Mapping[str, HostKVPool],
                 specs: Sequence[PoolSpec] | None = None) -> None:
        super().__init__(config, pools, specs)
        self.root = os.path.join(os.path.abspath(config.path), "segments-v1")
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._index: dict[str, dict[bytes, tuple[str, int]]] = {p: {} for p in self.codecs}
        self._segments: dict[str, _Segment] = {}
        self._bad: set[str] = set()  # segment names never to index again in this process
        self._bytes = 0
        self._handles: OrderedDict[tuple[str, str], object] = OrderedDict()
        # pending: (pool, key) -> page bytes; insertion order = arrival order
        self._pending: OrderedDict[tuple[str, bytes], np.ndarray] = OrderedDict()
        self._pending_since = 0.0
        self._flush_requested = False
        self._saving = 0
        self._closed = False
        self._last_refresh = 0.0
        self._ts_ctx = ts.Context({"file_io_concurrency": {"limit": max(16, config.read_concurrency)}})
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
            item_handlers=ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=False))
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

    def _read(self, pool: str, keys: list[bytes]) -> list[np.ndarray | None]:
        self._maybe_refresh()
        out: list[np.ndarray | None] = [None] * len(keys)
        plan = []  # (i, segment, slot, crc)
        with self._lock:
            idx = self._index[pool]
            for i, k in enumerate(keys):
                page = self._pending.get((pool, k))
                if page is not None:
                    out[i] = page.copy()
                    continue
                loc = idx.get(k)
                if loc is not None:
                    seg = self._segments[loc[0]]
                    plan.append((i, seg, loc[1], int(seg.crcs[pool][loc[1]])))
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
        return out

    def _write(self, pool: str, keys: list[bytes], pages: np.ndarray) -> list[bool]:
        with self._cond:
            if self._mgr is None or self._closed:
                self.metrics.add(write_errors=1 if self._mgr is None else 0, pages_dropped=len(keys))
                return [False] * len(keys)
            ok = []
            room = self.config.max_pending_pages - len(self._pending)
            for i, k in enumerate(keys):
                if (pool, k) in self._pending:
                    ok.append(True)
                elif room > 0:
                    if not self._pending:
                        self._pending_since = time.monotonic()
                    self._pending[(pool, k)] = pages[i]
                    room -= 1
                    ok.append(True)
                else:  # back-pressure: L3 is best effort, the writer is behind
                    ok.append(False)
            dropped = ok.count(False)
            if dropped:
                self.metrics.add(pages_dropped=dropped)
            self._cond.notify_all()
        return ok

    # ---- writer thread -------------------------------------------------------------------------
    def _writer_loop(self) -> None:
        S = self.config.segment_pages
        while True:
            with self._cond:
                while True:
                    if self._pending:
                        age = time.monotonic() - self._pending_since
                        if (len(self._pending) >= S or self._flush_requested or self._closed
                                or age >= self.config.flush_interval_s):
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
                batch = []
                for (pool, k), page in self._pending.items():
                    batch.append((pool, k, page))
                    if len(batch) >= S:
                        break
                self._saving += 1
            try:
                self._save_segment(batch)
            except Exception as e:  # never let the writer thread die
                log.warning("L3 orbax: writer error: %r", e)
                self.metrics.add(write_errors=1)
            finally:
                with self._cond:
                    for pool, k, _ in batch:
                        self._pending.pop((pool, k), None)
                    self._pending_since = time.monotonic()
                    self._saving -= 1
                    self._cond.notify_all()

    def _save_segment(self, batch: list) -> None:
        by_pool: dict[str, list] = {}
        for pool, k, page in batch:
            by_pool.setdefault(pool, []).append((k, page))
        tree, save_args = {}, {}
        for pool, items in by_pool.items():
            keys = [k for k, _ in items]
            data = _rows_as_block([p for _, p in items])
            crcs = np.array([integrity.crc32c(data[i], keys[i]) for i in range(len(keys))], np.uint32)
            tree[pool] = {"data": data, "keys": keys_to_array(keys), "crc": crcs}
            # one zarr chunk per page: without shard_axes orbax splits a page over many chunks
            save_args[pool] = {"data": ocp.SaveArgs(chunk_byte_size=data.shape[1], shard_axes=(0,)),
                               "keys": ocp.SaveArgs(), "crc": ocp.SaveArgs()}
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
                        os.path.basename(self._wdir), step, len(batch), e)
            self.metrics.add(write_errors=1, pages_dropped=len(batch))
            self._cleanup_failed_step(step)
            return
        dt = time.perf_counter() - t0
        path = os.path.join(self._wdir, str(step))
        name = f"{os.path.basename(self._wdir)}/{step}"
        seg = _Segment(name, path, (time.time(), name), {p: len(v) for p, v in by_pool.items()},
                       crcs={p: tree[p]["crc"] for p in tree},
                       keys={p: [k for k, _ in v] for p, v in by_pool.items()}, nbytes=nbytes)
        with self._lock:
            self._add_segment(seg)
        self.metrics.add(pages_written=len(batch), bytes_written=nbytes, write_seconds=dt, segments_written=1)
        log.debug("L3 orbax: saved segment %s: %d pages, %.1f MiB in %.3f s", name, len(batch), nbytes / 2**20, dt)
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
