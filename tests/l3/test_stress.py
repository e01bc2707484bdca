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
    def __init__(self, backend_factory, seed, policy, backend="memory", path=None, draft=False):
        self.rng = random.Random(seed)
        self.cache, self.be = make_cache(backend_factory, page_size=P, device_pages=24, host_pages=40)
        self.oracles = [KVOracle(self.be)]
        if draft:
            side = numpy_backend_factory(small_geom(P, "mla", layers=1), 24, 40)
            self.cache = HiRadixCache(HiCacheConfig(page_size=P), self.be.engine, self.be.device.allocator,
                                      {"draft": side.engine})
            self.oracles.append(KVOracle(side, salt=0x5A5A5A5A))
        cfg = StorageConfig(backend=backend, path=path, prefetch_policy=policy, prefetch_threshold_tokens=4,
                            prefetch_timeout_base_s=0.002, prefetch_timeout_per_ki_token_s=0.0,
                            capacity_bytes=0 if seed % 2 else 60 * self.be.geom.bytes_per_page)
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
            toks[self.rng.randrange(0, n):] += 1000
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
        ops = [(self.arrive, 4), (self.admit, 4), (self.cancel, 1), (self.evict, 2), (self.evict_host, 2),
               (self.events, 3), (self.flush, 1), (self.reset, 0.2)]
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
    for event in ("storage_backup_tokens", "prefetch_calls", "prefetch_skipped", "prefetch_revoked", "admitted",
                  "checked_pages", "evicted_host_tokens", "resets"):
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
    for event in ("storage_backup_tokens", "prefetch_attached_tokens", "loaded_storage_tokens", "loaded_tokens",
                  "checked_pages", "evicted_host_tokens"):
        assert totals[event] > 0, f"stress never produced {event}: {totals}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["memory", "file"])
def test_storage_stress_slow(backend_factory, backend, tmp_path):
    hits = 0
    for seed in range(12):
        policy = ("best_effort", "wait_complete", "timeout")[seed % 3]
        _, m = run(backend_factory, 100 + seed, policy, steps=2000, backend=backend,
                   path=str(tmp_path / f"s{seed}") if backend == "file" else None)
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
