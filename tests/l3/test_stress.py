"""Randomised stress of the L3 controller against the tree: match / insert / evict / prefetch /
finish / cancel / reset / flush in random order, with the controller's worker threads really
running. ``sanity_check`` after every step; every request's device pages are checked against
the KV oracle (bit-exact), so a page attached at the wrong position or read from the wrong key
fails at once. CI runs a bounded, seeded version; ``-m slow`` runs a long one. With a draft
sidecar (``draft=True``: upstream's SIDECAR draft KV, another geometry and other bytes) every
check covers the draft pool as well: through backups, L3 writes, prefetches and load-backs
the draft page with a target page's id holds that page's draft KV.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, numpy_backend_factory, small_geom
from hicache_jax.cache import HiCacheConfig, HiRadixCache, RadixKey
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig

P = 2


class Stress:
    def __init__(self, backend_factory, seed, policy, backend="memory", path=None, draft=False, agreement=None):
        self.rng = random.Random(seed)
        self.cache, self.be = make_cache(backend_factory, page_size=P, device_pages=24, host_pages=40)
        self.oracles = [KVOracle(self.be)]
        if draft or agreement is not None:
            sidecars = None
            if draft:
                side = numpy_backend_factory(small_geom(P, "mla", layers=1), 24, 40)
                sidecars = {"draft": side.engine}
            self.cache = HiRadixCache(
                HiCacheConfig(page_size=P), self.be.engine, self.be.device.allocator, sidecars, agreement=agreement
            )
            if draft:
                self.oracles.append(KVOracle(side, salt=0x5A5A5A5A))
        # Several ranks: a capacity would let one rank's store drop pages the other wrote (and
        # the ``reset`` operation is a single-process one): both off, every decision agreed.
        ranks = agreement is not None
        cfg = StorageConfig(
            backend=backend,
            path=path,
            prefetch_policy=policy,
            prefetch_threshold_tokens=4,
            prefetch_timeout_base_s=0.002,
            prefetch_timeout_per_ki_token_s=0.0,
            capacity_bytes=0 if seed % 2 or ranks else 60 * self.be.geom.bytes_per_page,
        )
        self.reset_weight = 0 if ranks else 0.2
        self.ctl = StorageController(self.cache, cfg, model="stress", batch_pages=2)
        self.oracle = self.oracles[0]
        # Prefix families: requests share long prefixes and branch, as multi-turn chats do.
        self.bases = [np.asarray([self.rng.randrange(0, 50) for _ in range(40)], np.int64) for _ in range(3)]
        self.pending: list = []
        self.stats = {"admitted": 0, "resets": 0, "checked_pages": 0}

    def key(self) -> RadixKey:
        base = self.rng.choice(self.bases)
        n = self.rng.randrange(2, 36)
        toks = base[:n].copy()
        if self.rng.random() < 0.3:  # a branch off the family's path
            toks[self.rng.randrange(0, n) :] += 1000
        ns = {"extra_key": "lora"} if self.rng.random() < 0.15 else {}
        return RadixKey(toks, **ns)

    # ---- operations -------------------------------------------------------------------------
    def arrive(self):
        self.pending.append(self.ctl.prefetch(self.key()))

    def admit(self):
        if not self.pending:
            return
        op = self.pending.pop(self.rng.randrange(len(self.pending)))
        self.ctl.finish_prefetch(op)
        self.serve(op.key)

    def cancel(self):
        if self.pending:
            self.ctl.cancel(self.pending.pop(self.rng.randrange(len(self.pending))))

    def serve(self, key: RadixKey):
        """begin_request, check the cached prefix bit-exact, compute the rest, finish."""
        cache = self.cache
        req, _ = cache.begin_request(key)
        cache.loading_check(block=True)
        for oracle in self.oracles:
            oracle.check_device(key, req.device_pages)
        self.stats["checked_pages"] += len(req.device_pages)
        need = -(-len(key) // P) - len(req.device_pages)
        new = cache.alloc_device(need)
        if new is None:
            if req.last_node is not None:
                cache.dec_lock_ref(req.last_node)
            return
        for oracle in self.oracles:
            oracle.write(key, new, len(req.device_pages))
        req.device_pages = np.concatenate([req.device_pages, new])
        cache.cache_finished_req(req)
        self.stats["admitted"] += 1

    def evict(self):
        self.cache.evict(self.rng.randrange(0, 30))

    def evict_host(self):
        self.cache.evict_host(self.rng.randrange(0, 30))

    def events(self):
        self.cache.check_events()
        time.sleep(0.0005 * self.rng.randrange(0, 4))  # let the workers move

    def flush(self):
        self.cache.flush()
        self.ctl.flush(5)

    def reset(self):
        self.cache.reset()
        self.stats["resets"] += 1

    def step(self):
        ops = [
            (self.arrive, 4),
            (self.admit, 4),
            (self.cancel, 1),
            (self.evict, 2),
            (self.evict_host, 2),
            (self.events, 3),
            (self.flush, 1),
            (self.reset, self.reset_weight),
        ]
        fn = self.rng.choices([f for f, _ in ops], [w for _, w in ops])[0]
        fn()
        self.cache.sanity_check(0)

    def finish(self):
        for op in self.pending:
            self.ctl.finish_prefetch(op)
        self.pending.clear()
        self.cache.sanity_check(0)
        self.ctl.close()
        self.cache.flush()
        self.cache.sanity_check(0)
        self.cache.reset()
        assert self.cache.host_allocator.available == self.cache.host_allocator.num_pages
        assert self.cache.device_allocator.available == self.cache.device_allocator.num_pages


def run(backend_factory, seed, policy, steps, **kw):
    s = Stress(backend_factory, seed, policy, **kw)
    try:
        for _ in range(steps):
            s.step()
    finally:
        m = s.cache.metrics.as_dict()
        s.finish()
    return s, m


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_storage_stress_ci(backend_factory, policy):
    totals: dict = {}
    for seed in range(3):
        s, m = run(backend_factory, seed, policy, steps=250)
        for k, v in list(m.items()) + list(s.stats.items()):
            if isinstance(v, (int, float)):  # counters (not the histograms / per-reason dicts)
                totals[k] = totals.get(k, 0) + v
    # The run must exercise the L3 paths, not pass trivially.
    for event in (
        "storage_backup_tokens",
        "prefetch_calls",
        "prefetch_skipped",
        "prefetch_revoked",
        "admitted",
        "checked_pages",
        "evicted_host_tokens",
        "resets",
    ):
        assert totals[event] > 0, f"stress never produced {event}: {totals}"
    if policy != "best_effort":
        assert totals["prefetch_attached_tokens"] > 0, totals


def test_storage_stress_with_a_draft_sidecar():
    """The draft pool's bytes follow the target's through L1, L2 and L3 (both pools stored,
    both read before a prefetch publishes)."""
    totals: dict = {}
    for seed, policy in enumerate(("wait_complete", "timeout")):
        s, m = run(numpy_backend_factory, 50 + seed, policy, steps=250, draft=True)
        assert sorted(s.ctl.pools) == ["draft", "target"]
        for k, v in list(m.items()) + list(s.stats.items()):
            totals[k] = totals.get(k, 0) + v
    for event in (
        "storage_backup_tokens",
        "prefetch_attached_tokens",
        "loaded_storage_tokens",
        "loaded_tokens",
        "checked_pages",
        "evicted_host_tokens",
    ):
        assert totals[event] > 0, f"stress never produced {event}: {totals}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["memory", "file"])
def test_storage_stress_slow(backend_factory, backend, tmp_path):
    hits = 0
    for seed in range(12):
        policy = ("best_effort", "wait_complete", "timeout")[seed % 3]
        _, m = run(
            backend_factory,
            100 + seed,
            policy,
            steps=2000,
            backend=backend,
            path=str(tmp_path / f"s{seed}") if backend == "file" else None,
        )
        hits += m["prefetch_attached_tokens"]
    assert hits > 0


def test_storage_stress_torch_backend():
    """The same stress on the torch backend (CPU), whose D2H/H2D copies really run on worker
    threads, so backups are acknowledged (and L3 jobs queued) at arbitrary points."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (the torch env runs this)")
    from cache_harness import Backend
    from npu_bridge import make_torch_backend

    def factory(geom, device_pages, host_pages, layout="page_first", deferred=False):
        return Backend(geom, *make_torch_backend(geom, device_pages, host_pages, layout, deferred=deferred))

    for seed, policy in enumerate(("best_effort", "wait_complete", "timeout")):
        run(factory, seed, policy, steps=200)


