"""Copies in flight: the pending backups and load-backs, their acknowledgement, retries and the
failure latch.

Pure Python, owner thread only; engines may run the copies on their own workers, the ledger
only polls their handles. Each queued ``PendingOp`` holds the lock receipt that keeps both
ends of its copy alive (``locks``) until it is acknowledged.

Acknowledgement, one process (``ack_writes`` / ``ack_loads``): count the finished ops at the
head of a queue (FIFO: up to the first unfinished one; all of them when blocking), then
finish that many: wait (retrying a failed copy), run the L3 hook of a backup while its locks
still hold, release its receipt, count its time.

Acknowledgement, several ranks (a ``collective`` agreement): the ledger is a participant of
the cache's ``StepAgreement``. ``report`` appends, per queue, how many head ops finished *and
succeeded* on this rank (a failed copy is retried here, locally, before it counts; when
blocking, every op is waited for first) and whether a copy failed for good; ``apply``
finishes the MIN over ranks of each count, so every rank releases the same ops at the same
step, and when any rank failed, every rank closes its latch in the same step (each raises
``CacheFailedError`` and recovers alike).

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
from .errors import CacheFailedError
from .locks import LockReceipt, PathLocks
from .metrics import CacheMetrics
from .tree_node import TreeNode


class PendingOp:
    """One copy waiting for its acknowledgement."""

    __slots__ = ("node", "handle", "tokens", "t0", "src", "dst", "load", "receipt", "plans")

    def __init__(
        self,
        node: TreeNode,
        handle: TransferHandle,
        tokens: int,
        src: np.ndarray,
        dst: np.ndarray,
        load: bool,
        receipt: LockReceipt,
        t0: float | None = None,
        plans: dict | None = None,
    ) -> None:
        self.node, self.handle, self.tokens = node, handle, tokens
        self.t0 = time.perf_counter() if t0 is None else t0
        self.src, self.dst, self.load = src, dst, load  # page ids, to issue the copy again
        self.receipt = receipt
        # The copies of components with their own page ids (``components.CopyPlan`` by name;
        # None without any): issued again with the op, ``done()`` when it is acknowledged.
        self.plans = plans


class TransferLedger:
    """The two queues of copies in flight and the failure latch; see the module docstring."""

    def __init__(
        self,
        components,
        metrics: CacheMetrics,
        locks: PathLocks,
        retries: int,
        on_failure: Callable[[CacheFailedError], None],
    ) -> None:
        self.components = components  # looked up per copy: tests may swap its methods
        self.metrics = metrics
        self.locks = locks
        self.retries = retries
        self.writes: deque[PendingOp] = deque()
        self.loads: deque[PendingOp] = deque()
        self.failure: CacheFailedError | None = None
        self.on_failure = on_failure  # the facade refuses its public calls from then on
        self.storage_hook = None  # a StorageController, when attached
        self.steps = None  # the cache's StepAgreement, with several ranks (``report`` / ``apply``)
        self.block_writes = self.block_loads = False  # a blocking step waits for this rank's copies
        self._local_failure: tuple[PendingOp, BaseException] | None = None  # this rank's, not yet agreed

    # ------------------------------------------------------------------ acknowledgement
    def ack_writes(self, block: bool) -> int:
        return self._ack(self.writes, block)

    def ack_loads(self, block: bool) -> int:
        return self._ack(self.loads, block)

    def poll(self) -> None:
        """One process: acknowledge finished copies without blocking, poll the L3 hook."""
        if self.writes:
            self.ack_writes(False)
        if self.storage_hook is not None:
            self.storage_hook.poll()
        if self.loads:
            self.ack_loads(False)

    def check_writes(self, block: bool, agreed: bool) -> int:
        """``writing_check``: one process acknowledges finished backups (FIFO, up to the first
        unfinished one; all if ``block``) and polls the L3 hook; several ranks (``agreed``)
        run one agreement step. Returns how many backups left the queue."""
        if agreed:
            before = len(self.writes)
            self.step(writes=block)
            return before - len(self.writes)
        n = self.ack_writes(block)
        if self.storage_hook is not None:
            self.storage_hook.poll()
        return n

    def check_loads(self, block: bool, agreed: bool) -> int:
        """``loading_check``: as ``check_writes`` for load-backs (no L3 poll)."""
        if agreed:
            before = len(self.loads)
            self.step(loads=block)
            return before - len(self.loads)
        return self.ack_loads(block)

    def step(self, writes: bool = False, loads: bool = False) -> None:
        """Several ranks: one agreement step of ``steps``; ``writes`` / ``loads``: wait for
        this rank's copies of that queue first (a blocking acknowledgement). Raises the
        failure latched (on every rank) at this step."""
        self.block_writes, self.block_loads = writes, loads
        try:
            self.steps.step()
        finally:
            self.block_writes = self.block_loads = False
        if self.failure is not None:  # latched on every rank at this step
            raise self.failure

    def _ack(self, queue: deque, block: bool) -> int:
        if block:
            n = len(queue)
        else:
            n = 0
            for op in queue:
                if not op.handle.done():
                    break
                n += 1
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
            f"the cache refuses every call until reset()"
        )
        self.on_failure(self.failure)
        raise self.failure from error

    # ------------------------------------------------------------------ several ranks
    def prepare(self) -> None:
        pass

    def report(self, out: list[int]) -> None:
        """Per queue, the head ops finished and successful on this rank; then -1 if a copy
        failed for good here (a MAX: any rank's failure latches every rank)."""
        out.append(self._succeeded_head(self.writes, self.block_writes))
        out.append(self._succeeded_head(self.loads, self.block_loads))
        out.append(-1 if self._local_failure is not None else 0)

    def _succeeded_head(self, queue: deque, block: bool) -> int:
        n = 0
        if self._local_failure is not None:
            return 0
        for op in queue:
            if not block and not op.handle.done():
                break
            if not self._copy_succeeded(op):
                break
            n += 1
        return n

    def _copy_succeeded(self, op: PendingOp) -> bool:
        """Wait for ``op`` (finished, or blocking); a failed copy is issued again from its
        still-locked source up to ``retries`` times. False (and this rank's failure noted)
        when every retry failed."""
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
                # The components' parts (``op.plans``: an SWA window, ...) are issued again too.
                handle = copy(op.src, op.dst) if op.plans is None else copy(op.src, op.dst, op.plans)
                handle.wait()
                op.handle = handle
                return True
            except Exception as e:  # noqa: BLE001
                error = e
        m.transfer_failures += 1
        self._local_failure = (op, error)
        return False

    def apply(self, agreed) -> None:
        """Finish the agreed number of ops of each queue; latch when any rank failed."""
        writes, loads, failed = int(agreed[0]), int(agreed[1]), int(agreed[2])
        if failed:
            local = self._local_failure
            where = "on this rank" if local is not None else "on another rank"
            what = (
                "a copy"
                if local is None
                else f"a {'load-back' if local[0].load else 'backup'} of {local[0].tokens} tokens"
            )
            self.failure = CacheFailedError(
                f"{what} failed {where} after {self.retries} retries"
                f"{'' if local is None else f' ({local[1]!r})'}; every rank refuses every call until reset()"
            )
            self.on_failure(self.failure)
            return
        for _ in range(writes):
            self.finish(self.writes.popleft())
        for _ in range(loads):
            self.finish(self.loads.popleft())

    def settle(self, op: PendingOp) -> None:
        """Several ranks, outside a step: wait for ``op`` (a blocking write_back backup), agree
        that every rank's copy succeeded, then finish it (or latch on every rank)."""
        ok = self._copy_succeeded(op)
        failed = int(self.steps.exchange([0 if ok else -1])[0])
        if failed:
            self.writes.append(op)  # released by reset's abandon with the others
            self.apply([0, 0, failed])
            raise self.failure
        self.finish(op)

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
        self._local_failure = None

    @property
    def in_flight(self) -> tuple[int, int]:
        return len(self.writes), len(self.loads)
