"""A sliding-window (SWA) component: the KV of a hybrid model's sliding-window layers.

Pure Python + numpy, owner thread only (the cache's). Hybrid models (gpt-oss, Gemma)
interleave full-attention layers, whose KV every later token reads, with sliding-window
layers, whose tokens read only the KV of a window of positions. The tree keeps the full
layers' KV as its full component; this component keeps the SWA layers' KV in its own,
smaller, pools (its own ``KVTransferEngine``: device pool + device allocator, host pool +
host allocator), so the device memory a request needs for those layers is bounded by the
window.

The window (``window`` = ``W``, the model's ``sliding_window``; the HF / gpt-oss convention of
``reference_model.window``): the query at position ``p`` attends to ``[p - W + 1, p]``. A step
that computes positions ``[m, e)`` after a cached prefix of ``m`` tokens therefore reads the
SWA KV of the ``W - 1`` positions ``[m - W + 1, m)`` from the cache (and writes the rest
itself). The tree keeps exactly that: ``context = W - 1`` tokens (at least 1) of SWA KV
before a usable prefix's end. Upstream's validator (sglang #23391) asks for ``W`` tokens,
one more than any step reads; the two rules differ only when ``(W - 1) % page_size == 0``
(always with pages of one token), where the exact one keeps one page less per window and
accepts prefixes whose run of SWA pages is exactly ``W - 1`` tokens long. "The window" below
means those ``context`` tokens.

State per node (``TreeNode.ext[name]``, a ``_SWAState``)
    ``dev`` / ``host``: this component's own page ids on each tier (one per page of the node,
    or None). They are freed directly from the node, never looked up through full page ids
    (a full -> SWA table, if an attention kernel wants one, is derived from the nodes:
    ``request_pages``), which rules out upstream's leak family of stale full -> SWA mappings
    (sglang #27586, #27789, #36135). A node whose SWA KV is gone on a tier while its full KV
    stays there is a *tombstone* on that tier. SWA on a tier implies full KV on that tier.
    ``holders``: the holds (see Locks) that keep its SWA device pages; its SWA lock count.
    ``access``: this component's own recency (see Eviction).

Usable prefix (``usable_prefix``; upstream's SWA match validator, sglang #23391)
    A prefix ending at a node boundary is usable on a tier iff its full KV is there and
    either the path from the root has no SWA tombstone on that tier, or every node among the
    last ``context`` tokens before its end has SWA KV on that tier. ``match_prefix`` returns
    the deepest device-usable end (``last_device_node``, ``device_indices``) and the deepest
    end usable from some tier (``last_host_node``); the tokens between are the continuation
    a ``load_back`` makes usable (``host_hit_length``), whether their full KV is on the
    device (only the SWA pages come back) or on the host.

Locks (per node ``holders``; one ``_Hold`` records exactly the states it incremented)
    * A caller's device lock (``inc_lock_ref``, a request's lock) also holds the SWA device
      pages of the window before its node's end (the nodes intersecting the last ``context``
      tokens; tombstones hold nothing), not the whole path. A tombstone of that window that
      gets SWA pages again while the lock lives (an insert recovers it, a load-back fills
      it) joins the hold, recorded there: a release decrements exactly what its hold
      incremented (never a lock it did not take: sglang #36350's class), and every hold on
      one node holds the same nodes, so the caller locks on a node stay interchangeable (the
      full locks are: ``dec_lock_ref(node)``). A request whose window moved past the tree's
      part releases its hold early (``slide_request``; the full lock stays) and the node's
      next release then releases an already-empty one first, so no release takes a hold
      somebody still needs.
    * A backup holds the source SWA pages of its chain, a load-back the window it loads
      into, until the copy is acknowledged (``CopyPlan.done``). Their host pages are kept
      by the transfer's full host lock: SWA host eviction skips host-locked nodes.
    Every hold lies under a full device path lock, so SWA lock <= full lock per node, and a
    tombstone is never held.

Eviction (per-component indexes and targets)
    ``device_index``: nodes with SWA device pages and no hold; ``host_index``: nodes with
    SWA host pages and none on the device (disjoint). Both order by the component's own
    recency, refreshed for the window before a match's and an insert's end only (upstream's
    rule), so the SWA of out-of-window ancestors goes first. ``alloc_device`` (the SWA pool
    can be the bottleneck: decode allocation) evicts SWA: an unlocked device leaf leaves the
    device whole (full and SWA: ``Evictor.evict_leaf``); an internal or full-locked node
    becomes a tombstone (only its SWA pages go). Full device eviction of a node takes its
    SWA device pages too (``on_evict``); full host eviction its SWA host pages. Host:
    ``alloc_host`` evicts ``host_index`` (host-locked nodes are skipped): a host-only leaf is
    dropped whole (``Evictor.drop_host_leaf``), others lose only their SWA host pages.

Insert (``check_insert`` validates first; ``on_insert_span`` applies)
    The caller passes one SWA page id per page (-1 where it has none); the ids are a run of
    -1 (below its *frontier*: out of the window, already freed) then ids. Out-of-window spans
    become tombstones (a node straddling the frontier is split there); a node that already
    has SWA device pages keeps them (the caller's are duplicates and freed); a tombstone (or
    a new leaf) gets the caller's pages for its in-window part only; a full value is never
    replaced (locked or not: the SWA ids live beside it). The deepest node, if it got pages,
    is capped at ``window_pages = ceil(context / page_size)`` pages (split), so locking it
    holds one window.

L2 (``on_backup``, ``before_load_back``, ``load_back_start``, ``prepare_load``)
    A backup (parent first, with the full pages) copies the SWA pages of its chain's nodes
    that have them on the device and not on the host, deepest first when the SWA host pool
    is short. A load-back brings back only the trailing window: the window's top node is
    split at the window's first page if it must be loaded, only the window's nodes without
    SWA device pages are loaded, and on-device nodes past the device-usable prefix count as
    the load-back's continuation (their full pages lead its ``device_pages``).

L3 (``l3_trailing_pages``, ``node_host_pages``, ``alloc_host``, ``on_attach_host``)
    The L3 controller stores the SWA host pages beside the full pages under the same chained
    page keys in a pool of this component's name, with the trailing-pages hit rule (only the
    ``window_pages`` before a hit's end must be stored) and attaches a
    prefetched window all or nothing.

Requests (``CacheRequest.component_pages[name]``: one id per started page, -1 where none)
    See ``HiRadixCache``'s "Sliding-window (SWA) requests" for the call sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import struct

import numpy as np

from ...allocator import ID_DTYPE, PageAllocator, has_duplicates
from ...transfer import KVTransferEngine
from ..eviction_index import EvictionIndex
from ..eviction_policies import EvictionStrategy
from .base import ComponentContext, CopyPlan, KVComponent, NoRoom
from .full import FULL

SWA = "swa"
_EMPTY = np.zeros(0, ID_DTYPE)
_INF = float("inf")
_DIGEST_NODE = struct.Struct("<BIq")  # dev / host flags, holds, access


class _SWAState:
    """One node's SWA pages, holds and recency (``TreeNode.ext[name]``)."""

    __slots__ = ("node", "dev", "host", "holders", "access", "heap_stamp")

    def __init__(self, node) -> None:
        self.node = node
        self.dev: np.ndarray | None = None
        self.host: np.ndarray | None = None
        self.holders: set = set()
        self.access = 0
        self.heap_stamp = [0, 0]  # device_index, host_index

    def __repr__(self) -> str:
        return (
            f"SWA({self.node!r}, dev={None if self.dev is None else self.dev.tolist()}, "
            f"host={None if self.host is None else self.host.tolist()}, lock={len(self.holders)})"
        )


