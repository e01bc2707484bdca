"""HiRadixCache: a radix tree over token pages with a device tier (L1) and a host tier (L2).

Pure Python + numpy; the KV bytes are moved by ``KVTransferEngine``s (numpy, JAX or torch),
and only integer page ids cross into them: ids the cache owns, through the engines'
``backup_owned`` / ``load_owned`` (an engine may skip re-validating those). This class is the
facade: every public entry point validates its caller's input before anything changes, then
hands the work to the module that owns it:

=====================  =======================================================================
module                 job
=====================  =======================================================================
``tree``               structure: root, clock, walk, split, attach, unlink (no residency)
``tree_node``          one node's fields, grouped by the module that owns them
``residency``          the full component's pages per node, ownership bitmaps, token
                       counters, eviction-index membership
``eviction_index``     candidates of one tier, lazily ordered by ...
``eviction_policies``  ... a strategy: lru, lfu, fifo, mru, priority
``locks``              every path-lock walk, lock receipts, the callers' locks
``lookup``             ``match_prefix`` / ``peek_prefix``
``insert``             ``insert`` (duplicates, revival, hits, priority) and ``insert_host``
``write_policy``       when to back up (write_through[_selective], write_back)
``decisions``          the choices that differ from upstream's, resolved from the config
``backup``             issuing a backup (chain, host pages, marking, ack at issue)
``load_back``          issuing a load-back (chain, device pages, locks)
``evictor``            eviction on both tiers, allocation with eviction
``host_reservations``  host pages reserved for a caller (an L3 prefetch), one rank or several
``copies_in_flight``   copies in flight: acknowledgement through ``agreement``, retries,
                       the failure latch
``request_helpers``    ``begin_request`` / ``cache_unfinished_req`` / ``cache_finished_req``
``call_gate``          the owner thread, the failure latch's refusal of calls, ``close``
``assembly``           the parts above, built and wired together (``__init__``), emptied
                       together (``reset``)
``components``         the KV components (full, sidecars, stateful plug-ins) and their hooks
``debug_view``         a read-only view for invariant checks (``invariants``) and tests
``residency_watch``    observers of pages arriving on / leaving a tier (``add_watch``); off
                       (one ``None`` test per hook site) while none is attached
``events``,            KV events (schema 1) for routers, from such a watch: stored / removed
``event_source``       / cleared per tier, keyed by the L3's chained page keys
``retention``          soft retention (``enable_retention``, ``retain=`` hints): a bounded,
                       expiring LRU bonus per prefix within a per-namespace token budget
``arguments``          the checks of the public calls' arguments
``results``, ``errors``  what the public calls return and raise; ``cache_request``: ``CacheRequest``
=====================  =======================================================================

Contract
========

Who allocates device pages
    The caller (the scheduler). It takes pages from the device allocator, directly or via
    ``alloc_device`` (which evicts unlocked leaves when the pool is short), writes KV into
    them, and hands them to ``insert``. From then on the tree owns them.

Who frees duplicates on insert
    The cache (see ``insert``). The trailing partial page of a key is never cached:
    ``cache_finished_req`` frees it, ``cache_unfinished_req`` leaves it with the request.

What is locked when (``locks``)
    * ``inc_lock_ref(node)`` / ``dec_lock_ref(receipt or node)``: a caller's device path lock
      (node up to the root). A locked node is never evicted from the device; callers lock
      the ``last_device_node`` of a match for as long as they use the matched pages.
      ``inc_lock_ref`` returns the lock's receipt; ``dec_lock_ref`` releases exactly that
      receipt, or, given a node, one lock a caller took on that very node (by
      ``inc_lock_ref`` or a request helper): never a transfer's or the L3 controller's.
    * A backup (D2H) holds a device and a host path lock on its deepest node from issue
      until ``writing_check`` sees it done, so neither copy is freed mid-transfer. A backup
      the engine reports done and successful when issued, with no earlier backup waiting,
      is acknowledged at once and takes no locks.
    * A load-back (H2D) holds the same two locks from issue until ``loading_check`` sees it
      done. The loaded pages appear in ``match_prefix`` at once; a forward pass must wait on
      the handle (per layer) before reading them, as upstream.
    * Host eviction skips host-locked nodes; device eviction skips device-locked nodes.

Which thread may call what
    Every method runs on one owner thread (the scheduler's). The cache is not thread-safe.
    The owner is the first thread that calls a checked method (construction does not count,
    so an engine may build the cache on its main thread and serve from a scheduler thread);
    a checked call from any other thread raises ``OwnerThreadError`` before anything changes
    (one thread-id compare per call). ``release_owner()`` (on the owner) hands the cache to
    whichever thread calls next; ``HiCacheConfig(check_owner_thread=False)`` turns the check
    off. ``check_owner(call)`` runs the same check for a caller's own entry points (the L3
    controller's). Read-only snapshots (``stats``, ``gauges``, the Prometheus export, the
    token-count properties) may be read from any thread; they are not checked. Engines may
    run copies on their own workers; the cache only polls their handles, from the owner
    thread, in ``writing_check`` / ``loading_check`` / ``check_events``.

L3 surface (used by ``hicache_jax.l3``, nothing else of the cache)
    ``storage_hook``: ``None`` unless a ``StorageController`` attaches itself. Then, on the
    owner thread: each acknowledged backup calls ``on_backup_acked(node)`` (before the
    backup's locks drop, or, for a backup acknowledged when issued, within the insert that
    made it; it may only take host locks and queue work), ``writing_check`` and
    ``check_events`` call ``poll()``, ``reset`` calls ``on_reset()`` before freeing pages, and
    ``sanity_check`` counts ``reserved_host_pages()`` as accounted for. The controller uses
    ``backed_up_prefix`` (read-only walk), ``pin_host`` / ``unpin_host`` (host lock receipts),
    ``reserve_host_pages`` (host pages for a prefetch, evicting host leaves) and
    ``insert_host`` (attach prefetched pages).

Failed copies (``copies_in_flight``)
    A copy that fails is issued again up to ``config.transfer_retries`` times when
    acknowledged; then the cache stops: every call raises ``CacheFailedError`` until
    ``reset()``, which empties it (and forgets callers' locks: they must abandon their
    requests). The refusal is installed when the latch closes (``call_gate``), so the
    public calls check nothing while it is open.

Across processes (``agreement``, ``step_agreement``)
    With several ranks (tensor-parallel processes, each holding its shard of every page and
    its own copy of this tree), every tree mutation must be a function of values identical
    on all ranks. ``agreement`` (default ``SingleProcessAgreement``, the identity) decides
    the mode. When it is ``collective``:

    * ``check_events`` runs one ``StepAgreement.step`` every call, unconditionally: the
      per-rank outcomes (copies finished and successful, host allocations that succeeded,
      and whatever the L3 controller and the engine register) are agreed in one fixed-shape
      MIN, and acted on alike by every rank;
    * ``writing_check`` / ``loading_check`` run one step (blocking: after waiting for every
      local copy); ``flush`` runs blocking steps until nothing is in flight or reserved;
      ``agree_step`` runs one step for a caller's own blocking wait (the L3 controller's);
    * a backup the write policy wants is reserved, agreed and committed at the next step
      (``backup.AgreedBackups``); write_back's backup inside an eviction agrees on its own;
    * a copy that fails for good on any rank latches every rank at the same step;
    * components with their own page ids (``swa``) take part: their host pages are reserved
      with each backup's and agreed beside them (``backup``; a part some rank could not get
      leaves component host tombstones on every rank), ``slide_window`` records this rank's
      length and the step slides to the MIN over ranks (``component_steps``), and the L3
      controller reserves their host pages with ``reserve_component_host_pages_agreed`` /
      ``settle_component_host_pages``. The digest covers their state.

    Device allocations (``alloc_device``, a load-back's pages) need no agreement: the device
    allocator changes only at agreed points, so it is identical on every rank. Every rank
    must call the public methods in the same order with the same arguments (the scheduler's
    decisions are functions of agreed state too). ``debug_view().digest()`` is the tree's
    digest: equal across ranks after every step.

Sliding-window (SWA) requests (``components.swa``; generic over components with their own page ids)
    A hybrid model's sliding-window layers keep their KV in the ``SWAComponent``'s own pools
    (``components=[SWAComponent(swa_engine, swa_engine.device_pool.allocator, window)]``).
    Matches are usable only where the window before their end has SWA KV (see the
    component); the call sequence of an engine (``tests/cache/swa_harness.py``'s
    ``SWADriver`` runs it on the numpy backend):

    1. admission: ``req, lb = begin_request(prompt[:-1])`` (match, load-back of the host /
       L3 continuation: full pages and only the window's SWA pages, lock); wait for ``lb``'s
       layers of both pools (``lb.handle.wait_layer(i)`` for the full layers,
       ``lb.handle.wait_layer(j, component="swa")`` for the SWA ones); ``req.device_pages``
       is the prefix's full page table, ``req.component_pages["swa"]`` its SWA page table
       (the window's pages, -1 elsewhere); trim ``req.key`` to the prefix it holds.
    2. each prefill chunk and each decode step: ``alloc_device(n)`` and
       ``alloc_component("swa", n)`` for the new pages (each pool evicts by its own rules:
       SWA allocation tombstones nodes or evicts unlocked leaves whole; on failure free what
       was taken), ``req.extend(key, pages, {"swa": swa_pages})`` (a decode step:
       ``req.append([token], pages, {"swa": swa_pages})``), run the forward pass,
       then ``slide_window(req)``: the request's own SWA pages wholly before the window
       (of its next pass and of its whole pages' end) are freed and set to -1, and once the
       window lies past the tree's part, its lock's hold on the tree's SWA pages goes (the
       full lock stays). A chunk ends with ``cache_unfinished_req(req, chunked=True)``
       (the tree takes or frees every SWA id the request passes; it re-reads the tree's
       window ids into ``component_pages``).
    3. finish: ``cache_finished_req(req)`` (inserts: out-of-window spans become tombstones,
       the window leaf is capped at ``window_pages`` pages; frees the partial
       tail page of both pools). Abort: free the request's own pages of both pools (entries
       from ``cached_pages`` on, ids >= 0) and ``dec_lock_ref(req.last_node)``.

    Raw calls take the same per-component ids: ``insert(..., component_pages=)``,
    ``insert_host(..., component_pages=)`` (L3), ``reserve_component_host_pages`` (with
    ranks: ``reserve_component_host_pages_agreed`` / ``settle_component_host_pages``),
    ``sanity_check(external, {"swa": n})``. With no such component registered every hook
    stays off the full component's paths (one empty tuple).
"""

