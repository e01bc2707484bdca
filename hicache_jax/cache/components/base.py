"""The component plug-in interface: one KV pool pair (device + host) riding through the tree.

Pure Python, owner thread only; only integer page ids cross into the engines.

A component moves its pages with every transfer of the tree (``backup`` / ``load``: given
the full component's page ids, it copies the pages it keeps for them) and, when it keeps
per-node state of its own (``stateful``), hears about every change of the tree's shape and
residency through hooks:

===========================  ===============================================================
hook                         called when
===========================  ===============================================================
``attach(ctx)``              once, when the cache is built (``ComponentContext``: the tree,
                             residency, evictor, ... a component may act on)
``on_split(upper, lower,     ``tree.split`` divided ``lower``: ``upper`` took its first ``k``
k)``                         pages (after the full component's split)
``on_insert(node)``          ``node`` gained pages on a tier: a new leaf, a revived host-only
                             node, attached L3 pages
``check_insert(segs, off0,   an insert is about to change the tree (nothing changed yet): may
pages)``                     refuse it (ValueError) over this component's ``pages``
``on_insert_span(last,       an insert ended at ``last``; the inserted span is its last
span, pages)``               ``span`` tokens, ``pages`` the caller's (taken or freed, each one)
``on_attach_host(leaf,       ``insert_host`` gave host pages up to ``leaf``'s end (None:
pages, first)``              nothing); this component's ``pages[first:]`` are the last pages of
                             the path ending there: device-only nodes given host copies (only
                             with ``device_only_host_copies``), then ``leaf`` (host-only, or
                             the last of those nodes); it keeps or frees each page
``on_backup(nodes)``         these nodes (root first) were just marked backed up; their copy is
                             issued right after; returns this component's ``CopyPlan`` or None
``reserve_backup(nodes)``,   several ranks: the backup of ``nodes`` as reserve -> agree ->
``commit_backup(nodes, r,    commit: reserve this component's host pages (an object with
ok)``,                       ``ok``: whether this rank got them; None: nothing to reserve),
``release_backup(r)``        then, once the ranks agreed, ``commit_backup`` (``ok``: every
                             rank's reservation succeeded; returns the ``CopyPlan`` or None)
                             or ``release_backup`` (the full part was rolled back). Default:
                             nothing reserved, ``commit_backup`` is ``on_backup``
``before_load_back(node)``   a load-back of ``node`` starts (may split host nodes)
``load_back_start(node,      the continuation a load-back makes usable starts below the
anchor)``                    returned ancestor of ``anchor`` (default: ``anchor`` itself)
``prepare_load(node,         a load-back will be issued: returns a ``CopyPlan`` (its pages
chain)``                     allocated) or None; raises ``NoRoom`` to skip the load-back
``on_load(nodes)``           these host-only nodes just got device pages (a load-back, issued)
``usable_prefix(nodes,       ``match`` / ``peek`` found these nodes (root first; the first
sizes, n_dev, touch)``       ``n_dev`` on the device): how many leading ones are usable on the
                             device and on any tier
``usable_device_nodes(       (the default ``usable_prefix`` asks this for the device part)
nodes)``
``on_lock(receipt)`` /       a path lock was taken / released (``locks.LockReceipt``)
``on_release(receipt)``
``on_evict(node, tier)``     ``node`` is about to leave ``"device"`` or ``"host"``
``slide_request(req,         ``HiRadixCache.slide_window(req)``: the request moved on (with
upto)``                      ranks: to the agreed length, ``component_steps``)
``check(nodes, view,         ``sanity_check``: this component's invariant violations
external)``
``digest_node(node)`` /      ``debug_view().digest()``: this component's per-node state and
``digest_state()``           its counters, as bytes / a dict of ints (ids left out: equal
                             across ranks that made the same decisions)
``reset()``                  the cache dropped everything
===========================  ===============================================================

Hooks of stateless components are never called: the cache keeps one tuple of stateful
components and checks it once per operation, so the full component's fast paths cost
nothing extra while none is registered. Per-node state lives in ``TreeNode.ext[name]``.

Own page ids (``own_page_ids``): a sidecar shares the full component's page ids; a component
with its own allocators (e.g. ``swa``, a sliding-window pool smaller than the full one)
keeps its own ids per node and moves them through ``CopyPlan``s: its ``backup`` / ``load``
copy the plan's ids (nothing without a plan), and the cache keeps the plan with the copy in
flight (issued again with it on a retry) and calls ``done()`` when the copy is acknowledged.
The request helpers carry such a component's pages in ``CacheRequest.component_pages``.
Such a component also provides, for the facade and the L3 controller: ``device_allocator``,
``host_allocator``, ``alloc_device(n)`` / ``alloc_host(n)`` (allocation with its own
eviction), ``request_pages(node, n)``, ``slide_request(req)``, ``check_free(ids, what)``,
``check_host_pages(ids, what)`` and ``node_host_pages(node)`` (``swa.SWAComponent``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from ...transfer import KVTransferEngine, LoadHandle, TransferHandle

if TYPE_CHECKING:  # pragma: no cover
    from ..config import HiCacheConfig
    from ..evictor import Evictor
    from ..locks import PathLocks
    from ..metrics import CacheMetrics
    from ..residency import Residency
    from ..copies_in_flight import TransferLedger
    from ..tree import RadixTree


class NoRoom(Exception):
    """A component cannot allocate what an operation needs (``prepare_load``): the operation
    is skipped, as when the full pool has no room."""


class ComponentContext:
    """What a stateful component may act on (``attach``): the cache's own modules."""

    def __init__(
        self,
        config: "HiCacheConfig",
        tree: "RadixTree",
        residency: "Residency",
        evictor: "Evictor",
        locks: "PathLocks",
        ledger: "TransferLedger",
        metrics: "CacheMetrics",
    ) -> None:
        self.config = config
        self.page_size = config.page_size
        self.tree = tree
        self.res = residency
        self.evictor = evictor
        self.locks = locks
        self.ledger = ledger
        self.metrics = metrics


