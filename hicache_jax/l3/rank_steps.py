"""Several ranks: the L3 controller's ``StepAgreement`` participant and its commit markers.

Each tensor-parallel rank has its own tree, host pool and controller over its shard of every
page; the ranks must take the same decisions. ``RankSteps`` reports this rank's outcomes in
each agreement step and acts only on the agreed (MIN-reduced) values, the same way on every
rank:

* a query's hit count (MIN: a rank that sees a page missing lowers it for all; -1 until
  answered);
* the host reservation for the hit and, per trailing-pages pool (an SWA window), for its
  window before the reserved pages' end (reserve -> agree -> commit: reserved in ``prepare``,
  one flag per operation: 1 only if every reservation succeeded; committed or rolled back by
  ``apply`` everywhere);
* per read: the pages delivered (MIN), whether it finished, whether some rank's ``timeout``
  deadline passed (negated, so the MIN is a MAX). With trailing-pages pools the read has a
  second phase in the same three slots: once the first phase's end ``done`` is agreed, every
  rank reads the windows before ``done``, or where its storage has none whole there, before
  its longest shorter stop that has them (the stop read: MIN, whether it finished, late); an
  agreed stop short of ``done`` becomes the new ``done`` and every rank reads again there (a
  few phases at most); a read without its windows on every rank attaches nothing;
* per L3 backup job: 0 running / 1 failed / 2 stored; a job every rank stored is settled as
  stored everywhere and rank 0 writes one commit marker per page (pool ``commit``), which
  makes a page group of a sharded pool visible to a query only once every rank's shard is
  written;
* per parked (draining) operation: whether its read let go of its pages.

At most ``OP_BUDGET`` operations, ``JOB_BUDGET`` jobs and ``DRAIN_BUDGET`` parked operations
report per step (the vector has a fixed width); the rest report at a later step, in start
order, the operation ``finish_prefetch`` waits for first.

Threading: owner thread only (``prepare`` / ``report`` / ``apply`` run inside
``cache.agree_step``, which the owner thread calls). Marker writes go to the backup thread
through ``L3Backups.write_markers``, after the job they commit.
"""

from __future__ import annotations

import time

from .backup import L3Backups
from .pools import COMMIT_POOL, L3Pools
from .prefetch import Prefetcher, PrefetchOperation

OP_BUDGET, JOB_BUDGET, DRAIN_BUDGET = 24, 32, 16
WINDOW_PHASES = 3  # window reads per prefetch at most (each later one at a shorter agreed stop)


