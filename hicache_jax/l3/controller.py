"""L3 controller: write-through backups host (L2) -> storage (L3), and prefetch storage -> host.

Usage (upstream HiCache's L3 flow; the engine's scheduler thread owns the cache and the controller)::

    cache = HiRadixCache(HiCacheConfig(page_size=16, storage=StorageConfig(backend="file", path=d)),
                         engine, device_allocator, sidecars={"draft": draft_engine})
    controller = StorageController(cache, model="llama-3-8b", weights_revision="abc123")
    op = controller.prefetch(radix_key)        # request arrival: non-blocking
    ...                                        # optional: admit once controller.prefetch_ready(op)
    storage_tokens = controller.finish_prefetch(op)   # admission, before cache.begin_request
    req, lb = cache.begin_request(radix_key)   # loads the new host-only nodes to the device
    cache.check_events()                       # every step: acks D2H backups -> L3 writes; polls
    controller.close()                         # shutdown: cancel prefetches, flush L3 writes
                                               # (or hicache_jax.CacheStack: one close() for all)

Signatures::

    StorageController(cache, storage_config=None, *, model, weights_revision="", tp_size=None, tp_rank=None,
                      salt="", storage=None, batch_pages=128, max_inflight_fraction=0.5)
    key_namespace(pool="target", namespace=DEFAULT_NAMESPACE) -> Namespace   # seeds the pool's page keys
    model, weights_revision, salt               # the identity given above (attributes)
    prefetch(key) -> PrefetchOperation
    prefetch_ready(op) -> bool
    finish_prefetch(op) -> int                 # tokens attached to the tree from storage
    cancel(op) -> None
    flush(timeout=None) -> bool
    close() -> None                            # idempotent; also a context manager
    pending_writes() -> dict                   # what an exit now would lose (any thread)
    stats() -> dict

``storage_config`` defaults to ``cache.config.storage`` (``HiCacheConfig.storage``); one of them
must be set. ``storage`` injects a ready ``HiCacheStorage`` built over the cache's host pools
(tests use slow or faulty stores); otherwise the controller builds one with ``create_storage``
and closes it in ``close``.

Pools and keys
    The target KV (component ``full``) is the storage pool ``target``; every other component
    is a pool of its own name. A component's hit policy is its ``l3_trailing_pages``: a
    sidecar (e.g. the draft model's KV, sharing the target's page ids) is ``ALL_PAGES``: a
    page is a storage hit only if every such pool has it, and ``get_multi`` reads every pool
    before it publishes anything, so a target page never lands without its draft. A component
    with its own page ids and a window (``swa``: ``window_pages`` = ceil((W - 1) / page)) is
    ``TRAILING_PAGES``: its pages are stored beside the target's under the same chained page
    keys (its own pool namespace), and only the ``window_pages`` before a hit's end must be
    stored (the storage's trailing-pages rule). Such a pool is queried, read and attached
    after the target's pages: a prefetch's pages count as arrived only once the window before
    their end has arrived too (all of a window or nothing: a short read of the window attaches
    nothing at that end; one rank then tries the longest shorter stop whose window storage
    holds, as for a read of the full pages that stopped early), and a prefetch from a mid-tree
    anchor needs the whole window
    from storage (the tree's own pages above the anchor are not searched for it).
    Page keys are SHA-256 chains (``storage.keys``) seeded with a per-pool ``Namespace`` of: the
    model id with the KV geometry folded in (kind, layers, heads, width), ``weights_revision``,
    KV dtype, page size, host layout, TP size/rank, pool name, and an ``extra_key`` that
    encodes the controller's ``salt`` and the RadixKey's ``extra_key``/``cache_salt`` (the tree's
    namespace) with ``radix_key.encode_namespace``: the tree's own typed identity, so two keys
    share L3 pages exactly when they share tree nodes (a ``RadixKey`` with a namespace value
    that has no stable encoding cannot be built). The controller keeps each
    tree node's page digests per pool, so a child chains from its parent's last digest; an
    entry outliving a split is trimmed to the lower part, and nodes without one are hashed.

L3 backup (write-through from L2, no threshold)
    Each acknowledged D2H backup calls ``on_backup_acked(node)``: the controller collects the
    nodes from ``node`` up to the first one already stored or in flight, takes a host lock on
    ``node`` (the pages stay in the host pool), and queues one job on the backup thread, which
    calls ``batch_set`` per pool (the other pools first, then the target; the storage skips
    keys it already holds). A trailing-pages pool stores the host pages its component holds
    for those nodes (``node_host_pages``; a host tombstone stores none); a failed page of it
    fails the job (retried later like a failed target page). ``batch_set`` copies the pages out before returning; the owner thread
    then drops the host lock at its next ``poll``. A node whose pages failed is retried on
    the next backup below it.

Prefetch (upstream HiCache's flow; policies in ``storage.config``)
    ``prefetch(key)`` walks the tree read-only. It starts only when the match ends on a
    backed-up node (or the root; or on device-only nodes, with several ranks too: the read then
    starts where the backed-up prefix ends and gives them host copies), the continuation after the
    tree's whole match is >= the threshold (``max(prefetch_threshold_tokens, page_size)``; it
    counts only tokens a read brings past what the tree holds usable, here and for the hit and
    the pages arrived: ``PrefetchOperation.new_tokens``; with an SWA component a match whose
    window is gone serves less than its full-KV length, and a read that brings the window back
    counts from there) and prefetches in flight hold less than
    ``max_inflight_fraction`` of the host pool. A skipped prefetch says why (``op.reason``,
    ``op.reason_code``), counts in ``metrics.prefetch_skipped_by_reason`` and logs it (debug). It host-locks the anchor node (the match's
    deepest node) and queues a query on the query thread: hash the continuation's page keys
    and count consecutive storage hits in ``batch_pages`` batches, stopping at the first
    partial batch. On the owner thread (``poll``, ``prefetch_ready`` or ``finish_prefetch``) a
    hit under the threshold is revoked; otherwise exactly ``hit`` host pages are allocated
    (evicting host leaves if needed; when the host cannot free that many, the pages it can
    give hold the hit's first pages, if they reach the threshold: ``prefetch_truncated``, else
    revoked) and the IO thread reads them batch by batch (all pools
    per batch), stopping at the first miss or when told to. ``finish_prefetch`` applies the
    policy -- ``best_effort``: take what has arrived; ``wait_complete``: wait for every page;
    ``timeout``: wait until done or ``prefetch_timeout(tokens)`` seconds after ``prefetch``
    (``tokens``: the hit once known, else the requested continuation) -- then hands the
    consecutive pages that arrived to ``HiRadixCache.insert_host`` (under the threshold: all
    freed, revoked). The tree may have changed meanwhile: pages it already holds are freed,
    pages that no longer connect are freed, never attached elsewhere (keys cover the whole
    prefix, so attached bytes are always the right ones). Pages still being written when a
    prefetch is cut short stay reserved until the IO thread lets go of them.

Counting
    ``finish_prefetch`` returns the tokens attached from storage (now host-only nodes). They
    reach the device through ``begin_request``'s load-back (subject to its
    ``load_back_threshold`` and device room, like any host hit); the cache remembers which
    nodes came from L3, so their load-back counts as ``cached_tokens{cache_source="storage"}``
    and not as a host hit (``metrics.loaded_storage_tokens``). An engine reporting per request
    uses device = the match's device hit, storage = min(this result, the load-back's
    ``num_tokens``), host = the load-back's ``num_tokens`` - storage. Counters live in
    ``cache.metrics`` (``prefetch_*``, ``prefetch_attached_tokens``, ``storage_backup_*``);
    ``stats()`` reports the store's counters (``controller.storage.metrics``) under the cache's
    metric family names (``storage_read_hit_pages``, ...); ``register_prometheus(cache)``
    exports both.

Threading
    Every public method, and every hook the cache calls (``on_backup_acked``, ``poll``,
    ``on_reset``, ``reserved_host_pages``), runs on the cache's owner thread; the controller
    is not thread-safe beyond that. Three worker threads (one each: query, IO, backup) never
    touch the tree, the allocators or ``cache.metrics``: they read storage indexes, write the
    host pages reserved for their prefetch, read host pages that a host lock keeps alive, and
    report back through per-operation conditions and a completion queue that the owner
    thread drains. Storage faults are misses and failed sets (the storage layer's contract);
    any other exception on a worker is logged and treated the same way, so nothing escapes to
    the scheduler except argument errors from the public methods. The three threads run
    ``StorageConfig.worker_nice`` below the scheduler's OS priority (``hicache_jax.workers``).

Several ranks (``cache.agreed``: tensor-parallel processes, each with its own tree, host pool
and controller over its shard of every page; ``tp_size`` / ``tp_rank`` default to the cache's
agreement)
    Every per-rank outcome goes through the cache's ``StepAgreement`` (the controller is a
    participant) and the controller acts only on agreed values: a query's hit count (MIN; a
    rank that sees a page missing lowers it for all), the host reservation for the hit and
    each trailing-pages pool's window (reserve -> agree -> commit: reserved in the step's
    ``prepare``, through the cache's agreed facades; committed or rolled back on every rank by
    its ``apply``), the pages each read has delivered (MIN: a short read on one rank shortens
    every rank's prefetch) and whether every read finished (with trailing-pages pools a second
    phase then reads the windows before that agreed end on every rank, and the prefetch
    attaches its pages only if every rank read them whole), whether some rank's
    ``timeout`` deadline passed (MAX), and which L3 backup jobs every rank has finished (their
    host pins drop at the same step everywhere). ``poll`` does nothing then; ``finish_prefetch``
    takes what was agreed (``best_effort``) or runs agreement steps until the agreed state lets
    it stop; ``flush`` runs steps until every backup job is agreed done. Operations are kept in
    start order, so every rank reports them in the same order.

    Visibility: a pool sharded over the ranks (MHA heads) is written by every rank under its
    own keys (the namespace holds ``tp_rank``), and a page group becomes visible only when
    every rank's shard is written: after the ranks agree that a backup job succeeded
    everywhere, rank 0 writes a commit marker per page (pool ``commit``: rank-independent keys,
    a one-byte page). Each rank's query asks for its own shard, rank 0's for the marker too:
    the hit is MIN-reduced, so every rank's agreed hit stops at the first page lacking a marker
    or any rank's shard (a shard can vanish on one rank), and a store that buffers writes per
    process (orbax) needs no other process's pending pages. A replicated pool (MLA latent KV:
    the same bytes on every rank) uses rank-independent keys and is written by rank 0 only, so
    it needs no marker (upstream ``backup_skip``); with only replicated pools nothing is
    marked. A pool whose engine says ``replicated`` (a draft with fewer KV heads than ranks)
    is stored the same way. The other ranks read rank 0's replicated pages, so with a
    per-process buffering store they hit once rank 0's writer has saved them
    (``flush_interval_s``).

Coupling: the controller uses only the cache's public L3 surface (``backed_up_prefix``,
``pin_host`` / ``unpin_host`` receipts, ``reserve_host_pages``, ``insert_host``, the
``storage_hook`` slot) and reads nodes' public fields (``parent``, ``children``, ``size``,
``key``, ``namespace``, ``host_value``, ``deleted``); it never changes a node.

Exit without ``close()``: every open controller is registered with ``exit_flush``, which
closes it when the main script returns (or at interpreter shutdown) and logs an error with
the counts where it cannot write them.

Modules (this class is the facade; each part has its own module and tests): ``pools`` (storage
pools and key namespaces), ``node_keys`` (per-node page keys), ``backup`` (write-through jobs),
``prefetch`` (prefetch operations), ``rank_steps`` (several ranks: the agreement participant
and the commit markers), ``exit_flush`` (the exit-time flush). The controller owns the three worker executors and the storage it
built, and shuts them down in ``close`` in that order: prefetch threads, backup thread, store.
"""

