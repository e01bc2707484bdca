"""L3 write-through: each acknowledged host backup becomes one job that copies the node's
host pages (and those of its not-yet-stored ancestors) into every storage pool.

``L3Backups.queue(node)`` collects the nodes from ``node`` up to the first one already stored
or in flight, host-locks ``node`` (its pages and its ancestors' stay in the host pool), marks
their digests ``INFLIGHT`` and submits one ``BackupJob`` to the backup executor, which calls
``batch_set`` per pool (the other pools first, the target last; a trailing-pages pool stores
the host pages its component holds for those nodes, and a failed page of it fails the job).
``batch_set`` copies the pages out before returning, so once a job is done its host lock can
go: ``settle`` drops it, counts the job in ``cache.metrics`` and marks its nodes ``STORED``
(or ``NEW`` again: retried with the next backup below them).

Policy (when a job counts as stored) comes from the caller: one rank settles its own outcome
(``reap``); several ranks settle the agreed one (``settle(job, stored)`` from the agreement
step; ``reap`` then takes only jobs finished here, in submission order).

Threading: every method except ``_run`` runs on the cache's owner thread. ``_run`` runs on the
backup executor (owned by the caller: ``StorageController`` creates and shuts it down); it
reads host pages the job's lock keeps alive and the job's own fields, never the tree, the
allocators or the metrics; it hands the job back through ``done`` (an event) and a deque the
owner drains. Once the executor refuses work (it was shut down, or the interpreter is exiting
and ``concurrent.futures`` stopped its threads) a job runs inline on the owner thread, so an
exit-time flush still writes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Executor

import numpy as np

from ..cache.locks import LockReceipt
from .node_keys import INFLIGHT, NEW, STORED, NodeDigests, PageDigests
from .pools import COMMIT_POOL, TARGET_POOL, L3Pools

log = logging.getLogger("hicache_jax.cache.storage")

_EMPTY = np.zeros(0, np.int64)


class BackupJob:
    """One write of a chain of nodes: per pool its page keys and host page ids; ``ok`` per
    target page (set by the backup thread), ``done`` once the storage has copied the pages."""

    __slots__ = ("node", "entries", "keys", "ids", "ok", "t0", "t_done", "done", "pin")

    def __init__(self, node, entries: list[PageDigests], keys: dict, ids: dict) -> None:
        self.node, self.entries, self.keys, self.ids = node, entries, keys, ids  # per pool
        self.pin: LockReceipt | None = None  # keeps the host pages until the storage copied them
        self.ok = np.zeros(len(ids[TARGET_POOL]), bool)
        self.t0 = time.perf_counter()
        self.t_done = 0.0  # set by the backup thread when the storage has the pages
        self.done = threading.Event()

    @property
    def pages(self) -> int:
        """Target pages this job writes."""
        return len(self.ids[TARGET_POOL])


class L3Backups:
    """The write-through jobs of one controller (see the module docstring)."""

    def __init__(
        self, cache, pools: L3Pools, digests: NodeDigests, storage, executor: Executor, *, agreed: bool
    ) -> None:
        self.cache = cache
        self.pools = pools
        self.digests = digests
        self.storage = storage
        self.executor = executor
        self.agreed = agreed
        self._jobs: dict[BackupJob, None] = {}  # not settled, in submission order
        self._done: deque[BackupJob] = deque()  # appended by the backup thread (one rank)
        self._inflight_keys: set[bytes] = set()  # target keys queued for L3

    def __len__(self) -> int:
        return len(self._jobs)

    def jobs(self) -> list[BackupJob]:
        """Jobs not settled yet, in submission order."""
        return list(self._jobs)

    def pending_pages(self) -> int:
        """Target pages queued or being written and not settled."""
        return sum(j.pages for j in self._jobs)

    def submit(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the backup thread, after the jobs queued before it; inline once
        the executor is shut down (see the module docstring)."""
        try:
            self.executor.submit(fn, *args)
        except RuntimeError:  # shut down (close, or interpreter exit): write now, on this thread
            fn(*args)

    # ------------------------------------------------------------------ owner thread
    def queue(self, node) -> BackupJob | None:
        """Queue the L3 write of ``node`` and its ancestors not stored or in flight yet."""
        root = self.cache.root
        if node is root or self.digests.get(node) is None:
            return None
        chain = []
        n = node
        while n is not root:
            e = self.digests.valid(n)
            if e is None:
                e = self.digests.get(n)
            if e is None or e.state != NEW or n.host_value is None:
                break
            chain.append((n, e))
            n = n.parent
        if not chain:
            return None
        chain.reverse()
        full = self.pools.all_pools
        ids = np.concatenate([n.host_value for n, _ in chain]).astype(np.int64)
        keys = {pool: [k for _, e in chain for k in e.digests[pool]] for pool in full}
        keep = np.array([k not in self._inflight_keys for k in keys[TARGET_POOL]], bool)
        if not keep.all():
            ids = ids[keep]
            keys = {pool: [k for k, f in zip(ks, keep) if f] for pool, ks in keys.items()}
        ids_by_pool = {pool: ids for pool in full}
        for pool, (comp, _wp) in self.pools.trailing.items():  # the component's own host pages, where it has them
            tk, ti = [], []
            for n, e in chain:
                h = comp.node_host_pages(n)
                if h is not None:
                    tk.extend(e.digests[pool])
                    ti.append(h)
            keys[pool] = tk
            ids_by_pool[pool] = np.concatenate(ti).astype(np.int64) if ti else _EMPTY
        for _, e in chain:
            e.state = INFLIGHT
        job = BackupJob(node, [e for _, e in chain], keys, ids_by_pool)
        self._inflight_keys.update(keys[TARGET_POOL])
        job.pin = self.cache.pin_host(node)  # the host pages stay until the storage has copied them
        self._jobs[job] = None
        self.submit(self._run, job)
        return job

    def reap(self) -> None:
        """Settle the jobs the backup thread finished. One rank: by their own outcome; several
        ranks: every job finished here (after a wait), by this rank's outcome, in order."""
        if self.agreed:
            for job in [j for j in self._jobs if j.done.is_set()]:
                self.settle(job, bool(job.ok.all()))
            return
        while self._done:
            self.settle(self._done.popleft(), None)

    def settle(self, job: BackupJob, stored: bool | None) -> None:
        """A finished job: drop its host lock, count it, mark its nodes stored or not
        (``stored``: the ranks' agreed outcome; None: this rank's)."""
        m = self.cache.metrics
        p = self.cache.page_size
        self._jobs.pop(job, None)
        if job.pin is not None:
            self.cache.unpin_host(job.pin)  # a no-op after a reset
        self._inflight_keys.difference_update(job.keys[TARGET_POOL])
        good = int(job.ok.sum())
        m.storage_backup_tokens += good * p
        m.storage_backup_bytes += good * self.cache.components.bytes_per_page
        m.storage_backup_failed_tokens += (len(job.ok) - good) * p
        m.storage_backup_duration_seconds.observe(job.t_done - job.t0)
        if stored is None:
            stored = good == len(job.ok)
        state = STORED if stored else NEW
        for e in job.entries:
            e.state = state

    def wait(self, timeout: float | None) -> bool:
        """Wait for every job (at most ``timeout`` seconds in all), then settle what finished.
        True if none is left."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        for job in list(self._jobs):
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if not job.done.wait(left):
                self.reap()
                return False
        self.reap()
        return True

    def write_markers(self, keys: list[bytes]) -> None:
        """Several ranks, rank 0: queue the commit markers of a page group every rank stored."""
        self.submit(self._write_markers, keys)

    # ------------------------------------------------------------------ backup thread
    def _run(self, job: BackupJob) -> None:
        try:
            ok = np.ones(job.pages, bool)
            if job.pages:
                for pool in self.pools.order:
                    if pool in self.pools.replicated and self.pools.tp_rank:
                        continue  # rank 0 writes the pages every rank shares
                    if pool in self.pools.trailing:
                        if len(job.ids[pool]) and not all(self.storage.batch_set(job.keys[pool], job.ids[pool], pool)):
                            ok[:] = False  # a window page missing: the job is retried
                        continue
                    ok &= np.asarray(self.storage.batch_set(job.keys[pool], job.ids[pool], pool), bool)
            job.ok = ok
        except Exception:
            log.exception("L3: backup of %d pages failed", job.pages)
        finally:
            job.t_done = time.perf_counter()
            if not self.agreed:  # several ranks: settled in agreed order instead
                self._done.append(job)
            job.done.set()

    def _write_markers(self, keys: list[bytes]) -> None:
        try:
            ok = self.storage.batch_set(keys, np.zeros(len(keys), np.int64), COMMIT_POOL)
            if not all(ok):
                log.warning("L3: %d of %d commit markers not written", len(ok) - sum(ok), len(ok))
        except Exception:
            log.exception("L3: writing %d commit markers failed", len(keys))
