"""Writes to the orbax log: segment buffers, the writer and publisher threads, saves and the capacity bound.

Buffering: ``enqueue`` puts pages straight into their pool's open segment buffer (a
``uint8[segment_pages, page_bytes]`` array, ``StorageConfig.segment_pages_for(page_bytes)``
rows, reused across saves up to ``write_buffer_bytes``) and returns; a page is pending from
then until its segment is saved (or dropped), and pending pages are served to reads from the
buffer (``serve_pending``). At most ``max_pending_pages`` are pending: beyond that pages are
refused (back-pressure; L3 is best effort and the writer is behind).

Saving, in two stages on two threads. The writer thread saves a segment (one buffer per pool,
oldest first) when a buffer is full, on ``flush()``, or ``flush_interval_s`` after the oldest
pending page arrived: an orbax ``Checkpointer`` writes it under its staging name
(``segment.staged_dir_name``, never read), without orbax's defensive deep copy (the save is
synchronous and the buffer is not touched until the publisher is done with it) and without
tensorstore's syncs around each of its commits (``durable_save``). It then hands the segment to
the publisher thread and saves the next one, while the publisher fsyncs the segment's files,
gives it its committed name (``durable_save.publish_step``) and indexes it: the fsync pass
(~175 ms per 128 MiB segment on the project VM) overlaps the next segment's encoding and write
instead of following it. At most two segments are in flight (the writer hands over the next
only once the publisher is idle), so buffers in flight stay bounded as before
(``max_pending_pages``, ``write_buffer_bytes``). A published segment is added to the index
before its pages stop being pending, so a reader that finds a page in neither place looked
after it left both (it was evicted); commit (eviction) order is save order. A failed save (disk
full, read-only directory) or a failed sync or rename drops that segment's pages (counted,
logged, ``removed`` told), removes what it left under either name, and the next save tries
again. Without a writer directory (``claim``) nothing is accepted.

Capacity (``evict_to_capacity``): while the index holds more than ``capacity_bytes``, whole
segments are evicted, oldest commit first: forgotten by the index, then renamed into
``trash/`` (so no reader ever sees a half-deleted segment) and deleted.

Where the time went (measured on the project's 2-vCPU VM, 2 MiB pages, segments of 64;
benchmarks/bench_l3.py): memory the process has not touched recently costs about as much as
the disk write itself there (the hypervisor takes freed guest pages back after ~2 s and
refaults them at 0.3-0.5 GB/s), so orbax's defensive deep copy per save (save CPU 1.0 s ->
0.2 s per 128 MiB without it) and a fresh pack buffer per ``batch_set`` each cost as much as
the I/O: hence reused buffers, packed into in place.

Contents listeners (``notify``, set by the store; ``HiCacheStorage.add_listener``): ``stored``
when pages become pending (readable from the buffer), under ``_cond``'s lock in the caller's
thread; ``removed`` for the pages of a failed save (writer thread) or a failed publish
(publisher thread), under that lock. Saved pages stay stored (the index takes them over
without a second ``stored``).

Threading and locking: ``enqueue``, ``serve_pending``, ``pending_flags``, ``flush`` and
``writes_pending`` may be called from any thread. One lock (``_cond``'s) guards the pending
table, the open, sealed and free buffers, the segment handed to the publisher and both threads'
flags; it is never held across I/O (copies of pending rows into a reader's destination happen
under it, which is what keeps a row from being recycled under the copy). ``_fill_lock``
serialises packing into the open buffers (taken before ``_cond``'s lock, never after) so the
lock is not held while pages are packed. Neither is held while the index's lock is taken. The
writer thread is the only user of the orbax ``Checkpointer`` and of the step counter; the
publisher the only one to rename, index and release a saved segment, and it calls
``after_save`` (eviction). ``_ORBAX_SAVE_LOCK`` (process-wide, one orbax save at a time
across stores) is held around each save only, with no other lock. ``close`` joins both (the publisher after the writer) before closing
the checkpointer and releasing the claim.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
import weakref
from collections import deque
from typing import Callable

import numpy as np
import orbax.checkpoint as ocp

from ...workers import lower_thread_priority
from .. import integrity
from ..base import PageCodec
from ..config import StorageConfig
from ..keys import keys_to_array
from ..metrics import StorageMetrics
from .claim import WriterClaim
from .durable_save import SegmentArrayHandler, SegmentSave, SegmentTreeHandler, publish_step, type_handler_registry
from .index import SegmentIndex
from .segment import TRASH_DIR, Segment, staged_dir_name, step_dir_name

log = logging.getLogger("hicache_jax.storage")

# One orbax save at a time in the process, across stores: orbax numbers the steps of a save by a
# process-wide operation id (``futures.synchronization.OperationIdGenerator``) that a save in
# another thread advances, and a save then waits on a signal under the wrong id (seen: two
# stores of one process saving at once, one save stuck for orbax's 300 s signal timeout, then
# failed). One store never has two saves at once (one writer thread); the lock is for two.
_ORBAX_SAVE_LOCK = threading.Lock()


class _ChunkSizeWarningFilter(logging.Filter):
    """Drops orbax's "target_byte_size too small" warning: one chunk per page is this store's
    design (pages are read one at a time), so it fired on every segment save for pages < 1 MiB."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "target_byte_size too small" not in str(record.msg)