from __future__ import annotations

import logging

import numpy as np

from ..cache.hiradix_cache import HiRadixCache
from ..cache.radix_key import DEFAULT_NAMESPACE, as_radix_key, encode_namespace
from ..storage import HiCacheStorage, Namespace, StorageConfig, create_storage
from ..workers import background_executor
from .backup import L3Backups
from . import exit_flush
from .node_keys import NodeDigests
from .pools import L3Pools
from .prefetch import Prefetcher, PrefetchOperation
from .rank_steps import RankSteps

log = logging.getLogger("hicache_jax.cache.storage")

__all__ = ["PrefetchOperation", "StorageController", "encode_namespace"]


class StorageController:
    """Wires an L3 store into a ``HiRadixCache``. See the module docstring for the contract."""

    def __init__(
        self,
        cache: HiRadixCache,
        storage_config: StorageConfig | None = None,
        *,
        model: str,
        weights_revision: str = "",
        tp_size: int | None = None,
        tp_rank: int | None = None,
        salt: str = "",
        storage: HiCacheStorage | None = None,
        batch_pages: int = 128,
        max_inflight_fraction: float = 0.5,
    ) -> None:
        if not isinstance(cache, HiRadixCache):
            raise TypeError(f"cache: expected a HiRadixCache, got {type(cache).__name__}")
        if cache.storage_hook is not None:
            raise ValueError("cache: a storage controller is already attached")
        if storage_config is None:
            storage_config = cache.config.storage
            if storage_config is None:
                raise ValueError("storage_config: not given and cache.config.storage is None; set one of them")
        if not isinstance(storage_config, StorageConfig):
            raise TypeError(f"storage_config: expected a StorageConfig, got {type(storage_config).__name__}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model: expected a non-empty str (the model identity in every page key), got {model!r}")
        if not isinstance(salt, str):
            raise TypeError(f"salt: expected a str, got {type(salt).__name__}")
        if isinstance(batch_pages, bool) or not isinstance(batch_pages, int) or batch_pages < 1:
            raise ValueError(f"batch_pages: expected an int >= 1, got {batch_pages!r}")
        if (
            isinstance(max_inflight_fraction, bool)
            or not isinstance(max_inflight_fraction, (int, float))
            or not 0 < max_inflight_fraction <= 1
        ):
            raise ValueError(f"max_inflight_fraction: expected a number in (0, 1], got {max_inflight_fraction!r}")
        self.cache = cache
        self.config = storage_config
        self.page_size = cache.page_size
        self.batch_pages = batch_pages
        self.max_inflight_fraction = float(max_inflight_fraction)
        self.threshold = max(storage_config.prefetch_threshold_tokens, self.page_size)
        self.salt = salt
        self.model = model
        self.weights_revision = weights_revision
        agreement = cache.agreement
        self._agreed = cache.agreed
        tp_size = agreement.num_processes if tp_size is None else tp_size
        self.tp_rank = agreement.rank if tp_rank is None else tp_rank
        layout = L3Pools(
            cache.components,
            model=model,
            weights_revision=weights_revision,
            tp_size=tp_size,
            tp_rank=self.tp_rank,
            salt=salt,
        )  # validates model / revision / TP
        self.pools, self.replicated, self.markers = layout.pools, layout.replicated, layout.markers
        if storage is None:
            self.storage = create_storage(storage_config, self.pools, layout.specs)
            self._owns_storage = True
        else:
            if not isinstance(storage, HiCacheStorage):
                raise TypeError(f"storage: expected a HiCacheStorage, got {type(storage).__name__}")
            if set(storage.codecs) != set(self.pools) or any(
                storage.codecs[n].pool is not p for n, p in self.pools.items()
            ):
                raise ValueError(
                    f"storage: must be built over this cache's host pools {sorted(self.pools)}, "
                    f"got pools {sorted(storage.codecs)}"
                )
            for spec in layout.specs:
                if storage.specs[spec.name] != spec:
                    raise ValueError(
                        f"storage: pool {spec.name!r} must have the spec {spec}, got {storage.specs[spec.name]}"
                    )
            self.storage = storage
            self._owns_storage = False
        self._layout = layout
        self._digests = NodeDigests(lambda: cache.root, self.page_size, layout.namespaces)  # reset replaces the root
        nice = storage_config.worker_nice  # the L3 threads yield cores to the scheduler (workers.py)
        self._query = background_executor("hicache-l3-query", nice)
        self._io = background_executor("hicache-l3-io", nice)
        self._writer = background_executor("hicache-l3-backup", nice)
        self._backups = L3Backups(cache, layout, self._digests, self.storage, self._writer, agreed=self._agreed)
        self._prefetcher = Prefetcher(
            cache,
            layout,
            self._digests,
            self.storage,
            storage_config,
            owner=self,
            query=self._query,
            io=self._io,
            batch_pages=batch_pages,
            max_inflight_fraction=self.max_inflight_fraction,
            agreed=self._agreed,
        )
        self._ranks = (
            RankSteps(cache, layout, self._prefetcher, self._backups, self.storage, storage_config)
            if self._agreed
            else None
        )
        self._closed = False
        cache.storage_hook = self
        if self._ranks is not None:
            cache.step_agreement.add(self._ranks)
        exit_flush.track(self)  # a process exiting without close() flushes (or says what it loses)

    def _namespaces(self, radix_ns: tuple) -> dict[str, Namespace] | None:
        return self._layout.namespaces(radix_ns)

    def key_namespace(self, pool: str = "target", namespace: tuple = DEFAULT_NAMESPACE) -> Namespace:
        """The ``Namespace`` that seeds ``pool``'s page keys for a tree namespace (a
        ``RadixKey``'s ``namespace``; ``(None, None)`` the default tenant): ``storage.page_keys(ns, tokens)``
        are the keys this controller stores those pages under. What a KV event source or
        another process keys pages with to match this L3."""
        if not isinstance(pool, str) or pool not in self.pools:
            raise ValueError(f"pool: expected one of {sorted(self.pools)}, got {pool!r}")
        if not isinstance(namespace, tuple) or len(namespace) != 2:
            raise TypeError(f"namespace: expected a RadixKey's namespace (a 2-tuple), got {namespace!r}")
        out = self._layout.namespaces(namespace)
        if out is None:
            raise ValueError(f"namespace: {namespace!r} has no stable encoding (its pages skip storage)")
        return out[pool]

    # ------------------------------------------------------------------ hooks (owner thread)
    def on_backup_acked(self, node) -> None:
        """A D2H backup of ``node`` (and its un-backed ancestors) was acknowledged: queue L3."""
        if self._closed:
            return
        try:
            self._backups.queue(node)
        except Exception:  # never break the cache's acknowledgement loop
            log.exception("L3: queueing a backup failed")

    def poll(self) -> None:
        """Owner-thread progress: release finished L3 backups, start reads, reclaim pages.
        Several ranks: nothing (the agreement steps do it, on agreed values)."""
        if self._agreed:
            return
        try:
            self._backups.reap()
            self._prefetcher.poll()
        except Exception:
            log.exception("L3: poll failed")

    def on_reset(self) -> None:
        """The cache is about to drop every page: let L3 backups finish reading, drop anchors.
        (Several ranks: backup jobs still in flight end without their commit markers; ``flush``
        before a reset to keep them.)"""
        self._backups.wait(None)
        self._prefetcher.on_reset()
        self._digests.clear()

    def reserved_host_pages(self) -> np.ndarray:
        """Host pages allocated for prefetches and not (yet) handed to the tree or freed."""
        return self._prefetcher.reserved_host_pages()

    def reserved_component_host_pages(self, component: str) -> np.ndarray:
        """``reserved_host_pages`` of a trailing-pages pool's component (its own host pool)."""
        return self._prefetcher.reserved_component_host_pages(component)

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, key: object) -> PrefetchOperation:
        """Start prefetching the storage continuation of ``key`` (non-blocking; owner thread)."""
        self.cache.check_owner("StorageController.prefetch")
        key = as_radix_key(key)  # a bad key raises before anything moves
        if not self._closed:
            self.poll()
        return self._prefetcher.start(key, closed=self._closed)

    def prefetch_ready(self, op: PrefetchOperation) -> bool:
        """Whether ``finish_prefetch(op)`` would return without waiting under the policy
        (several ranks: as of the last agreement step, the same answer on every rank)."""
        self.cache.check_owner("StorageController.prefetch_ready")
        self._check_op(op)
        if self._ranks is not None:
            return self._ranks.ready(op)
        return self._prefetcher.ready(op)

    def _check_op(self, op: object) -> PrefetchOperation:
        if not isinstance(op, PrefetchOperation):
            raise TypeError(f"op: expected a PrefetchOperation, got {type(op).__name__}")
        if op.owner is not self:
            raise ValueError("op: started by another controller")
        return op

    def finish_prefetch(self, op: PrefetchOperation) -> int:
        """Stop ``op`` per the policy and attach what arrived to the tree as host-only nodes.

        Call at admission, before ``cache.begin_request``. Returns the tokens attached from
        storage (0 if skipped, revoked or nothing arrived). Raises ValueError if called twice.
        """
        self.cache.check_owner("StorageController.finish_prefetch")
        self._check_op(op)
        if op.status == "closed":
            return 0
        if op.finalized:
            raise ValueError(f"op: already finished ({op.status})")
        op.finalized = True
        if op.status not in ("querying", "loading"):  # skipped / revoked
            self._prefetcher.forget(op)
            if op.status == "revoked":
                self._prefetcher.account(op, 0)
            return 0
        if self._ranks is not None:
            return self._ranks.finish(op)
        return self._prefetcher.finish(op)

    def cancel(self, op: PrefetchOperation) -> None:
        """Drop a prefetch whose request will not be scheduled (frees everything it holds)."""
        self.cache.check_owner("StorageController.cancel")
        self._check_op(op)
        if op.finalized:
            return
        op.finalized = True
        self._prefetcher.cancel(op)

    # ------------------------------------------------------------------ L3 writes
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued L3 backup is handed to the storage and the storage has made
        it durable. True if nothing is left pending. Several ranks: agreement steps until
        every job is agreed done (``timeout`` bounds only the storage's own flush: a deadline
        is a per-rank clock)."""
        if self._ranks is not None:
            self._ranks.flush()
        elif not self._backups.wait(timeout):
            return False
        return bool(self.storage.flush(timeout))

    def pending_writes(self) -> dict:
        """What a process exiting now would lose: ``l3_pages`` (target pages in L3 backup jobs
        not settled), ``unacknowledged_backups`` (D2H backups the cache has not acknowledged:
        each becomes L3 writes once it is), ``store_buffered`` (the store holds accepted pages
        it has not made durable) and ``total`` (their sum, the buffer counting 1). Any thread;
        a snapshot."""
        try:
            buffered = not self._closed and bool(self.storage.writes_pending())
        except Exception:  # a broken store: what it holds is not countable, so count it pending
            buffered = True
        unacked = 0 if self._closed else int(self.cache.in_flight[0])
        pages = self._backups.pending_pages()
        return {
            "l3_pages": pages,
            "unacknowledged_backups": unacked,
            "store_buffered": buffered,
            "total": pages + unacked + int(buffered),
        }

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ lifecycle
    # The store's counters (``storage.metrics``) under the cache's metric family names
    # (``hicache_jax.cache.metrics.FAMILIES``): one naming scheme, pages counted as pages.
    _STORE_FAMILIES = {
        "hits": "storage_read_hit_pages",
        "misses": "storage_read_miss_pages",
        "corrupt": "storage_corrupt_pages",
        "read_errors": "storage_read_errors",
        "quarantined": "storage_quarantined_files",
        "verified": "storage_verified_pages",
        "bytes_read": "storage_read_bytes",
        "read_seconds": "storage_read_seconds",
        "pages_written": "storage_written_pages",
        "bytes_written": "storage_written_bytes",
        "write_seconds": "storage_write_seconds",
        "write_errors": "storage_write_errors",
        "pages_dropped": "storage_dropped_pages",
        "sets_skipped": "storage_duplicate_pages",
        "pages_evicted": "storage_evicted_pages",
    }

    def stats(self) -> dict:
        """Configuration, operations in flight and the store's counters, named as the cache's
        metric families (``cache.stats()`` includes them while the controller is attached)."""
        snap = self.storage.metrics.snapshot()
        out = {
            "backend": self.storage.backend_name,
            "prefetch_policy": self.config.prefetch_policy,
            "prefetch_threshold_tokens": self.threshold,
            "prefetches_in_flight": len(self._prefetcher),
            "prefetch_reserved_host_pages": int(self.reserved_host_pages().size),
            "storage_backups_in_flight": len(self._backups),
            "storage_writes_pending": int(bool(self.storage.writes_pending())),
            "storage_capacity_bytes": self.config.capacity_bytes,
        }
        for k, name in self._STORE_FAMILIES.items():
            out[name] = snap.get(k, 0)
        return out

    def close(self) -> None:
        """Acknowledge pending D2H backups, cancel prefetches, flush every L3 write, close the
        storage (if built here) and detach from the cache.

        Idempotent; owner thread.
        """
        if self._closed:
            return
        exit_flush.untrack(self)
        try:  # D2H backups still in flight: acknowledge them so their L3 writes are queued too
            if self._agreed:  # agree on the last copies and jobs while every rank still steps
                self.cache.flush()
                self.flush()
            else:
                self.cache.writing_check(block=True)
        except Exception:
            log.exception("L3: acknowledging backups at close failed")
        self._closed = True
        if self._ranks is not None:
            self.cache.step_agreement.remove(self._ranks)
        for op in self._prefetcher.ops():
            self.cancel(op)
            op.status, op.reason = "closed", "controller closed"
        self._query.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=True, cancel_futures=True)
        self._prefetcher.release_all_drained()
        self._writer.shutdown(wait=True)
        self._backups.reap()
        try:
            self.storage.flush(None)
            if self._owns_storage:
                self.storage.close()
        except Exception:
            log.exception("L3: closing the storage failed")
        if self.cache.storage_hook is self:
            self.cache.storage_hook = None
        self._digests.clear()

    def __enter__(self) -> "StorageController":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