class RankSteps:
    """The L3 participant of the cache's ``StepAgreement`` (see the module docstring)."""

    def __init__(self, cache, pools: L3Pools, prefetcher: Prefetcher, backups: L3Backups, storage, config) -> None:
        self.cache = cache
        self.pools = pools
        self.prefetcher = prefetcher
        self.backups = backups
        self.storage = storage
        self.config = config
        self.page_size = cache.page_size
        self.threshold = prefetcher.threshold
        self._waiting_for: PrefetchOperation | None = None  # reported first
        self._step_ops: list[PrefetchOperation] = []
        self._step_jobs: list = []
        self._step_drain: list[PrefetchOperation] = []

    # ------------------------------------------------------------------ what callers ask
    @staticmethod
    def complete(op: PrefetchOperation) -> bool:
        """Nothing more will arrive, as agreed (the windows' phase included)."""
        if op.status == "loading":
            return op.agreed.finished and not op.agreed.windows_pending
        return op.status != "querying"

    def ready(self, op: PrefetchOperation) -> bool:
        """Whether ``finish`` returns without a step (as of the last step: the same on every rank)."""
        policy = self.config.prefetch_policy
        return policy == "best_effort" or self.complete(op) or policy == "timeout" and op.agreed.late

    def finish(self, op: PrefetchOperation) -> int:
        """``finish_prefetch`` with several ranks: only agreed values decide (the loop's exit
        condition is agreed state, so every rank runs the same number of steps)."""
        policy = self.config.prefetch_policy
        timed_out = False
        if policy != "best_effort":
            self._waiting_for = op  # reported first, so the wait cannot starve
            try:
                while not self.complete(op):
                    if policy == "timeout" and op.agreed.late:
                        timed_out = True
                        break
                    op.pause(0.002)  # a local pause; the decision is the next step's
                    self.cache.agree_step()
            finally:
                self._waiting_for = None
        if timed_out:
            self.cache.metrics.prefetch_timeouts += 1
        done = op.agreed.done if op.status == "loading" else 0
        if op.reads_windows and not op.agreed.windows_ok:
            done = 0  # the windows are all or nothing: a read without them attaches nothing
        return self.prefetcher.conclude(
            op, done, self.complete(op), None, "stopped before the ranks agreed on the storage hit"
        )

    def flush(self) -> None:
        """Run steps until every backup job is agreed done; on rank 0, until the markers queued
        for them are written."""
        while len(self.backups):
            self.backups.jobs()[0].done.wait(0.01)
            self.cache.agree_step()
        if self.pools.markers and self.pools.tp_rank == 0:
            self.backups.executor.submit(lambda: None).result()  # the markers queued before it are written

    # ------------------------------------------------------------------ StepAgreement participant
    def prepare(self) -> None:
        """Pick what reports this step and reserve host pages for the hits agreed at the last
        step (the reserve of reserve -> agree -> commit)."""
        ops = []
        waiting = self._waiting_for
        if waiting is not None and self.prefetcher.in_flight(waiting):
            ops.append(waiting)
        for op in self.prefetcher.ops():
            if len(ops) >= OP_BUDGET:
                break
            if op is not waiting and (op.status == "querying" or op.status == "loading" and not self.complete(op)):
                ops.append(op)
        self._step_ops = ops
        for op in ops:
            if op.status == "querying" and op.agreed.hit is not None:
                # The fewest pages worth reading: the threshold past what the tree held.
                min_pages = -(-(self.threshold + op.tree_end - op.start) // self.page_size)
                op.agreed.reservation = n, _ids = self.cache.reserve_host_pages_agreed(op.agreed.hit, min_pages)
                # Each trailing pool's window for the pages every rank reserves (``n`` is the
                # same on every rank, so every rank makes the same reservations).
                op.agreed.side_reservation = {
                    pool: (k, self.cache.reserve_component_host_pages_agreed(comp.name, k))
                    for pool, (comp, wp) in self.pools.trailing.items()
                    if n
                    for k in (min(wp, n),)
                }
        self._step_jobs = self.backups.jobs()[:JOB_BUDGET]
        self._step_drain = self.prefetcher.draining()[:DRAIN_BUDGET]

    def report(self, out: list[int]) -> None:
        """This rank's outcomes (see the module docstring for the layout)."""
        now = time.perf_counter()
        for op in self._step_ops:
            hit, done, finished = op.progress()
            if op.status == "querying":
                if op.agreed.hit is None:
                    out.append(-1 if hit is None else hit)
                else:
                    n, ids = op.agreed.reservation
                    whole = all(sid is not None for _k, sid in op.agreed.side_reservation.values())
                    out.append(1 if n and ids is not None and whole else 0)
            elif op.agreed.windows_pending:
                stop, finished = op.window_progress()
                late = self.config.prefetch_policy == "timeout" and now >= self.prefetcher.deadline(op)
                out.extend((stop, 1 if finished else 0, -1 if late else 0))
            else:
                late = self.config.prefetch_policy == "timeout" and now >= self.prefetcher.deadline(op)
                out.extend((done, 1 if finished else 0, -1 if late else 0))
        for job in self._step_jobs:
            out.append(0 if not job.done.is_set() else 2 if job.ok.all() else 1)
        for op in self._step_drain:
            out.append(1 if op.progress()[2] else 0)

    def apply(self, agreed) -> None:
        """Act on the agreed values, the same way on every rank."""
        m = self.cache.metrics
        pf = self.prefetcher
        i = 0
        for op in self._step_ops:
            if op.status == "querying":
                a = int(agreed[i])
                i += 1
                if op.agreed.hit is None:
                    if a >= 0:
                        op.agreed.hit = a
                        if op.new_tokens(a) < self.threshold:
                            pf.revoke(op, "storage hit below the threshold" if a else "no storage hit", count=a > 0)
                    continue
                (n, ids), op.agreed.reservation = op.agreed.reservation, None
                side, op.agreed.side_reservation = op.agreed.side_reservation, {}
                for pool, (k, sid) in side.items():
                    self.cache.settle_component_host_pages(self.pools.trailing[pool][0].name, k, sid, bool(a))
                if a:
                    self.cache.settle_host_pages(n, ids, True)
                    if n < op.agreed.hit:
                        m.prefetch_truncated += 1  # the part of the prefix the host could hold
                    pf.start_read(op, ids, {pool: sid for pool, (_k, sid) in side.items()} if side else None)
                else:
                    if n:
                        self.cache.settle_host_pages(n, ids, False)
                    pf.revoke(op, "no host memory for the hit" if not n else "a rank could not reserve host pages")
            elif op.agreed.windows_pending:
                if agreed[i + 1]:  # every rank's window read ended: the shortest stop read whole
                    stop = int(agreed[i])
                    if stop == op.agreed.done:  # every rank has the windows there
                        op.agreed.windows_pending = False
                        op.agreed.windows_ok = True
                    elif stop and op.agreed.window_phases < WINDOW_PHASES and op.new_tokens(stop) >= self.threshold:
                        op.agreed.done = stop  # some rank has no window at done: all read at stop
                        pf.start_window_read(op, stop)
                    else:
                        op.agreed.windows_pending = False
                        op.agreed.windows_ok = False
                op.agreed.late = op.agreed.late or bool(agreed[i + 2])
                i += 3
            else:
                op.agreed.done = int(agreed[i])
                op.agreed.finished = bool(agreed[i + 1])
                op.agreed.late = op.agreed.late or bool(agreed[i + 2])
                i += 3
                if op.agreed.finished and op.reads_windows and op.new_tokens(op.agreed.done) >= self.threshold:
                    pf.start_window_read(op, op.agreed.done)  # phase two, at the same step on every rank
        for job in self._step_jobs:
            a = int(agreed[i])
            i += 1
            if a:
                self.backups.settle(job, a == 2)
                if a == 2 and self.pools.markers and self.pools.tp_rank == 0 and job.pages:
                    self.backups.write_markers(job.keys[COMMIT_POOL])
        for op in self._step_drain:
            if agreed[i]:
                pf.release_drained(op)
            i += 1
        self._step_ops, self._step_jobs, self._step_drain = [], [], []

    def abandon(self) -> None:
        """The step's exchange failed (``AgreementError``, on every rank): give back the host
        pages ``prepare`` reserved for agreed hits, as if the step had not run. The agreed hit
        stays, so the next good step reserves again; nothing else ``prepare`` picked changed."""
        for op in self._step_ops:
            reservation, op.agreed.reservation = op.agreed.reservation, None
            side, op.agreed.side_reservation = op.agreed.side_reservation, {}
            if op.status == "querying" and reservation is not None:
                for pool, (k, sid) in side.items():
                    self.cache.settle_component_host_pages(self.pools.trailing[pool][0].name, k, sid, False)
                n, ids = reservation
                if n:
                    self.cache.settle_host_pages(n, ids, False)
        self._step_ops, self._step_jobs, self._step_drain = [], [], []
