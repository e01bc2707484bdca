"""Load-backs (host -> device): bring a host-only chain back to the device.

Pure numpy, owner thread only. ``LoadBackIssuer.load_back(node)`` takes the host-only chain
ending at ``node`` up to its first on-device ancestor (the anchor), all or nothing: it is
skipped (None, nothing changed) when shorter than ``load_back_threshold`` tokens, longer
than ``mem_quota`` or when the device has no room even after eviction. Otherwise the chain
gets device pages (taken straight from the eviction that made room, if any: the shortfall,
or the chain's whole size with ``evict_whole``, upstream's batch, ``decisions``), the copy is
issued on every component and the chain counts as on-device at once: ``match_prefix`` sees
it, and a forward pass must wait on the handle (per layer) before reading the pages.

Locks: the anchor (device) and the chain (host) are locked while eviction makes room; from
issue until the acknowledgement the receipt holds a device and a host path lock on ``node``.

Stateful components (``components``; only when one is registered) take part: they may split
nodes first (``before_load_back``: e.g. a sliding window loads only the pages of its window),
move the start of the continuation up (``load_back_start``: on-device nodes whose own pages a
component must load count as part of the load-back, and their device pages lead the
result's ``device_pages``), and add their own copies (``prepare_load``, all or nothing: a
component without room skips the whole load-back, nothing changed). A load-back may then
have an empty full chain (only a component's pages move).

Storage origin: nodes an L3 prefetch attached (``insert_host``) are remembered until their
first load-back, whose tokens then count in ``loaded_storage_tokens`` as well (the metric
``cached_tokens{cache_source="storage"}``; the rest of ``loaded_tokens`` is the host source).
The set is empty without L3, so the check costs one truth test per load-back. A split of
such a node before its load-back puts the new upper part in the set too (``on_split``): both
parts came from storage.
"""

from __future__ import annotations

import numpy as np

from .components import NoRoom
from .evictor import Evictor
from .locks import PathLocks
from .metrics import CacheMetrics
from .residency import EMPTY_IDS, Residency
from .results import LoadBackResult
from .copies_in_flight import PendingOp, TransferLedger
from .tree_node import TreeNode