logging.getLogger("absl").addFilter(_ChunkSizeWarningFilter())


def pack_into(codec: PageCodec, ids: np.ndarray, out: np.ndarray) -> None:
    """``codec.pack(ids)`` written into ``out`` (``uint8[n, page_bytes]``, C-contiguous rows,
    an open segment's buffer) instead of a new array."""
    codec.pack(ids, out)


class SegmentBuffer:
    """Pages of one pool waiting for a save: rows ``[0, n)`` of ``data`` hold ``keys``, whose
    CRC-32Cs (of key || row) are ``crcs``."""

    __slots__ = ("pool", "data", "keys", "crcs", "n", "view_ref")

    def __init__(self, pool: str, data: np.ndarray) -> None:
        self.pool, self.data, self.keys, self.crcs, self.n, self.view_ref = pool, data, [], [], 0, None


def _into_trash(path: str, trash_root: str, label: str) -> str:
    """Rename the step directory ``path`` into ``trash_root`` under a fresh name starting with
    ``label``; returns the new path. Raises ``OSError`` (nothing moved)."""
    os.makedirs(trash_root, exist_ok=True)
    dst = os.path.join(trash_root, f"{label}-{uuid.uuid4().hex[:8]}")
    os.rename(path, dst)
    return dst


def evict_to_capacity(index: SegmentIndex, capacity_bytes: int, metrics: StorageMetrics) -> None:
    """Evict whole segments, oldest commit first, until the index holds at most
    ``capacity_bytes`` (0: no bound)."""
    if not capacity_bytes:
        return
    while index.stored_bytes > capacity_bytes:
        victim = index.oldest()
        if victim is None:
            return
        if index.forget(victim.name) is None:
            continue  # another thread evicted it first
        metrics.add(segments_evicted=1, pages_evicted=sum(victim.counts.values()))
        try:  # rename first so no reader ever sees a half-deleted segment
            dst = _into_trash(victim.path, os.path.join(index.root, TRASH_DIR), victim.name.replace("/", "-"))
            shutil.rmtree(dst, ignore_errors=True)
        except FileNotFoundError:
            pass  # another process evicted it first
        except OSError as e:
            log.warning("L3 orbax: evicting %s failed: %r", victim.name, e)
            index.never_index(victim.name)  # do not re-index it on refresh


class _Staged:
    """A segment the writer thread has saved under its staging name, on its way to the
    publisher (sync, committed name, index)."""

    __slots__ = ("buffers", "step_dir", "staged", "path", "crcs", "npages", "nbytes", "save_seconds")

    def __init__(
        self,
        buffers: list[SegmentBuffer],
        step_dir: str,
        staged: str,
        path: str,
        crcs: dict[str, np.ndarray],
        npages: int,
        nbytes: int,
        save_seconds: float,
    ) -> None:
        self.buffers, self.step_dir, self.staged, self.path = buffers, step_dir, staged, path
        self.crcs, self.npages, self.nbytes, self.save_seconds = crcs, npages, nbytes, save_seconds


def _remove_step(path: str, trash_root: str) -> None:
    """Remove a step directory that may carry a committed name: renamed into ``trash_root``
    first (as eviction does), so no reader of another process that listed it meanwhile sees it
    half-deleted; removed in place if that rename fails."""
    if not os.path.lexists(path):
        return
    try:
        path = _into_trash(path, trash_root, os.path.basename(path))
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