from __future__ import annotations

from threading import get_ident
from typing import Mapping, Sequence

import numpy as np

from .._checks import check_int
from ..allocator import PageAllocator, check_page_ids
from ..transfer import KVTransferEngine
from .agreement import Agreement, SingleProcessAgreement
from .arguments import (
    check_component_pages,
    check_external_pages,
    check_flag,
    check_host_attach,
    check_priority,
    check_retain,
    check_retention_config,
    own_component,
)
from .assembly import assemble
from .call_gate import CallGate
from .components import ComponentRegistry, KVComponent
from .config import HiCacheConfig
from .debug_view import CacheDebugView
from .errors import CacheClosedError, CacheFailedError, CacheInvariantError, OwnerThreadError
from .eviction_index import EvictionIndex
from .locks import LockReceipt
from .metrics import CacheMetrics, build_info, cache_stats, occupancy
from .radix_key import as_radix_key
from .cache_request import CacheRequest
from .residency_watch import ResidencyWatch, WatchSet
from .results import DeviceFit, InsertResult, LoadBackResult, MatchResult
from .step_agreement import StepAgreement
from .tree_node import TreeNode

__all__ = [
    "CacheClosedError",
    "CacheFailedError",
    "CacheInvariantError",
    "DeviceFit",
    "HiRadixCache",
    "InsertResult",
    "LoadBackResult",
    "MatchResult",
    "OwnerThreadError",
]