class LoadBackIssuer:
    """Issues load-backs; see the module docstring."""

    def __init__(
        self,
        residency: Residency,
        locks: PathLocks,
        ledger: TransferLedger,
        evictor: Evictor,
        metrics: CacheMetrics,
        page_size: int,
        threshold: int,
        evict_whole: bool = False,
    ) -> None:
        self.evict_whole = evict_whole  # device short: evict the load's whole size (``decisions``)
        self.res = residency
        self.locks = locks
        self.ledger = ledger
        self.evictor = evictor
        self.metrics = metrics
        self.page_size = page_size
        self.threshold = threshold
        self.hooked: tuple = ()  # components with their own residency (``components``)
        self.storage_origin: set[TreeNode] = set()  # attached by an L3 prefetch, not loaded since
        self._prune_at = 1024

    def from_storage(self, node: TreeNode) -> None:
        """``node``'s host pages came from L3 (``insert_host``): its first load-back counts as a
        storage hit."""
        origin = self.storage_origin
        origin.add(node)
        if len(origin) > self._prune_at:  # nodes evicted before any load-back
            origin.difference_update([n for n in origin if n.deleted or n.value is not None])
            self._prune_at = max(1024, 2 * len(origin))

    def attached_from_storage(self, leaf: TreeNode | None, new: int) -> None:
        """``insert_host`` attached ``new`` tokens of new nodes ending at ``leaf``: their
        load-back counts as cached_tokens{storage}: every new node, also the upper part of one
        a component split while placing its pages (a window's start)."""
        node = leaf
        while node is not None and new > 0 and node.value is None:
            self.from_storage(node)
            new -= node.size
            node = node.parent

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        """The tree split ``lower`` (which keeps its identity) under a new ``upper``."""
        origin = self.storage_origin
        if origin and lower in origin:
            origin.add(upper)

    def load_back(self, node: TreeNode, mem_quota: int | None) -> LoadBackResult | None:
        if self.hooked:
            return self._load_back_hooked(node, mem_quota)
        chain = []
        tokens = 0
        n = node
        while n.value is None:
            chain.append(n)
            tokens += n.size
            n = n.parent
        anchor = n
        m = self.metrics
        if not chain:
            return None
        if tokens < self.threshold or (mem_quota is not None and tokens > mem_quota):
            m.load_back_skipped += 1
            return None
        chain.reverse()
        npages = tokens // self.page_size
        # Protect the anchor (device) and the chain (host) while eviction makes room; one walk.
        locks = self.locks
        receipt = locks.lock_both(node, anchor)
        dev = self.evictor.alloc_device(npages, True, self.evict_whole)
        if dev is None:
            locks.release(receipt)
            m.load_back_skipped += 1
            return None
        host_ids = np.concatenate([c.host_value for c in chain]) if len(chain) > 1 else chain[0].host_value
        ledger = self.ledger
        res = self.res
        try:
            handle = ledger.components.load(host_ids, dev)
        except BaseException:  # the engine refused the copy: give the pages back, then raise
            res.free_device_pages([dev])
            locks.release(receipt)
            raise
        receipt = self._attach_chain(anchor, chain, dev, tokens, receipt)
        ledger.loads.append(PendingOp(node, handle, tokens, host_ids, dev, True, receipt))
        self._count_load(chain, tokens, npages)
        return LoadBackResult(dev.copy(), tokens, node, handle)

    def _count_load(self, chain: list, tokens: int, npages: int) -> None:
        """The metrics of one issued load-back of ``tokens`` tokens (``npages`` device pages);
        chain nodes that came from L3 count as storage-loaded, once."""
        m = self.metrics
        m.load_back_calls += 1
        m.loaded_tokens += tokens
        origin = self.storage_origin
        if origin:
            for c in chain:
                if c in origin:
                    origin.discard(c)
                    m.loaded_storage_tokens += c.size
        m.loaded_bytes += npages * self.ledger.components.bytes_per_page

    def _attach_chain(self, anchor: TreeNode, chain: list, dev: np.ndarray, tokens: int, receipt):
        """Give the loaded chain its device pages and lock it (returns the extended receipt).

        set_device for the whole chain at once, then the chain's device locks: the anchor's
        path already holds the lock taken before the copy, so only the chain nodes (evicted, so
        unlocked) get theirs. Each chain node but the last gets an on-device child and the
        last is locked, so no chain node joins the device index; chain nodes are host-locked,
        so they join no host index: only the anchor's membership can change."""
        res = self.res
        res.protected_tokens += tokens
        off = 0
        p = self.page_size
        for c in chain:
            k = c.size // p
            c.value = dev[off : off + k]
            c.parent.dev_children += 1
            off += k
        receipt = self.locks.extend_to_loaded_chain(receipt, chain)
        res.refresh(anchor)
        if res.watch is not None:
            for c in chain:
                res.watch.stored("device", c)
        return receipt

    def _load_back_hooked(self, node: TreeNode, mem_quota: int | None) -> LoadBackResult | None:
        """``load_back`` with stateful components (see the module docstring)."""
        hooked = self.hooked
        for comp in hooked:
            comp.before_load_back(node)
        chain = []
        tokens = 0
        n = node
        while n.value is None:
            chain.append(n)
            tokens += n.size
            n = n.parent
        anchor = n
        starts = {comp.load_back_start(node, anchor) for comp in hooked}
        start = anchor
        between = []  # on-device nodes below ``start`` down to the anchor, deepest first
        if starts != {anchor}:
            root = anchor
            while root.parent is not None:
                root = root.parent
            n = anchor
            walked = []
            while True:  # the shallowest start wins
                if n in starts:
                    start = n
                    between = list(walked)
                if n is root:
                    break
                walked.append(n)
                n = n.parent
        m = self.metrics
        if not chain and start is anchor:
            return None
        between.reverse()
        total = tokens + sum(b.size for b in between)
        if total < self.threshold or (mem_quota is not None and tokens > mem_quota):
            m.load_back_skipped += 1
            return None
        chain.reverse()
        npages = tokens // self.page_size
        locks = self.locks
        res = self.res
        receipt = locks.lock_both(node, anchor)
        dev = self.evictor.alloc_device(npages, True) if npages else EMPTY_IDS
        if dev is None:
            locks.release(receipt)
            m.load_back_skipped += 1
            return None
        plans: dict = {}
        try:
            for comp in hooked:
                plan = comp.prepare_load(node, chain)
                if plan is not None:
                    plans[comp.name] = plan
        except NoRoom:
            for plan in plans.values():
                plan.cancel()
            if npages:
                res.free_device_pages([dev])
            locks.release(receipt)
            m.load_back_skipped += 1
            return None
        if not chain:
            host_ids = EMPTY_IDS
        else:
            host_ids = np.concatenate([c.host_value for c in chain]) if len(chain) > 1 else chain[0].host_value
        ledger = self.ledger
        try:
            handle = ledger.components.load(host_ids, dev, plans or None)
        except BaseException:  # the engine refused the copy: give everything back, then raise
            for plan in plans.values():
                plan.cancel()
            if npages:
                res.free_device_pages([dev])
            locks.release(receipt)
            raise
        if chain:
            receipt = self._attach_chain(anchor, chain, dev, tokens, receipt)
        for plan in plans.values():
            plan.commit()
        if chain:
            for comp in hooked:
                comp.on_load(chain)
        ledger.loads.append(PendingOp(node, handle, tokens, host_ids, dev, True, receipt, plans=plans or None))
        self._count_load(chain, total, npages)
        pages = [b.value for b in between]
        if npages:
            pages.append(dev)
        device_pages = np.concatenate(pages) if len(pages) > 1 else pages[0].copy()
        return LoadBackResult(device_pages, total, node, handle)
