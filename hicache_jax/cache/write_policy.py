"""Write policies: when device KV is backed up to the host tier (upstream
``--hicache-write-policy``, sglang ``hiradix_cache.py``).

Pure Python, owner thread only. Hits are counted on insert only (walked nodes, split
parents, the new leaf; not for chunked inserts, revived nodes or under write_back, as
upstream: ``insert``); ``insert`` calls ``after_insert`` with the deepest inserted node.

* ``write_through``: back a node up once it has 1 hit; ``write_through_selective``: once it
  has 2. The deepest node on the inserted path that reached the threshold is backed up with
  its un-backed ancestors in one transfer (contiguity from the root).
* ``write_back``: no backup on insert; ``before_evict`` (installed into the evictor) backs a
  leaf up right before it leaves the device, blocking on the copy, as upstream. When the
  host has no room even after host eviction the leaf is dropped (``dropped_tokens``).

Several ranks (a ``collective`` agreement): ``defer`` is set, and a backup due at insert is
handed to it (``backup.AgreedBackups``: reserved, agreed and committed at the next step)
instead of being issued at once; write_back's ``before_evict_agreed`` reserves, agrees on the
allocation (``StepAgreement.exchange``), commits or rolls back, then waits for the copy and
agrees that every rank's succeeded (``TransferLedger.settle``), all inside the eviction; with
components that keep host pages of their own it agrees on their part in the same exchange.
"""

from __future__ import annotations

from .backup import BackupIssuer, reports_components
from .config import WritePolicy
from .metrics import CacheMetrics
from .copies_in_flight import TransferLedger
from .tree import RadixTree
from .tree_node import TreeNode


class WritePolicyDriver:
    """Decides backups by policy; ``BackupIssuer`` carries them out."""

    def __init__(
        self,
        policy: WritePolicy,
        threshold: int | None,
        tree: RadixTree,
        backups: BackupIssuer,
        ledger: TransferLedger,
        metrics: CacheMetrics,
    ) -> None:
        self.policy = policy
        self.threshold = threshold if policy != WritePolicy.WRITE_BACK else None
        self.tree = tree
        self.backups = backups
        self.ledger = ledger
        self.metrics = metrics
        self.defer = None  # several ranks: AgreedBackups.want, called instead of backing up at once

    def after_insert(self, node: TreeNode) -> None:
        """An insert that counted hits ended at ``node`` (not the root)."""
        threshold = self.threshold
        if threshold is None:
            return
        # Deepest node on the path that reached the threshold; its backup carries the
        # un-backed ancestors too (contiguity from the root).
        root = self.tree.root
        target = node
        while target is not root and target.hit_count < threshold:
            target = target.parent
        if target is not root and target.host_value is None:
            if self.defer is not None:
                self.defer(target)
                return
            op = self.backups.backup(target)
            if op is not None:
                self.ledger.writes.append(op)

    def before_evict(self, node: TreeNode) -> None:
        """write_back: back up ``node`` (not backed up) before it leaves the device."""
        op = self.backups.backup(node, ack_now=False)
        if op is not None:  # maybe only the un-backed ancestors that fit (``backup``)
            self.ledger.finish(op)
        if node.host_value is None:
            self.metrics.dropped_tokens += node.size

    def before_evict_agreed(self, node: TreeNode) -> None:
        """write_back with several ranks: ``before_evict`` as reserve -> agree -> commit."""
        backups = self.backups
        r = backups.reserve(node)
        if r is not None:
            steps = self.ledger.steps
            two = reports_components(backups)  # the components' part too (``backup``)
            agreed = steps.exchange([r.full_ok, r.component_ok] if two else [r.full_ok])
            if agreed[0]:
                self.ledger.settle(backups.commit(r, bool(agreed[1]) if two else True))
            else:
                backups.rollback(r)
        if node.host_value is None:
            self.metrics.dropped_tokens += node.size