def _short_reads_and_a_missing_page(ctl):
    """Rank 1's storage diverges: every third read batch stops a page short, and every fifth
    query batch finds only its first page. Returns the counts of what fired."""
    get_multi, exists_multi = ctl.storage.get_multi, ctl.storage.exists_multi
    calls = {"get": 0, "exists": 0}
    fired = {"short_read": 0, "missing_page": 0}

    def short(transfers):
        res = get_multi(transfers)
        calls["get"] += 1
        if calls["get"] % 3 == 0 and res.hit_pages > 0:
            fired["short_read"] += 1
            return type(res)(res.hit_pages - 1, res.pool_hits)
        return res

    def missing(transfers):
        res = exists_multi(transfers)
        calls["exists"] += 1
        if calls["exists"] % 5 == 0 and res.hit_pages > 1:
            fired["missing_page"] += 1
            return type(res)(1, {k: min(v, 1) for k, v in res.pool_hits.items()})
        return res

    ctl.storage.get_multi, ctl.storage.exists_multi = short, missing
    return fired


def _stress_on_two_ranks(tmp_path, make_agreement, steps, seed=70, policy="wait_complete"):
    """The draft stress on two thread ranks over one file store: the same seeded operations on
    both (every decision from the RNG or agreed state), the digest after every step. Rank 1's
    storage reads short and misses pages (``_short_reads_and_a_missing_page``)."""
    from rank_threads import ThreadGroup, run_ranks

    group = ThreadGroup(2, timeout=60)

    def rank(r):
        s = Stress(
            numpy_backend_factory,
            seed,
            policy,
            backend="file",
            path=str(tmp_path),
            draft=True,
            agreement=make_agreement(group, r),
        )
        assert s.ctl.markers and s.ctl.replicated == {"draft"}  # target sharded, MLA draft replicated
        fired = _short_reads_and_a_missing_page(s.ctl) if r == 1 else None
        digests = []
        try:
            for _ in range(steps):
                s.step()
                digests.append(s.cache.debug_view().digest())
        finally:
            m = s.cache.metrics.as_dict()
            s.finish()
        return digests, m, dict(s.stats, fired=fired)

    return run_ranks(group, rank, timeout=150)


