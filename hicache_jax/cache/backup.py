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

Several ranks (a ``collective`` agreement): a host allocation is a per-rank outcome, so a
backup is reserve -> agree -> commit or roll back. ``reserve(node)`` evicts host leaves by
the shortfall the allocator's free count shows (a function of agreed state, so every rank
evicts the same nodes), then allocates: the one step whose outcome may differ per rank. The
anchor's copy stays guarded until the decision. ``commit`` marks the chain, issues the copy
and returns the op to queue; ``rollback`` frees what this rank got. ``AgreedBackups`` (a
``StepAgreement`` participant) runs the backups the write policy asked for this way, once
per step; write_back's backup inside an eviction agrees on its own (``write_policy``).

Components with host pages of their own (``own_page_ids``, e.g. ``swa``) reserve theirs
right after the full part (``KVComponent.reserve_backup``), and a reservation has two
outcomes to agree on: the full part's and the components' (``Reservation.component_ok``).
The full part commits when every rank got its full pages; the components' part then commits
only when every rank also got its component pages, else those nodes stay component host
tombstones (as a short SWA host pool leaves them in one process). The copy carries the
components' plans (``PendingOp.plans``: issued again with it on a retry).

While a reservation waits for its decision its chain's nodes are still on the device only
(``host_value`` None) but already promised a host copy: ``reserved`` counts them, so an L3
attach never gives one of them a copy of its own (``Inserter.attach_host``: it would get two,
or lose one on a rollback). Reservations live inside one agreement (a step's ``prepare`` to its
``apply``, or write_back's exchange inside an eviction), so between steps ``reserved`` is empty;
the chains are chosen from agreed state, so it is the same set on every rank.
"""

from __future__ import annotations

import time

import numpy as np

from .evictor import Evictor
from .locks import PathLocks
from .metrics import CacheMetrics
from .residency import Residency
from .copies_in_flight import PendingOp, TransferLedger
from .tree_node import TreeNode


class BackupIssuer:
    """Issues backups; see the module docstring."""

    def __init__(
        self,
        residency: Residency,
        locks: PathLocks,
        ledger: TransferLedger,
        evictor: Evictor,
        metrics: CacheMetrics,
        page_size: int,
        evict_whole: bool = False,
    ) -> None:
        self.evict_whole = evict_whole  # host short: evict at least the node's size (``decisions``)
        self.res = residency
        self.locks = locks
        self.ledger = ledger
        self.evictor = evictor
        self.metrics = metrics
        self.page_size = page_size
        self.hooked: tuple = ()  # components with their own residency (``components``)
        # Nodes of chains reserved and not yet committed or released (several ranks), with how
        # many reservations hold each (module docstring).
        self.reserved: dict[TreeNode, int] = {}

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

    # ------------------------------------------------------------------ several ranks
    def reserve(self, node: TreeNode) -> "Reservation | None":
        """Reserve host pages for backing up ``node`` and its un-backed ancestors (the longest
        prefix of that chain the host can hold after evicting by the shortfall). None, with
        nothing held, when not even the chain's first node fits: every rank sees that alike.
        The reservation's ``host_ids`` is None when this rank's allocation failed."""
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
        p = self.page_size
        ev = self.evictor
        guard = anchor is not res.root
        if guard:  # kept until commit / rollback: other reservations evict meanwhile
            self.locks.guard_host_copy(anchor)
        short = tokens // p - ev.host_available
        if short > 0:  # the shortfall, or upstream's batch (``evict_whole``), as ``issue`` evicts
            ev.evict_host(max(short, node.size // p if self.evict_whole else 0))
        room = ev.host_available * p
        if tokens > room:
            fit = fit_tokens = 0
            for c in chain:
                if fit_tokens + c.size > room:
                    break
                fit += 1
                fit_tokens += c.size
            self.metrics.backup_failed_tokens += tokens - fit_tokens
            if not fit:
                if guard:
                    self.locks.unguard_host_copy(anchor)
                res.refresh(anchor)
                return None
            chain = chain[:fit]
            tokens = fit_tokens
        r = Reservation(chain, anchor, guard, tokens, ev.reserve_host(tokens // p))
        reserved = self.reserved
        for c in chain:
            reserved[c] = reserved.get(c, 0) + 1
        if self.hooked:  # components with host pages of their own reserve theirs (module docstring)
            r.components = {c.name: c.reserve_backup(chain) for c in self.hooked}
        return r

    def commit(self, r: "Reservation", component_ok: bool = True) -> PendingOp:
        """Every rank got its full pages: mark the chain backed up, issue the copy, lock both
        ends. ``component_ok``: every rank also got its component pages (else those are given
        back: component host tombstones)."""
        res = self.res
        if r.guard:
            self.locks.unguard_host_copy(r.anchor)
        self._unreserve(r)
        chain, host_ids, tokens = r.chain, r.host_ids, r.tokens
        self.evictor.settle_host(tokens // self.page_size, host_ids, True)
        node = chain[-1]
        dev_ids = np.concatenate([c.value for c in chain]) if len(chain) > 1 else chain[0].value
        t0 = time.perf_counter()
        ledger = self.ledger
        self._mark(chain, host_ids, tokens)
        plans = None
        for comp in self.hooked:
            plan = comp.commit_backup(chain, r.components.get(comp.name), component_ok)
            if plan is not None:
                if plans is None:
                    plans = {}
                plans[comp.name] = plan
        handle = (
            ledger.components.backup(dev_ids, host_ids)
            if plans is None
            else ledger.components.backup(dev_ids, host_ids, plans)
        )
        m = self.metrics
        m.backup_tokens += tokens
        m.backup_bytes += host_ids.shape[0] * ledger.components.bytes_per_page
        receipt = self.locks.lock_both(node)
        res.refresh(r.anchor)
        return PendingOp(node, handle, tokens, dev_ids, host_ids, False, receipt, t0, plans)

    def rollback(self, r: "Reservation") -> None:
        """Some rank's full allocation failed: give back what this rank got (its component
        pages too); nothing is marked."""
        self.release(r)
        self.metrics.backup_failed_tokens += r.tokens

    def release(self, r: "Reservation") -> None:
        """Give back a reservation's host pages (its components' too) and anchor guard (no counters)."""
        self.evictor.settle_host(r.tokens // self.page_size, r.host_ids, False)
        for comp in self.hooked:
            comp.release_backup(r.components.get(comp.name))
        if r.guard:
            self.locks.unguard_host_copy(r.anchor)
        self._unreserve(r)
        self.res.refresh(r.anchor)

    def _unreserve(self, r: "Reservation") -> None:
        reserved = self.reserved
        for c in r.chain:
            k = reserved.pop(c, 0) - 1
            if k > 0:
                reserved[c] = k

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
            c.host_value = host_ids[off : off + k]
            c.parent.host_children += 1
            off += k
        if res.watch is not None:
            for c in chain:
                res.watch.stored("host", c)


class Reservation:
    """Host pages reserved for one backup chain, waiting for the ranks' decision; with
    ``components``, each stateful component's own reservation (name -> its object or None)."""

    __slots__ = ("chain", "anchor", "guard", "tokens", "host_ids", "components")

    def __init__(self, chain: list, anchor: TreeNode, guard: bool, tokens: int, host_ids: np.ndarray | None) -> None:
        self.chain, self.anchor, self.guard, self.tokens, self.host_ids = chain, anchor, guard, tokens, host_ids
        self.components: dict = {}

    @property
    def full_ok(self) -> int:
        """1 when this rank got the full part's host pages, else 0."""
        return 0 if self.host_ids is None else 1

    @property
    def component_ok(self) -> int:
        """1 when this rank got every component's host pages (or none needed any), else 0."""
        return 0 if any(c is not None and not c.ok for c in self.components.values()) else 1