class _Hold:
    """What one lock or copy incremented: exactly these states."""

    __slots__ = ("states", "kind")

    def __init__(self, kind: str) -> None:
        self.states: list[_SWAState] = []
        self.kind = kind  # "window", "backup" or "load"

    def __repr__(self) -> str:
        return f"_Hold({self.kind}, {len(self.states)} nodes)"


class _HostReservation:
    """SWA host pages reserved for one backup (several ranks), waiting for the agreement:
    ``states`` to back up (root first), ``npages`` as every rank counts them, ``ids`` this
    rank's (None: its allocation failed; counted in ``phantom_pages`` until settled)."""

    __slots__ = ("states", "npages", "ids")

    def __init__(self, states: list, npages: int, ids: np.ndarray | None) -> None:
        self.states, self.npages, self.ids = states, npages, ids

    @property
    def ok(self) -> bool:
        return self.ids is not None


class _WindowRecency(EvictionStrategy):
    """Least recently used window first (the component's own ``access``)."""

    name = "swa_lru"

    def key(self, st: _SWAState) -> tuple:
        return (st.access,)


@dataclass
class SWAMetrics:
    tombstoned_tokens: int = 0  # SWA device pages evicted from nodes that keep their full KV
    leaf_evictions: int = 0  # whole device leaves evicted by SWA allocation
    host_tombstoned_tokens: int = 0  # SWA host pages evicted from nodes that keep their full host KV
    host_leaf_evictions: int = 0  # whole host-only leaves dropped by SWA host allocation
    backup_tokens: int = 0  # SWA tokens copied to the host
    backup_failed_tokens: int = 0  # SWA tokens of backed-up nodes the SWA host pool had no room for
    loaded_tokens: int = 0  # SWA tokens loaded back (only window nodes)
    load_no_room: int = 0  # load-backs skipped: no SWA device room for the window, or no window on any tier
    alloc_failures: int = 0  # alloc_device / alloc_host calls that found no room
    released_windows: int = 0  # window holds released early (slide_request)
    freed_request_pages: int = 0  # requests' own pages freed as their window slid


