"""Backups (device -> host): issue the copy of a node and its un-backed ancestors.

Pure numpy, owner thread only. ``BackupIssuer.backup(node)`` collects the chain from
``node`` up to its first backed-up ancestor (the anchor), allocates host pages for all of it
(evicting host leaves if short: the shortfall, or, with ``evict_whole``, at least the node's
size, upstream's batch, ``decisions``; when even that leaves too little room, for the
longest prefix of the chain that fits), issues one copy on every component
(``components``) and marks the chain backed up at once, parent first, so backed-up nodes
always form a prefix from the root. The write policy (``write_policy``) decides when to call it.

Until its acknowledgement a backup holds a device and a host path lock on ``node``
(``PendingOp.receipt``), so neither copy is freed mid-transfer. A copy the engine reports
finished and successful as soon as it is issued (a synchronous engine), while no earlier
backup waits, is acknowledged on the spot (``ack_now``): it takes no locks and never queues,
and the L3 hook runs right away.
"""

from __future__ import annotations

import time

import numpy as np

from .evictor import Evictor
from .locks import PathLocks
from .metrics import CacheMetrics
from .residency import Residency
from .transfers import PendingOp, TransferLedger
from .tree_node import TreeNode


class BackupIssuer:
    """Issues backups; see the module docstring."""

    def __init__(self, residency: Residency, locks: PathLocks, ledger: TransferLedger, evictor: Evictor,
                 metrics: CacheMetrics, page_size: int, evict_whole: bool = False) -> None:
        self.evict_whole = evict_whole  # host short: evict at least the node's size (``decisions``)
        self.res = residency
        self.locks = locks
        self.ledger = ledger
        self.evictor = evictor
        self.metrics = metrics
        self.page_size = page_size
        self.hooked: tuple = ()  # components with their own residency (``components``)

    def backup(self, node: TreeNode, ack_now: bool = True) -> PendingOp | None:
        """Back up ``node`` and its un-backed ancestors, parent first, in one transfer.

        When the host has room (after host eviction) for only part of the chain, the longest
        prefix of it that fits is backed up and the rest counted in ``backup_failed_tokens``
        (the caller sees ``node.host_value`` still None). Returns the op to acknowledge later
        (it holds a device and a host path lock on the deepest node backed up), or None: no
        host room for even the chain's first node, or, with ``ack_now``, a copy acknowledged
        when issued (see the module docstring)."""
        res = self.res
        chain = []
        tokens = 0
        n = node
        while n.host_value is None:
            chain.append(n)
            tokens += n.size
            n = n.parent
        anchor = n
        chain.reverse()
        npages = tokens // self.page_size
        # Host eviction must keep the backed-up path's copies (the prefix stays contiguous
        # from the root). The only candidate on the path is the anchor's copy (host reclaim:
        # an on-device node without backed-up children; every node above it has one), so the
        # anchor alone is guarded meanwhile (a count, not just leaving the index: host
        # eviction re-indexes a parent whose last backed-up child it removes).
        host_ids = res.host_allocator.alloc(npages)
        if host_ids is None:  # host eviction will run: guard the anchor's copy meanwhile
            guard = anchor is not res.root
            if guard:
                self.locks.guard_host_copy(anchor)
            host_ids = self.evictor.alloc_host(npages, node.size // self.page_size if self.evict_whole else 0)
            if guard:
                self.locks.unguard_host_copy(anchor)  # the refresh below (either way) re-indexes it
        if host_ids is None:
            # Not all of it fits: back up the longest prefix of the chain that does, parent
            # first (upstream backs each node up on its own, so it keeps the ancestors that
            # fit and skips the rest); host eviction above already freed what it could.
            room = res.host_allocator.available * self.page_size
            fit = fit_tokens = 0
            for c in chain:
                if fit_tokens + c.size > room:
                    break
                fit += 1
                fit_tokens += c.size
            self.metrics.backup_failed_tokens += tokens - fit_tokens
            if not fit:
                res.refresh(anchor)
                return None
            chain = chain[:fit]
            node = chain[-1]
            tokens = fit_tokens
            npages = tokens // self.page_size
            host_ids = res.host_allocator.alloc(npages)
        dev_ids = np.concatenate([c.value for c in chain]) if len(chain) > 1 else chain[0].value
        t0 = time.perf_counter()
        ledger = self.ledger
        plans = None
        if self.hooked:
            # Stateful components learn of the chain before any copy is issued (they may
            # allocate their own host pages here and return their copy); the marking below
            # is the same either way.
            self._mark(chain, host_ids, tokens)
            for comp in self.hooked:
                plan = comp.on_backup(chain)
                if plan is not None:
                    if plans is None:
                        plans = {}
                    plans[comp.name] = plan
            if plans is None:
                handle = ledger.components.backup(dev_ids, host_ids)
            else:
                handle = ledger.components.backup(dev_ids, host_ids, plans)
        else:
            try:
                handle = ledger.components.backup(dev_ids, host_ids)
            except BaseException:  # the engine refused the copy: give the host pages back, then raise
                res.host_allocator.free(host_ids)
                res.refresh(anchor)
                raise
            self._mark(chain, host_ids, tokens)
        m = self.metrics
        m.backup_tokens += tokens
        m.backup_bytes += npages * ledger.components.bytes_per_page
        if ack_now and not ledger.writes and handle.done():
            try:
                handle.wait()
            except Exception:  # noqa: BLE001 - a failed copy: acknowledged (and retried) later
                pass
            else:
                if plans is not None:
                    for plan in plans.values():
                        plan.done()
                res.refresh(node)
                res.refresh(anchor)
                hook = ledger.storage_hook
                if hook is not None:
                    hook.on_backup_acked(node)  # L2 -> L3 write-through
                done = handle.completed_at
                if done is None or done < t0:  # no stamp, or an engine's shared completed handle
                    done = time.perf_counter()
                m.backup_duration_seconds.observe(done - t0)
                return None
        # Until acknowledged: the device pages stay (device lock), and so do the new host
        # copies and the anchor's (host lock; the chain joins no host index meanwhile).
        receipt = self.locks.lock_both(node)
        res.refresh(anchor)
        return PendingOp(node, handle, tokens, dev_ids, host_ids, False, receipt, t0, plans)

    def _mark(self, chain: list, host_ids: np.ndarray, tokens: int) -> None:
        """set_host for the whole chain at once: every chain node but the last has a backed-up
        child now, so only the last and the anchor can change index membership (the caller
        refreshes both)."""
        res = self.res
        res.host_owned[host_ids] = True
        res.host_tokens += tokens
        off = 0
        p = self.page_size
        for c in chain:
            k = c.size // p
            c.host_value = host_ids[off:off + k]
            c.parent.host_children += 1
            off += k
