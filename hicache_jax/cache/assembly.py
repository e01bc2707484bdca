"""The parts of one cache, built and wired together (``assemble``: ``HiRadixCache.__init__``
calls it once its arguments are validated) and emptied together (``CacheParts.drop_all``:
``reset``).

Pure Python. ``assemble`` runs on the thread that builds the cache (it binds no owner);
``drop_all`` on the owner thread, after ``reset`` waited for the copies in flight. The parts
keep the references the wiring gives them; ``CacheParts`` only names them for the facade.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..allocator import PageAllocator
from .agreement import Agreement
from .backup import AgreedBackups, BackupIssuer
from .component_steps import ComponentSteps
from .components import ComponentContext, ComponentRegistry, KVComponent
from .config import HiCacheConfig, WritePolicy
from .decisions import Decisions, resolve
from .errors import CacheFailedError
from .eviction_policies import strategy_for
from .evictor import Evictor
from .host_reservations import HostReservations
from .insert import Inserter
from .load_back import LoadBackIssuer
from .locks import CallerLocks, PathLocks
from .lookup import Lookup
from .metrics import CacheMetrics
from .request_helpers import RequestHelpers
from .residency import Residency
from .step_agreement import StepAgreement
from .copies_in_flight import TransferLedger
from .tree import RadixTree
from .tree_node import TreeNode
from .write_policy import WritePolicyDriver


@dataclass(eq=False)
class CacheParts:
    """The modules' objects of one cache (the facade's module table names their jobs)."""

    res: Residency
    tree: RadixTree
    locks: PathLocks
    callers: CallerLocks
    ledger: TransferLedger
    decisions: Decisions
    evictor: Evictor
    reservations: HostReservations
    backups: BackupIssuer
    policy: WritePolicyDriver
    inserter: Inserter
    lookup: Lookup
    load_backs: LoadBackIssuer
    requests: RequestHelpers
    stateful: tuple
    # Components with their own page ids (e.g. ``swa``), by name: the callers' per-component
    # pages (``component_pages``) and allocations go to them.
    own: dict[str, KVComponent]
    # Whether an L3 prefetch reads for device-only nodes and gives them host copies
    # (``backed_up_prefix``, ``insert_host``). Only where every stateful component places its
    # pages on such nodes (``device_only_host_copies``: ``swa`` does). With ranks too: the walk
    # reads agreed state only, and a node whose backup is reserved for an agreement and not
    # yet decided never takes a copy from an attach (``reserved``).
    device_only_host_copies: bool
    steps: StepAgreement
    agreed_backups: AgreedBackups | None  # several ranks: backups reserved for an agreement
    component_steps: ComponentSteps | None  # several ranks with own-id components: agreed window slides

    def drop_all(self) -> TreeNode:
        """``reset``, once the copies are done (or abandoned) and the L3 hook and the watches
        were told: free every page the tree owns, forget every lock, reservation and noted
        slide, reset the components; returns the new root."""
        res, tree = self.res, self.tree
        res.drop_all()
        tree.mark_all_deleted()
        self.callers.clear()
        self.load_backs.storage_origin.clear()
        if self.agreed_backups is not None:
            self.agreed_backups.clear()
        self.backups.reserved.clear()  # (empty between agreements; the same dict as the inserter's)
        if self.component_steps is not None:
            self.component_steps.clear()
        for comp in self.stateful:
            comp.reset()
        root = tree.new_root()
        res.adopt_root(root)
        return root


def assemble(
    cache: Any,
    config: HiCacheConfig,
    components: ComponentRegistry,
    device_allocator: PageAllocator,
    agreement: Agreement,
    metrics: CacheMetrics,
    on_failure: Callable[[CacheFailedError], None],
) -> CacheParts:
    """Build the parts of ``cache`` (the tree's owner identity; its public ``match_prefix``,
    ``load_back`` and ``debug_view`` are what the request helpers and the step digest call)
    and wire them: the stateful components' hooks, and with a collective ``agreement`` the
    agreed protocol (the facade's module docstring, "Across processes"). ``on_failure``: the
    failure latch's callback (the facade's refusal of calls)."""
    m, p = metrics, config.page_size
    host_alloc = components.host_allocator
    stateful = components.stateful
    res = Residency(device_allocator, host_alloc, strategy_for(config.eviction_policy), config.host_reclaim)
    load_backs: list[LoadBackIssuer] = []  # built after the tree: its split hook looks it up

    def split(upper: TreeNode, lower: TreeNode, k: int) -> None:
        """What the tree calls on a split: residency, every stateful component, and the
        load-back issuer's storage origin."""
        res.split(upper, lower, k)
        for comp in stateful:
            comp.on_split(upper, lower, k)
        load_backs[0].on_split(upper, lower)

    tree = RadixTree(p, cache, split)
    res.adopt_root(tree.root)
    locks = PathLocks(res)
    callers = CallerLocks(locks)
    ledger = TransferLedger(components, m, locks, config.transfer_retries, on_failure)
    # The choices that differ from upstream's (docs/deviations-from-upstream.md).
    d = resolve(config, device_allocator.num_pages, host_alloc.num_pages)
    evictor = Evictor(tree, res, m, p, config.write_policy == WritePolicy.WRITE_BACK, d.host_eviction_order)
    backups = BackupIssuer(res, locks, ledger, evictor, m, p, d.evict_whole)
    policy = WritePolicyDriver(config.write_policy, config.write_through_threshold, tree, backups, ledger, m)
    evictor.before_evict = policy.before_evict
    inserter = Inserter(tree, res, policy, p, d.count_hits, d.stamp_split_remainder)
    lookup = Lookup(tree, res, p, d.stamp_split_remainder)
    load_backs.append(LoadBackIssuer(res, locks, ledger, evictor, m, p, config.load_back_threshold, d.evict_whole))
    requests = RequestHelpers(tree, res, inserter, callers, cache.match_prefix, cache.load_back, p, m)
    if stateful:  # their hooks run only then: the full component's paths check one tuple
        for part in (evictor, backups, inserter, lookup, load_backs[0], locks):
            part.hooked = stateful
        ctx = ComponentContext(config, tree, res, evictor, locks, ledger, m)
        for comp in stateful:
            comp.attach(ctx)
    own = {c.name: c for c in stateful if c.own_page_ids}
    requests.own = tuple(own.values())
    device_only_host_copies = all(c.device_only_host_copies for c in stateful)
    inserter.device_only_host_copies = device_only_host_copies
    inserter.reserved = backups.reserved
    steps = StepAgreement(agreement, digest=lambda: cache.debug_view().digest())
    agreed_backups = component_steps = None
    if agreement.collective:
        agreed_backups = AgreedBackups(backups)
        policy.defer = agreed_backups.want
        if config.write_policy == WritePolicy.WRITE_BACK:
            evictor.before_evict = policy.before_evict_agreed
        ledger.steps = steps
        steps.add(agreed_backups)
        steps.add(ledger)
        if own:
            component_steps = ComponentSteps(tuple(own.values()))
            requests.component_steps = component_steps
            steps.add(component_steps)
    return CacheParts(
        res,
        tree,
        locks,
        callers,
        ledger,
        d,
        evictor,
        HostReservations(evictor),
        backups,
        policy,
        inserter,
        lookup,
        load_backs[0],
        requests,
        stateful,
        own,
        device_only_host_copies,
        steps,
        agreed_backups,
        component_steps,
    )