def reports_components(issuer: BackupIssuer) -> bool:
    """Whether a reservation carries two outcomes (full, components): some component keeps
    host pages of its own. Fixed at construction, so the layout is the same on every rank."""
    return any(c.own_page_ids for c in issuer.hooked)


class AgreedBackups:
    """The write policy's backups with several ranks: reserve -> agree -> commit, in steps.

    A ``StepAgreement`` participant. ``want(node)`` (the write policy, at insert) queues a
    target; each step, ``prepare`` reserves up to ``budget`` of them, oldest first (a target
    whose chain overlaps one reserved in the same step waits for the next; one that left the
    device or got backed up meanwhile is dropped: both are tree state every rank shares),
    ``report`` says whether this rank's allocation succeeded, and ``apply`` commits each
    reservation every rank holds and rolls back the others. Committed copies are queued on
    the ledger and acknowledged by later steps.

    With components that keep host pages of their own, each reservation reports two values
    (its full part, its components' part: the module docstring), so the budget of 16
    reservations takes up to 32 of the vector's slots; without, one each.
    """

    def __init__(self, issuer: BackupIssuer, budget: int = 16) -> None:
        self.issuer = issuer
        self.budget = budget
        self.wanted: dict[TreeNode, None] = {}  # insertion-ordered set
        self.pending: list[Reservation] = []
        self.rolled_back = 0  # reservations some rank could not allocate

    def want(self, node: TreeNode) -> None:
        self.wanted[node] = None

    def prepare(self) -> None:
        if not self.wanted:
            return
        claimed: set[int] = set()
        for node in list(self.wanted):
            if len(self.pending) >= self.budget:
                break
            if node.deleted or node.value is None or node.host_value is not None:
                del self.wanted[node]
                continue
            n, overlap = node, False
            while n.host_value is None:
                if id(n) in claimed:
                    overlap = True
                    break
                n = n.parent
            if overlap:
                continue
            del self.wanted[node]
            r = self.issuer.reserve(node)
            if r is not None:
                claimed.update(id(c) for c in r.chain)
                self.pending.append(r)

    def report(self, out: list[int]) -> None:
        if reports_components(self.issuer):
            for r in self.pending:
                out.extend((r.full_ok, r.component_ok))
        else:
            out.extend(r.full_ok for r in self.pending)

    def apply(self, agreed) -> None:
        pending, self.pending = self.pending, []
        writes = self.issuer.ledger.writes
        two = reports_components(self.issuer)
        for i, r in enumerate(pending):
            if two:
                ok, comp_ok = agreed[2 * i], agreed[2 * i + 1]
            else:
                ok, comp_ok = agreed[i], 1
            if ok:
                writes.append(self.issuer.commit(r, bool(comp_ok)))
            else:
                self.issuer.rollback(r)
                self.rolled_back += 1

    def abandon(self) -> None:
        """The step's exchange failed (``AgreementError``, on every rank): give back this
        step's reservations and queue their targets again, as if the step had not run."""
        pending, self.pending = self.pending, []
        for r in pending:
            self.issuer.release(r)
            self.wanted[r.chain[-1]] = None

    @property
    def idle(self) -> bool:
        return not self.wanted and not self.pending

    def clear(self) -> None:
        """``reset``: forget the targets (reservations never outlive a step)."""
        self.wanted.clear()
