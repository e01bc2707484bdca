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

Signatures::

    StorageController(cache, storage_config=None, *, model, weights_revision="", tp_size=None, tp_rank=None,
                      salt="", storage=None, batch_pages=128, max_inflight_fraction=0.5)
    prefetch(key) -> PrefetchOperation
    prefetch_ready(op) -> bool
    finish_prefetch(op) -> int                 # tokens attached to the tree from storage
    cancel(op) -> None
    flush(timeout=None) -> bool
    close() -> None
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
    nothing of the prefetch), and a prefetch from a mid-tree anchor needs the whole window
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
    backed-up node (or the root), the continuation after it is >= the threshold
    (``max(prefetch_threshold_tokens, page_size)``) and prefetches in flight hold less than
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
    rank that sees a page missing lowers it for all), the host reservation for the hit
    (reserve -> agree -> commit: reserved in the step's ``prepare``, committed or rolled back on
    every rank by its ``apply``), the pages each read has delivered (MIN: a short read on one
    rank shortens every rank's prefetch) and whether every read finished, whether some rank's
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
    marked. The other ranks read rank 0's replicated pages, so with a per-process buffering
    store they hit once rank 0's writer has saved them (``flush_interval_s``).

Coupling: the controller uses only the cache's public L3 surface (``backed_up_prefix``,
``pin_host`` / ``unpin_host`` receipts, ``reserve_host_pages``, ``insert_host``, the
``storage_hook`` slot) and reads nodes' public fields (``parent``, ``children``, ``size``,
``key``, ``namespace``, ``host_value``, ``deleted``); it never changes a node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import replace

import numpy as np

from ..cache.components import FULL
from ..cache.hiradix_cache import HiRadixCache
from ..cache.locks import LockReceipt
from ..cache.radix_key import RadixKey, as_radix_key, encode_namespace
from ..cache.tree_node import TreeNode
from ..host_pool import HostKVPool
from ..kv_geometry import KVGeometry
from ..storage import (HiCacheStorage, Namespace, PoolHitPolicy, PoolSpec, PoolTransfer, StorageConfig, consecutive,
                       create_storage, page_keys)
from ..workers import background_executor
from .digests import INFLIGHT, NEW, STORED, NodeDigests, PageDigests

log = logging.getLogger("hicache_jax.cache.storage")

TARGET_POOL = "target"
COMMIT_POOL = "commit"  # several ranks, sharded pools: one marker page per committed page group
# Several ranks: at most this many prefetches, L3 backup jobs and draining prefetches report
# per agreement step (the vector has a fixed width); the rest report at a later step.
_OP_BUDGET, _JOB_BUDGET, _DRAIN_BUDGET = 24, 32, 16
_EMPTY = np.zeros(0, np.int64)


class _BackupJob:
    __slots__ = ("node", "entries", "keys", "ids", "ok", "t0", "t_done", "done", "pin")

    def __init__(self, node, entries, keys: dict, ids: dict) -> None:
        self.node, self.entries, self.keys, self.ids = node, entries, keys, ids  # per pool
        self.pin: LockReceipt | None = None  # keeps the host pages until the storage copied them
        self.ok = np.zeros(len(ids[TARGET_POOL]), bool)  # per target page
        self.t0 = time.perf_counter()
        self.t_done = 0.0  # set by the backup thread when the storage has the pages
        self.done = threading.Event()


class PrefetchOperation:
    """One request's prefetch. Read-only for callers; ``status`` is one of:

    ``skipped`` (never started), ``querying`` (counting storage hits), ``loading`` (host pages
    reserved, reading), ``revoked`` (dropped; nothing attached), ``finished`` (after
    ``finish_prefetch``; ``storage_tokens`` is the result), ``closed`` (controller closed).

    ``reason`` says in words why it was skipped or revoked; a skipped one also has
    ``reason_code``: ``below_threshold`` (the continuation after what the tree holds is
    shorter than ``StorageConfig.prefetch_threshold_tokens``), ``not_backed_up``,
    ``host_budget``, ``namespace_unsupported`` or ``closed``.
    """

    def __init__(self, controller: "StorageController", key: RadixKey) -> None:
        self._ctrl = controller
        self.key = key
        self.status = "skipped"
        self.reason = ""  # why it was skipped or revoked, in words (with the numbers)
        self.reason_code = ""  # a skipped prefetch: the label of prefetch_skipped_total{reason}
        self.start = 0  # tokens of the key already backed up in the tree at prefetch time
        self.end = 0  # page-aligned end of the key
        self.storage_tokens = 0
        self.t0 = time.perf_counter()
        self._cond = threading.Condition()
        self._cancel = False
        self._anchor: TreeNode | None = None
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
        # and the part the controller still owns.
        self._side_ids: dict[str, np.ndarray] = {}
        self._side_reserved: dict[str, np.ndarray] = {}
        self._side_used: dict[str, int] = {}  # IO thread: window pages read per pool
        self._finalized = False
        # IO thread (under _cond):
        self._done_pages = 0
        self._io_finished = False
        # Several ranks (owner thread): what every rank agreed on, and this step's reservation.
        self._agreed_hit: int | None = None
        self._agreed_done = 0
        self._agreed_finished = False
        self._agreed_late = False
        self._reservation: tuple[int, np.ndarray | None] | None = None
        self._t_done: float | None = None  # query or IO thread: when its last storage call ended

    @property
    def requested_tokens(self) -> int:
        return self.end - self.start

    @property
    def hit_tokens(self) -> int | None:
        """Storage hit (tokens after ``start``) once the query finished, else None."""
        with self._cond:
            return None if self._hit_pages is None else self._hit_pages * self._ctrl.page_size

    @property
    def loaded_tokens(self) -> int:
        with self._cond:
            return self._done_pages * self._ctrl.page_size

    def __repr__(self) -> str:
        return (f"PrefetchOperation(status={self.status}, start={self.start}, end={self.end}, "
                f"hit={self.hit_tokens}, loaded={self.loaded_tokens}, storage_tokens={self.storage_tokens})")