@pytest.mark.parametrize("policy", ["wait_complete", "timeout", "best_effort"])
def test_storage_stress_with_a_draft_sidecar_on_two_ranks(tmp_path, policy):
    """Every step's digest is equal on both ranks, every served byte (target and draft) is
    checked on each, and the run goes through L3 (backups, prefetched and attached pages)."""
    (d0, m0, st0), (d1, m1, st1) = _stress_on_two_ranks(tmp_path, lambda g, r: g.agreement(r), steps=300, policy=policy)
    first = next((i for i, (a, b) in enumerate(zip(d0, d1)) if a != b), None)
    assert first is None, f"the ranks' trees differ from step {first}"
    assert all(st1["fired"].values()), st1["fired"]  # each divergence fired on rank 1
    assert st0["admitted"] == st1["admitted"] and st0["checked_pages"] == st1["checked_pages"]
    assert st0["checked_pages"] > 0 and st0["admitted"] > 0, st0
    # (the timeout policy's 2 ms deadline and best_effort rarely wait for a read: their runs
    # attach little or nothing from storage, and must agree on that)
    events = ["storage_backup_tokens", "prefetch_calls", "evicted_host_tokens"]
    if policy == "wait_complete":
        events += ["prefetch_attached_tokens", "loaded_storage_tokens"]
    for event in events:
        assert m0[event] > 0 and m0[event] == m1[event], (event, m0[event], m1[event])


def test_storage_stress_on_two_ranks_without_the_exchange_diverges(tmp_path):
    """The same run with each rank deciding alone: rank 1's short reads and missing pages make
    its tree differ (the test above can see a divergence)."""
    from hicache_jax.cache import NoExchangeAgreement

    (d0, _m0, _s0), (d1, _m1, _s1) = _stress_on_two_ranks(tmp_path, lambda g, r: NoExchangeAgreement(r, 2), steps=200)
    assert d0 != d1
