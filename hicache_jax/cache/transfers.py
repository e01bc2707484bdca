"""Copies in flight: the pending backups and load-backs, their acknowledgement, retries and the
failure latch.

Pure Python, owner thread only; engines may run the copies on their own workers, the ledger
only polls their handles. Each queued ``PendingOp`` holds the lock receipt that keeps both
ends of its copy alive (``locks``) until it is acknowledged.

Acknowledgement (``ack``): count the finished ops at the head of a queue (FIFO: up to the
first unfinished one; all of them when blocking), pass the count through the ``Agreement``
(the identity in one process; the MIN over ranks in several, so every rank's tree releases
the same ops), then finish that many: wait (retrying a failed copy), run the L3 hook of a
backup while its locks still hold, release its receipt, count its time.

Failed copies: a copy whose handle reports a failure is issued again from the same source
pages into the same destination pages (both still locked) up to ``retries`` times. If it
still fails, the latch closes: ``failure`` holds a ``CacheFailedError``, ``on_failure`` tells
the facade, which raises it from every public call until ``reset`` (``abandon``), so pages
with undefined bytes are never served.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import numpy as np

from ..transfer import TransferHandle
from .agreement import Agreement
from .errors import CacheFailedError
from .locks import LockReceipt, PathLocks
from .metrics import CacheMetrics
from .tree_node import TreeNode


class PendingOp:
    """One copy waiting for its acknowledgement."""

    __slots__ = ("node", "handle", "tokens", "t0", "src", "dst", "load", "receipt", "plans")

    def __init__(self, node: TreeNode, handle: TransferHandle, tokens: int, src: np.ndarray, dst: np.ndarray,
                 load: bool, receipt: LockReceipt, t0: float | None = None, plans: dict | None = None) -> None:
        self.node, self.handle, self.tokens = node, handle, tokens
        self.t0 = time.perf_counter() if t0 is None else t0
        self.src, self.dst, self.load = src, dst, load  # page ids, to issue the copy again
        self.receipt = receipt
        # The copies of components with their own page ids (``components.CopyPlan`` by name;
        # None without any): issued again with the op, ``done()`` when it is acknowledged.
        self.plans = plans


class TransferLedger:
    """The two queues of copies in flight and the failure latch; see the module docstring."""

    def __init__(self, components, metrics: CacheMetrics, locks: PathLocks, retries: int,
                 agreement: Agreement, on_failure: Callable[[CacheFailedError], None]) -> None:
        if not isinstance(agreement, Agreement):
            raise TypeError(f"agreement: expected an Agreement, got {type(agreement).__name__}")
        self.components = components  # looked up per copy: tests may swap its methods
        self.metrics = metrics
        self.locks = locks
        self.retries = retries
        self.agreement = agreement
        self.writes: deque[PendingOp] = deque()
        self.loads: deque[PendingOp] = deque()
        self.failure: CacheFailedError | None = None
        self.on_failure = on_failure  # the facade refuses its public calls from then on
        self.storage_hook = None  # a StorageController, when attached

    # ------------------------------------------------------------------ acknowledgement
    def ack_writes(self, block: bool) -> int:
        return self._ack(self.writes, "backup", block)

    def ack_loads(self, block: bool) -> int:
        return self._ack(self.loads, "load", block)

    def _ack(self, queue: deque, topic: str, block: bool) -> int:
        if block:
            n = len(queue)
        else:
            n = 0
            for op in queue:
                if not op.handle.done():
                    break
                n += 1
        n = self.agreement.min_count(topic, n)
        for _ in range(n):
            self.finish(queue.popleft())
        return n

    def finish(self, op: PendingOp) -> None:
        """Acknowledge ``op``: wait for it (retrying a failed copy), run the L3 hook of a
        backup while its locks still hold, release its locks, count its time."""
        try:
            first_try = self._wait(op)
            if not op.load and self.storage_hook is not None:
                self.storage_hook.on_backup_acked(op.node)  # L2 -> L3 write-through
        finally:
            if op.plans:
                for plan in op.plans.values():
                    plan.done()
            self.locks.release(op.receipt)
        # Issue -> completion as the handle stamped it; the acknowledgement time where it has no
        # stamp (or a retry finished the copy).
        done = op.handle.completed_at if first_try else None
        if done is None or done < op.t0:
            done = time.perf_counter()
        m = self.metrics
        (m.load_back_duration_seconds if op.load else m.backup_duration_seconds).observe(done - op.t0)

    def _wait(self, op: PendingOp) -> bool:
        """Wait for ``op``'s copy; a failed one is issued again from its source. True when the
        first copy succeeded (False: a retry did).

        Both ends of the copy are locked until the op is released (after this returns), so
        a retry copies the same bytes into the same pages, and nothing read the destination
        meanwhile (except a load-back's own caller, which sees the failure through its
        handle). If every retry fails, the latch closes (``CacheFailedError``).
        """
        try:
            op.handle.wait()
            return True
        except Exception as e:  # noqa: BLE001 - an engine may raise its own error types
            error = e
        m = self.metrics
        for _ in range(self.retries):
            m.transfer_retries += 1
            try:
                copy = self.components.load if op.load else self.components.backup
                (copy(op.src, op.dst) if op.plans is None else copy(op.src, op.dst, op.plans)).wait()
                return False
            except Exception as e:  # noqa: BLE001
                error = e
        m.transfer_failures += 1
        what = "load-back" if op.load else "backup"
        self.failure = CacheFailedError(
            f"a {what} of {op.tokens} tokens failed after {self.retries} retries ({error!r}); "
            f"the cache refuses every call until reset()")
        self.on_failure(self.failure)
        raise self.failure from error

    # ------------------------------------------------------------------ reset
    def abandon(self) -> None:
        """After a failure: wait for the copies still running (ignoring their errors, so none
        lands in pages the next user gets), forget them and open the latch."""
        for op in (*self.writes, *self.loads):
            try:
                op.handle.wait()
            except Exception:  # noqa: BLE001 - the cache is being emptied anyway
                pass
        self.writes.clear()
        self.loads.clear()
        self.failure = None

    @property
    def in_flight(self) -> tuple[int, int]:
        return len(self.writes), len(self.loads)
