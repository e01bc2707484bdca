"""Residency of the target ("full") KV: which pages each node holds on each tier, the page
ownership bitmaps, the token counters and the three eviction indexes.

Pure numpy, owner thread only. ``Residency`` is the one place that puts pages on a node or
takes them off (``set_device`` / ``clear_device`` / ``set_host`` / ``clear_host``, and the
batched forms the hot paths inline), and the one place that decides a node's membership in
the eviction indexes (``refresh``):

* ``device_index``: on-device nodes with no device lock and no on-device child;
* ``host_index``: host-only nodes with no host lock and no backed-up child;
* ``reclaim_index`` (``host_reclaim``): on-device, backed-up nodes with no host lock and no
  backed-up child, whose host copy may be dropped when the host tier is full.

Ownership: ``dev_owned`` / ``host_owned`` mark the pages the tree holds (what ``insert``
validates callers' pages against, and what ``reset`` frees). Counters:
``evictable_tokens`` (on device, unlocked), ``protected_tokens`` (on device, locked) and
``host_tokens``. Path locks (``locks``) move tokens between the first two.
"""

from __future__ import annotations

import numpy as np

from ..allocator import ID_DTYPE, PageAllocator
from .eviction_index import EvictionIndex
from .eviction_policies import EvictionStrategy, ReversedStrategy
from .tree_node import TreeNode

EMPTY_IDS = np.zeros(0, ID_DTYPE)


