"""Eviction and allocation with eviction, on both tiers.

Pure numpy, owner thread only. The order comes from the eviction indexes (``residency``,
ordered by the configured strategy); this module decides what leaving a tier means:

* device (``evict``): pop unlocked device leaves. A backed-up leaf is demoted to host-only
  (a host eviction candidate from then on); otherwise it is deleted. Under write_back the
  write policy first backs the leaf up, blocking (``before_evict``, set by
  ``write_policy``); when the host has no room the leaf is dropped. The copies one eviction
  staged stay off the host index until it ends, so a later backup of the same eviction
  never evicts them to make room.
* host (``evict_host``): first (``host_reclaim``) the host copies of on-device nodes with no
  backed-up child are dropped, the most recently used first (the reverse of device
  eviction's order, so the host keeps the copies of the nodes about to leave the device);
  then host-only, host-unlocked leaves are deleted, least recently used first. A host-only
  leaf long off the device goes before the copies (``HOST_ONLY_AGING``). That is the
  ``aging`` order; ``decisions`` picks it, ``copies_first`` (no aging) or upstream's
  ``host_only_first`` (host-only leaves first, copies only when none can go).

``alloc_device`` / ``alloc_host`` allocate, evicting when short. A device allocation that
needed eviction takes the pages the eviction frees directly (no free and re-allocation):
for the caller, or, with ``owned``, for the tree itself (a load-back's destination).
Plug-in components with their own residency are told of every node leaving a tier
(``on_evict`` hooks) when any is registered.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .decisions import AGING, HOST_ONLY_FIRST
from .metrics import CacheMetrics
from .residency import Residency
from .tree import RadixTree
from .tree_node import TreeNode

# Host eviction (``evict_host``): a host-only leaf goes before a host copy of an on-device node
# once it is older than the device's eviction boundary by this many times the copy's lead over
# it (see there). Measured on the multiturn-64x10 trace (bench_tree_multiturn, write_through,
# L2 at host ratios 0.5/1/2): 1 -> 0.026/0.069/0.184, 4 -> 0.067/0.151/0.301, 8 -> 0.082/
# 0.188/0.368 (reclaiming least recently used copies after host-only leaves: 0/0/0.184).
# 4 is the largest tried that keeps the trace's hit rates at host ratio 4 upstream's
# (6 raises L2 there, 0.501 -> 0.506): upstream never reclaims, and a big host must behave
# as upstream's.
HOST_ONLY_AGING = 4


class Evictor:
    """Eviction on both tiers; see the module docstring."""

    def __init__(
        self,
        tree: RadixTree,
        residency: Residency,
        metrics: CacheMetrics,
        page_size: int,
        write_back: bool,
        host_eviction_order: str = AGING,
    ) -> None:
        self.tree = tree
        self.res = residency
        self.metrics = metrics
        self.page_size = page_size
        self.write_back = write_back
        self.host_eviction_order = host_eviction_order  # ``decisions``; see ``evict_host``
        # write_back: back ``node`` up (blocking) before it leaves the device; set by the write policy.
        self.before_evict: Callable[[TreeNode], None] | None = None
        self.hooked: tuple = ()  # components with their own residency (``components``)
        # Several ranks: pages that reservations of the current step failed to allocate on
        # this rank (``reserve_host``); 0 otherwise.
        self.phantom_pages = 0

    # ------------------------------------------------------------------ device
    def evict(self, num_tokens: int, keep: int = 0) -> tuple[int, np.ndarray | None]:
        """Free at least ``num_tokens`` device tokens if possible; returns ``(tokens freed,
        kept pages)``. With ``keep``, up to that many of the pages taken off the tree (the
        first ones evicted) are not freed: they stay allocated and marked as the tree's, and
        come back as an int32 array (None if none) for the tree's own use or the caller's."""
        t0 = time.perf_counter()
        m = self.metrics
        m.evict_calls += 1
        res = self.res
        watch = res.watch
        if watch is not None:
            watch.before_evict("device")
        freed = demoted = deleted = 0
        free_ids = []
        dm, hm, rm = res.dev_members, res.host_members, res.reclaim_members
        before_evict = self.before_evict if self.write_back else None
        hooked = self.hooked
        dl = res.device_index
        tree = self.tree
        root = tree.root
        nxt = None  # a parent that just became the next candidate (see below)
        staged = []  # write_back: nodes this call backed up, guarded until it ends
        while freed < num_tokens:
            if nxt is None:
                node = dl.pop()
                if node is None:
                    break
            else:
                node, nxt = nxt, None
            size = node.size
            if node.host_value is None and before_evict is not None:
                before_evict(node)  # write_back blocks on the copy, as upstream
                if node.host_value is not None:
                    # Staged by this eviction: its fresh host copy is no host eviction
                    # candidate until the eviction ends (a later backup of this same call
                    # must not evict it to make room; upstream demotes only at the end).
                    node.host_lock_ref += 1
                    staged.append(node)
            if hooked:
                for comp in hooked:
                    comp.on_evict(node, "device")
            # Inlined clear-device (+ unlink): the node left the device index when popped
            # (write_back: the backup's unlock may have re-listed it).
            assert node.lock_ref == 0, "evicting a locked node"
            free_ids.append(node.value)
            node.value = None
            parent = node.parent
            parent.dev_children -= 1
            freed += size
            if node in dm:
                dl.set_member(node, False)
            if watch is not None:
                watch.removed("device", node)
            if node.host_value is None:
                # Holds nothing now: it is in no index (never backed up), unlink it.
                tree.unlink(node)
                deleted += size
            else:
                # Host-only from now on: a host eviction candidate unless host-locked or a
                # parent of host copies; no longer a reclaim candidate (not on the device).
                if node.host_lock_ref == 0 and node.host_children == 0 and node not in hm:
                    hm.add(node)  # inlined host_index.set_member(node, True)
                    res.host_index.push(node)
                if node in rm:
                    res.reclaim_index.set_member(node, False)
                demoted += size
            # Inlined refresh(parent): only its device-leaf status can change (one device
            # child fewer); the root is never in an index. A parent that would be popped next
            # anyway (usually: a chain of one conversation's nodes shares its access time) is
            # taken directly, skipping a heap push and pop; the eviction order is the same.
            if parent.dev_children == 0 and parent.lock_ref == 0 and parent is not root and parent not in dm:
                if freed < num_tokens and dl.precedes(parent):
                    nxt = parent
                else:
                    dm.add(parent)  # inlined device_index.set_member(parent, True)
                    dl.push(parent)
        for node in staged:  # now host eviction candidates (host-only leaves)
            node.host_lock_ref -= 1
            res.refresh(node)
        res.evictable_tokens -= freed  # every evicted node was unlocked: evictable
        m.deleted_device_tokens += deleted
        m.demoted_tokens += demoted
        kept = None
        if free_ids and keep:
            ids = np.concatenate(free_ids) if len(free_ids) > 1 else free_ids[0]
            kept = ids[:keep].copy()  # never a view of a former node's pages
            if ids.shape[0] > keep:
                res.free_device_pages([ids[keep:]])
        elif free_ids:
            res.free_device_pages(free_ids)
        m.evicted_device_tokens += freed
        m.eviction_seconds += time.perf_counter() - t0
        return freed, kept

    def alloc_device(self, num_pages: int, owned: bool, whole: bool = False) -> np.ndarray | None:
        """``num_pages`` device pages, evicting if short: the caller's, or, with ``owned``, the
        tree's own, already marked as the tree's. None (nothing allocated, the eviction done)
        when the device has no room even after eviction. When short, the eviction frees the
        shortfall, or, with ``whole``, ``num_pages`` (upstream's load-back batch, ``decisions``)."""
        res = self.res
        a = res.device_allocator
        short = num_pages - a.available
        if short <= 0:
            ids = a.alloc(num_pages)
            if owned:
                res.dev_owned[ids] = True
            return ids
        _freed, kept = self.evict((num_pages if whole else short) * self.page_size, keep=num_pages)
        rest = num_pages - (0 if kept is None else kept.shape[0])
        more = a.alloc(rest) if rest else None
        if rest and more is None:
            if kept is not None:  # still the tree's: free them as an eviction would have
                res.free_device_pages([kept])
            return None
        if kept is not None and not owned:
            res.dev_owned[kept] = False  # the caller's now (still allocated)
        if more is not None and owned:
            res.dev_owned[more] = True
        if kept is None:
            return more
        return kept if more is None else np.concatenate([kept, more])

    def evict_leaf(self, node: TreeNode) -> None:
        """Evict one given unlocked device leaf (no device lock, no on-device child), as
        ``evict`` would when it popped it: demoted to host-only if backed up (write_back backs
        it up first), else deleted. For components whose own eviction picks a leaf (a
        sliding-window pool short of pages evicts whole leaves, ``components.swa``); never on
        the full component's hot paths."""
        res = self.res
        if node.lock_ref or node.dev_children or node.value is None or node is self.tree.root:
            raise ValueError(f"node: {node!r} is not an unlocked device leaf")
        m = self.metrics
        if node.host_value is None and self.write_back and self.before_evict is not None:
            self.before_evict(node)
        for comp in self.hooked:
            comp.on_evict(node, "device")
        res.device_index.set_member(node, False)
        ids = node.value
        node.value = None
        parent = node.parent
        parent.dev_children -= 1
        res.evictable_tokens -= node.size
        if res.watch is not None:
            res.watch.removed("device", node)
        if node.host_value is None:
            res.forget(node)
            self.tree.unlink(node)
            m.deleted_device_tokens += node.size
        else:
            res.refresh(node)
            m.demoted_tokens += node.size
        res.refresh(parent)
        res.free_device_pages([ids])
        m.evicted_device_tokens += node.size

    def drop_host_leaf(self, node: TreeNode) -> None:
        """Delete one given host-only leaf (no host lock, no backed-up child), as ``evict_host``
        would; for components' own host eviction, like ``evict_leaf``."""
        res = self.res
        if (
            node.value is not None
            or node.host_value is None
            or node.host_lock_ref
            or node.host_children
            or node.children
        ):
            raise ValueError(f"node: {node!r} is not an unlocked host-only leaf")
        for comp in self.hooked:
            comp.on_evict(node, "host")
        ids = res.clear_host(node, owned=False)
        res.forget(node)
        parent = node.parent
        self.tree.unlink(node)
        res.refresh(parent)
        res.free_host_pages([ids])
        self.metrics.evicted_host_tokens += node.size

    # ------------------------------------------------------------------ host
    def evict_host(self, num_pages: int) -> int:
        """Free at least ``num_pages`` host pages if possible; returns pages freed."""
        t0 = time.perf_counter()
        m = self.metrics
        m.evict_host_calls += 1
        res = self.res
        if res.watch is not None:
            res.watch.before_evict("host")
        hooked = self.hooked
        want = num_pages * self.page_size
        freed = 0
        free_ids = []
        # Two kinds of victims: host copies of on-device nodes (``host_reclaim``; the reclaim
        # index lists the most recently used first, ``residency``) and host-only leaves
        # (least recently used first). A copy is redundant while its node is on the device,
        # and the copies of the most recently used nodes stay redundant longest (device
        # eviction demotes them last); dropping the least recently used ones instead (the
        # old order) left the host nothing for the nodes leaving the device next. So copies
        # go first, the most recently used first, and the host keeps the host-only leaves
        # and the copies of the nodes about to leave the device. A host-only leaf must not
        # stay forever though: it goes first once it is older than the device's eviction
        # boundary (the next device victim's access time) minus HOST_ONLY_AGING times the
        # copy's lead over that boundary (no aging while the device has no victim).
        # That is the ``aging`` order; ``copies_first`` never ages (write_back: a dropped copy
        # costs a copy when its node leaves the device, never a hit) and ``host_only_first``
        # is upstream's (copies only once no host-only leaf can go), ``decisions``.
        rl, hl = res.reclaim_index, res.host_index
        order = self.host_eviction_order
        host_first = order == HOST_ONLY_FIRST
        d = res.device_index.peek() if order == AGING and hl and rl else None
        boundary = None if d is None else d.last_access  # None: no device victim, no aging
        while freed < want:
            if host_first:
                node = hl.pop()
                host_only = node is not None
                if not host_only:
                    node = rl.pop()
                    if node is None:
                        break
            else:
                node = rl.peek()
                if node is not None and boundary is not None:
                    h = hl.peek()
                    if h is not None and h.last_access < boundary - HOST_ONLY_AGING * (node.last_access - boundary):
                        node = None
                host_only = node is None
                if host_only:
                    node = hl.pop()
                    if node is None:
                        break
                else:
                    rl.pop()
            if hooked:
                for comp in hooked:
                    comp.on_evict(node, "host")
            free_ids.append(res.clear_host(node, owned=False))
            freed += node.size
            if host_only:  # holds nothing now: unlink it
                m.evicted_host_tokens += node.size
                res.forget(node)
                parent = node.parent
                self.tree.unlink(node)
                res.refresh(parent)
            else:  # still on the device, no longer backed up
                m.reclaimed_host_tokens += node.size
        if free_ids:
            res.free_host_pages(free_ids)
        m.host_eviction_seconds += time.perf_counter() - t0
        return freed // self.page_size

    def alloc_host(self, npages: int, at_least: int = 0) -> np.ndarray | None:
        """``npages`` host pages, evicting host leaves if short (the shortfall, or ``at_least``
        pages if more: upstream's backup batch, ``decisions``); None when there is no room.

        The eviction is sized by the allocator's free count, never by whether an allocation
        failed: with several ranks the free count is agreed state, an allocation's outcome
        is not (``agreement``), so every rank evicts the same nodes."""
        a = self.res.host_allocator
        short = npages - a.available
        if short > 0:
            self.evict_host(max(short, at_least))
        return a.alloc(npages)

    # ------------------------------------------------------------------ several ranks
    @property
    def host_available(self) -> int:
        """Free host pages as every rank counts them: the allocator's free count minus the
        pages this rank's failed reservations of the current step would have taken."""
        return self.res.host_allocator.available - self.phantom_pages

    def reserve_host(self, npages: int) -> np.ndarray | None:
        """Several ranks: ``alloc_host`` for a reservation (reserve -> agree -> commit). The
        eviction is sized by ``host_available``, which is the same on every rank even after
        an earlier reservation of this step failed on one of them; a failed allocation
        counts its pages as ``phantom_pages`` until ``settle_host`` (its commit / rollback)."""
        short = npages - self.host_available
        if short > 0:
            self.evict_host(short)
        ids = self.res.host_allocator.alloc(npages)
        if ids is None:
            self.phantom_pages += npages
        return ids

    def settle_host(self, npages: int, ids: np.ndarray | None, keep: bool) -> None:
        """End a ``reserve_host``: forget its phantom pages; free ``ids`` unless ``keep``."""
        if ids is None:
            self.phantom_pages -= npages
        elif not keep:
            self.res.host_allocator.free(ids)
