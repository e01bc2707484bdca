"""A read-only view of one cache's internals, for invariant checks and tests (plus two
fault-injection calls for tests of ``sanity_check``: ``inject_*``; the eviction indexes have
their own, ``EvictionIndex.inject_entry``).

Pure numpy, owner thread only, O(1) to make. Everything it returns is a copy or an
immutable value, except the nodes and eviction indexes themselves, which callers must not
change. ``invariants.collect_violations`` reads the cache only through this view; tests that
must look inside (the ownership bitmaps, the copies in flight, a request's fast path) use it
instead of private attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from .eviction_index import EvictionIndex
from .tree_node import TreeNode

if TYPE_CHECKING:  # pragma: no cover
    from ..allocator import PageAllocator
    from .assembly import CacheParts
    from .config import HiCacheConfig
    from .request_helpers import RequestHelpers


class ViewedCache(Protocol):
    """What the view takes from the cache it shows (``HiRadixCache`` is one): its identity (the
    nodes' owner), settings and allocators. Typed against this rather than the cache, so this
    module never imports the module that imports it (no import circle in ``cache``)."""

    config: "HiCacheConfig"
    page_size: int
    device_allocator: "PageAllocator"
    host_allocator: "PageAllocator | None"


class CacheDebugView:
    def __init__(self, cache: ViewedCache, parts: "CacheParts") -> None:
        self.cache = cache
        self.config = cache.config
        self.page_size = cache.page_size
        self.device_allocator = cache.device_allocator
        self.host_allocator = cache.host_allocator
        self.components = parts.stateful  # the stateful plug-in components (their ``check`` hooks)
        self._tree, self._res, self._ledger = parts.tree, parts.res, parts.ledger
        self._callers, self._requests = parts.callers, parts.requests
        self._evictor = parts.evictor
        self._agreed_backups = parts.agreed_backups  # several ranks' backup reservations, or None
        self._component_steps = parts.component_steps  # several ranks' agreed window slides, or None
        self._reserved_backups = parts.backups.reserved  # BackupIssuer.reserved

    @property
    def root(self) -> TreeNode:
        return self._tree.root

    def nodes(self) -> list[TreeNode]:
        return self._tree.nodes()

    @property
    def indexes(self) -> tuple[EvictionIndex, EvictionIndex, EvictionIndex]:
        """(device, host, reclaim) eviction indexes."""
        res = self._res
        return res.device_index, res.host_index, res.reclaim_index

    @property
    def watch(self):
        """The residency watch slot (``residency_watch``): None while nothing is attached."""
        return self._res.watch

    @property
    def counters(self) -> dict[str, int]:
        res = self._res
        return {
            "evictable_tokens": res.evictable_tokens,
            "protected_tokens": res.protected_tokens,
            "host_tokens": res.host_tokens,
        }

    def inject_counter_error(self, name: str, delta: int) -> None:
        """Fault injection for tests of ``sanity_check`` (the one thing here that writes):
        shift one of ``counters`` by ``delta`` without the change it should reflect."""
        if name not in ("evictable_tokens", "protected_tokens", "host_tokens"):
            raise ValueError(f"name: expected one of the counters, got {name!r}")
        setattr(self._res, name, getattr(self._res, name) + delta)

    def inject_ownership_error(self, tier: str, page: int) -> None:
        """Fault injection for tests of ``sanity_check``: flip page ``page``'s bit in the
        ``tier`` (``"device"`` / ``"host"``) ownership bitmap, nothing else."""
        if tier not in ("device", "host"):
            raise ValueError(f"tier: expected 'device' or 'host', got {tier!r}")
        owned = self._res.dev_owned if tier == "device" else self._res.host_owned
        owned[page] = not owned[page]

    @property
    def clock(self) -> int:
        """The tree's logical clock."""
        return self._tree.clock

    @property
    def tracked_slides(self) -> int:
        """Several ranks with own-id components: requests whose window slides are tracked
        (``component_steps``); 0 otherwise."""
        steps = self._component_steps
        return 0 if steps is None else len(steps.tracked)

    @property
    def reservations(self) -> tuple[int, int]:
        """Several ranks: (host pages this rank's failed reservations still count, backup
        reservations waiting for their agreement); both 0 outside a step."""
        backups = self._agreed_backups
        return self._evictor.phantom_pages, 0 if backups is None else len(backups.pending)

    @property
    def reserved_backup_nodes(self) -> int:
        """Several ranks: nodes of backup chains reserved and not yet committed or released
        (``BackupIssuer.reserved``, which keeps an L3 attach off them); 0 outside an agreement."""
        return len(self._reserved_backups)

    def inject_reserved_backup(self, node: TreeNode) -> None:
        """Fault injection for tests of ``sanity_check``: ``node`` left counted as reserved for
        a backup after its agreement."""
        self._reserved_backups[node] = self._reserved_backups.get(node, 0) + 1

    def inject_phantom_pages(self, n: int) -> None:
        """Fault injection for tests of ``sanity_check``: a reservation left counting ``n``
        phantom host pages after its step."""
        self._evictor.phantom_pages += n

    @property
    def device_owned(self) -> np.ndarray:
        """Copy of the device-page ownership bitmap (True: the tree's page)."""
        return self._res.dev_owned.copy()

    @property
    def host_owned(self) -> np.ndarray:
        return self._res.host_owned.copy()

    def pending(self) -> list[tuple[str, TreeNode]]:
        """The copies in flight, in queue order: ``("backup" | "load", node)``."""
        return [("backup", op.node) for op in self._ledger.writes] + [("load", op.node) for op in self._ledger.loads]

    def pending_load_handles(self) -> list:
        """The handles of the load-backs in flight, in queue order."""
        return [op.handle for op in self._ledger.loads]

    def digest(self, pages: bool = False) -> str:
        """Hex digest of the tree's structure and residency per node, the clock, the counters
        and the copies in flight (``rank_digest.state_digest``): equal across ranks whose trees
        made the same decisions. ``pages=True`` also folds in the page ids. Stateful components
        (e.g. ``swa``) add their per-node state and counters (``KVComponent.digest_node`` /
        ``digest_state``); a cache without them digests exactly as before."""
        from .rank_digest import state_digest

        return state_digest(self._tree.root, self._tree.clock, self.counters, self.pending(), pages, self.components)

    @property
    def caller_locks(self) -> int:
        """Locks callers hold (``inc_lock_ref`` and the request helpers)."""
        return self._callers.count()

    def caller_locks_by_node(self) -> dict:
        """Locks callers hold, per node (only nodes with at least one): ``{node: count}``."""
        return {node: len(r) for node, r in self._callers.by_node.items() if r}

    def reserved_host_pages(self, component: str | None = None) -> np.ndarray:
        """Host pages the attached L3 controller holds for prefetches (not the tree's): of the
        full component, or of ``component`` (one with its own page ids)."""
        hook = self._ledger.storage_hook
        if hook is None:
            return np.zeros(0, np.int64)
        if component is None:
            return np.asarray(hook.reserved_host_pages(), np.int64)
        of = getattr(hook, "reserved_component_host_pages", None)
        return np.zeros(0, np.int64) if of is None else np.asarray(of(component), np.int64)

    @property
    def requests(self) -> "RequestHelpers":
        """The request helpers (tests call ``request_path`` on it, or patch it to force walks
        from the root)."""
        return self._requests