class SegmentWriter:
    """Buffers accepted pages and saves them as segments from its own thread."""

    def __init__(
        self,
        claim: WriterClaim | None,
        index: SegmentIndex,
        codecs: dict[str, PageCodec],
        config: StorageConfig,
        metrics: StorageMetrics,
        after_save: Callable[[], None],
    ) -> None:
        self.index = index
        self.codecs = codecs
        self.config = config
        self.metrics = metrics
        self._after_save = after_save
        self.notify: Callable[[str, str, list[bytes]], None] | None = None  # the store's listeners
        self._cond = threading.Condition(threading.Lock())
        self._fill_lock = threading.Lock()
        # pending: (pool, key) -> (segment buffer, row); insertion order = arrival order
        self._pending: dict[tuple[str, bytes], tuple[SegmentBuffer, int]] = {}
        self._open: dict[str, SegmentBuffer] = {}  # pool -> buffer being filled
        self._sealed: deque[SegmentBuffer] = deque()  # full (or flushed) buffers, oldest first
        self._free: dict[str, list[np.ndarray]] = {p: [] for p in codecs}
        self._seg_pages = {p: config.segment_pages_for(c.page_bytes) for p, c in codecs.items()}
        self._free_bytes = 0
        self._pending_since = 0.0
        self._flush_requested = False
        self._saving = 0  # segments taken from _sealed and not yet published (or dropped)
        self._closed = False
        # saved segments the publisher syncs, names and indexes, oldest first; the head is the
        # one being published (removed when done), so at most two segments are in flight: one
        # saving, one publishing (``_run`` waits to hand over the next until this is empty)
        self._to_publish: deque[_Staged] = deque()
        self._writer_done = False  # the writer thread has returned: the publisher may too
        self._claim = claim
        self._ckpt = None
        # numpy arrays of a save: no deep copy, no fsync per commit (``durable_save``)
        self._arrays = SegmentArrayHandler()
        self._next_step = 0
        if claim is not None:
            try:
                # We hold the flock, so no live process writes here: clear temp and staged steps
                # a killed owner left (synchronously; orbax's own cleanup runs in the background).
                claim.clear_uncommitted()
                self._open_checkpointer()
            except Exception as e:  # a broken writer directory: still serve reads
                log.warning("L3 orbax: opening a checkpointer in %s failed (%r); storing disabled", claim.path, e)
                claim.release()
                self._claim = None
        self._thread = threading.Thread(target=self._run, name="l3-orbax-writer", daemon=True)
        self._publisher = threading.Thread(target=self._run_publisher, name="l3-orbax-publish", daemon=True)
        self._thread.start()
        self._publisher.start()

    # ---- read-only views (tests, diagnostics) ----------------------------------------------------
    @property
    def directory(self) -> str | None:
        """The claimed writer directory, or None (storing disabled)."""
        return self._claim.path if self._claim is not None else None

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def publisher(self) -> threading.Thread:
        return self._publisher

    @property
    def manager(self):
        """The orbax ``Checkpointer`` that saves segments (None: storing disabled). Only the
        writer thread calls it."""
        return self._ckpt

    @property
    def free_buffer_bytes(self) -> int:
        """Bytes of saved segment buffers kept for reuse."""
        with self._cond:
            return self._free_bytes

    # ---- pending pages -------------------------------------------------------------------------
    def pending_flags(self, pool: str, keys: list[bytes]) -> list[bool]:
        with self._cond:
            return [(pool, k) in self._pending for k in keys]

    def serve_pending(self, pool: str, keys: list[bytes], take: Callable[[int, np.ndarray], None]) -> set[int]:
        """Call ``take(i, row)`` for every pending ``keys[i]``, under the lock (``row`` is a view
        of the segment buffer, valid only during the call); returns those ``i``."""
        served = set()
        with self._cond:
            if not self._pending:
                return served
            for i, k in enumerate(keys):
                ent = self._pending.get((pool, k))
                if ent is not None:
                    take(i, ent[0].data[ent[1]])
                    served.add(i)
        return served

    def enqueue(self, pool: str, keys: list[bytes], fill: Callable[[np.ndarray, np.ndarray], None]) -> list[bool]:
        """Accept ``keys`` (distinct, not stored) into ``pool``'s open segment buffer;
        ``fill(dst_rows, sel)`` writes the pages ``sel`` (indices into keys) into ``dst_rows``.
        Per key, whether it is accepted (or already pending)."""
        S = self._seg_pages[pool]
        with self._fill_lock:
            with self._cond:
                if self._ckpt is None or self._closed:
                    self.metrics.add(write_errors=1 if self._ckpt is None else 0, pages_dropped=len(keys))
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
                    with self._cond:
                        self._open[pool] = buf
                take = min(S - buf.n, len(accept) - pos)
                sel = np.asarray(accept[pos : pos + take], np.intp)
                rows = buf.data[buf.n : buf.n + take]
                # Outside the lock (readers go on meanwhile), one row at a time: each row's CRC
                # reads it back while it is still in the CPU's cache (64 x 2 MiB pages packed and
                # checksummed in 86-94 ms against 99-112 ms packing all rows first, project VM).
                # The CRCs here, in the caller's thread, not in the writer's before its save:
                # they then overlap the save of the segment before (~0.02 s of CPU per 128 MiB
                # segment on the project VM that the writer no longer spends in series). The GIL
                # is kept: a call per row that dropped it could wait up to a switch interval per
                # row to get it back from the (Python-heavy) saving writer (see ``pack``).
                crcs = []
                for r in range(take):
                    fill(rows[r : r + 1], sel[r : r + 1])
                    crcs.append(integrity.crc32c(rows[r], keys[sel[r]], release_gil=False))
                with self._cond:
                    if not self._pending:
                        self._pending_since = time.monotonic()
                    for r, i in enumerate(sel):
                        self._pending[(pool, keys[i])] = (buf, buf.n + r)
                        buf.keys.append(keys[i])
                    if self.notify is not None:
                        self.notify("stored", pool, [keys[i] for i in sel])
                    buf.crcs += crcs
                    buf.n += take
                    if buf.n >= S:
                        del self._open[pool]
                        self._sealed.append(buf)
                    self._cond.notify_all()
                pos += take
        return ok

    def _new_buffer(self, pool: str) -> SegmentBuffer:  # under _fill_lock
        with self._cond:
            free = self._free[pool]
            data = free.pop() if free else None
            if data is not None:
                self._free_bytes -= data.nbytes
        if data is None:
            data = np.empty((self._seg_pages[pool], self.codecs[pool].page_bytes), np.uint8)
        return SegmentBuffer(pool, data)

    def _recycle(self, buf: SegmentBuffer) -> None:  # under _cond; no pending page refers to buf any more
        data, buf.data = buf.data, None
        if buf.view_ref is not None and buf.view_ref() is not None:
            return  # something (orbax, tensorstore) still holds the saved view: never reuse it
        if self._closed or self._free_bytes + data.nbytes > self.config.write_buffer_bytes:
            return
        self._free[buf.pool].append(data)
        self._free_bytes += data.nbytes

    # ---- the writer thread ---------------------------------------------------------------------
    def _run(self) -> None:
        # Below the scheduler's priority (StorageConfig.worker_nice); orbax's commit threads,
        # started from here, inherit it.
        lower_thread_priority(self.config.worker_nice)
        try:
            self._write_loop()
        finally:
            with self._cond:
                self._writer_done = True
                self._cond.notify_all()

    def _write_loop(self) -> None:
        while True:
            seal = False
            with self._cond:
                while True:
                    if self._sealed:
                        break
                    if any(b.n for b in self._open.values()):  # pages no save has taken yet
                        age = time.monotonic() - self._pending_since
                        if self._flush_requested or self._closed or age >= self.config.flush_interval_s:
                            seal = True
                            break
                        wait = max(0.001, self.config.flush_interval_s - age)
                    else:
                        if self._flush_requested and not self._saving:
                            self._flush_requested = False
                            self._cond.notify_all()
                        if self._closed and not self._saving:
                            return
                        wait = None
                    self._cond.wait(wait)
            if seal:  # hand over the partly filled buffers (waits for a fill in progress)
                with self._fill_lock:
                    with self._cond:
                        for p in list(self._open):
                            if self._open[p].n:
                                self._sealed.append(self._open.pop(p))
            with self._cond:
                if not self._sealed:
                    continue
                # one buffer per pool: the oldest, plus the oldest of every other pool
                segment = [self._sealed.popleft()]
                for b in list(self._sealed):
                    if all(b.pool != x.pool for x in segment):
                        segment.append(b)
                        self._sealed.remove(b)
                self._saving += 1
            staged = None
            try:
                staged = self._save(segment)
            except Exception as e:  # never let the writer thread die
                log.warning("L3 orbax: writer error: %r", e)
                self.metrics.add(write_errors=1)
            with self._cond:
                if staged is None:
                    self._release(segment, saved=False)
                    continue
                while self._to_publish:  # at most one segment publishing while the next saves
                    self._cond.wait()
                self._to_publish.append(staged)
                self._cond.notify_all()

    def _release(self, segment: list[SegmentBuffer], saved: bool) -> None:
        """Under ``_cond``: ``segment``'s pages stop pending (after the index has them, if
        ``saved``; else they are dropped and ``removed`` is notified) and its buffers are
        recycled: both stages are done with them."""
        for b in segment:
            lost = []
            for k in b.keys:
                if self._pending.get((b.pool, k), (None,))[0] is b:
                    del self._pending[(b.pool, k)]
                    lost.append(k)
            if not saved and lost and self.notify is not None:
                self.notify("removed", b.pool, lost)  # a failed save or sync dropped them
            self._recycle(b)
        self._pending_since = time.monotonic()
        self._saving -= 1
        if not self._pending and not self._saving:
            # the flush asked for is done: clear the request here, in the step that completes
            # it, so pages enqueued after ``flush`` returns are not sealed early by a stale one
            # (the writer thread, which also clears it, may not run before the caller's next
            # ``enqueue``; a batch split that way could commit half of it)
            self._flush_requested = False
        self._cond.notify_all()

    def _open_checkpointer(self) -> None:
        # A plain Checkpointer saving each step to an explicit (staging) path, in the layout
        # CheckpointManager gave (the item in ``{step}/default``); nothing in orbax tracks the
        # steps, so the publisher may rename them away.
        handler = SegmentTreeHandler(
            use_ocdbt=True,
            use_zarr3=True,
            use_compression=False,
            type_handler_registry=type_handler_registry(self._arrays),
        )
        self._ckpt = ocp.Checkpointer(ocp.CompositeCheckpointHandler(default=handler))
        # Steps are saved as "{generation}_{step}": the generation is this claim's own, so step
        # numbers start at 0 without ever reusing a segment name (see ``segment``).

    def _save(self, segment: list[SegmentBuffer]) -> _Staged | None:
        """Save ``segment`` under its staging name; None if the save failed (the caller drops
        its pages). The publisher gives it its committed name."""
        tree, save_args = {}, {}
        npages = 0
        for b in segment:
            data = b.data[: b.n]
            b.view_ref = weakref.ref(data)
            crcs = np.array(b.crcs, np.uint32)  # computed as the pages were enqueued
            tree[b.pool] = {"data": data, "keys": keys_to_array(b.keys), "crc": crcs}
            # one zarr chunk per page: without shard_axes orbax splits a page over many chunks
            save_args[b.pool] = {
                "data": ocp.SaveArgs(chunk_byte_size=data.shape[1], shard_axes=(0,)),
                "keys": ocp.SaveArgs(),
                "crc": ocp.SaveArgs(),
            }
            npages += b.n
            del data
        step = self._next_step
        self._next_step += 1
        step_dir = step_dir_name(self._claim.generation, step)
        staged = os.path.join(self._claim.path, staged_dir_name(self._claim.generation, step))
        nbytes = sum(t["data"].nbytes for t in tree.values())
        t0 = time.perf_counter()
        try:
            with _ORBAX_SAVE_LOCK:
                self._arrays.begin_save()
                try:
                    self._ckpt.save(staged, args=ocp.args.Composite(default=SegmentSave(tree, save_args=save_args)))
                finally:
                    self._arrays.end_save()
            if not os.path.isdir(os.path.join(staged, "default")):  # readers would never find its arrays
                raise RuntimeError(f"step {step} was not saved as {staged}/default")
        except Exception as e:
            log.warning(
                "L3 orbax: saving segment %s/%s (%d pages) failed: %r; pages dropped",
                self._claim.name,
                step_dir,
                npages,
                e,
            )
            self.metrics.add(write_errors=1, pages_dropped=npages)
            self._cleanup_failed_step(step)
            return None
        crcs = {p: tree[p]["crc"] for p in tree}
        tree.clear()  # drop our references to the buffers' views
        return _Staged(
            segment,
            step_dir,
            staged,
            os.path.join(self._claim.path, step_dir),
            crcs,
            npages,
            nbytes,
            time.perf_counter() - t0,
        )

    def _cleanup_failed_step(self, step: int) -> None:
        # A failed save may leave a temp dir or a staged step: remove this step's, and only
        # this step's (the publisher may be syncing the step before it).
        wdir = self._claim.path
        step_dir = step_dir_name(self._claim.generation, step)
        try:
            for n in os.listdir(wdir):
                if n == step_dir or n.startswith(f"{step_dir}."):
                    shutil.rmtree(os.path.join(wdir, n), ignore_errors=True)
        except OSError:
            pass
        try:  # start from a fresh checkpointer: nothing of the failed save cached
            self._ckpt.close()
            self._open_checkpointer()
            self._next_step = max(self._next_step, step + 1)
        except Exception as e:
            log.warning("L3 orbax: reopening the checkpointer failed: %r; storing disabled", e)
            self._ckpt = None

    # ---- the publisher thread ------------------------------------------------------------------
    def _run_publisher(self) -> None:
        lower_thread_priority(self.config.worker_nice)
        while True:
            with self._cond:
                while not self._to_publish:
                    if self._writer_done:
                        return
                    self._cond.wait()
                staged = self._to_publish[0]
            published = False
            try:
                published = self._publish(staged)
            except Exception as e:  # never let the publisher die
                log.warning("L3 orbax: publisher error: %r", e)
                self.metrics.add(write_errors=1)
            finally:
                with self._cond:
                    self._to_publish.popleft()
                    self._release(staged.buffers, saved=published)

    def _publish(self, staged: _Staged) -> bool:
        """Sync ``staged``, give it its committed name and index it; False (its pages dropped,
        nothing left under either name) if the sync or the rename failed."""
        t0 = time.perf_counter()
        try:
            publish_step(staged.staged, staged.path)
        except Exception as e:
            log.warning(
                "L3 orbax: publishing segment %s/%s (%d pages) failed: %r; pages dropped",
                self._claim.name,
                staged.step_dir,
                staged.npages,
                e,
            )
            self.metrics.add(write_errors=1, pages_dropped=staged.npages)
            trash = os.path.join(self.index.root, TRASH_DIR)
            _remove_step(staged.path, trash)  # renamed, but its name may not be on disk: unsure
            _remove_step(staged.staged, trash)
            return False
        dt = staged.save_seconds + time.perf_counter() - t0
        name = f"{self._claim.name}/{staged.step_dir}"
        bufs = staged.buffers
        seg = Segment(
            name,
            staged.path,
            (time.time(), name),
            {b.pool: b.n for b in bufs},
            crcs=staged.crcs,
            keys={b.pool: list(b.keys) for b in bufs},
            nbytes=staged.nbytes,
        )
        self.index.add(seg)
        self.metrics.add(pages_written=staged.npages, bytes_written=staged.nbytes, write_seconds=dt, segments_written=1)
        log.debug(
            "L3 orbax: saved segment %s: %d pages, %.1f MiB in %.3f s", name, staged.npages, staged.nbytes / 2**20, dt
        )
        self._after_save()
        return True

    # ---- lifecycle -----------------------------------------------------------------------------
    def writes_pending(self) -> bool:
        with self._cond:
            return bool(self._pending or self._saving)

    def flush(self, timeout: float | None) -> bool:
        """Wait until every pending page's segment is published and indexed (or dropped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._flush_requested = True
            self._cond.notify_all()
            while self._pending or self._saving:
                if not (self._thread.is_alive() and self._publisher.is_alive()):
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 0.5)
            return True

    def close(self) -> None:
        """Save and publish what is pending, stop both threads, close the checkpointer, release
        the claim."""
        self.flush(None)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self._publisher.join()  # returns once the writer has and nothing is left to publish
        try:
            if self._ckpt is not None:
                self._ckpt.close()
        except Exception as e:
            log.warning("L3 orbax: closing the checkpointer: %r", e)
        with self._cond:
            self._free = {p: [] for p in self.codecs}
            self._free_bytes = 0
        if self._claim is not None:
            self._claim.release()
