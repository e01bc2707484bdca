"""A deterministic serving trace for several ranks of one cache, with per-rank divergence.

Every rank runs ``run_trace`` with the same seed, so the scheduler's calls are the same on
every rank; what differs is only what the divergences inject on the ranks listed in
``diverge_on`` (rank 1 in the tests):

* ``alloc_fail``: every third host allocation for a backup or a prefetch fails on that rank
  (its allocator says there is room; the allocation still fails, as a failing pinned
  allocation would);
* ``slow_d2h``: that rank's copies (deferred numpy engine) finish ``SLOW_STEPS`` steps after
  they were issued; the other ranks finish theirs in the step they were issued;
* ``short_read``: that rank's storage reads stop two pages short of every request;
* ``missing_page``: that rank's storage reports a page missing (every query's fourth page).

A step: requests arrive (an L3 prefetch each, when a controller is attached), the oldest are
admitted (``finish_prefetch``, ``begin_request``, the load-back waited for, the served prefix's
KV checked byte for byte against the oracle, new pages written, ``cache_finished_req``),
every few steps the device or the host tier is evicted (so prefixes come back from the host
and from storage), the rank's finished copies complete, and ``check_events`` ends the step.
After every step the tree's digest (``debug_view().digest()``) is recorded.

Pure numpy: the tests run it on threads (``rank_threads``) and in real processes over
``jax.distributed`` (``tests/distributed``).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from hicache_jax.cache import HiCacheConfig, HiRadixCache, RadixKey

from cache_harness import KVOracle, numpy_backend_factory, small_geom

SEED = 20260518
SLOW_STEPS = 3
DIVERGENCES = ("alloc_fail", "slow_d2h", "short_read", "missing_page")


P = 2


def rank_cache(agreement, *, storage_dir=None, device_pages=160, host_pages=96, policy="write_through",
               deferred=True, retries=2, kind="mha"):
    """One rank's cache (numpy engine, deferred copies) and, with ``storage_dir``, its L3
    controller over a file store every rank shares."""
    be = numpy_backend_factory(small_geom(P, kind), device_pages, host_pages, "page_first", deferred)
    cache = HiRadixCache(HiCacheConfig(page_size=P, load_back_threshold=0, write_policy=policy,
                                       transfer_retries=retries), be.engine, be.device.allocator, agreement=agreement)
    ctl = None
    if storage_dir is not None:
        from hicache_jax.l3 import StorageController
        from hicache_jax.storage import StorageConfig

        ctl = StorageController(cache, StorageConfig(backend="file", path=str(storage_dir),
                                                     prefetch_threshold_tokens=P), model="rank-trace")
    return cache, be, ctl


def inject(cache, ctl, divergence: set[str]) -> dict:
    """Install ``divergence`` on this rank; returns counters of what fired."""
    fired = {k: 0 for k in DIVERGENCES}
    if "alloc_fail" in divergence:
        alloc = cache.host_allocator.alloc
        calls = [0]

        def failing_alloc(n):
            calls[0] += 1
            if n and calls[0] % 3 == 0:
                fired["alloc_fail"] += 1
                return None
            return alloc(n)

        cache.host_allocator.alloc = failing_alloc
    if ctl is not None and "short_read" in divergence:
        get_multi = ctl.storage.get_multi

        def short_get(transfers):
            r = get_multi(transfers)
            if r.hit_pages > 2:
                fired["short_read"] += 1
                return type(r)(r.hit_pages - 2, {k: max(0, v - 2) for k, v in r.pool_hits.items()})
            return r

        ctl.storage.get_multi = short_get
    if ctl is not None and "missing_page" in divergence:
        exists_multi = ctl.storage.exists_multi

        def missing(transfers):
            r = exists_multi(transfers)
            if r.hit_pages > 3:
                fired["missing_page"] += 1
                return type(r)(3, {k: min(v, 3) for k, v in r.pool_hits.items()})
            return r

        ctl.storage.exists_multi = missing
    return fired


def run_trace(cache, be, ctl=None, *, divergence: set[str] = frozenset(), steps: int = 40,
              on_step=None) -> dict:
    """Run the trace on this rank (see the module docstring). ``on_step(i, digest)`` is
    called after every step (the process tests compare digests across ranks there).
    Returns the digests, the served prefix lengths and what the divergences did."""
    rng = np.random.default_rng(SEED)
    p = cache.page_size
    oracle = KVOracle(be)
    fired = inject(cache, ctl, set(divergence))
    slow = "slow_d2h" in divergence
    convs = [list(rng.integers(0, 997, 8 * p)) for _ in range(5)]
    waiting: deque = deque()
    issued: dict = {}  # deferred handle -> step it was issued
    digests, served = [], []
    for step in range(steps):
        for _ in range(int(rng.integers(1, 3))):
            c = int(rng.integers(0, len(convs)))
            convs[c] = convs[c] + list(rng.integers(0, 997, p * int(rng.integers(1, 5))))
            key = RadixKey(np.asarray(convs[c], np.int64))
            waiting.append((key, ctl.prefetch(key) if ctl is not None else None))
        for _ in range(min(2, len(waiting) - 1)):
            key, op = waiting.popleft()
            if op is not None:
                ctl.finish_prefetch(op)
            served.append(_serve(cache, oracle, key))
        action = int(rng.integers(0, 5))
        if action == 0:
            cache.evict(max(p, cache.evictable_tokens // 2))
        elif action == 1 and ctl is not None:
            cache.flush()
            ctl.flush()
            cache.evict(cache.evictable_tokens)
            cache.evict_host(cache.host_tokens)
        for h in be.engine.pending:
            issued.setdefault(h, step)
        for h in list(be.engine.pending):
            if not slow or step - issued[h] >= SLOW_STEPS:
                be.engine.complete(h)
            elif not h.completed:
                fired["slow_d2h"] += 1  # held back this step
        cache.check_events()
        d = cache.debug_view().digest()
        digests.append(d)
        if on_step is not None:
            on_step(step, d)
    cache.flush()
    if ctl is not None:
        ctl.flush()
    be.engine.complete_all()
    cache.flush()
    digests.append(cache.debug_view().digest())
    cache.sanity_check(0)
    return {"digests": digests, "served": served, "fired": fired,
            "storage_tokens": cache.metrics.storage_hit_tokens, "host_tokens_loaded": cache.metrics.loaded_tokens}


def _serve(cache, oracle: KVOracle, key: RadixKey) -> int:
    """Admit one request: match (+ load-back), check the served prefix's bytes, write the rest,
    insert. Returns the cached prefix length in tokens."""
    p = cache.page_size
    req, lb = cache.begin_request(key)
    if lb is not None:
        for layer in range(lb.handle.num_layers):
            lb.handle.wait_layer(layer)  # a forward pass waits for its layers (forces the copy)
    hit = req.device_pages.shape[0]
    oracle.check_device(key, req.device_pages)
    new = cache.alloc_device(len(key) // p - hit)
    assert new is not None, "the trace's device pool is too small"
    oracle.write(key, new, hit)
    req.key = RadixKey(key.token_ids[:hit * p])
    req.extend(key, new)
    cache.cache_finished_req(req)
    return hit * p