class Residency:
    """Where the full component's pages live, and which nodes may leave which tier."""

    def __init__(
        self,
        device_allocator: PageAllocator,
        host_allocator: PageAllocator,
        strategy: EvictionStrategy,
        host_reclaim: bool,
    ) -> None:
        self.device_allocator = device_allocator
        self.host_allocator = host_allocator
        # One index per tier rule; a node is in at most one of device/host (disjoint by rule).
        self.device_index = EvictionIndex("device_leaves", 0, strategy)
        self.host_index = EvictionIndex("host_leaves", 1, strategy)
        # Host reclaim drops the copies of the on-device nodes device eviction demotes last
        # first: the host keeps the copies of the nodes about to leave the device.
        self.reclaim_index = EvictionIndex("host_reclaimable", 2, ReversedStrategy(strategy))
        self.indexes = (self.device_index, self.host_index, self.reclaim_index)
        # The member sets, bound once: refresh and the walks test membership on every node.
        self.dev_members = self.device_index.members
        self.host_members = self.host_index.members
        self.reclaim_members = self.reclaim_index.members
        self.reclaim = host_reclaim
        self.dev_owned = np.zeros(device_allocator.num_pages, bool)
        self.host_owned = np.zeros(host_allocator.num_pages, bool)
        self.root: TreeNode | None = None
        self.evictable_tokens = 0  # on device, lock_ref == 0
        self.protected_tokens = 0  # on device, lock_ref > 0
        self.host_tokens = 0  # held on the host tier
        # An attached ``ResidencyWatch`` (events, retention), or None: every hook site tests it.
        self.watch = None

    def adopt_root(self, root: TreeNode) -> None:
        """A new (empty) tree: its root holds an empty value on both tiers and stays locked."""
        root.value = EMPTY_IDS
        root.host_value = EMPTY_IDS
        root.lock_ref = 1  # the root is never evicted on either tier
        root.host_lock_ref = 1
        self.root = root
        self.evictable_tokens = self.protected_tokens = self.host_tokens = 0
        for index in self.indexes:
            index.clear()

    # ------------------------------------------------------------------ index membership
    def refresh(self, node: TreeNode) -> None:
        """Recompute node's membership in every eviction index (after any state change)."""
        if node is self.root or node.deleted:
            return
        on_dev = node.value is not None
        if node.host_value is not None and node.host_lock_ref == 0 and node.host_children == 0:
            host = not on_dev
            reclaim = on_dev and self.reclaim
        else:
            host = reclaim = False
        dev = on_dev and node.lock_ref == 0 and node.dev_children == 0
        # Hot path: most refreshes change nothing, so compare before touching the sets.
        if dev != (node in self.dev_members):
            self.device_index.set_member(node, dev)
        if host != (node in self.host_members):
            self.host_index.set_member(node, host)
        if reclaim != (node in self.reclaim_members):
            self.reclaim_index.set_member(node, reclaim)

    def stamp(self, node: TreeNode, t: int) -> None:
        """Give ``node`` the access time ``t`` and re-order it in every index that lists it
        (a split's remainder under ``stamp_split_remainder``, ``decisions``)."""
        node.last_access = t
        for index in self.indexes:
            if node in index.members:
                index.push(node)

    def forget(self, node: TreeNode) -> None:
        """The node leaves the tree: drop it from every index."""
        for index in self.indexes:
            index.set_member(node, False)

    # ------------------------------------------------------------------ pages on nodes
    def set_device(self, node: TreeNode, ids: np.ndarray) -> None:
        node.value = ids
        self.dev_owned[ids] = True
        if node.lock_ref:
            self.protected_tokens += node.size
        else:
            self.evictable_tokens += node.size
        node.parent.dev_children += 1
        self.refresh(node)
        self.refresh(node.parent)
        if self.watch is not None:
            self.watch.stored("device", node)

    def set_host(self, node: TreeNode, ids: np.ndarray) -> None:
        node.host_value = ids
        self.host_owned[ids] = True
        self.host_tokens += node.size
        node.parent.host_children += 1
        self.refresh(node)
        self.refresh(node.parent)
        if self.watch is not None:
            self.watch.stored("host", node)

    def clear_host(self, node: TreeNode, owned: bool = True) -> np.ndarray:
        """Take ``node``'s pages off the host tier; ``owned=False``: the caller clears
        ``host_owned`` for them (one batched write per eviction, ``free_tree_pages``)."""
        ids = node.host_value
        node.host_value = None
        if owned:
            self.host_owned[ids] = False
        self.host_tokens -= node.size
        node.parent.host_children -= 1
        self.refresh(node)
        self.refresh(node.parent)
        if self.watch is not None:
            self.watch.removed("host", node)
        return ids

    def split(self, upper: TreeNode, lower: TreeNode, k: int) -> None:
        """``tree.split`` made ``upper`` out of ``lower``'s first ``k`` pages: divide the pages
        and copy the path locks (every holder whose path crossed ``lower`` crosses ``upper``)."""
        upper.value = None if lower.value is None else lower.value[:k]
        upper.host_value = None if lower.host_value is None else lower.host_value[:k]
        upper.lock_ref = lower.lock_ref
        upper.host_lock_ref = lower.host_lock_ref
        if lower.value is not None:
            lower.value = lower.value[k:]
        if lower.host_value is not None:
            lower.host_value = lower.host_value[k:]
        upper.dev_children = int(lower.value is not None)
        upper.host_children = int(lower.host_value is not None)
        self.refresh(upper)
        if self.watch is not None:
            self.watch.split(upper, lower, k)

    # ------------------------------------------------------------------ freeing
    def free_device_pages(self, free_ids: list) -> None:
        """Return pages taken off the device tier (``dev_owned`` still marks them): one bitmap
        write and one allocator free for the whole batch (distinct by the bitmap)."""
        _free(free_ids, self.dev_owned, self.device_allocator)

    def free_host_pages(self, free_ids: list) -> None:
        """``free_device_pages`` for the host tier."""
        _free(free_ids, self.host_owned, self.host_allocator)

    def owned_device_ids(self) -> np.ndarray:
        return np.flatnonzero(self.dev_owned).astype(ID_DTYPE)

    def owned_host_ids(self) -> np.ndarray:
        return np.flatnonzero(self.host_owned).astype(ID_DTYPE)

    def drop_all(self) -> None:
        """``reset``: free every page the tree owns on both tiers."""
        self.device_allocator.free(self.owned_device_ids())
        self.host_allocator.free(self.owned_host_ids())
        self.dev_owned[:] = False
        self.host_owned[:] = False


def _free(free_ids: list, owned: np.ndarray, allocator: PageAllocator) -> None:
    ids = np.concatenate(free_ids, dtype=np.intp) if len(free_ids) > 1 else free_ids[0].astype(np.intp)
    owned[ids] = False
    allocator.free_owned(ids)