class CopyPlan:
    """One component's part of a transfer, in its own page ids: copy ``src`` -> ``dst`` (device
    -> host for a backup, host -> device for a load). ``commit`` applies a load's new state
    once the copy is issued; ``done`` runs when the copy is acknowledged (release what kept
    its pages); ``cancel`` when it is never issued (free what ``prepare_load`` allocated)."""

    __slots__ = ("component", "src", "dst", "_commit", "_done", "_cancel")

    def __init__(
        self,
        component: str,
        src: np.ndarray,
        dst: np.ndarray,
        *,
        commit: Callable[[], None] | None = None,
        done: Callable[[], None] | None = None,
        cancel: Callable[[], None] | None = None,
    ) -> None:
        self.component = component
        self.src, self.dst = src, dst
        self._commit, self._done, self._cancel = commit, done, cancel

    def commit(self) -> None:
        if self._commit is not None:
            self._commit()
            self._commit = None

    def done(self) -> None:
        if self._done is not None:
            self._done()
            self._done = None
            self._cancel = None

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel()
            self._cancel = None
            self._done = None

    def __repr__(self) -> str:
        return f"CopyPlan({self.component!r}, {len(self.src)} pages)"


class KVComponent:
    """One KV pool pair and its hooks; see the module docstring."""

    stateful = False  # True: the tree calls the structural hooks below
    own_page_ids = False  # True: its own page ids per node, moved through CopyPlans
    # L3: None stores every page (ALL_PAGES); n >= 1 stores and requires only the n pages
    # before a hit's end (TRAILING_PAGES, e.g. a sliding window's pages).
    l3_trailing_pages: int | None = None
    # L3: True when ``on_attach_host`` places pages on device-only nodes that ``insert_host``
    # gave full host copies (a prefetch read from the backed-up end of a match); a stateful
    # component without it makes such a prefetch anchor at the match's end (not read).
    device_only_host_copies = False

    def __init__(self, name: str, engine: KVTransferEngine) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty str, got {name!r}")
        if not isinstance(engine, KVTransferEngine):
            raise TypeError(f"engine: expected a KVTransferEngine, got {type(engine).__name__}")
        self.name = name
        self.engine = engine

    # ------------------------------------------------------------------ transfers
    def backup(
        self, device_ids: np.ndarray, host_ids: np.ndarray, plan: CopyPlan | None = None
    ) -> TransferHandle | None:
        """D2H copy of this component's pages for the full pages ``device_ids`` -> ``host_ids``
        (the cache's own ids: ``KVTransferEngine.backup_owned``); a component with its own
        ids copies its ``plan`` instead (None: nothing to copy)."""
        if self.own_page_ids:
            return None if plan is None else self.engine.backup_owned(plan.src, plan.dst)
        return self.engine.backup_owned(device_ids, host_ids)

    def load(self, host_ids: np.ndarray, device_ids: np.ndarray, plan: CopyPlan | None = None) -> LoadHandle | None:
        """H2D copy of this component's pages for the full pages ``host_ids`` -> ``device_ids``."""
        if self.own_page_ids:
            return None if plan is None else self.engine.load_owned(plan.src, plan.dst)
        return self.engine.load_owned(host_ids, device_ids)

    # ------------------------------------------------------------------ structural hooks
    def attach(self, ctx: ComponentContext) -> None:
        pass

    def on_split(self, upper, lower, k: int) -> None:
        pass

    def on_insert(self, node) -> None:
        pass

    def check_insert(self, segs: list, off0: int, pages: np.ndarray | None) -> None:
        pass

    def on_insert_span(self, last, span: int, pages: np.ndarray | None) -> None:
        pass

    def on_attach_host(self, leaf, pages: np.ndarray | None, first: int) -> None:
        pass

    def on_backup(self, nodes: list) -> CopyPlan | None:
        return None

    def reserve_backup(self, nodes: list):
        return None

    def commit_backup(self, nodes: list, reservation, ok: bool) -> CopyPlan | None:
        return self.on_backup(nodes)

    def release_backup(self, reservation) -> None:
        pass

    def before_load_back(self, node) -> None:
        pass

    def load_back_start(self, node, anchor):
        return anchor

    def prepare_load(self, node, chain: list) -> CopyPlan | None:
        return None

    def on_load(self, nodes: list) -> None:
        pass

    def usable_device_nodes(self, nodes: list) -> int:
        return len(nodes)

    def usable_prefix(self, nodes: list, sizes: list, n_dev: int, touch: bool) -> tuple[int, int]:
        """(device-usable, any-tier-usable) leading node counts. The default asks
        ``usable_device_nodes`` for the device part; a shortened device prefix also ends the
        any-tier one there (what lies past it needs this component's own load path)."""
        k = self.usable_device_nodes(nodes[:n_dev]) if n_dev else 0
        return (k, k) if k < n_dev else (k, len(nodes))

    def on_lock(self, receipt) -> None:
        pass

    def on_release(self, receipt) -> None:
        pass

    def on_evict(self, node, tier: str) -> None:
        pass

    def slide_request(self, req, upto: int | None = None) -> None:
        """``req`` moved on; ``upto``: slide only as far as its first ``upto`` tokens (None: all)."""
        pass

    def request_pages(self, node, num_pages: int) -> np.ndarray | None:
        """Own-id components: the ids a request locked at ``node`` may use for the first
        ``num_pages`` pages of its key (-1 where none)."""
        return None

    def check(self, nodes: list, view=None, external: int | None = None) -> list[str]:
        return []

    def reset(self) -> None:
        pass

    # ------------------------------------------------------------------ digest (several ranks)
    def digest_node(self, node) -> bytes:
        """This component's state of ``node`` for ``debug_view().digest()``, as fixed-width
        bytes that are equal on every rank whose tree made the same decisions (no page ids,
        no Python ``hash``). Default: nothing."""
        return b""

    def digest_state(self) -> dict:
        """This component's counters for the digest (name -> int). Default: none."""
        return {}

    def stats(self) -> dict:
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
