"""L3 prefetch: count a key's continuation in storage, read it into reserved host pages, and
attach what arrived to the tree as host-only nodes.

``Prefetcher.start(key)`` walks the tree read-only (``backed_up_prefix``), decides whether a
prefetch is worth starting (a skip says why: ``op.reason_code``), host-locks the anchor node
and queues a query: hash the continuation's page keys and count consecutive storage hits in
``batch_pages`` batches (stopping at the first partial batch; a trailing-pages pool must also
hold the window before the hit's end). On the owner thread (``advance``) a hit under the
threshold is revoked, otherwise host pages are reserved (a truncated reservation when the host
cannot give them all) and the IO executor reads them batch by batch (all pools per batch; a
trailing-pages pool's window is read after, all of it or nothing; one rank: where the read's
end has no whole window in storage, at the longest shorter stop that has one; with several
ranks only once the ranks agree where the first read ended: ``start_window_read``). ``conclude`` hands the
consecutive pages that arrived to ``HiRadixCache.insert_host`` and frees (or, while the IO
thread may still write them, parks in ``draining``) the rest.

Mechanism here, policy in the caller: when to stop waiting (``best_effort`` / ``wait_complete``
/ ``timeout``) is decided by ``finish`` for one rank, and by agreed values for several ranks
(``rank_steps``), which drive ``start_read`` / ``revoke`` / ``conclude`` through the public
methods below and read an operation's progress through ``PrefetchOperation.progress``.

Threading: ``Prefetcher``'s methods run on the cache's owner thread. ``_run_query`` runs on the
query executor and ``_run_io`` on the IO executor (both created and shut down by the caller):
they never touch the tree, the allocators or the metrics; they read storage indexes, write only
the host pages reserved for their operation, and report through the operation's condition
(``PrefetchOperation._cond`` guards ``_keys``, ``_hit_pages``, ``_done_pages``, ``_io_finished``,
``_t_done`` and ``_cancel``). Storage faults are misses; any other worker exception is logged
and treated as a miss.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor

import numpy as np

from ..cache.locks import LockReceipt
from ..cache.radix_key import RadixKey, as_radix_key
from ..storage import Namespace, PoolTransfer, consecutive, page_keys
from .node_keys import STORED, NodeDigests, PageDigests
from .pools import TARGET_POOL, L3Pools

log = logging.getLogger("hicache_jax.cache.storage")

_EMPTY = np.zeros(0, np.int64)
# Window stops a rank tries when the read's end has no whole window in storage (each try is
# one existence query and one window read).
_WINDOW_STOP_TRIES = 3


class AgreedProgress:
    """Several ranks: what every rank agreed on about one operation (owner thread)."""

    __slots__ = (
        "hit",
        "done",
        "finished",
        "late",
        "reservation",
        "side_reservation",
        "windows_pending",
        "windows_ok",
        "window_phases",
    )

    def __init__(self) -> None:
        self.hit: int | None = None  # agreed storage hit in pages, once every rank answered
        self.done = 0  # pages every rank has read
        self.finished = False  # every rank's read let go of its pages
        self.late = False  # some rank's timeout deadline passed
        self.reservation: tuple[int, np.ndarray | None] | None = None  # this step's host reservation
        # This step's reservations of the trailing-pages pools' windows: pool -> (pages, ids or None).
        self.side_reservation: dict[str, tuple[int, np.ndarray | None]] = {}
        # Trailing-pages pools: the windows before the agreed ``done`` are read in a second
        # phase, started once the first read's end is agreed; pending until its end is agreed.
        self.windows_pending = False
        self.windows_ok = False  # every rank read every window whole (agreed)
        self.window_phases = 0  # window reads started (a shorter agreed stop starts another)


class PrefetchOperation:
    """One request's prefetch. Read-only for callers; ``status`` is one of:

    ``skipped`` (never started), ``querying`` (counting storage hits), ``loading`` (host pages
    reserved, reading), ``revoked`` (dropped; nothing attached), ``finished`` (after
    ``finish_prefetch``; ``storage_tokens`` is the result), ``closed`` (controller closed).

    ``reason`` says in words why it was skipped or revoked; a skipped one also has
    ``reason_code``: ``below_threshold`` (the continuation after what the tree holds, on any
    tier, is shorter than ``StorageConfig.prefetch_threshold_tokens``; the threshold never
    counts pages of device-only nodes a read gives host copies: ``new_tokens``),
    ``not_backed_up`` (the match ends on a node on the device only and the cache anchors the
    read there: a key matched whole, or a stateful component without
    ``device_only_host_copies``; otherwise the read starts where the backed-up prefix ends
    and the device-only nodes get host copies from it, with several ranks too:
    ``HiRadixCache.backed_up_prefix``; a device-only node backed up meanwhile keeps that
    backup's copy and the read's pages for it are freed), ``host_budget``,
    ``namespace_unsupported`` or ``closed``.
    """

    def __init__(self, owner: object, key: RadixKey, page_size: int) -> None:
        self.owner = owner  # the controller that started it
        self.key = key
        self.page_size = page_size
        self.status = "skipped"
        self.reason = ""  # why it was skipped or revoked, in words (with the numbers)
        self.reason_code = ""  # a skipped prefetch: the label of prefetch_skipped_total{reason}
        self.start = 0  # tokens of the key already backed up in the tree at prefetch time
        # Tokens of the key the tree held usable on any tier at prefetch time (with an SWA
        # component: not past a match whose window is gone): past ``start`` when the match ends
        # on device-only nodes (the read gives them host copies); the threshold counts only what
        # a read brings past it (``new_tokens``).
        self.tree_end = 0
        self.end = 0  # page-aligned end of the key
        self.storage_tokens = 0
        self.t0 = time.perf_counter()
        self.finalized = False  # finish_prefetch or cancel was called
        self.agreed = AgreedProgress()
        self._cond = threading.Condition()
        self._cancel = False
        self._anchor = None
        self._anchor_pin: LockReceipt | None = None
        self._ns: dict[str, Namespace] = {}
        self._prev: dict[str, bytes] | None = None
        # Written by the query thread (under _cond):
        self._keys: dict[str, list[bytes]] = {}
        self._hit_pages: int | None = None
        # Owner thread:
        self._ids = _EMPTY  # host pages allocated for the hit
        self._reserved = _EMPTY  # the part of _ids the controller still owns
        # Trailing-pages pools: host pages of their component for the window (pool -> ids),
        # and the part the controller still owns (component -> ids).
        self._side_ids: dict[str, np.ndarray] = {}
        self._side_reserved: dict[str, np.ndarray] = {}
        self._side_used: dict[str, int] = {}  # IO thread: window pages read per pool
        # IO thread (under _cond):
        self._done_pages = 0
        self._io_finished = False
        self._win_stop = 0  # several ranks: the stop whose windows the second phase read whole (0: none)
        self._t_done: float | None = None  # query or IO thread: when its last storage call ended

    @property
    def requested_tokens(self) -> int:
        return self.end - self.start

    def new_tokens(self, pages: int) -> int:
        """Tokens past what the tree held at prefetch time (``tree_end``) in the first
        ``pages`` pages read from ``start``: what the threshold counts."""
        return max(0, self.start + pages * self.page_size - self.tree_end)

    @property
    def hit_tokens(self) -> int | None:
        """Storage hit (tokens after ``start``) once the query finished, else None."""
        with self._cond:
            return None if self._hit_pages is None else self._hit_pages * self.page_size

    @property
    def loaded_tokens(self) -> int:
        with self._cond:
            return self._done_pages * self.page_size

    @property
    def reserved_pages(self) -> int:
        """Host pages reserved for this operation and not handed to the tree or freed."""
        return int(self._reserved.size)

    @property
    def reads_windows(self) -> bool:
        """Whether this prefetch also reads trailing windows (an SWA pool's last pages)."""
        return bool(self._side_ids)

    def progress(self) -> tuple[int | None, int, bool]:
        """(storage hit in pages or None, pages read, whether the read finished), one snapshot."""
        with self._cond:
            return self._hit_pages, self._done_pages, self._io_finished

    def window_progress(self) -> tuple[int, bool]:
        """Several ranks, a window read (``Prefetcher.start_window_read``): (the stop whose
        windows arrived whole on this rank: the one asked for, a shorter one, or 0 for none;
        whether the read finished), one snapshot."""
        with self._cond:
            return self._win_stop, self._io_finished

    def stop(self) -> None:
        """Tell the worker threads to stop at their next batch."""
        with self._cond:
            self._cancel = True

    def pause(self, seconds: float) -> None:
        """Wait up to ``seconds`` for a worker thread to report progress."""
        with self._cond:
            self._cond.wait(seconds)

    def __repr__(self) -> str:
        return (
            f"PrefetchOperation(status={self.status}, start={self.start}, end={self.end}, "
            f"hit={self.hit_tokens}, loaded={self.loaded_tokens}, storage_tokens={self.storage_tokens})"
        )


class Prefetcher:
    """The prefetch operations of one controller (see the module docstring)."""

    def __init__(
        self,
        cache,
        pools: L3Pools,
        digests: NodeDigests,
        storage,
        config,
        *,
        owner: object,
        query: Executor,
        io: Executor,
        batch_pages: int,
        max_inflight_fraction: float,
        agreed: bool,
    ) -> None:
        self.cache = cache
        self.pools = pools
        self.digests = digests
        self.storage = storage
        self.config = config
        self.owner = owner
        self.query = query
        self.io = io
        self.page_size = cache.page_size
        self.batch_pages = batch_pages
        self.max_inflight_fraction = max_inflight_fraction
        self.threshold = max(config.prefetch_threshold_tokens, self.page_size)
        self.agreed = agreed
        self._ops: dict[PrefetchOperation, None] = {}  # started, not finished; in start order
        self._draining: list[PrefetchOperation] = []  # finished while the IO thread still held pages
        self._threshold_skip_logged = False

    def ops(self) -> list[PrefetchOperation]:
        """Operations started and not finished, in start order."""
        return list(self._ops)

    def draining(self) -> list[PrefetchOperation]:
        """Finished operations whose reserved pages the IO thread may still write."""
        return list(self._draining)

    def in_flight(self, op: PrefetchOperation) -> bool:
        return op in self._ops

    def __len__(self) -> int:
        return len(self._ops)

    # ------------------------------------------------------------------ start (owner thread)
    def inflight_pages(self) -> int:
        n = 0
        for op in self._ops:
            n += op._reserved.size if op.status == "loading" else op.requested_tokens // self.page_size
        return n + sum(op._reserved.size for op in self._draining)

    def start(self, key: object, closed: bool = False) -> PrefetchOperation:
        key = as_radix_key(key)
        op = PrefetchOperation(self.owner, key, self.page_size)
        cache = self.cache
        p = self.page_size
        n = len(key) - len(key) % p
        if closed:
            op.status = "closed"
            self.skip(op, "closed", "controller closed")
            return op
        anchor, matched, anchor_m = cache.backed_up_prefix(key)
        op.start, op.end = matched, n
        # What the tree holds *usable*: with an SWA component, a match whose window is gone
        # (tombstones) serves less than the tree's full-KV match, and a read that brings the
        # window back is worth its tokens up to the full match too. Never before ``start``:
        # the read brings nothing there.
        op.tree_end = max(matched, min(cache.tree_match_tokens(key), sum(cache.peek_prefix(key))))
        code = reason = ""
        if anchor is not cache.root and anchor.host_value is None:
            code, reason = "not_backed_up", "the matched prefix is not backed up"
        elif n - op.tree_end < self.threshold:
            code = "below_threshold"
            reason = (
                f"continuation below the threshold: {n - op.tree_end} tokens after the {op.tree_end} the "
                f"tree holds, < {self.threshold} (StorageConfig.prefetch_threshold_tokens, at least a page)"
            )
        elif self.inflight_pages() >= self.max_inflight_fraction * cache.host_allocator.num_pages:
            code, reason = "host_budget", "prefetches in flight hold the host budget"
        else:
            ns = self.pools.namespaces(key.namespace)
            if ns is None:
                code, reason = "namespace_unsupported", "namespace not supported"
        if code:
            self.skip(op, code, reason)
            return op
        op._ns = ns
        if anchor is not cache.root:
            e = self.digests.valid(anchor)
            if e is not None:
                op._prev = e.at(anchor_m // p - 1)  # the last page of the anchor inside the match
            op._anchor_pin = cache.pin_host(anchor)  # keeps the prefix the prefetch continues
            op._anchor = anchor
        op.status = "querying"
        self._ops[op] = None
        cache.metrics.prefetch_calls += 1
        self.query.submit(self._run_query, op)
        return op

    def skip(self, op: PrefetchOperation, code: str, reason: str) -> None:
        """``op`` never starts: record why (``op.reason_code`` / ``op.reason``), count it per
        reason (``prefetch_skipped_by_reason``) and log it (debug; the first threshold skip
        also at info, since it hides every storage hit of short prompts)."""
        op.reason_code, op.reason = code, reason
        m = self.cache.metrics
        m.prefetch_skipped += 1
        m.prefetch_skipped_by_reason[code] = m.prefetch_skipped_by_reason.get(code, 0) + 1
        if code == "below_threshold" and not self._threshold_skip_logged:
            self._threshold_skip_logged = True
            log.info(
                "L3: prefetch skipped: %s; shorter continuations never read L3 (further skips are "
                "logged at debug level)",
                reason,
            )
        else:
            log.debug("L3: prefetch of %d tokens skipped: %s", op.requested_tokens, reason)

    # ------------------------------------------------------------------ progress (owner thread)
    def poll(self) -> None:
        """One rank: start reads for answered queries, free what finished reads let go of."""
        for op in list(self._ops):
            self.advance(op)
        for op in list(self._draining):
            if op.progress()[2]:
                self.release_drained(op)

    def advance(self, op: PrefetchOperation) -> None:
        """One rank: a finished query becomes a revoke or a read into reserved host pages."""
        if op.status != "querying":
            return
        hit = op.progress()[0]
        if hit is None:
            return
        if op.new_tokens(hit) < self.threshold:
            self.revoke(op, "storage hit below the threshold" if hit else "no storage hit", count=hit > 0)
            return
        ids = self.cache.reserve_host_pages(hit)
        if ids is None:
            # Host eviction freed what it could (pages under a backup or an L3 write stay
            # locked): read the part of the prefix that fits rather than nothing, when that is
            # still worth a read. The pages it freed would otherwise go unused.
            fit = self.cache.host_allocator.available
            if op.new_tokens(fit) < self.threshold:
                self.revoke(op, "no host memory for the hit")
                return
            ids = self.cache.host_allocator.alloc(fit)  # hit_tokens still says what storage had
            self.cache.metrics.prefetch_truncated += 1
        side = {}
        for pool, (comp, wp) in self.pools.trailing.items():
            sid = self.cache.reserve_component_host_pages(comp.name, min(wp, ids.size))
            if sid is None:
                self.cache.host_allocator.free(ids)
                for taken_pool, taken in side.items():
                    self.pools.trailing[taken_pool][0].host_allocator.free(taken)
                self.revoke(op, f"no {comp.name} host memory for the window")
                return
            side[pool] = sid.astype(np.int64)
        op._side_ids = side
        op._side_reserved = {self.pools.trailing[pool][0].name: sid for pool, sid in side.items()}
        self.start_read(op, ids)

    def start_read(self, op: PrefetchOperation, ids: np.ndarray, side: dict[str, np.ndarray] | None = None) -> None:
        """Hand ``ids`` (reserved host pages for the hit's first pages) to the IO thread.
        ``side``: several ranks, the trailing-pages pools' window pages (pool -> ids), read by
        ``start_window_read`` once the ranks agree where the read ended."""
        if side is not None:
            op._side_ids = {pool: sid.astype(np.int64) for pool, sid in side.items()}
            op._side_reserved = {self.pools.trailing[pool][0].name: sid for pool, sid in op._side_ids.items()}
        op._ids = op._reserved = ids.astype(np.int64)
        op.status = "loading"
        self.io.submit(self._run_io, op)

    def start_window_read(self, op: PrefetchOperation, done: int) -> None:
        """Several ranks, the second phase of a read with trailing-pages pools: read each
        window before the agreed ``done`` (all or nothing), or, where storage has no whole
        window there, before this rank's longest shorter stop that has one (as one rank does;
        the ranks then agree on the shortest and read again there: ``RankSteps.apply``).
        Reopens the read (``progress`` says unfinished) until the IO thread is done with the
        window pages."""
        with op._cond:
            op._io_finished = False
            op._win_stop = 0
        op.agreed.windows_pending = True
        op.agreed.window_phases += 1
        self.io.submit(self._run_windows, op, done)

    def deadline(self, op: PrefetchOperation) -> float:
        """When the ``timeout`` policy stops waiting for ``op``."""
        hit = op.progress()[0]
        tokens = op.requested_tokens if hit is None else hit * self.page_size
        return op.t0 + self.config.prefetch_timeout(tokens)

    def complete(self, op: PrefetchOperation) -> bool:
        """One rank: nothing more will arrive (revoked, or the read stopped)."""
        if op.status != "loading":
            return op.status != "querying"
        return op.progress()[2]

    def ready(self, op: PrefetchOperation) -> bool:
        """One rank: whether ``finish`` would return without waiting under the policy."""
        self.advance(op)
        policy = self.config.prefetch_policy
        if policy == "best_effort" or self.complete(op):
            return True
        return policy == "timeout" and time.perf_counter() >= self.deadline(op)

    # ------------------------------------------------------------------ the end (owner thread)
    def finish(self, op: PrefetchOperation) -> int:
        """One rank: wait per the policy, then ``conclude``. Returns the tokens attached."""
        policy = self.config.prefetch_policy
        timed_out = False
        if policy != "best_effort":
            while True:
                self.advance(op)
                if self.complete(op):
                    break
                left = None
                if policy == "timeout":
                    left = self.deadline(op) - time.perf_counter()
                    if left <= 0:
                        timed_out = True
                        break
                with op._cond:
                    if (
                        op.status == "querying"
                        and op._hit_pages is None
                        or op.status == "loading"
                        and not op._io_finished
                    ):
                        op._cond.wait(0.05 if left is None else min(left, 0.05))
        with op._cond:
            op._cancel = True
            done = op._done_pages if op.status == "loading" else 0
            io_finished = op._io_finished
            # Completion: the last storage call's end; now, if the policy cut the op short.
            t_end = op._t_done if (io_finished or op.status == "revoked") and op._t_done is not None else None
        if timed_out:
            self.cache.metrics.prefetch_timeouts += 1
        return self.conclude(op, done, io_finished, t_end, "stopped before the storage answered")

    def conclude(
        self, op: PrefetchOperation, done: int, read_finished: bool, t_end: float | None, unanswered: str
    ) -> int:
        """Attach the first ``done`` pages read (when they reach the threshold), free the rest
        (or park them while the read may still write them: ``read_finished`` False), release
        the anchor and count. ``unanswered``: the revoke reason of an op still querying."""
        op.stop()
        self._ops.pop(op, None)
        m = self.cache.metrics
        attached = 0
        if op.status == "loading":
            got, rest = op._ids[:done], op._ids[done:]
            op._reserved = rest
            side_pages = None
            if op._side_ids:  # the windows that arrived go with the pages (done > 0 only then)
                side_pages = {}
                keep_side = {}
                for pool, sid in op._side_ids.items():
                    name = self.pools.trailing[pool][0].name
                    cnt = op._side_used.get(pool, 0) if done else 0
                    arr = np.full(done, -1, np.int64)
                    if cnt:
                        arr[done - cnt :] = sid[:cnt]
                    side_pages[name] = arr
                    keep_side[name] = sid[cnt:]
                op._side_reserved = keep_side
            if rest.size or any(x.size for x in op._side_reserved.values()):
                if read_finished:
                    self.free(op)
                else:
                    self._draining.append(op)  # freed once the IO thread lets go
            if op.new_tokens(done) < self.threshold:
                if done:
                    self.cache.host_allocator.free(got)
                    for name, arr in (side_pages or {}).items():
                        if (arr >= 0).any():
                            self.cache.components.components[name].host_allocator.free(arr[arr >= 0])
                m.prefetch_revoked += 1
                op.status, op.reason = "revoked", "arrived below the threshold"
            else:
                attached, leaf = self.cache.insert_host(op.key, got, op.start, side_pages)
                if leaf is not None:
                    k = attached // self.page_size
                    self.digests.set(
                        leaf, PageDigests({pool: ks[done - k : done] for pool, ks in op._keys.items()}, STORED)
                    )  # it came from L3
                else:
                    m.prefetch_revoked += 1
                    op.reason = "the tree no longer connects"
                op.status = "finished"
            m.prefetched_tokens += done * self.page_size
        elif op.status == "querying":  # nothing was reserved yet
            op.status, op.reason = "revoked", unanswered
        self.release_anchor(op)
        self.account(op, attached, t_end)
        return attached

    def account(self, op: PrefetchOperation, attached: int, t_end: float | None = None) -> None:
        op.storage_tokens = attached
        m = self.cache.metrics
        m.prefetch_attached_tokens += attached
        if t_end is None:
            with op._cond:
                t_end = op._t_done
        m.prefetch_duration_seconds.observe((t_end if t_end is not None else time.perf_counter()) - op.t0)

    def forget(self, op: PrefetchOperation) -> None:
        """``op`` will not be finished (skipped or revoked before ``finish_prefetch``)."""
        self._ops.pop(op, None)

    def cancel(self, op: PrefetchOperation) -> None:
        """Drop ``op``: free its pages (or park them until its read lets go), release its anchor."""
        self._ops.pop(op, None)
        op.stop()
        read_finished = op.agreed.finished and not op.agreed.windows_pending if self.agreed else op.progress()[2]
        if op.status == "loading" and not read_finished:
            self._draining.append(op)
        else:
            self.free(op)
        if op.status in ("querying", "loading"):
            op.status, op.reason = "revoked", "cancelled"
        self.release_anchor(op)

    def revoke(self, op: PrefetchOperation, reason: str, count: bool = True) -> None:
        op.stop()
        op.status, op.reason = "revoked", reason
        self._ops.pop(op, None)
        if count:
            self.cache.metrics.prefetch_revoked += 1
        log.debug("L3: prefetch revoked: %s", reason)
        self.release_anchor(op)

    def release_anchor(self, op: PrefetchOperation) -> None:
        if op._anchor is not None:
            self.cache.unpin_host(op._anchor_pin)  # a no-op after a reset
            op._anchor = op._anchor_pin = None

    def release_drained(self, op: PrefetchOperation) -> None:
        """A parked operation's read let go of its pages: free them."""
        self._draining.remove(op)
        self.free(op)

    def release_all_drained(self) -> None:
        """Free every parked operation's pages (the IO executor has stopped)."""
        for op in self._draining:
            self.free(op)
        self._draining.clear()

    def free(self, op: PrefetchOperation) -> None:
        if op._reserved.size:
            self.cache.host_allocator.free(op._reserved)
            op._reserved = _EMPTY
        for name, sid in op._side_reserved.items():
            if sid.size:
                self.cache.components.components[name].host_allocator.free(sid)
        op._side_reserved = {}

    def reserved_host_pages(self) -> np.ndarray:
        """Host pages allocated for prefetches and not (yet) handed to the tree or freed."""
        parts = [op._reserved for op in (*self._ops, *self._draining) if op._reserved.size]
        return np.concatenate(parts) if parts else _EMPTY

    def reserved_component_host_pages(self, component: str) -> np.ndarray:
        """``reserved_host_pages`` of a trailing-pages pool's component (its own host pool)."""
        parts = [
            op._side_reserved[component]
            for op in (*self._ops, *self._draining)
            if op._side_reserved.get(component, _EMPTY).size
        ]
        return np.concatenate(parts) if parts else _EMPTY

    def on_reset(self) -> None:
        """The cache drops every page: release every anchor (their pins die with the tree)."""
        for op in self._ops:
            self.release_anchor(op)

    # ------------------------------------------------------------------ worker threads
    def _run_query(self, op: PrefetchOperation) -> None:  # query thread
        keys: dict[str, list[bytes]] = {}
        hit = 0
        try:
            toks = op.key.token_ids
            for pool, ns in op._ns.items():
                prev = op._prev[pool] if op._prev is not None else None
                if prev is None and op.start:
                    prev = page_keys(ns, toks[: op.start])[-1]
                keys[pool] = page_keys(ns, toks[op.start : op.end], prev)
            n = len(keys[TARGET_POOL])
            # Several ranks: the hit is MIN-reduced over the ranks (see pools.queried_pools).
            asked = self.pools.queried_pools()
            for s in range(0, n, self.batch_pages):
                if op._cancel:
                    break
                e = min(n, s + self.batch_pages)
                r = self.storage.exists_multi([PoolTransfer(pool, keys[pool][s:e]) for pool in asked])
                hit += r.hit_pages
                if r.hit_pages < e - s:
                    break
            trailing = self.pools.trailing
            if trailing and hit and not op._cancel:
                # The largest hit whose trailing windows are stored too (the storage's rule);
                # from a mid-tree anchor the whole window must come from storage.
                # Several ranks: the markers only as ``asked`` (rank 0), as in the count above.
                hit = self.storage.exists_multi(
                    [PoolTransfer(pool, ks[:hit]) for pool, ks in keys.items() if pool in asked or pool in trailing]
                ).hit_pages
                if op.start and hit < max(wp for _c, wp in trailing.values()):
                    hit = 0
        except Exception:
            log.exception("L3: prefetch query failed")
            hit = 0
        with op._cond:
            op._keys, op._hit_pages = keys, hit
            op._t_done = time.perf_counter()
            op._cond.notify_all()

    def _run_io(self, op: PrefetchOperation) -> None:  # IO thread
        try:
            ids, n = op._ids, op._ids.size
            trailing = bool(op._side_ids) and not self.agreed  # several ranks: a second phase
            total = 0
            read = self.pools.read_pools()
            for s in range(0, n, self.batch_pages):
                if op._cancel:
                    break
                e = min(n, s + self.batch_pages)
                r = self.storage.get_multi([PoolTransfer(pool, op._keys[pool][s:e], ids[s:e]) for pool in read])
                got = min(max(int(r.hit_pages), 0), e - s)
                total += got
                if not trailing:
                    with op._cond:
                        op._done_pages += got
                        op._cond.notify_all()
                if got < e - s:
                    break
            if trailing:
                done = self._read_windows_or_shorter(op, total)
                with op._cond:
                    op._done_pages = done
                    op._cond.notify_all()
        except Exception:
            log.exception("L3: prefetch read failed")
        finally:
            with op._cond:
                op._io_finished = True
                op._t_done = time.perf_counter()
                op._cond.notify_all()

    def _run_windows(self, op: PrefetchOperation, done: int) -> None:  # IO thread
        stop = 0
        try:
            stop = self._read_windows_or_shorter(op, done)
        except Exception:
            log.exception("L3: prefetch window read failed")
        finally:
            with op._cond:
                op._win_stop = stop
                op._io_finished = True
                op._t_done = time.perf_counter()
                op._cond.notify_all()

    def _read_windows_or_shorter(self, op: PrefetchOperation, done: int) -> int:  # IO thread
        """``_read_windows`` at ``done``; when that window is not whole in storage (the
        read stopped early, at a stop whose window was never stored: the pages there were out of
        the window when backed up), the longest shorter stop whose windows storage holds (the
        storage's trailing-pages rule over the pages read), a few times at most. Returns the
        stop served (0: none)."""
        stop = done
        for _ in range(_WINDOW_STOP_TRIES):
            got = self._read_windows(op, stop)
            if got or stop <= 1 or op._cancel:
                return got
            asked, trailing = self.pools.queried_pools(), self.pools.trailing  # as the query asked
            stop = self.storage.exists_multi(
                [
                    PoolTransfer(pool, ks[: stop - 1])
                    for pool, ks in op._keys.items()
                    if pool in asked or pool in trailing
                ]
            ).hit_pages
            if op.new_tokens(stop) < self.threshold:
                return 0
        return 0

    def _read_windows(self, op: PrefetchOperation, done: int) -> int:  # IO thread
        """Read each trailing-pages pool's window before ``done`` into its reserved host pages:
        ``done`` when every window arrived whole, else 0 (nothing of the prefetch counts)."""
        if not done or op._cancel:
            return 0
        used = {}
        for pool, sid in op._side_ids.items():
            wp = self.pools.trailing[pool][1]
            if op.start and done < wp:
                return 0
            lo = max(0, done - wp)
            cnt = done - lo
            if cnt > sid.size:
                return 0
            flags = self.storage.batch_get(op._keys[pool][lo:done], sid[:cnt].tolist(), pool)
            if consecutive(flags) < cnt:
                return 0  # a short window: all of it or nothing
            used[pool] = cnt
        op._side_used = used
        return done