class SWAComponent(KVComponent):
    """The sliding-window KV of a hybrid model; see the module docstring.

    ``engine``: the SWA pools' transfer engine (its device pool with ``device_allocator``,
    its host pool with its own allocator; any sizes); ``window``: the model's sliding window
    ``W`` in tokens (the query at ``p`` attends to ``[p - W + 1, p]``); the cache keeps the
    ``context = W - 1`` tokens of SWA KV before a usable prefix's end (module docstring). A
    larger ``window`` is safe (keeps more); a smaller one is not.
    """

    stateful = True
    own_page_ids = True
    device_only_host_copies = True  # on_attach_host places a window on the path's nodes

    def __init__(self, engine: KVTransferEngine, device_allocator: PageAllocator, window: int, name: str = SWA) -> None:
        super().__init__(name, engine)
        if name == FULL:
            raise ValueError(f"name: {FULL!r} is reserved for the target KV")
        if not isinstance(device_allocator, PageAllocator):
            raise TypeError(f"device_allocator: expected a PageAllocator, got {type(device_allocator).__name__}")
        if device_allocator.num_pages != engine.device_num_pages:
            raise ValueError(
                f"device_allocator: {device_allocator.num_pages} pages, but the SWA engine's device pool "
                f"has {engine.device_num_pages}"
            )
        own = getattr(getattr(engine, "device_pool", None), "allocator", None)
        if isinstance(own, PageAllocator) and own is not device_allocator:
            raise ValueError("device_allocator: expected the SWA engine's device pool's allocator")
        host_pool = getattr(engine, "host_pool", None)
        if host_pool is None or not isinstance(getattr(host_pool, "allocator", None), PageAllocator):
            raise TypeError("engine: the SWA engine needs a host pool with an allocator")
        if device_allocator is host_pool.allocator:
            raise ValueError("device_allocator: this is the SWA host pool's allocator; pass the device pool's")
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
            raise ValueError(f"window: expected an int >= 1 (tokens), got {window!r}")
        if host_pool.allocator.used or device_allocator.used:
            raise ValueError("engine: the SWA pools must start empty (the cache owns them)")
        self.window = int(window)
        # Tokens of SWA KV before a prefix's end that the next step reads: W - 1 (its first
        # query at position m reads [m - W + 1, m]); at least one token (W = 1 keeps a page).
        self.context = max(1, self.window - 1)
        p = engine.geom.page_size
        self.page_size = p
        self.window_pages = -(-self.context // p)  # ceil((W - 1) / page_size)
        self.l3_trailing_pages = self.window_pages
        self.device_allocator = device_allocator
        self.host_allocator: PageAllocator = host_pool.allocator
        self.dev_owned = np.zeros(device_allocator.num_pages, bool)
        self.host_owned = np.zeros(self.host_allocator.num_pages, bool)
        order = _WindowRecency()
        self.device_index = EvictionIndex(f"{name}_device", 0, order)
        self.host_index = EvictionIndex(f"{name}_host", 1, order)
        self.evictable_tokens = 0  # SWA on device, no hold
        self.protected_tokens = 0  # SWA on device, held
        self.host_tokens = 0  # SWA on host
        self._win: dict = {}  # node -> [window holds of caller locks on it, released-early count]
        # Several ranks: SWA host pages that reservations of the current step failed to get on
        # this rank (``reserve_backup``, ``reserve_host_agreed``); 0 between steps.
        self.phantom_pages = 0
        self.metrics = SWAMetrics()
        self.ctx: ComponentContext | None = None

    # ------------------------------------------------------------------ wiring
    def attach(self, ctx: ComponentContext) -> None:
        if ctx.page_size != self.page_size:
            raise ValueError(f"components[{self.name!r}]: page_size {self.page_size} != the cache's {ctx.page_size}")
        if self.ctx is not None:
            raise ValueError(f"components[{self.name!r}]: already attached to a cache")
        self.ctx = ctx
        self.tree = ctx.tree
        self.evictor = ctx.evictor

    # ------------------------------------------------------------------ state helpers
    def state(self, node) -> _SWAState | None:
        """The node's SWA state, or None (never had any: a tombstone on both tiers)."""
        ext = node.ext
        return None if ext is None else ext.get(self.name)

    def _make(self, node) -> _SWAState:
        ext = node.ext
        if ext is None:
            node.ext = ext = {}
        st = ext.get(self.name)
        if st is None:
            st = ext[self.name] = _SWAState(node)
            st.access = self.tree.clock
        return st

    def node_device_pages(self, node) -> np.ndarray | None:
        """The node's SWA device page ids (a copy), or None (a device tombstone)."""
        st = self.state(node)
        return None if st is None or st.dev is None else st.dev.copy()

    def node_host_pages(self, node) -> np.ndarray | None:
        """The node's SWA host page ids (a copy), or None (a host tombstone)."""
        st = self.state(node)
        return None if st is None or st.host is None else st.host.copy()

    def lock_count(self, node) -> int:
        """Holds on the node's SWA device pages (its SWA lock)."""
        st = self.state(node)
        return 0 if st is None else len(st.holders)

    def _refresh(self, st: _SWAState) -> None:
        dev = st.dev is not None and not st.holders
        host = st.host is not None and st.dev is None
        if dev != (st in self.device_index.members):
            self.device_index.set_member(st, dev)
        if host != (st in self.host_index.members):
            self.host_index.set_member(st, host)

    def _touch(self, st: _SWAState, t: int) -> None:
        if st.access != t:
            st.access = t
            self.device_index.touch(st)
            self.host_index.touch(st)

    def _set_dev(self, st: _SWAState, ids: np.ndarray) -> None:
        st.dev = ids
        self.dev_owned[ids] = True
        if st.holders:
            self.protected_tokens += st.node.size
        else:
            self.evictable_tokens += st.node.size
        self._refresh(st)

    def _take_dev(self, st: _SWAState) -> np.ndarray:
        """Take the state's SWA device pages off it (a tombstone from now on); the caller frees them."""
        if st.holders:
            raise AssertionError(f"{self.name}: evicting held SWA pages of {st.node!r} ({len(st.holders)} holds)")
        ids = st.dev
        st.dev = None
        self.evictable_tokens -= st.node.size
        self._refresh(st)
        return ids

    def _free_dev(self, ids: np.ndarray) -> None:
        ids = ids.astype(np.intp)
        self.dev_owned[ids] = False
        self.device_allocator.free_owned(ids)

    def _set_host(self, st: _SWAState, ids: np.ndarray) -> None:
        st.host = ids
        self.host_owned[ids] = True
        self.host_tokens += st.node.size
        self._refresh(st)

    def _take_host(self, st: _SWAState) -> np.ndarray:
        ids = st.host
        st.host = None
        self.host_tokens -= st.node.size
        self._refresh(st)
        return ids

    def _free_host(self, ids: np.ndarray) -> None:
        ids = ids.astype(np.intp)
        self.host_owned[ids] = False
        self.host_allocator.free_owned(ids)

    def _hold(self, st: _SWAState, hold: _Hold) -> None:
        if not st.holders and st.dev is not None:
            self.evictable_tokens -= st.node.size
            self.protected_tokens += st.node.size
        st.holders.add(hold)
        hold.states.append(st)
        self._refresh(st)

    def _release(self, hold: _Hold) -> None:
        for st in hold.states:
            st.holders.discard(hold)
            if not st.holders and st.dev is not None:
                self.protected_tokens -= st.node.size
                self.evictable_tokens += st.node.size
            if not st.node.deleted:
                self._refresh(st)
        hold.states = []

    def _window(self, node) -> list:
        """The nodes intersecting the last ``context`` tokens before ``node``'s end, deepest first."""
        out = []
        acc = 0
        root = self.tree.root
        w = self.context
        while node is not root and acc < w:
            out.append(node)
            acc += node.size
            node = node.parent
        return out

    # ------------------------------------------------------------------ tree hooks
    def on_split(self, upper, lower, k: int) -> None:
        st = self.state(lower)
        if st is None:
            return
        up = self._make(upper)
        if st.dev is not None:
            up.dev, st.dev = st.dev[:k], st.dev[k:]
        if st.host is not None:
            up.host, st.host = st.host[:k], st.host[k:]
        up.access = st.access
        if st.holders:  # every hold on the lower part holds the upper part too (path locks)
            up.holders = set(st.holders)
            for h in st.holders:
                h.states.append(up)
        self._refresh(up)

    def usable_prefix(self, nodes: list, sizes: list, n_dev: int, touch: bool) -> tuple[int, int]:
        w = self.context
        run_dev = run_any = _INF  # tokens since the last tombstone on that tier (none yet: any length)
        k_dev = k_any = 0
        name = self.name
        for i, node in enumerate(nodes):
            ext = node.ext
            st = None if ext is None else ext.get(name)
            on_dev = st is not None and st.dev is not None
            size = sizes[i]
            if i < n_dev:
                run_dev = run_dev + size if on_dev else 0
                if run_dev >= w:
                    k_dev = i + 1
            run_any = run_any + size if on_dev or (st is not None and st.host is not None) else 0
            if run_any >= w:
                k_any = i + 1
        if touch:
            t = self.tree.clock
            for k in {k_dev, k_any}:
                if k:
                    for n in self._window(nodes[k - 1]):
                        st = self.state(n)
                        if st is not None:
                            self._touch(st, t)
        return k_dev, k_any

    # ------------------------------------------------------------------ locks
    def on_lock(self, receipt) -> None:
        if receipt.host is not None or receipt.device is None:
            return  # a transfer's or an L3 pin: its copies keep their pages (CopyPlans, host locks)
        node = receipt.device
        hold = _Hold("window")
        for n in self._window(node):
            st = self.state(n)
            if st is not None and st.dev is not None:
                self._hold(st, hold)
        entry = self._win.get(node)
        if entry is None:
            self._win[node] = [[hold], 0]
        else:
            entry[0].append(hold)

    def on_release(self, receipt) -> None:
        if receipt.host is not None or receipt.device is None:
            return
        entry = self._win.get(receipt.device)
        if entry is None:  # after reset
            return
        if entry[1]:  # a hold released early goes first (see the module docstring)
            entry[1] -= 1
        else:
            self._release(entry[0].pop())
        if not entry[0] and not entry[1]:
            del self._win[receipt.device]

    def _join_window_holds(self, revived: list) -> None:
        """``revived`` (states that just got SWA device pages) join the window holds of the
        caller locks whose window they lie in (see Locks in the module docstring)."""
        if not self._win or not revived:
            return
        rv = set(revived)
        for x, entry in self._win.items():
            if not entry[0]:
                continue
            for n in self._window(x):
                st = self.state(n)
                if st in rv:
                    for hold in entry[0]:
                        if hold not in st.holders:
                            self._hold(st, hold)

    def release_window(self, node) -> bool:
        """Release one caller lock's window hold on ``node`` early (its full lock stays);
        False when none is left to release."""
        entry = self._win.get(node)
        if entry is None or not entry[0]:
            return False
        self._release(entry[0].pop())
        entry[1] += 1
        self.metrics.released_windows += 1
        return True

    # ------------------------------------------------------------------ eviction
    def on_evict(self, node, tier: str) -> None:
        st = self.state(node)
        if st is None:
            return
        if tier == "device":
            if st.dev is not None:
                self._free_dev(self._take_dev(st))
        elif st.host is not None:
            self._free_host(self._take_host(st))

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` SWA device pages if possible (see the module
        docstring); returns the SWA pages freed."""
        freed = 0
        idx = self.device_index
        ev = self.evictor
        m = self.metrics
        watch = ev.res.watch
        if watch is not None:
            watch.before_evict("device")  # settle lazy state first (retention expiry), as Evictor.evict
        while freed < num_pages:
            st = idx.pop()
            if st is None:
                break
            node = st.node
            k = st.dev.shape[0]
            if node.dev_children == 0 and node.lock_ref == 0:
                # An unlocked device leaf: it leaves the device whole (its full KV, without the
                # window before its end, serves no match; on_evict frees the SWA pages).
                ev.evict_leaf(node)
                m.leaf_evictions += 1
            else:  # internal, or full-locked (a request whose window moved on): a tombstone
                self._free_dev(self._take_dev(st))
                m.tombstoned_tokens += node.size
            freed += k
        return freed

    def alloc_device(self, num_pages: int) -> np.ndarray | None:
        """``num_pages`` SWA device pages for the caller, evicting SWA if short; None (nothing
        allocated, the eviction done) when there is no room even then."""
        a = self.device_allocator
        if num_pages > a.num_pages:  # never fits: evicting would only lose cached windows
            return None
        if num_pages > a.available:
            self.evict(num_pages - a.available)
        ids = a.alloc(num_pages)
        if ids is None:
            self.metrics.alloc_failures += 1
        return ids

    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` SWA host pages if possible; returns the pages freed."""
        freed = 0
        idx = self.host_index
        aside = []
        m = self.metrics
        watch = self.evictor.res.watch
        if watch is not None:
            watch.before_evict("host")
        while freed < num_pages:
            st = idx.pop()
            if st is None:
                break
            node = st.node
            if node.host_lock_ref:  # a copy reads or writes its host pages
                aside.append(st)
                continue
            k = st.host.shape[0]
            if node.value is None and not node.children:
                self.evictor.drop_host_leaf(node)  # on_evict frees the SWA host pages
                m.host_leaf_evictions += 1
            else:
                self._free_host(self._take_host(st))
                m.host_tombstoned_tokens += node.size
            freed += k
        for st in aside:
            self._refresh(st)
        return freed

    def alloc_host(self, num_pages: int) -> np.ndarray | None:
        """``num_pages`` SWA host pages (the caller's: an L3 prefetch's), evicting if short."""
        a = self.host_allocator
        if num_pages > a.available:
            self.evict_host(num_pages - a.available)
        ids = a.alloc(num_pages)
        if ids is None:
            self.metrics.alloc_failures += 1
        return ids

    # ------------------------------------------------------------------ insert
    @staticmethod
    def _frontier(pages: np.ndarray) -> int:
        """Index of the first id; ValueError when a -1 follows an id."""
        valid = pages >= 0
        if not valid.any():
            return pages.shape[0]
        f = int(valid.argmax())
        if not valid[f:].all():
            raise ValueError(
                "component_pages: -1 (no page) must only come before the first page id (the ids "
                "from the request's SWA frontier on)"
            )
        return f

    def check_insert(self, segs: list, off0: int, pages: np.ndarray | None) -> None:
        if pages is None or not pages.shape[0]:
            return
        f = self._frontier(pages)
        if f == pages.shape[0]:
            return
        p = self.page_size
        tree_ids = np.full(pages.shape[0], -1, np.int64)
        j = 0
        for node, m, _off in segs:
            k = m // p
            st = self.state(node)
            if st is not None and st.dev is not None:
                tree_ids[j : j + k] = st.dev[:k]
            j += k
        mine = (pages >= 0) & (pages != tree_ids)
        taken = pages[mine]
        if not taken.shape[0]:
            return
        name = f"component_pages[{self.name!r}]"
        if has_duplicates(taken):
            uniq, counts = np.unique(taken, return_counts=True)
            raise ValueError(f"{name}: duplicate ids {uniq[counts > 1][:8].tolist()}")
        owned = self.dev_owned[taken]
        if owned.any():
            raise ValueError(
                f"{name}: pages {taken[owned][:8].tolist()} are already owned by the cache at other positions"
            )
        held = self.device_allocator.allocated_mask(taken)
        if not held.all():
            raise ValueError(f"{name}: pages {taken[~held][:8].tolist()} are not allocated (double free?)")

    def on_insert_span(self, last, span: int, pages: np.ndarray | None) -> None:
        tree = self.tree
        t = tree.clock
        p = self.page_size
        got_pages = False
        if pages is not None and pages.shape[0] and (pages >= 0).any():
            nodes = []
            acc = 0
            n = last
            while acc < span:
                nodes.append(n)
                acc += n.size
                n = n.parent
            nodes.reverse()
            free = []
            revived = []
            j = 0
            for node in nodes:
                k = node.size // p
                c = pages[j : j + k]
                j += k
                if c.shape[0] == 0 or c[-1] < 0:  # ids are a suffix: none here
                    continue
                st = self.state(node)
                if st is not None and st.dev is not None:  # keeps its own: the caller's are duplicates
                    dup = (c >= 0) & (c != st.dev)  # (-1: below the caller's frontier, no page)
                    if dup.any():
                        free.append(c[dup])
                    continue
                f = int((c >= 0).argmax())
                if f:  # the frontier lies inside: its upper part stays a tombstone
                    tree.split(node, f * p)
                    c = c[f:]
                st = self._make(node)
                st.access = t
                self._set_dev(st, c.astype(ID_DTYPE))
                revived.append(st)
                if node is last:
                    got_pages = True
            if free:
                self._free_dev(np.concatenate(free) if len(free) > 1 else free[0])
            self._join_window_holds(revived)
        if got_pages and last.size > self.window_pages * p:
            # Cap: locking the new end holds one window, not a whole chunked-prefill leaf.
            tree.split(last, last.size - self.window_pages * p)
        for n in self._window(last):
            st = self.state(n)
            if st is not None:
                self._touch(st, t)

    def on_attach_host(self, leaf, pages: np.ndarray | None, first: int) -> None:
        if pages is None:
            return
        drop = pages[:first] if leaf is not None else pages
        drop = drop[drop >= 0]
        if drop.shape[0]:
            self.host_allocator.free(drop)
        if leaf is None:
            return
        # ``mine`` covers the last pages of the path ending at ``leaf``'s end: device-only
        # nodes that just got full host copies (none of their own SWA host pages: those need
        # full host KV), then ``leaf``. The ids are a suffix (a window): walk up from ``leaf``
        # until they run out, splitting the node where they start.
        mine = pages[first:]
        valid = mine >= 0
        if not valid.any():
            return
        f = int(valid.argmax())
        p = self.page_size
        node, end = leaf, mine.shape[0]
        while end > f:
            lo = end - node.size // p
            above = node.parent
            if lo < f:  # the window starts inside: the upper part stays an SWA host tombstone
                self.tree.split(node, (f - lo) * p)
                lo = f
            st = self._make(node)
            ids = mine[lo:end].astype(ID_DTYPE)
            if st.host is None:
                self._set_host(st, ids)
            else:  # never after a device-only match (SWA host implies full host); kept anyway
                self.host_allocator.free(ids)
            node, end = above, lo

    # ------------------------------------------------------------------ L2
    def _backup_need(self, nodes: list) -> tuple[list, int]:
        """The states of ``nodes`` (root first) with SWA pages on the device and none on the
        host, and their pages."""
        need = []
        npages = 0
        for n in nodes:
            st = self.state(n)
            if st is not None and st.dev is not None and st.host is None:
                need.append(st)
                npages += st.dev.shape[0]
        return need, npages

    def _fit_deepest(self, need: list, npages: int, room: int) -> tuple[list, int]:
        """The deepest states of ``need`` whose pages fit in ``room`` (a window is what a match
        needs), root first; the rest are counted as failed."""
        keep = []
        fit = 0
        for st in reversed(need):
            if fit + st.dev.shape[0] > room:
                break
            keep.append(st)
            fit += st.dev.shape[0]
        self.metrics.backup_failed_tokens += (npages - fit) * self.page_size
        return keep[::-1], fit

    def _backup_plan(self, need: list, npages: int, ids: np.ndarray) -> CopyPlan:
        """Mark ``need`` backed up to ``ids`` and hold their device pages until the copy is
        acknowledged (``CopyPlan.done``)."""
        hold = _Hold("backup")
        off = 0
        src = []
        for st in need:
            k = st.dev.shape[0]
            self._set_host(st, ids[off : off + k])
            self._hold(st, hold)
            src.append(st.dev)
            off += k
        self.metrics.backup_tokens += npages * self.page_size
        return CopyPlan(
            self.name, np.concatenate(src) if len(src) > 1 else src[0], ids, done=lambda: self._release(hold)
        )

    def on_backup(self, nodes: list) -> CopyPlan | None:
        need, npages = self._backup_need(nodes)
        if not need:
            return None
        ids = self.alloc_host(npages)
        if ids is None:
            need, npages = self._fit_deepest(need, npages, self.host_allocator.available)
            if not need:
                return None
            ids = self.host_allocator.alloc(npages)
            if ids is None:  # refused although counted free (a failing allocator): no SWA copy
                self.metrics.alloc_failures += 1
                return None
        return self._backup_plan(need, npages, ids)

    # ------------------------------------------------------------------ L2, several ranks
    @property
    def host_available(self) -> int:
        """Free SWA host pages as every rank counts them within a step: the allocator's free
        count minus the pages this rank's failed reservations of the step would have taken."""
        return self.host_allocator.available - self.phantom_pages

    def _reserve_host(self, npages: int) -> np.ndarray | None:
        ids = self.host_allocator.alloc(npages)
        if ids is None:
            self.phantom_pages += npages
            self.metrics.alloc_failures += 1
        return ids

    def _settle_host(self, npages: int, ids: np.ndarray | None, keep: bool) -> None:
        if ids is None:
            self.phantom_pages -= npages
        elif not keep:
            self.host_allocator.free(ids)

    def reserve_backup(self, nodes: list) -> _HostReservation | None:
        """Several ranks: ``on_backup``'s host pages as a reservation. SWA host eviction is
        sized by ``host_available`` (agreed state even after an earlier reservation of the
        step failed on one rank), the deepest nodes are kept when short (as ``on_backup``),
        and only the allocation itself may differ per rank. None: nothing to back up or no
        room on any rank (nothing held)."""
        need, npages = self._backup_need(nodes)
        if not need:
            return None
        short = npages - self.host_available
        if short > 0:
            self.evict_host(short)
        room = self.host_available
        if npages > room:
            need, npages = self._fit_deepest(need, npages, room)
            if not need:
                return None
        return _HostReservation(need, npages, self._reserve_host(npages))

    def commit_backup(self, nodes: list, r: _HostReservation | None, ok: bool) -> CopyPlan | None:
        """The ranks agreed on the full part of a backup: back up the reserved SWA pages if
        every rank got them (``ok``), else free them: those nodes stay SWA host tombstones, as
        with a short SWA host pool in one process."""
        if r is None:
            return None
        self._settle_host(r.npages, r.ids, ok)
        if not ok:
            self.metrics.backup_failed_tokens += r.npages * self.page_size
            return None
        return self._backup_plan(r.states, r.npages, r.ids)

    def release_backup(self, r: _HostReservation | None) -> None:
        """The full part was rolled back (or the step abandoned): give the reservation back."""
        if r is not None:
            self._settle_host(r.npages, r.ids, False)

    def reserve_host_agreed(self, num_pages: int) -> np.ndarray | None:
        """Several ranks: ``alloc_host`` as the reserve of reserve -> agree -> commit (an L3
        prefetch's window). Evicts by the shortfall of ``host_available``, then takes this
        rank's ``num_pages`` pages. None: its allocation failed, or no rank has room (the
        free count every rank shares is short; counted like a failed allocation, so every
        reservation ends the same way): ``settle_host_agreed(num_pages, ids, keep)`` ends it
        after the step's agreement, on every rank."""
        short = num_pages - self.host_available
        if short > 0:
            self.evict_host(short)
        if num_pages > self.host_available:
            self.phantom_pages += num_pages
            self.metrics.alloc_failures += 1
            return None
        return self._reserve_host(num_pages)

    def settle_host_agreed(self, num_pages: int, ids: np.ndarray | None, keep: bool) -> None:
        """End a ``reserve_host_agreed``: forget its phantom pages; free ``ids`` unless ``keep``
        (then they are the caller's, e.g. for ``insert_host``)."""
        self._settle_host(num_pages, ids, keep)

    def before_load_back(self, node) -> None:
        win = self._window(node)
        if not win:
            return
        top = win[-1]
        st = self.state(top)
        if st is None or st.dev is not None or st.host is None:
            return
        below = sum(n.size for n in win[:-1])
        need = -(-(self.context - below) // self.page_size)  # pages of ``top`` inside the window
        k = top.size // self.page_size - need
        if k > 0:  # only the window's pages come back: split the rest off
            self.tree.split(top, k * self.page_size)

    def load_back_start(self, node, anchor):
        root = self.tree.root
        path = []
        n = anchor
        while n is not root:
            path.append(n)
            n = n.parent
        if not path:
            return anchor
        path.reverse()
        k, _ = self.usable_prefix(path, [x.size for x in path], len(path), False)
        return path[k - 1] if k else root

    def prepare_load(self, node, chain: list) -> CopyPlan | None:
        hold = _Hold("load")
        to_load = []
        for n in self._window(node):
            st = self.state(n)
            if st is not None and st.dev is not None:
                self._hold(st, hold)
            elif st is not None and st.host is not None:
                to_load.append(st)
            else:  # the window is not on any tier: loading cannot make this prefix usable
                self._release(hold)
                self.metrics.load_no_room += 1
                raise NoRoom(f"{self.name}: the window before {node!r} is not on any tier")
        if not to_load:
            if not hold.states:
                return None
            return CopyPlan(
                self.name, _EMPTY, _EMPTY, done=lambda: self._release(hold), cancel=lambda: self._release(hold)
            )
        to_load.reverse()
        npages = sum(st.host.shape[0] for st in to_load)
        dev = self.alloc_device(npages)
        if dev is None:
            self._release(hold)
            self.metrics.load_no_room += 1
            raise NoRoom(f"{self.name}: no device room for {npages} window pages")
        src = np.concatenate([st.host for st in to_load]) if len(to_load) > 1 else to_load[0].host

        def commit() -> None:
            off = 0
            t = self.tree.clock
            for st in to_load:
                k = st.host.shape[0]
                self._hold(st, hold)
                st.access = t
                self._set_dev(st, dev[off : off + k])
                off += k
            self._join_window_holds(to_load)
            self.metrics.loaded_tokens += npages * self.page_size

        def cancel() -> None:
            self._release(hold)
            self.device_allocator.free(dev)

        return CopyPlan(self.name, src, dev, commit=commit, done=lambda: self._release(hold), cancel=cancel)

    # ------------------------------------------------------------------ requests
    def request_pages(self, node, num_pages: int) -> np.ndarray:
        """The SWA ids a request locked at ``node`` (ending at page ``num_pages``) may read:
        the window's pages, -1 elsewhere."""
        out = np.full(num_pages, -1, ID_DTYPE)
        first = max(0, (num_pages * self.page_size - self.context) // self.page_size)
        end = num_pages
        root = self.tree.root
        p = self.page_size
        while node is not root and end > first:
            k = node.size // p
            st = self.state(node)
            if st is not None and st.dev is not None:
                lo = max(first, end - k)
                out[lo:end] = st.dev[lo - (end - k) :]
            end -= k
            node = node.parent
        return out

    def check_free(self, ids: np.ndarray, what: str) -> None:
        """ValueError unless ``ids`` are the caller's own SWA device pages (allocated, not the tree's)."""
        if ids.shape[0] and (self.dev_owned[ids] | ~self.device_allocator.allocated_mask(ids)).any():
            bad = ids[self.dev_owned[ids] | ~self.device_allocator.allocated_mask(ids)]
            raise ValueError(f"{what}: pages {bad[:8].tolist()} are not the request's to free")

    def check_host_pages(self, pages: np.ndarray, what: str) -> None:
        """ValueError unless ``pages`` (-1: none) are a run of -1 then distinct SWA host pages
        the caller holds (allocated, not the tree's)."""
        f = self._frontier(pages)
        ids = pages[f:]
        if not ids.shape[0]:
            return
        if has_duplicates(ids):
            raise ValueError(f"{what}: duplicate ids")
        bad = ids[self.host_owned[ids] | ~self.host_allocator.allocated_mask(ids)]
        if bad.shape[0]:
            raise ValueError(f"{what}: {bad[:8].tolist()} are free or owned by the tree")

    def slide_request(self, req, upto: int | None = None) -> None:
        """The request moved on: free its own pages wholly before the window of its first
        ``upto`` tokens (default: all of ``req.key``; with ranks, the agreed length,
        ``component_steps``) and release its window hold once that window lies past the
        tree's part."""
        pages = None if req.component_pages is None else req.component_pages.get(self.name)
        if pages is None:
            return
        # The window of the request's next pass, and that of its whole pages' end (what its
        # next insert makes usable for later matches): keep both.
        p = self.page_size
        n = req.num_tokens if upto is None else min(upto, req.num_tokens)
        keep_from = (n // p) * p - self.context
        if keep_from <= 0:
            return
        out = min(keep_from // p, pages.shape[0])  # pages wholly before the window
        cached = req.cached_pages
        if out > cached:
            own = pages[cached:out]
            drop = own[own >= 0]
            if drop.shape[0]:
                self.check_free(drop.astype(np.intp), f"req.component_pages[{self.name!r}]")
                self.device_allocator.free(drop)
                own[:] = -1
                self.metrics.freed_request_pages += drop.shape[0]
        if out >= cached and cached and req.last_node is not None and (pages[:cached] >= 0).any():
            self.release_window(req.last_node)
            pages[:cached] = -1

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        self.device_allocator.free(np.flatnonzero(self.dev_owned))
        self.host_allocator.free(np.flatnonzero(self.host_owned))
        self.dev_owned[:] = False
        self.host_owned[:] = False
        self.device_index.clear()
        self.host_index.clear()
        self.evictable_tokens = self.protected_tokens = self.host_tokens = 0
        self._win.clear()
        self.phantom_pages = 0

    # ------------------------------------------------------------------ digest
    def digest_node(self, node) -> bytes:
        """Whether the node has SWA pages on each tier, its SWA holds and its SWA recency
        (no ids: each rank has its own allocators)."""
        st = self.state(node)
        if st is None:
            return b""
        return _DIGEST_NODE.pack((st.dev is not None) | (st.host is not None) << 1, len(st.holders), st.access)

    def digest_state(self) -> dict:
        """The token counters, the window holds of callers' locks (held, released early) and
        the device allocator's free pages. Not the host allocator's: a step's reservations are
        taken before its exchange and settled after it, so a reservation that failed on one
        rank only leaves the free counts apart exactly while the digest is compared (the host
        tree tokens and each node's host flag carry the agreed outcome)."""
        return {
            "evictable_tokens": self.evictable_tokens,
            "protected_tokens": self.protected_tokens,
            "host_tokens": self.host_tokens,
            "window_holds": sum(len(e[0]) for e in self._win.values()),
            "windows_released_early": sum(e[1] for e in self._win.values()),
            "device_available": self.device_allocator.available,
        }

    def stats(self) -> dict:
        p = self.page_size
        return {
            "window": self.window,
            "context_tokens": self.context,
            "window_pages": self.window_pages,
            "device_total_pages": self.device_allocator.num_pages,
            "device_free_pages": self.device_allocator.available,
            "device_evictable_tokens": self.evictable_tokens,
            "device_protected_tokens": self.protected_tokens,
            "host_total_pages": self.host_allocator.num_pages,
            "host_free_pages": self.host_allocator.available,
            "host_tree_tokens": self.host_tokens,
            "page_size": p,
            "metrics": asdict(self.metrics),
        }

    # ------------------------------------------------------------------ invariants
    def check(self, nodes: list, view=None, external: int | None = None) -> list[str]:
        errs: list[str] = []
        p = self.page_size
        name = self.name
        want_dev, want_host = set(), set()
        evictable = protected = host_tokens = 0
        dev_pages, host_pages = [], []
        live_holds = set()
        for node in nodes:
            st = self.state(node)
            if st is None:
                continue
            if node.parent is None:
                if st.dev is not None or st.host is not None or st.holders:
                    errs.append("the root holds SWA pages or holds")
                continue
            if st.node is not node:
                errs.append(f"{node!r}: SWA state belongs to {st.node!r}")
            k = node.size // p
            if st.dev is not None:
                if node.value is None:
                    errs.append(f"{node!r}: SWA on the device without its full KV there")
                if st.dev.shape != (k,):
                    errs.append(f"{node!r}: {st.dev.shape[0]} SWA device pages for {k} pages of tokens")
                dev_pages.append(st.dev)
                if st.holders:
                    protected += node.size
                else:
                    evictable += node.size
                    want_dev.add(st)
            elif st.holders:
                errs.append(f"{node!r}: a tombstone (no SWA device pages) is locked ({len(st.holders)} holds)")
            if st.host is not None:
                if node.host_value is None:
                    errs.append(f"{node!r}: SWA on the host without its full KV there")
                if st.host.shape != (k,):
                    errs.append(f"{node!r}: {st.host.shape[0]} SWA host pages for {k} pages of tokens")
                host_pages.append(st.host)
                host_tokens += node.size
                if st.dev is None:
                    want_host.add(st)
            if len(st.holders) > node.lock_ref:
                errs.append(f"{node!r}: SWA lock {len(st.holders)} exceeds its full lock {node.lock_ref}")
            for h in st.holders:
                live_holds.add(h)
                if st not in h.states:
                    errs.append(f"{node!r}: held by {h!r} which does not list it")
        for h in live_holds:
            for st in h.states:
                if h not in st.holders or st.node.deleted:
                    errs.append(f"{h!r} lists {st.node!r} without holding it")
        for index, want in ((self.device_index, want_dev), (self.host_index, want_host)):
            if index.members != want:
                extra = [s.node for s in index.members if s not in want][:4]
                missing = [s.node for s in want if s not in index.members][:4]
                errs.append(f"{index.name}: stale members {extra}, missing {missing}")
            errs.extend(index.check())
        both = self.device_index.members & self.host_index.members
        if both:
            errs.append(f"nodes in both the SWA device and host eviction lists: {[s.node for s in both][:4]}")
        if (evictable, protected, host_tokens) != (self.evictable_tokens, self.protected_tokens, self.host_tokens):
            errs.append(
                f"SWA counts: evictable {self.evictable_tokens} / protected {self.protected_tokens} / host "
                f"{self.host_tokens}, recomputed {evictable} / {protected} / {host_tokens}"
            )
        windows = sum(len(e[0]) + e[1] for e in self._win.values())
        if view is not None and windows != view.caller_locks:
            errs.append(f"{windows} SWA window holds for {view.caller_locks} caller locks")
        for x, entry in self._win.items():
            need = {st for n in self._window(x) if (st := self.state(n)) is not None and st.dev is not None}
            for hold in entry[0]:
                if not need <= set(hold.states):
                    errs.append(
                        f"a window hold of a caller lock on {x!r} misses SWA pages of its window: "
                        f"{[st.node for st in need - set(hold.states)][:4]}"
                    )
        if self.phantom_pages:
            errs.append(f"SWA host reservations left {self.phantom_pages} phantom pages after their step")
        reserved = np.zeros(0, np.int64) if view is None else view.reserved_host_pages(name)
        for tier, alloc, pages, owned, extra in (
            ("device", self.device_allocator, dev_pages, self.dev_owned, external),
            ("host", self.host_allocator, host_pages, self.host_owned, reserved),
        ):
            try:
                alloc.check()
            except AssertionError as e:
                errs.append(f"SWA {tier} allocator: {e}")
            ids = np.concatenate(pages) if pages else np.zeros(0, np.int64)
            uniq, counts = np.unique(ids, return_counts=True)
            if (counts > 1).any():
                errs.append(f"SWA {tier} pages held by two nodes: {uniq[counts > 1][:8].tolist()}")
            if ids.size and not alloc.is_allocated(ids).all():
                errs.append(
                    f"SWA {tier} pages in the tree but free in the allocator: "
                    f"{ids[~alloc.is_allocated(ids)][:8].tolist()}"
                )
            mask = np.zeros(alloc.num_pages, bool)
            mask[ids] = True
            if not np.array_equal(mask, owned):
                errs.append(
                    f"SWA {tier} ownership bitmap disagrees with the tree at pages "
                    f"{np.flatnonzero(mask != owned)[:8].tolist()}"
                )
            if tier == "device":
                if (evictable + protected) // p != uniq.size:
                    errs.append(f"SWA device pages {uniq.size} != (evictable + protected) tokens / page_size")
                if extra is not None and alloc.available + uniq.size + extra != alloc.num_pages:
                    errs.append(
                        f"SWA device pool memory leak detected: free {alloc.available} + evictable "
                        f"{evictable // p} + protected {protected // p} + external {extra} != total "
                        f"{alloc.num_pages}"
                    )
            else:
                if extra.size and (
                    np.unique(extra).size != extra.size or mask[extra].any() or not alloc.is_allocated(extra).all()
                ):
                    errs.append(
                        "SWA host pages reserved by the storage controller are repeated, free or owned by the tree"
                    )
                if alloc.available + uniq.size + extra.size != alloc.num_pages:
                    errs.append(
                        f"SWA host pool memory leak detected: free {alloc.available} + tree {uniq.size} + "
                        f"reserved {extra.size} != total {alloc.num_pages}"
                    )
        return errs