class StorageController:
    """Wires an L3 store into a ``HiRadixCache``. See the module docstring for the contract."""

    def __init__(self, cache: HiRadixCache, storage_config: StorageConfig | None = None, *, model: str,
                 weights_revision: str = "", tp_size: int | None = None, tp_rank: int | None = None, salt: str = "",
                 storage: HiCacheStorage | None = None, batch_pages: int = 128,
                 max_inflight_fraction: float = 0.5) -> None:
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
        if isinstance(max_inflight_fraction, bool) or not isinstance(max_inflight_fraction, (int, float)) \
                or not 0 < max_inflight_fraction <= 1:
            raise ValueError(f"max_inflight_fraction: expected a number in (0, 1], got {max_inflight_fraction!r}")
        self.cache = cache
        self.config = storage_config
        self.page_size = cache.page_size
        self.batch_pages = batch_pages
        self.max_inflight_fraction = float(max_inflight_fraction)
        self.threshold = max(storage_config.prefetch_threshold_tokens, self.page_size)
        self.salt = salt
        agreement = cache.agreement
        self._agreed = cache.agreed
        tp_size = agreement.num_processes if tp_size is None else tp_size
        tp_rank = agreement.rank if tp_rank is None else tp_rank
        self.tp_rank = tp_rank
        engines = cache.components.engines
        comps = cache.components.components
        pool_names = {}
        for comp in engines:
            name = TARGET_POOL if comp == FULL else comp
            if name in pool_names.values() or name == COMMIT_POOL:
                raise ValueError(f"cache: sidecar {comp!r} clashes with the storage pool name {name!r}")
            pool_names[comp] = name
        self.pools = {pool_names[c]: engines[c].host_pool for c in engines}
        # Components whose pages are stored for the window before a hit's end only: pool ->
        # (component, window pages).
        self._trailing = {pool_names[c]: (comps[c], comps[c].l3_trailing_pages) for c in engines
                          if comps[c].l3_trailing_pages is not None}
        for pool, (comp, _wp) in self._trailing.items():
            if not comp.own_page_ids:
                raise ValueError(f"cache: component {comp.name!r} has a trailing-pages L3 policy but shares the "
                                 f"full page ids")
        # The other pools (draft, swa) first, the target last: its pages are written only after theirs.
        self._order = [n for n in self.pools if n != TARGET_POOL] + [TARGET_POOL]
        # Several ranks: a replicated pool (MLA latent KV) is the same on every rank; rank 0
        # alone writes it, under keys every rank shares (see the module docstring).
        self.replicated = {pool_names[c] for c, e in engines.items() if tp_size > 1 and e.geom.kind == "mla"}
        # Namespace template per pool: model identity with the KV geometry folded in.
        self._ns_base = {}
        for comp, eng in engines.items():
            g = eng.geom
            ident = f"{model}#{g.kind}:L{g.num_layers}:H{g.heads}:D{g.width}"
            shared = pool_names[comp] in self.replicated
            self._ns_base[pool_names[comp]] = Namespace.from_geometry(
                g, eng.host_pool.layout, model=ident, weights_revision=weights_revision, pool=pool_names[comp],
                tp_size=1 if shared else tp_size, tp_rank=0 if shared else tp_rank)  # validates model / revision / TP
        # Commit markers when a pool is sharded over several ranks: rank-independent keys.
        self.markers = tp_size > 1 and len(self.replicated) < len(engines)
        if self.markers:
            g = engines[FULL].geom
            ident = f"{model}#{g.kind}:L{g.num_layers}:H{g.heads}:D{g.width}"
            self._ns_base[COMMIT_POOL] = Namespace.from_geometry(
                g, engines[FULL].host_pool.layout, model=ident, weights_revision=weights_revision, pool=COMMIT_POOL,
                tp_size=tp_size, tp_rank=0)
            self.pools[COMMIT_POOL] = HostKVPool(KVGeometry.mla(1, 1, 1, 0, "float8_e4m3fn"), 1)
        # Pools read in full up to the hit (the trailing-pages ones are read per window).
        self._all_pools = [n for n in self.pools if n not in self._trailing]
        specs = [PoolSpec(n, PoolHitPolicy.TRAILING_PAGES, self._trailing[n][1]) if n in self._trailing
                 else PoolSpec(n) for n in self.pools]
        if storage is None:
            self.storage = create_storage(storage_config, self.pools, specs)
            self._owns_storage = True
        else:
            if not isinstance(storage, HiCacheStorage):
                raise TypeError(f"storage: expected a HiCacheStorage, got {type(storage).__name__}")
            if set(storage.codecs) != set(self.pools) or any(storage.codecs[n].pool is not p
                                                             for n, p in self.pools.items()):
                raise ValueError(f"storage: must be built over this cache's host pools {sorted(self.pools)}, "
                                 f"got pools {sorted(storage.codecs)}")
            for spec in specs:
                if storage.specs[spec.name] != spec:
                    raise ValueError(f"storage: pool {spec.name!r} must have the spec {spec}, got "
                                     f"{storage.specs[spec.name]}")
            self.storage = storage
            self._owns_storage = False
        self._ns_cache: dict[tuple, dict[str, Namespace] | None] = {}
        self._bad_ns_logged: set = set()
        self._digests = NodeDigests(lambda: cache.root, self.page_size, self._namespaces)  # reset replaces the root
        self._ops: dict[PrefetchOperation, None] = {}  # started, not finished; in start order
        self._draining: list[PrefetchOperation] = []  # finished while the IO thread still held pages
        self._backups: dict[_BackupJob, None] = {}  # in submission order
        self._backup_done: deque[_BackupJob] = deque()  # appended by the backup thread
        self._inflight_keys: set[bytes] = set()  # target keys queued for L3
        nice = storage_config.worker_nice  # the L3 threads yield cores to the scheduler (workers.py)
        self._query = background_executor("hicache-l3-query", nice)
        self._io = background_executor("hicache-l3-io", nice)
        self._writer = background_executor("hicache-l3-backup", nice)
        self._closed = False
        self._waiting_for: PrefetchOperation | None = None  # several ranks: reported first
        self._step_ops: list[PrefetchOperation] = []
        self._step_jobs: list[_BackupJob] = []
        self._step_drain: list[PrefetchOperation] = []
        self._threshold_skip_logged = False
        cache.storage_hook = self
        if self._agreed:
            cache.step_agreement.add(self)

    # ------------------------------------------------------------------ keys
    def _namespaces(self, radix_ns: tuple) -> dict[str, Namespace] | None:
        if radix_ns in self._ns_cache:
            return self._ns_cache[radix_ns]
        try:
            extra = encode_namespace(self.salt, radix_ns)
            out = {pool: replace(ns, extra_key=extra) for pool, ns in self._ns_base.items()}
        except TypeError as e:
            if radix_ns not in self._bad_ns_logged:
                self._bad_ns_logged.add(radix_ns)
                log.warning("L3: namespace %r is not supported (%s); its pages skip storage", radix_ns, e)
            out = None
        self._ns_cache[radix_ns] = out
        return out

    # ------------------------------------------------------------------ hooks (owner thread)
    def on_backup_acked(self, node: TreeNode) -> None:
        """A D2H backup of ``node`` (and its un-backed ancestors) was acknowledged: queue L3."""
        if self._closed:
            return
        try:
            self._queue_backup(node)
        except Exception:  # never break the cache's acknowledgement loop
            log.exception("L3: queueing a backup failed")

    def _queue_backup(self, node: TreeNode) -> None:
        root = self.cache.root
        if node is root or self._digests.get(node) is None:
            return
        chain = []
        n = node
        while n is not root:
            e = self._digests.valid(n)
            if e is None:
                e = self._digests.get(n)
            if e is None or e.state != NEW or n.host_value is None:
                break
            chain.append((n, e))
            n = n.parent
        if not chain:
            return
        chain.reverse()
        ids = np.concatenate([n.host_value for n, _ in chain]).astype(np.int64)
        keys = {pool: [k for _, e in chain for k in e.digests[pool]] for pool in self._all_pools}
        keep = np.array([k not in self._inflight_keys for k in keys[TARGET_POOL]], bool)
        if not keep.all():
            ids = ids[keep]
            keys = {pool: [k for k, f in zip(ks, keep) if f] for pool, ks in keys.items()}
        ids_by_pool = {pool: ids for pool in self._all_pools}
        for pool, (comp, _wp) in self._trailing.items():  # the component's own host pages, where it has them
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
        job = _BackupJob(node, [e for _, e in chain], keys, ids_by_pool)
        self._inflight_keys.update(keys[TARGET_POOL])
        job.pin = self.cache.pin_host(node)  # the host pages stay until the storage has copied them
        self._backups[job] = None
        self._writer.submit(self._run_backup, job)

    def poll(self) -> None:
        """Owner-thread progress: release finished L3 backups, start reads, reclaim pages.
        Several ranks: nothing (the agreement steps do it, on agreed values)."""
        if self._agreed:
            return
        try:
            self._reap_backups()
            for op in list(self._ops):
                self._advance(op)
            for op in list(self._draining):
                with op._cond:
                    finished = op._io_finished
                if finished:
                    self._draining.remove(op)
                    self._free(op)
        except Exception:
            log.exception("L3: poll failed")

    def on_reset(self) -> None:
        """The cache is about to drop every page: let L3 backups finish reading, drop anchors.
        (Several ranks: backup jobs still in flight end without their commit markers; ``flush``
        before a reset to keep them.)"""
        self._wait_backups(None)
        for op in self._ops:
            self._release_anchor(op)
        self._digests.clear()

    def reserved_host_pages(self) -> np.ndarray:
        """Host pages allocated for prefetches and not (yet) handed to the tree or freed."""
        parts = [op._reserved for op in self._ops if op._reserved.size]
        parts += [op._reserved for op in self._draining if op._reserved.size]
        return np.concatenate(parts) if parts else _EMPTY

    def reserved_component_host_pages(self, component: str) -> np.ndarray:
        """``reserved_host_pages`` of a trailing-pages pool's component (its own host pool)."""
        parts = [op._side_reserved[component] for op in (*self._ops, *self._draining)
                 if op._side_reserved.get(component, _EMPTY).size]
        return np.concatenate(parts) if parts else _EMPTY

    # ------------------------------------------------------------------ backups
    def _run_backup(self, job: _BackupJob) -> None:  # backup thread
        try:
            ok = np.ones(len(job.ids[TARGET_POOL]), bool)
            if len(job.ids[TARGET_POOL]):
                for pool in self._order:
                    if pool in self._trailing:
                        if len(job.ids[pool]) and not all(self.storage.batch_set(job.keys[pool], job.ids[pool], pool)):
                            ok[:] = False  # a window page missing: the job is retried
                        continue
                    if pool in self.replicated and self.tp_rank:
                        continue  # rank 0 writes the pages every rank shares
                    ok &= np.asarray(self.storage.batch_set(job.keys[pool], job.ids[pool], pool), bool)
            job.ok = ok
        except Exception:
            log.exception("L3: backup of %d pages failed", len(job.ids[TARGET_POOL]))
        finally:
            job.t_done = time.perf_counter()
            if not self._agreed:  # several ranks: reaped in agreed order instead
                self._backup_done.append(job)
            job.done.set()

    def _reap_backups(self) -> None:
        if self._agreed:  # every job this rank finished (after a wait), in submission order
            for job in [j for j in self._backups if j.done.is_set()]:
                self._reap(job, bool(job.ok.all()))
            return
        while self._backup_done:
            self._reap(self._backup_done.popleft(), None)

    def _reap(self, job: _BackupJob, stored: bool | None) -> None:
        """A finished job: drop its host pin, count it, mark its nodes stored or not
        (``stored``: the ranks' agreed outcome; None: this rank's)."""
        m = self.cache.metrics
        p = self.page_size
        self._backups.pop(job, None)
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

    def _wait_backups(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.perf_counter() + timeout
        for job in list(self._backups):
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if not job.done.wait(left):
                self._reap_backups()
                return False
        self._reap_backups()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued L3 backup is handed to the storage and the storage has made
        it durable. True if nothing is left pending. Several ranks: agreement steps until
        every job is agreed done (``timeout`` bounds only the storage's own flush: a deadline
        is a per-rank clock)."""
        if self._agreed:
            while self._backups:
                next(iter(self._backups)).done.wait(0.01)
                self.cache.agree_step()
            if self.markers and self.tp_rank == 0:
                self._writer.submit(lambda: None).result()  # the markers queued before it are written
            return bool(self.storage.flush(timeout))
        if not self._wait_backups(timeout):
            return False
        return bool(self.storage.flush(timeout))

    # ------------------------------------------------------------------ prefetch
    def _inflight_pages(self) -> int:
        n = 0
        for op in self._ops:
            n += op._reserved.size if op.status == "loading" else op.requested_tokens // self.page_size
        return n + sum(op._reserved.size for op in self._draining)

    def prefetch(self, key: object) -> PrefetchOperation:
        """Start prefetching the storage continuation of ``key`` (non-blocking; owner thread)."""
        self.cache.check_owner("StorageController.prefetch")
        key = as_radix_key(key)
        op = PrefetchOperation(self, key)
        cache = self.cache
        m = cache.metrics
        p = self.page_size
        n = len(key) - len(key) % p
        if self._closed:
            op.status = "closed"
            self._skip(op, "closed", "controller closed")
            return op
        self.poll()
        anchor, matched, anchor_m = cache.backed_up_prefix(key)
        op.start, op.end = matched, n
        code = reason = ""
        if anchor is not cache.root and anchor.host_value is None:
            code, reason = "not_backed_up", "the matched prefix is not backed up"
        elif n - matched < self.threshold:
            code = "below_threshold"
            reason = (f"continuation below the threshold: {n - matched} tokens after the {matched} the tree "
                      f"holds, < {self.threshold} (StorageConfig.prefetch_threshold_tokens, at least a page)")
        elif self._inflight_pages() >= self.max_inflight_fraction * cache.host_allocator.num_pages:
            code, reason = "host_budget", "prefetches in flight hold the host budget"
        else:
            ns = self._namespaces(key.namespace)
            if ns is None:
                code, reason = "namespace_unsupported", "namespace not supported"
        if code:
            self._skip(op, code, reason)
            return op
        op._ns = ns
        if anchor is not cache.root:
            e = self._digests.valid(anchor)
            if e is not None:
                k = anchor_m // p  # pages of the anchor inside the match
                op._prev = e.at(k - 1)
            op._anchor_pin = cache.pin_host(anchor)  # keeps the prefix the prefetch continues
            op._anchor = anchor
        op.status = "querying"
        self._ops[op] = None
        m.prefetch_calls += 1
        self._query.submit(self._run_query, op)
        return op

    def _skip(self, op: PrefetchOperation, code: str, reason: str) -> None:
        """``op`` never starts: record why (``op.reason_code`` / ``op.reason``), count it per
        reason (``prefetch_skipped_by_reason``) and log it (debug; the first threshold skip
        also at info, since it hides every storage hit of short prompts)."""
        op.reason_code, op.reason = code, reason
        m = self.cache.metrics
        m.prefetch_skipped += 1
        m.prefetch_skipped_by_reason[code] = m.prefetch_skipped_by_reason.get(code, 0) + 1
        if code == "below_threshold" and not self._threshold_skip_logged:
            self._threshold_skip_logged = True
            log.info("L3: prefetch skipped: %s; shorter continuations never read L3 (further skips are "
                     "logged at debug level)", reason)
        else:
            log.debug("L3: prefetch of %d tokens skipped: %s", op.requested_tokens, reason)

    def _run_query(self, op: PrefetchOperation) -> None:  # query thread
        keys: dict[str, list[bytes]] = {}
        hit = 0
        try:
            toks = op.key.token_ids
            for pool, ns in op._ns.items():
                prev = op._prev[pool] if op._prev is not None else None
                if prev is None and op.start:
                    prev = page_keys(ns, toks[:op.start])[-1]
                keys[pool] = page_keys(ns, toks[op.start:op.end], prev)
            n = len(keys[TARGET_POOL])
            # Several ranks: rank 0 alone checks the commit markers (it wrote them, so it sees
            # them at once even in a store that buffers per process); the hit is MIN-reduced.
            asked = [p for p in self._all_pools if p != COMMIT_POOL or self.tp_rank == 0]
            for s in range(0, n, self.batch_pages):
                if op._cancel:
                    break
                e = min(n, s + self.batch_pages)
                r = self.storage.exists_multi([PoolTransfer(pool, keys[pool][s:e]) for pool in asked])
                hit += r.hit_pages
                if r.hit_pages < e - s:
                    break
            if self._trailing and hit and not op._cancel:
                # The largest hit whose trailing windows are stored too (the storage's rule);
                # from a mid-tree anchor the whole window must come from storage.
                hit = self.storage.exists_multi([PoolTransfer(pool, ks[:hit]) for pool, ks in keys.items()]).hit_pages
                if op.start and hit < max(wp for _c, wp in self._trailing.values()):
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
            trailing = bool(op._side_ids)
            total = 0
            for s in range(0, n, self.batch_pages):
                if op._cancel:
                    break
                e = min(n, s + self.batch_pages)
                r = self.storage.get_multi([PoolTransfer(pool, op._keys[pool][s:e], ids[s:e])
                                            for pool in self._all_pools if pool != COMMIT_POOL])
                got = min(max(int(r.hit_pages), 0), e - s)
                total += got
                if not trailing:
                    with op._cond:
                        op._done_pages += got
                        op._cond.notify_all()
                if got < e - s:
                    break
            if trailing:
                done = self._read_windows(op, total)
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

    def _read_windows(self, op: PrefetchOperation, done: int) -> int:  # IO thread
        """Read each trailing-pages pool's window before ``done`` into its reserved host pages:
        ``done`` when every window arrived whole, else 0 (nothing of the prefetch counts)."""
        if not done or op._cancel:
            return 0
        used = {}
        for pool, sid in op._side_ids.items():
            wp = self._trailing[pool][1]
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

    def _advance(self, op: PrefetchOperation) -> None:
        """Owner thread: a finished query becomes a revoke or a read into reserved host pages."""
        if op.status != "querying":
            return
        with op._cond:
            hit = op._hit_pages
        if hit is None:
            return
        if hit * self.page_size < self.threshold:
            self._revoke(op, "storage hit below the threshold" if hit else "no storage hit", count=hit > 0)
            return
        ids = self.cache.reserve_host_pages(hit)
        if ids is None:
            # Host eviction freed what it could (pages under a backup or an L3 write stay
            # locked): read the part of the prefix that fits rather than nothing, when that is
            # still worth a read. The pages it freed would otherwise go unused.
            fit = self.cache.host_allocator.available
            if fit * self.page_size < self.threshold:
                self._revoke(op, "no host memory for the hit")
                return
            ids = self.cache.host_allocator.alloc(fit)  # hit_tokens still says what storage had
            self.cache.metrics.prefetch_truncated += 1
        side = {}
        for pool, (comp, wp) in self._trailing.items():
            sid = self.cache.reserve_component_host_pages(comp.name, min(wp, ids.size))
            if sid is None:
                self.cache.host_allocator.free(ids)
                for taken_pool, taken in side.items():
                    self._trailing[taken_pool][0].host_allocator.free(taken)
                self._revoke(op, f"no {comp.name} host memory for the window")
                return
            side[pool] = sid.astype(np.int64)
        op._ids = op._reserved = ids.astype(np.int64)
        op._side_ids = side
        op._side_reserved = {self._trailing[pool][0].name: sid for pool, sid in side.items()}
        op.status = "loading"
        self._io.submit(self._run_io, op)

    def _release_anchor(self, op: PrefetchOperation) -> None:
        if op._anchor is not None:
            self.cache.unpin_host(op._anchor_pin)  # a no-op after a reset
            op._anchor = op._anchor_pin = None

    def _free(self, op: PrefetchOperation) -> None:
        if op._reserved.size:
            self.cache.host_allocator.free(op._reserved)
            op._reserved = _EMPTY
        for name, sid in op._side_reserved.items():
            if sid.size:
                self.cache.components.components[name].host_allocator.free(sid)
        op._side_reserved = {}

    def _revoke(self, op: PrefetchOperation, reason: str, count: bool = True) -> None:
        with op._cond:
            op._cancel = True
        op.status, op.reason = "revoked", reason
        self._ops.pop(op, None)
        if count:
            self.cache.metrics.prefetch_revoked += 1
        log.debug("L3: prefetch revoked: %s", reason)
        self._release_anchor(op)

    def _deadline(self, op: PrefetchOperation) -> float:
        with op._cond:
            hit = op._hit_pages
        tokens = op.requested_tokens if hit is None else hit * self.page_size
        return op.t0 + self.config.prefetch_timeout(tokens)

    def _complete(self, op: PrefetchOperation) -> bool:
        """Nothing more will arrive (revoked, or the read stopped)."""
        if op.status != "loading":
            return op.status != "querying"
        with op._cond:
            return op._io_finished

    def prefetch_ready(self, op: PrefetchOperation) -> bool:
        """Whether ``finish_prefetch(op)`` would return without waiting under the policy
        (several ranks: as of the last agreement step, the same answer on every rank)."""
        self.cache.check_owner("StorageController.prefetch_ready")
        self._check_op(op)
        if self._agreed:
            policy = self.config.prefetch_policy
            return policy == "best_effort" or self._agreed_complete(op) or policy == "timeout" and op._agreed_late
        self._advance(op)
        policy = self.config.prefetch_policy
        if policy == "best_effort" or self._complete(op):
            return True
        return policy == "timeout" and time.perf_counter() >= self._deadline(op)

    def _check_op(self, op: object) -> PrefetchOperation:
        if not isinstance(op, PrefetchOperation):
            raise TypeError(f"op: expected a PrefetchOperation, got {type(op).__name__}")
        if op._ctrl is not self:
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
        if op._finalized:
            raise ValueError(f"op: already finished ({op.status})")
        op._finalized = True
        if op.status not in ("querying", "loading"):  # skipped / revoked / closed
            self._ops.pop(op, None)
            if op.status == "revoked":
                self._account(op, 0)
            return 0
        if self._agreed:
            return self._finish_agreed(op)
        policy = self.config.prefetch_policy
        timed_out = False
        if policy != "best_effort":
            while True:
                self._advance(op)
                if self._complete(op):
                    break
                left = None
                if policy == "timeout":
                    left = self._deadline(op) - time.perf_counter()
                    if left <= 0:
                        timed_out = True
                        break
                with op._cond:
                    if op.status == "querying" and op._hit_pages is None or \
                            op.status == "loading" and not op._io_finished:
                        op._cond.wait(0.05 if left is None else min(left, 0.05))
        with op._cond:
            op._cancel = True
            done = op._done_pages if op.status == "loading" else 0
            io_finished = op._io_finished
            # Completion: the last storage call's end; now, if the policy cut the op short.
            t_end = op._t_done if (io_finished or op.status == "revoked") and op._t_done is not None else None
        if timed_out:
            self.cache.metrics.prefetch_timeouts += 1
        self._ops.pop(op, None)
        attached = 0
        if op.status == "loading":
            got, rest = op._ids[:done], op._ids[done:]
            op._reserved = rest
            side_pages = None
            if op._side_ids:  # the windows that arrived go with the pages (done > 0 only then)
                side_pages = {}
                keep_side = {}
                for pool, sid in op._side_ids.items():
                    name = self._trailing[pool][0].name
                    cnt = op._side_used.get(pool, 0) if done else 0
                    arr = np.full(done, -1, np.int64)
                    if cnt:
                        arr[done - cnt:] = sid[:cnt]
                    side_pages[name] = arr
                    keep_side[name] = sid[cnt:]
                op._side_reserved = keep_side
            if rest.size or any(x.size for x in op._side_reserved.values()):
                if io_finished:
                    self._free(op)
                else:
                    self._draining.append(op)  # freed by poll once the IO thread lets go
            if done * self.page_size < self.threshold:
                if done:
                    self.cache.host_allocator.free(got)
                    for name, arr in (side_pages or {}).items():
                        if (arr >= 0).any():
                            self.cache.components.components[name].host_allocator.free(arr[arr >= 0])
                self.cache.metrics.prefetch_revoked += 1
                op.status, op.reason = "revoked", "arrived below the threshold"
            else:
                attached, leaf = self.cache.insert_host(op.key, got, op.start, side_pages)
                if leaf is not None:
                    k = attached // self.page_size
                    self._digests.set(leaf, PageDigests({pool: ks[done - k:done] for pool, ks in op._keys.items()},
                                                        STORED))  # it came from L3
                else:
                    self.cache.metrics.prefetch_revoked += 1
                    op.reason = "the tree no longer connects"
                op.status = "finished"
            self.cache.metrics.prefetched_tokens += done * self.page_size
        elif op.status == "querying":  # nothing was reserved yet
            op.status, op.reason = "revoked", "stopped before the storage answered"
        self._release_anchor(op)
        self._account(op, attached, t_end)
        return attached

    def _account(self, op: PrefetchOperation, attached: int, t_end: float | None = None) -> None:
        op.storage_tokens = attached
        m = self.cache.metrics
        m.prefetch_attached_tokens += attached
        if t_end is None:
            with op._cond:
                t_end = op._t_done
        m.prefetch_duration_seconds.observe((t_end if t_end is not None else time.perf_counter()) - op.t0)

    def cancel(self, op: PrefetchOperation) -> None:
        """Drop a prefetch whose request will not be scheduled (frees everything it holds)."""
        self.cache.check_owner("StorageController.cancel")
        self._check_op(op)
        if op._finalized:
            return
        op._finalized = True
        self._ops.pop(op, None)
        with op._cond:
            op._cancel = True
            io_finished = op._agreed_finished if self._agreed else op._io_finished
        if op.status == "loading" and not io_finished:
            self._draining.append(op)
        else:
            self._free(op)
        if op.status in ("querying", "loading"):
            op.status, op.reason = "revoked", "cancelled"
        self._release_anchor(op)

    # ------------------------------------------------------------------ several ranks
    def _agreed_complete(self, op: PrefetchOperation) -> bool:
        if op.status == "loading":
            return op._agreed_finished
        return op.status != "querying"

    def _finish_agreed(self, op: PrefetchOperation) -> int:
        """``finish_prefetch`` with several ranks: only agreed values decide (the loop's exit
        condition is agreed state, so every rank runs the same number of steps)."""
        policy = self.config.prefetch_policy
        m = self.cache.metrics
        timed_out = False
        if policy != "best_effort":
            self._waiting_for = op  # reported first, so the wait cannot starve
            try:
                while not self._agreed_complete(op):
                    if policy == "timeout" and op._agreed_late:
                        timed_out = True
                        break
                    with op._cond:  # a local pause; the decision is the next step's
                        op._cond.wait(0.002)
                    self.cache.agree_step()
            finally:
                self._waiting_for = None
        with op._cond:
            op._cancel = True
        if timed_out:
            m.prefetch_timeouts += 1
        self._ops.pop(op, None)
        attached = 0
        if op.status == "loading":
            done = op._agreed_done
            got, rest = op._ids[:done], op._ids[done:]
            op._reserved = rest
            if rest.size:
                if op._agreed_finished:
                    self._free(op)
                else:
                    self._draining.append(op)  # freed once every rank's read let go (agreed)
            if done * self.page_size < self.threshold:
                if done:
                    self.cache.host_allocator.free(got)
                m.prefetch_revoked += 1
                op.status, op.reason = "revoked", "arrived below the threshold"
            else:
                attached, leaf = self.cache.insert_host(op.key, got, op.start)
                if leaf is not None:
                    k = attached // self.page_size
                    self._digests.set(leaf, PageDigests({pool: ks[done - k:done] for pool, ks in op._keys.items()},
                                                        STORED))  # it came from L3
                else:
                    m.prefetch_revoked += 1
                    op.reason = "the tree no longer connects"
                op.status = "finished"
            m.prefetched_tokens += done * self.page_size
        elif op.status == "querying":  # nothing reserved outside a step (best_effort, or a timeout)
            op.status, op.reason = "revoked", "stopped before the ranks agreed on the storage hit"
        self._release_anchor(op)
        self._account(op, attached)
        return attached

    def prepare(self) -> None:
        """``StepAgreement`` participant: pick what reports this step (in start order, the
        operation ``finish_prefetch`` waits for first) and reserve host pages for the hits
        agreed at the last step (the reserve of reserve -> agree -> commit)."""
        ops = []
        waiting = self._waiting_for
        if waiting is not None and waiting in self._ops:
            ops.append(waiting)
        for op in self._ops:
            if len(ops) >= _OP_BUDGET:
                break
            if op is not waiting and (op.status == "querying" or op.status == "loading" and not op._agreed_finished):
                ops.append(op)
        self._step_ops = ops
        min_pages = -(-self.threshold // self.page_size)
        for op in ops:
            if op.status == "querying" and op._agreed_hit is not None:
                op._reservation = self.cache.reserve_host_pages_agreed(op._agreed_hit, min_pages)
        self._step_jobs = list(self._backups)[:_JOB_BUDGET]
        self._step_drain = self._draining[:_DRAIN_BUDGET]

    def report(self, out: list[int]) -> None:
        """This rank's outcomes: per operation its storage hit (-1 until the query answered),
        whether its reservation succeeded, or its pages read, whether the read finished and
        (negated: a MAX) whether its deadline passed; per backup job 0 running / 1 failed /
        2 stored; per draining operation whether its read let go of its pages."""
        now = time.perf_counter()
        for op in self._step_ops:
            if op.status == "querying":
                if op._agreed_hit is None:
                    with op._cond:
                        hit = op._hit_pages
                    out.append(-1 if hit is None else hit)
                else:
                    n, ids = op._reservation
                    out.append(1 if n and ids is not None else 0)
            else:
                with op._cond:
                    done, finished = op._done_pages, op._io_finished
                late = self.config.prefetch_policy == "timeout" and now >= self._deadline(op)
                out.extend((done, 1 if finished else 0, -1 if late else 0))
        for job in self._step_jobs:
            out.append(0 if not job.done.is_set() else 2 if job.ok.all() else 1)
        for op in self._step_drain:
            with op._cond:
                out.append(1 if op._io_finished else 0)

    def apply(self, agreed) -> None:
        """Act on the agreed values, the same way on every rank."""
        m = self.cache.metrics
        p = self.page_size
        i = 0
        for op in self._step_ops:
            if op.status == "querying":
                a = int(agreed[i])
                i += 1
                if op._agreed_hit is None:
                    if a >= 0:
                        op._agreed_hit = a
                        if a * p < self.threshold:
                            self._revoke(op, "storage hit below the threshold" if a else "no storage hit", count=a > 0)
                    continue
                (n, ids), op._reservation = op._reservation, None
                if a:
                    self.cache.settle_host_pages(n, ids, True)
                    op._ids = op._reserved = ids.astype(np.int64)
                    if n < op._agreed_hit:
                        m.prefetch_truncated += 1  # the part of the prefix the host could hold
                    op.status = "loading"
                    self._io.submit(self._run_io, op)
                else:
                    if n:
                        self.cache.settle_host_pages(n, ids, False)
                    self._revoke(op, "no host memory for the hit" if not n else "a rank could not reserve host pages")
            else:
                op._agreed_done = int(agreed[i])
                op._agreed_finished = bool(agreed[i + 1])
                op._agreed_late = op._agreed_late or bool(agreed[i + 2])
                i += 3
        for job in self._step_jobs:
            a = int(agreed[i])
            i += 1
            if a:
                self._reap(job, a == 2)
                if a == 2 and self.markers and self.tp_rank == 0 and len(job.ids[TARGET_POOL]):
                    self._writer.submit(self._write_markers, job.keys[COMMIT_POOL])
        for op in self._step_drain:
            if agreed[i]:
                self._draining.remove(op)
                self._free(op)
            i += 1
        self._step_ops, self._step_jobs, self._step_drain = [], [], []

    def _write_markers(self, keys: list[bytes]) -> None:  # backup thread, rank 0
        try:
            ok = self.storage.batch_set(keys, np.zeros(len(keys), np.int64), COMMIT_POOL)
            if not all(ok):
                log.warning("L3: %d of %d commit markers not written", len(ok) - sum(ok), len(ok))
        except Exception:
            log.exception("L3: writing %d commit markers failed", len(keys))

    # ------------------------------------------------------------------ lifecycle
    # The store's counters (``storage.metrics``) under the cache's metric family names
    # (``hicache_jax.cache.metrics.FAMILIES``): one naming scheme, pages counted as pages.
    _STORE_FAMILIES = {
        "hits": "storage_read_hit_pages", "misses": "storage_read_miss_pages", "corrupt": "storage_corrupt_pages",
        "read_errors": "storage_read_errors", "quarantined": "storage_quarantined_files",
        "verified": "storage_verified_pages", "bytes_read": "storage_read_bytes", "read_seconds": "storage_read_seconds",
        "pages_written": "storage_written_pages", "bytes_written": "storage_written_bytes",
        "write_seconds": "storage_write_seconds", "write_errors": "storage_write_errors",
        "pages_dropped": "storage_dropped_pages", "sets_skipped": "storage_duplicate_pages",
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
            "prefetches_in_flight": len(self._ops),
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
        try:  # D2H backups still in flight: acknowledge them so their L3 writes are queued too
            if self._agreed:  # agree on the last copies and jobs while every rank still steps
                self.cache.flush()
                self.flush()
            else:
                self.cache.writing_check(block=True)
        except Exception:
            log.exception("L3: acknowledging backups at close failed")
        self._closed = True
        if self._agreed:
            self.cache.step_agreement.remove(self)
        for op in list(self._ops):
            self.cancel(op)
            op.status, op.reason = "closed", "controller closed"
        self._query.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=True, cancel_futures=True)
        for op in self._draining:
            self._free(op)
        self._draining.clear()
        self._writer.shutdown(wait=True)
        self._reap_backups()
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