class HiRadixCache(CallGate):
    """A radix tree over token pages whose KV lives on the device (L1) and the host (L2), with
    an optional L3 behind it (``hicache_jax.l3.StorageController``).

    Build it with ``HiRadixCache(HiCacheConfig(page_size=...), engine, device_allocator)``:
    ``engine`` moves KV pages between a device pool and the host pool it owns (e.g.
    ``JaxTransferEngine(JaxDevicePool(...), host_pool)``), ``device_allocator`` is that device
    pool's page allocator (the scheduler and the cache share it). The host pool must be empty:
    the cache owns every host page.

    Per request (the helpers; ``match_prefix`` / ``insert`` / ``inc_lock_ref`` are the raw calls):

    1. ``req, load = begin_request(prompt_key)``: match, load back the host continuation,
       lock the prefix. ``req.device_pages`` is the cached prefix's page table; wait on
       ``load`` (per layer) before reading loaded pages. ``req.hit_tokens`` says how many of
       its tokens each tier served.
    2. ``pages = alloc_device(n)`` for the rest (evicts unlocked leaves when short; None when
       it cannot: ``device_fit(n)`` says whether it never can or cannot now),
       ``req.extend(key, pages)``, run the model on the uncached suffix; per decode step
       ``req.append([token], pages)`` (the new token only, and a page when it starts one: O(1),
       where ``extend`` with the grown key copies and compares every token).
    3. ``cache_finished_req(req)``: insert its whole pages, free the partial tail, unlock
       (``cache_unfinished_req`` after a chunk). A request given up on (client gone):
       ``abort_request(req)`` frees what it holds and inserts nothing.

    Call ``check_events()`` once per scheduler step, busy or idle: it acknowledges finished
    copies (until then their pages stay locked and counted in flight) and lets an attached
    L3 controller make progress. ``flush()`` waits for every copy; ``reset()`` empties the
    cache. One thread makes every call (the owner: see the module docstring, "Which thread
    may call what"). A copy that fails after its retries stops the cache
    (``CacheFailedError`` on every call until ``reset``). ``stats()`` / ``register_prometheus``
    report the metrics; ``sanity_check`` verifies the invariants. The module docstring has
    the full contract (who allocates and frees, what is locked when, several ranks, sliding
    windows).
    """

    def __init__(
        self,
        config: HiCacheConfig,
        engine: KVTransferEngine,
        device_allocator: PageAllocator,
        sidecars: Mapping[str, KVTransferEngine] | None = None,
        *,
        components: Sequence[KVComponent] = (),
        agreement: Agreement | None = None,
    ) -> None:
        if not isinstance(config, HiCacheConfig):
            raise TypeError(f"config: expected a HiCacheConfig, got {type(config).__name__}")
        self.components = ComponentRegistry(engine, device_allocator, sidecars, components)
        if config.page_size != self.components.page_size:
            raise ValueError(
                f"config: page_size {config.page_size} != the KV geometry's page_size {self.components.page_size}"
            )
        host_alloc = self.components.host_allocator
        if host_alloc.used:
            raise ValueError(
                f"engine: the host pool must start empty (the cache owns it), {host_alloc.used} pages are in use"
            )
        if agreement is None:
            agreement = SingleProcessAgreement()
        if not isinstance(agreement, Agreement):
            raise TypeError(f"agreement: expected an Agreement, got {type(agreement).__name__}")
        self.config = config
        self._open_gate(config.check_owner_thread)  # the owner thread (module docstring), open
        self.build_info = build_info(engine)  # the build_info metric's labels
        self.page_size = config.page_size
        self.device_allocator = device_allocator
        self.host_allocator = host_alloc
        self.write_policy = config.write_policy
        self.metrics = CacheMetrics()
        self._retention = None  # ``retention.enable_retention``
        self.agreement = agreement
        self.agreed = agreement.collective  # several ranks: the agreed protocol (module docstring)
        parts = assemble(self, config, self.components, device_allocator, agreement, self.metrics, self._refuse_calls)
        self._res, self._tree, self._locks, self._callers = parts.res, parts.tree, parts.locks, parts.callers
        self._ledger, self._evictor, self._backups = parts.ledger, parts.evictor, parts.backups
        self._watches = WatchSet(self._res)  # ``add_watch``; ``res.watch`` is their combination
        self._inserter, self._lookup, self._load_backs = parts.inserter, parts.lookup, parts.load_backs
        self._requests, self._reservations, self._steps = parts.requests, parts.reservations, parts.steps
        self._stateful, self._own = parts.stateful, parts.own
        self._device_only_host_copies = parts.device_only_host_copies
        self._agreed_backups, self._component_steps = parts.agreed_backups, parts.component_steps
        self._parts = parts
        self.decisions = parts.decisions  # the choices that differ from upstream's
        self.root = parts.tree.root  # replaced by reset (a plain attribute: harnesses read it per request)

    # ------------------------------------------------------------------ state, read-only
    @property
    def evictable_tokens(self) -> int:
        """Tokens on the device that no lock protects."""
        return self._res.evictable_tokens

    @property
    def protected_tokens(self) -> int:
        """Tokens on the device under at least one device lock."""
        return self._res.protected_tokens

    @property
    def host_tokens(self) -> int:
        """Tokens held on the host tier."""
        return self._res.host_tokens

    @property
    def device_lru(self) -> EvictionIndex:
        """Device eviction candidates (unlocked device leaves)."""
        return self._res.device_index

    @property
    def host_lru(self) -> EvictionIndex:
        """Host eviction candidates (host-only leaves)."""
        return self._res.host_index

    @property
    def reclaim_lru(self) -> EvictionIndex:
        """Host copies of on-device nodes that host eviction may drop (``host_reclaim``)."""
        return self._res.reclaim_index

    @property
    def storage_hook(self):
        """The attached L3 controller, or None (see the module docstring)."""
        return self._ledger.storage_hook

    @storage_hook.setter
    def storage_hook(self, hook) -> None:
        self._ledger.storage_hook = hook

    @property
    def step_agreement(self) -> StepAgreement:
        """The per-step agreement (used when ``agreed``): the L3 controller and the engine
        register their per-rank outcomes with it (``add``); ``stats()`` counts its exchanges."""
        return self._steps

    @property
    def in_flight(self) -> tuple[int, int]:
        """(backups, load-backs) not yet acknowledged."""
        return self._ledger.in_flight

    @property
    def failure(self) -> CacheFailedError | None:
        """The latched copy failure (every call raises it until ``reset``), or None."""
        return self._ledger.failure

    def debug_view(self) -> CacheDebugView:
        """A read-only view of the internals, for ``sanity_check`` and tests."""
        return CacheDebugView(self, self._parts)

    # ------------------------------------------------------------------ residency watches
    def add_watch(self, watch: ResidencyWatch) -> None:
        """Attach an observer of pages arriving on / leaving each tier (``residency_watch``:
        KV events, retention). Owner thread; a watch is attached at most once."""
        if get_ident() != self._owner:
            self._not_owner("add_watch")
        self._watches.add(watch)

    def remove_watch(self, watch: ResidencyWatch) -> None:
        """Detach a watch ``add_watch`` attached (ValueError if it is not attached)."""
        if get_ident() != self._owner:
            self._not_owner("remove_watch")
        self._watches.remove(watch)

    def enable_retention(self, config):
        """Install soft retention (``retention``; LRU eviction only): from now on the device,
        host and reclaim indexes order by ``RetentionStrategy`` and ``retain=`` hints are
        accepted. Returns the ``retention.Retention`` (its ``stats()``)."""
        if get_ident() != self._owner:
            self._not_owner("enable_retention")
        from .retention import install

        check_retention_config(config, self.config.eviction_policy, self._retention is not None, self.agreed)
        self._retention = self._requests.retention = ret = install(self._res, config)
        self.add_watch(ret)
        return ret

    @property
    def retention(self):
        """The installed ``retention.Retention``, or None."""
        return self._retention

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: object) -> MatchResult:
        """Longest cached page-aligned prefix of ``key``; splits a node the match ends inside.

        Refreshes the access time of every matched node; never counts a hit.
        """
        if get_ident() != self._owner:
            self._not_owner("match_prefix")
        key = as_radix_key(key)
        res = self._lookup.match(key)
        m = self.metrics
        m.match_calls += 1
        m.match_tokens += len(key) - len(key) % self.page_size
        m.device_hit_tokens += res.device_hit_length
        m.host_match_tokens += res.host_hit_length
        return res

    def peek_prefix(self, key: object) -> tuple[int, int]:
        """``(device tokens, host-only tokens)`` of the cached page-aligned prefix of ``key``
        (with stateful components: the usable device prefix and the continuation a load-back
        would make usable, as ``match_prefix`` reports them).

        Read-only, unlike ``match_prefix``: no split, no access-time refresh, no metrics, so a
        scheduler may ask it about waiting requests as often as it likes.
        """
        if get_ident() != self._owner:
            self._not_owner("peek_prefix")
        return self._lookup.peek(as_radix_key(key))

    # ------------------------------------------------------------------ insert
    def insert(
        self,
        key: object,
        device_pages: object,
        *,
        chunked: bool = False,
        priority: int = 0,
        component_pages: Mapping[str, object] | None = None,
        retain: object = None,
    ) -> InsertResult:
        """Insert ``key``'s whole pages with their device pages (one id per whole page).

        The tree takes ownership of the pages it keeps and frees the caller's duplicates
        (see ``insert``'s module). ``chunked=True`` (a chunked-prefill insert) counts no hits.
        ``priority``: the request's eviction priority (``eviction_policy="priority"``).
        ``component_pages``: per component with its own page ids (e.g. ``"swa"``), one of its
        device page ids per page of ``device_pages``, -1 where the caller has none (for a
        sliding window: -1 up to the caller's frontier, ids after it); the tree takes or frees
        every one, like the full pages. ``retain``: a ``retention.RetentionHint`` for the
        inserted prefix (retention must be enabled).
        """
        if get_ident() != self._owner:
            self._not_owner("insert")
        key = as_radix_key(key)
        if retain is not None:
            retain = check_retain(retain, self._retention)
        priority = check_priority(priority)
        chunked = check_flag("chunked", chunked)
        if device_pages is None:
            raise TypeError("device_pages: expected a sequence of device page ids, got None")
        pages = check_page_ids(device_pages, self.device_allocator.num_pages, "device_pages", unique=False)
        cp = None
        if component_pages is not None:
            cp = check_component_pages(self._own, component_pages, pages.shape[0], "device")
        result = self._inserter.insert(key, pages, chunked, priority=priority, comp_pages=cp)[0]  # a private copy
        if retain is not None and result.last_node is not self._tree.root:
            self._retention.retain(self._tree.root, result.last_node, retain)
        return result

    def insert_host(
        self, key: object, host_pages: object, start: int, component_pages: Mapping[str, object] | None = None
    ) -> tuple[int, TreeNode | None]:
        """Attach host pages (e.g. read from L3) as host-only nodes; returns (tokens attached, leaf).

        ``host_pages[i]`` (allocated from the host pool, not owned by the tree) holds page
        ``start // page_size + i`` of ``key``. The cache takes every page: it attaches the run
        that continues the tree's backed-up path from its end and frees the rest (pages the tree
        already holds, or pages that no longer connect because the backed-up path now ends
        before ``start``). Where the path goes on after its backed-up part with nodes on the
        device only, those nodes (the last one split where the pages end or the key leaves it)
        take the pages of their tokens as their host copies, and the rest attaches after them
        (a component's pages go to the nodes they belong to, e.g. an ``swa`` window; with a
        stateful component without ``device_only_host_copies``, such pages are freed instead,
        and so they are, with the rest, where one of those nodes is in a backup chain reserved
        for the ranks' agreement and not yet decided: only from inside an agreement, see
        ``backup``). The tokens attached
        count every page taken (host copies included); the leaf is the deepest node given
        pages (a new host-only node, or the last device-only one), None when nothing was
        attached. ``component_pages``: per component with its own page ids,
        its host page ids aligned with ``host_pages`` (-1 where none; e.g. a prefetched sliding
        window: the last pages), allocated from its host pool; the cache takes every one too.
        """
        if get_ident() != self._owner:
            self._not_owner("insert_host")
        key = as_radix_key(key)
        start, ids = check_host_attach(
            len(key), start, host_pages, self.page_size, self.host_allocator, self._res.host_owned
        )
        end = start + ids.shape[0] * self.page_size
        cp = None
        if component_pages is not None:
            cp = check_component_pages(self._own, component_pages, ids.shape[0], "host")
        new = end - self._tree.walk(key, end)[1]  # tokens the attach may add as new nodes
        attached, leaf = self._inserter.attach_host(key, ids, start, cp)
        self._load_backs.attached_from_storage(leaf, new)  # their load-back: cached_tokens{storage}
        return attached, leaf

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode) -> LockReceipt | None:
        """Lock ``node`` and its ancestors on the device tier; returns the lock's receipt (None
        for the root, which needs no lock)."""
        if get_ident() != self._owner:
            self._not_owner("inc_lock_ref")
        self._tree.check_node(node)
        if node.value is None:
            raise ValueError(f"node: {node!r} is not on the device; lock the last_device_node of a match")
        if node is not self._tree.root:
            return self._callers.take(node)
        return None

    def dec_lock_ref(self, node: "TreeNode | LockReceipt") -> None:
        """Undo one caller lock: exactly the one a receipt from ``inc_lock_ref`` names, or,
        given a node, one lock a caller took on exactly that node (``inc_lock_ref`` or a
        request helper). Raises ValueError (no change) when there is no such lock: a caller
        never releases a lock the cache took for itself (a transfer's, an L3 pin)."""
        if get_ident() != self._owner:
            self._not_owner("dec_lock_ref")
        if isinstance(node, LockReceipt):
            self._callers.release_receipt(node)
            node = node.device
        else:
            self._tree.check_node(node)
            if node is self._tree.root:
                return
            self._callers.release(node)
        if self._component_steps is not None and node is not None:  # an abandoned request's slides go
            self._component_steps.lock_released(node, len(self._callers.by_node.get(node, ())))

    # ------------------------------------------------------------------ L3 surface
    def backed_up_prefix(self, key: object) -> tuple[TreeNode, int, int]:
        """Read-only walk of ``key``'s whole pages: ``(node, tokens, tokens of that node inside
        the match)``, where an L3 prefetch of ``key`` continues; the root and 0, 0 when nothing
        matches. The node is the deepest matched one, except where the tree's match ends before
        ``key``'s last whole page on nodes that are not backed up (on the device only: host
        copy reclaimed, or never made): then it is the deepest backed-up node of the match (or
        the root) and ``tokens`` ends with it, so the prefetch reads from there and the
        device-only nodes get their host copies from what it reads (``insert_host``) instead of
        the pages after them being lost to storage. Where the key is matched whole, the deepest
        matched node is returned whatever its tiers (there is nothing after it to read), and
        so it is with a stateful component without ``device_only_host_copies`` (``insert_host``
        would free such pages).
        The node is backed up when its ``host_value`` is not None (contiguity: so is its path).
        Several ranks: the same on every rank, since it reads only tree state, which the ranks
        change alike at agreed points. The device-only nodes may get backed up by the ranks'
        agreement before the read ends; ``insert_host`` then frees their pages (each node gets
        one host copy: the backup's, or the read's)."""
        return self._lookup.backed_up(as_radix_key(key), self._device_only_host_copies)

    def tree_match_tokens(self, key: object) -> int:
        """Read-only walk: how many tokens of ``key``'s whole pages the tree holds on any tier
        (no split, no access-time refresh, no metrics; with an SWA component, whether their
        window is there or not). Where ``backed_up_prefix`` ends before this, the nodes between
        are on the device only: what an L3 read from there brings beyond the tree starts here."""
        key = as_radix_key(key)
        return self._tree.walk(key, len(key) - len(key) % self.page_size)[1]

    def pin_host(self, node: TreeNode) -> LockReceipt:
        """Keep the host copies of ``node`` and its ancestors (a host path lock) until
        ``unpin_host`` of the receipt; the root needs no pin (a receipt that does nothing)."""
        self._tree.check_node(node)
        if node is not self._tree.root and node.host_value is None:
            raise ValueError(f"node: {node!r} is not backed up")
        if node is self._tree.root:
            return LockReceipt(None, None)
        return self._locks.lock_host(node)

    def unpin_host(self, receipt: LockReceipt) -> None:
        """Release a ``pin_host`` receipt (a no-op once ``reset`` dropped its node)."""
        if not isinstance(receipt, LockReceipt) or receipt.device is not None:
            raise TypeError(f"receipt: expected a pin_host receipt, got {type(receipt).__name__} {receipt!r}")
        self._locks.release(receipt)

    # Host reservations (``host_reservations``: the protocol with several ranks is there).
    def reserve_host_pages(self, num_pages: int) -> np.ndarray | None:
        """``num_pages`` host pages for the caller (an L3 prefetch's destination), evicting
        host leaves if short; None when there is no room (the eviction done). The caller owns
        them until it hands them to ``insert_host`` or frees them."""
        return self._reservations.reserve(num_pages)

    def reserve_component_host_pages(self, name: str, num_pages: int) -> np.ndarray | None:
        """``reserve_host_pages`` from the host pool of the component ``name`` (one with its
        own page ids), evicting with that component's own host eviction if short."""
        if get_ident() != self._owner:
            self._not_owner("reserve_component_host_pages")
        return self._reservations.reserve_component(own_component(self._own, name), num_pages)

    def reserve_host_pages_agreed(self, num_pages: int, min_pages: int) -> tuple[int, np.ndarray | None]:
        """Several ranks, from a ``StepAgreement`` participant's ``prepare``: the reserve of
        reserve -> agree -> commit for ``num_pages`` host pages (an L3 prefetch's destination),
        at least ``min_pages``. Returns ``(n, ids)``: ``n`` the pages reserved as every rank
        counts them (0: nothing held), and this rank's ids, or None when its allocation
        failed. After the step's agreement, end it on every rank with
        ``settle_host_pages(n, ids, keep)`` (``HostReservations.reserve_agreed``)."""
        return self._reservations.reserve_agreed(num_pages, min_pages)

    def settle_host_pages(self, num_pages: int, ids: np.ndarray | None, keep: bool) -> None:
        """End a ``reserve_host_pages_agreed`` of ``num_pages`` pages: ``keep`` when every rank
        got its pages (the caller owns them), else they are freed."""
        self._reservations.settle(num_pages, ids, keep)

    def reserve_component_host_pages_agreed(self, name: str, num_pages: int) -> np.ndarray | None:
        """``reserve_host_pages_agreed`` for ``num_pages`` host pages of the component ``name``
        (one with its own page ids, e.g. an L3 prefetch's SWA window), all or nothing. Returns
        this rank's ids or None; report ``ids is not None``, then end it on every rank with
        ``settle_component_host_pages(name, num_pages, ids, keep)``
        (``HostReservations.reserve_component_agreed``)."""
        if get_ident() != self._owner:
            self._not_owner("reserve_component_host_pages_agreed")
        return self._reservations.reserve_component_agreed(own_component(self._own, name), num_pages)

    def settle_component_host_pages(self, name: str, num_pages: int, ids: np.ndarray | None, keep: bool) -> None:
        """End a ``reserve_component_host_pages_agreed`` of ``num_pages`` pages (see there)."""
        self._reservations.settle_component(own_component(self._own, name), num_pages, ids, keep)

    # ------------------------------------------------------------------ transfers
    def writing_check(self, block: bool = False) -> int:
        """Acknowledge finished backups (FIFO, up to the first unfinished one; all if ``block``).
        With several ranks: one agreement step (see the module docstring)."""
        if get_ident() != self._owner:
            self._not_owner("writing_check")
        return self._ledger.check_writes(check_flag("block", block), self.agreed)

    def loading_check(self, block: bool = False) -> int:
        """Acknowledge finished load-backs (FIFO, up to the first unfinished one; all if ``block``).
        With several ranks: one agreement step (see the module docstring)."""
        if get_ident() != self._owner:
            self._not_owner("loading_check")
        return self._ledger.check_loads(check_flag("block", block), self.agreed)

    def check_events(self) -> None:
        """Poll both queues without blocking (call once per scheduler step). With several
        ranks: one agreement step, every call, even with nothing in flight."""
        if get_ident() != self._owner:
            self._not_owner("check_events")
        if self.agreed:
            self._ledger.step()
        else:
            self._ledger.poll()
        if self._res.watch is not None:
            self._res.watch.step()

    def agree_step(self, block: bool = False) -> None:
        """Several ranks: one agreement step now (a caller's blocking wait runs these in a loop
        whose exit condition is agreed state, so every rank runs the same number). One
        process: ``check_events`` (``block``: ``flush``)."""
        if get_ident() != self._owner:
            self._not_owner("agree_step")
        block = check_flag("block", block)
        if self.agreed:
            self._ledger.step(block, block)
        elif block:
            self.flush()
        else:
            self.check_events()

    def flush(self) -> None:
        """Block until every transfer in flight is acknowledged (with several ranks: and every
        backup the write policy asked for is committed or rolled back, and every window slide
        noted is agreed and applied)."""
        if get_ident() != self._owner:
            self._not_owner("flush")
        if self.agreed:
            ledger, backups, slides = self._ledger, self._agreed_backups, self._component_steps
            # agreed state: the same on every rank, so every rank runs the same steps
            while ledger.writes or ledger.loads or not backups.idle or (slides is not None and not slides.idle):
                self._ledger.step(True, True)
            return
        self.writing_check(block=True)
        self.loading_check(block=True)

    # ------------------------------------------------------------------ eviction
    def alloc_device(self, num_pages: int) -> np.ndarray | None:
        """Allocate device pages for the caller, evicting unlocked leaves if short; None on
        failure (nothing allocated; more pages than the pool has: without evicting anything):
        ``device_fit(num_pages)`` then says whether the pool can
        never hold that many pages (``DeviceFit.TOO_LARGE``) or is full now
        (``DeviceFit.FULL_NOW``: locked or unacknowledged pages; retry after requests finish)."""
        if get_ident() != self._owner:
            self._not_owner("alloc_device")
        num_pages = check_int("num_pages", num_pages, 0)
        if num_pages > self.device_allocator.num_pages:  # TOO_LARGE: evicting would only lose the cache
            return None
        return self._evictor.alloc_device(num_pages, False)

    def device_fit(self, num_pages: int) -> DeviceFit:
        """Whether ``alloc_device(num_pages)`` can succeed: ``FITS`` (free pages plus the
        pages eviction can free now cover it), ``FULL_NOW`` (not now: the rest are locked by
        requests or copies in flight; it can fit later) or ``TOO_LARGE`` (more pages than the
        device pool has: it never fits; split the request or refuse it). Read-only."""
        if get_ident() != self._owner:
            self._not_owner("device_fit")
        num_pages = check_int("num_pages", num_pages, 0)
        if num_pages > self.device_allocator.num_pages:
            return DeviceFit.TOO_LARGE
        if num_pages <= self.device_allocator.available + self._res.evictable_tokens // self.page_size:
            return DeviceFit.FITS
        return DeviceFit.FULL_NOW

    def alloc_component(self, name: str, num_pages: int) -> np.ndarray | None:
        """Allocate device pages of the component ``name`` (one with its own page ids, e.g.
        ``"swa"``) for the caller, evicting by that component's own rules when short (a
        sliding window: unlocked leaves whole, other nodes' SWA pages only, leaving
        tombstones); None (nothing allocated) when there is no room even then, and at once,
        evicting nothing, for more pages than the component's pool has."""
        if get_ident() != self._owner:
            self._not_owner("alloc_component")
        comp = own_component(self._own, name)
        return comp.alloc_device(check_int("num_pages", num_pages, 0))

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens if possible; returns tokens freed."""
        if get_ident() != self._owner:
            self._not_owner("evict")
        return self._evictor.evict(check_int("num_tokens", num_tokens, 0))[0]

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens if possible; returns tokens freed."""
        if get_ident() != self._owner:
            self._not_owner("evict_host")
        pages = -(-check_int("num_tokens", num_tokens, 0) // self.page_size)
        return self._evictor.evict_host(pages) * self.page_size

    # ------------------------------------------------------------------ load-back (H2D)
    def load_back(self, node: TreeNode, mem_quota: int | None = None) -> LoadBackResult | None:
        """Load the host-only chain ending at ``node`` (a match's ``last_host_node``) to the device.

        All or nothing: returns None (and changes nothing) when the chain is shorter than
        ``load_back_threshold`` tokens, longer than ``mem_quota`` tokens, or the device has
        no room even after eviction. The loaded nodes count as on-device at once, locked
        until ``loading_check`` acknowledges the copy.
        """
        if get_ident() != self._owner:
            self._not_owner("load_back")
        self._tree.check_node(node)
        if mem_quota is not None:
            mem_quota = check_int("mem_quota", mem_quota, 0)
        return self._load_backs.load_back(node, mem_quota)

    # ------------------------------------------------------------------ request helpers
    def begin_request(
        self,
        key: object,
        mem_quota: int | None = None,
        load_back: bool = True,
        priority: int = 0,
        retain: object = None,
    ) -> tuple[CacheRequest, LoadBackResult | None]:
        """Match ``key``, load back its host continuation (if worth it), lock the device prefix.

        Returns the request (its ``device_pages`` = the cached prefix, owned by the tree) and
        the load-back in flight, if any. ``priority`` is kept in the request for its inserts.
        ``retain``: a ``retention.RetentionHint`` applied to the matched prefix now and to the
        request's inserts (``req.retain``). Every argument is validated before the match
        changes anything (access times, counters).
        """
        if get_ident() != self._owner:
            self._not_owner("begin_request")
        key = as_radix_key(key)
        if mem_quota is not None:
            mem_quota = check_int("mem_quota", mem_quota, 0)
        if retain is not None:
            retain = check_retain(retain, self._retention)
        return self._requests.begin(
            key, mem_quota, check_flag("load_back", load_back), check_priority(priority), retain
        )

    def cache_unfinished_req(self, req: CacheRequest, chunked: bool = False) -> None:
        """Insert the request's whole pages so far and re-point it at the tree's pages.

        Duplicate pages are freed and replaced in ``req.device_pages`` by the tree's; the lock
        moves to the new deepest node. A trailing partial page stays with the request.
        """
        if get_ident() != self._owner:
            self._not_owner("cache_unfinished_req")
        self._requests.unfinished(self._requests.check(req), check_flag("chunked", chunked))

    def cache_finished_req(self, req: CacheRequest) -> None:
        """Insert the finished request's whole pages, free its partial tail page, unlock it."""
        if get_ident() != self._owner:
            self._not_owner("cache_finished_req")
        self._requests.finished(self._requests.check(req))

    def abort_request(self, req: CacheRequest) -> None:
        """Give up on a request (client disconnected, cancelled, failed): free the pages it
        owns (its ``device_pages`` from ``cached_pages`` on, and likewise its own pages of
        components such as ``swa``), release its lock on the tree, and insert nothing. The
        tree's pages it matched stay cached. The request is emptied (no pages, no lock); a
        second abort does nothing. It may hold fewer pages than its tokens need: a request as
        ``begin_request`` returned it (the cached prefix's pages only) when ``alloc_device``
        found no room for the rest. Validates first: ids that are not the request's to free
        raise ValueError with nothing changed."""
        if get_ident() != self._owner:
            self._not_owner("abort_request")
        self._requests.abort(req)

    def slide_window(self, req: CacheRequest, written: int | None = None) -> None:
        """After a forward pass wrote the KV of all of ``req.key``'s tokens: components with
        a sliding window free the request's own pages that lie wholly before the window of
        its whole pages' end (so also before the window of its next pass; ``component_pages``
        entries set to -1) and, once that window lies past the tree's part
        (``cached_pages``), release the hold of the request's lock on the tree's window pages
        (its full lock stays). A no-op without such components.

        ``written``: how many of ``req.key``'s tokens this rank's forward pass has written
        (default: all); the slide goes only that far. With several ranks the slide is agreed:
        this call records the length, and the next step slides every rank to the MIN over
        ranks (``component_steps``)."""
        if get_ident() != self._owner:
            self._not_owner("slide_window")
        req = self._requests.check(req)
        self._requests.slide(req, None if written is None else check_int("written", written, 0))

    # ------------------------------------------------------------------ reset / stats / checks
    def reset(self) -> None:
        """Drop everything: wait for transfers, free every page the tree owns.

        Raises RuntimeError (after the wait, before freeing) while callers still hold locks.
        After a ``CacheFailedError`` it waits for the copies in flight ignoring their errors,
        and drops callers' locks too: callers must abandon every request they held.
        """
        if get_ident() != self._owner:
            self._not_owner("reset")
        ledger = self._ledger
        if ledger.failure is None:
            self.flush()
            if self._res.protected_tokens:
                raise RuntimeError(f"reset: callers still hold locks on {self._res.protected_tokens} device tokens")
        else:
            ledger.abandon()
            self._accept_calls()
        if ledger.storage_hook is not None:
            ledger.storage_hook.on_reset()  # L3 backups still reading host pages finish first
        if self._res.watch is not None:
            self._res.watch.cleared()
        self.root = self._parts.drop_all()

    def all_nodes(self) -> list[TreeNode]:
        return self._tree.nodes()

    def gauges(self) -> dict:
        """Current occupancy: capacity / free / used per tier, KV bytes per (tier, pool), copies
        in flight, tree size. Cheap (no tree walk); read by ``stats()`` and the Prometheus export.

        Read on the owner thread (one process), it first acknowledges the copies and L3
        operations that have finished (``check_events``'s non-blocking poll), so an idle cache
        whose last copies are done shows nothing in flight and no pages held for them. Read on
        another thread (a Prometheus HTTP server's), it changes nothing and shows copies as
        in flight until the owner's next ``check_events``."""
        if get_ident() == self._owner and not self.agreed and self._ledger.failure is None:
            try:
                self._ledger.poll()
            except CacheFailedError:
                pass  # latched: the owner's next call raises it
        return occupancy(self)

    def stats(self) -> dict:
        """The configuration and every metric family (``metrics.FAMILIES``: the names the
        Prometheus export and the README use), L3's included while a storage controller is
        attached. A few pre-issue-20 keys remain as aliases (``device_tree_tokens``,
        ``host_tree_tokens``, ``hit_rate``)."""
        agreement = None
        if self.agreed:  # several ranks: the per-step agreement's exchanges and time
            agreement = {**self._steps.stats(), "rolled_back_backups": self._agreed_backups.rolled_back}
            if self._component_steps is not None:
                agreement["agreed_slides"] = self._component_steps.slides
        return cache_stats(self, agreement)

    def sanity_check(
        self, external_device_pages: int | None = None, external_pages: Mapping[str, int] | None = None
    ) -> None:
        """Verify every invariant; gathers all violations, then raises CacheInvariantError once.

        ``external_device_pages``: device pages the caller holds outside the tree (allocated,
        not yet inserted). When given, also checks free + tree + external == total.
        ``external_pages``: the same per component with its own page ids (name -> its device
        pages the caller holds), for that component's pool identity.
        """
        from .invariants import raise_violations

        if external_device_pages is not None:
            external_device_pages = check_int("external_device_pages", external_device_pages, 0)
        if external_pages is not None:
            external_pages = check_external_pages(self._own, external_pages)
        raise_violations(self.debug_view(), external_device_pages, external_pages)
