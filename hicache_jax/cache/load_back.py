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

Storage origin: nodes an L3 prefetch attached (``insert_host``) are remembered until their
first load-back, whose tokens then count in ``loaded_storage_tokens`` as well (the metric
``cached_tokens{cache_source="storage"}``; the rest of ``loaded_tokens`` is the host source).
The set is empty without L3, so the check costs one truth test per load-back. A split of
such a node before its load-back leaves the upper part counted as a host hit.
"""

from __future__ import annotations

import numpy as np

from .evictor import Evictor
from .locks import PathLocks
from .metrics import CacheMetrics
from .residency import Residency
from .results import LoadBackResult
from .transfers import PendingOp, TransferLedger
from .tree_node import TreeNode


class LoadBackIssuer:
    """Issues load-backs; see the module docstring."""

    def __init__(self, residency: Residency, locks: PathLocks, ledger: TransferLedger, evictor: Evictor,
                 metrics: CacheMetrics, page_size: int, threshold: int, evict_whole: bool = False) -> None:
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

    def load_back(self, node: TreeNode, mem_quota: int | None) -> LoadBackResult | None:
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
        # set_device for the whole chain at once, then the chain's device locks: the anchor's
        # path already holds the lock taken above, so only the chain nodes (evicted, so
        # unlocked) get theirs. Each chain node but the last gets an on-device child and the
        # last is locked, so no chain node joins the device index; chain nodes are
        # host-locked, so they join no host index: only the anchor's membership can change.
        res.protected_tokens += tokens
        off = 0
        p = self.page_size
        for c in chain:
            k = c.size // p
            c.value = dev[off:off + k]
            c.parent.dev_children += 1
            off += k
        receipt = locks.extend_to_loaded_chain(receipt, chain)
        res.refresh(anchor)
        if self.hooked:
            for comp in self.hooked:
                comp.on_load(chain)
        ledger.loads.append(PendingOp(node, handle, tokens, host_ids, dev, True, receipt))
        m.load_back_calls += 1
        m.loaded_tokens += tokens
        origin = self.storage_origin
        if origin:
            for c in chain:
                if c in origin:
                    origin.discard(c)
                    m.loaded_storage_tokens += c.size
        m.loaded_bytes += npages * ledger.components.bytes_per_page
        return LoadBackResult(dev.copy(), tokens, node, handle)
