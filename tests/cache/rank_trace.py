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
* ``missing_page``: that rank's storage reports a page missing (every query's fourth page);
* ``swa_alloc_fail``: every third SWA host allocation (an SWA backup's; the first, fourth...)
  fails on that rank;
* ``late_slide``: that rank's forward pass lags one step: its ``slide_window`` says only the
  tokens before the request's last extension were written (``written=``).

Caches (``rank_cache(components=)``): ``full`` (one pool, optionally an L3 controller),
``swa`` (a hybrid model: an ``SWAComponent`` with its own pools) and ``draft+swa`` (also a
draft model's sidecar pool on the full page ids). The SWA caches run ``run_swa_trace``:
requests live over several steps (admission with its load-back, prefill, then a page of
decode per step, ``slide_window`` after each pass), served by the reference call sequence
(``swa_harness.SWADriver``) with every byte checked against an oracle per pool; no L3 here, so
``short_read`` / ``missing_page`` do not apply there (``divergences``): the SWA trace with L3
across ranks is ``tests/l3/swa_l3_trace.py``.

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
from swa_harness import SWADriver, make_swa_cache

SEED = 20260518
SLOW_STEPS = 3
DIVERGENCES = ("alloc_fail", "slow_d2h", "short_read", "missing_page", "swa_alloc_fail", "late_slide")
L3_DIVERGENCES = ("short_read", "missing_page")
SWA_DIVERGENCES = ("swa_alloc_fail", "late_slide")
COMPONENTS = ("full", "swa", "draft+swa")
WINDOW = 5  # the SWA caches' sliding window (tokens)
DRAFT_SALT = 0xD2AF7  # the draft pool's KV differs from the target's


def divergences(components: str = "full", l3: bool = True) -> tuple[str, ...]:
    """The divergences a trace over that cache can fire."""
    return tuple(
        d for d in DIVERGENCES if (l3 or d not in L3_DIVERGENCES) and (components != "full" or d not in SWA_DIVERGENCES)
    )


P = 2


def rank_cache(
    agreement,
    *,
    storage_dir=None,
    device_pages=160,
    host_pages=96,
    policy="write_through",
    deferred=True,
    retries=2,
    kind="mha",
    components="full",
    swa_device_pages=40,
    swa_host_pages=40,
):
    """One rank's cache (numpy engine, deferred copies) and, with ``storage_dir``, its L3
    controller over a file store every rank shares. ``components``: one of ``COMPONENTS``;
    for the SWA caches the returned backend carries ``swa_be`` / ``swa`` / ``draft_be`` (the
    SWA backend and component, the draft sidecar's backend or None)."""
    if components not in COMPONENTS:
        raise ValueError(f"components: expected one of {COMPONENTS}, got {components!r}")
    if components != "full":
        draft_be = None
        sidecars = None
        if components == "draft+swa":
            draft_be = numpy_backend_factory(small_geom(P, kind), device_pages, host_pages, "page_first", deferred)
            sidecars = {"draft": draft_be.engine}
        cache, be, swa_be, swa = make_swa_cache(
            page_size=P,
            window=WINDOW,
            device_pages=device_pages,
            host_pages=host_pages,
            swa_device_pages=swa_device_pages,
            swa_host_pages=swa_host_pages,
            deferred=deferred,
            kind=kind,
            agreement=agreement,
            sidecars=sidecars,
            write_policy=policy,
            transfer_retries=retries,
        )
        be.swa_be, be.swa, be.draft_be = swa_be, swa, draft_be
        return cache, be, None
    be = numpy_backend_factory(small_geom(P, kind), device_pages, host_pages, "page_first", deferred)
    cache = HiRadixCache(
        HiCacheConfig(page_size=P, load_back_threshold=0, write_policy=policy, transfer_retries=retries),
        be.engine,
        be.device.allocator,
        agreement=agreement,
    )
    ctl = None
    if storage_dir is not None:
        from hicache_jax.l3 import StorageController
        from hicache_jax.storage import StorageConfig

        ctl = StorageController(
            cache, StorageConfig(backend="file", path=str(storage_dir), prefetch_threshold_tokens=P), model="rank-trace"
        )
    return cache, be, ctl


def inject(cache, ctl, divergence: set[str]) -> dict:
    """Install ``divergence`` on this rank; returns counters of what fired."""
    swa = cache.components.components.get("swa")
    fired = {k: 0 for k in divergences("full" if swa is None else "swa", l3=ctl is not None)}
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
    if swa is not None and "swa_alloc_fail" in divergence:
        swa_alloc = swa.host_allocator.alloc
        swa_calls = [0]

        def failing_swa_alloc(n):
            swa_calls[0] += 1
            if n and swa_calls[0] % 3 == 1:  # not in step with alloc_fail's calls (both fail alike)
                fired["swa_alloc_fail"] += 1
                return None
            return swa_alloc(n)

        swa.host_allocator.alloc = failing_swa_alloc
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


def run_trace(cache, be, ctl=None, *, divergence: set[str] = frozenset(), steps: int = 40, on_step=None) -> dict:
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
    digests, served, device_only_reads = [], [], 0
    for step in range(steps):
        for _ in range(int(rng.integers(1, 3))):
            c = int(rng.integers(0, len(convs)))
            convs[c] = convs[c] + list(rng.integers(0, 997, p * int(rng.integers(1, 5))))
            key = RadixKey(np.asarray(convs[c], np.int64))
            op = ctl.prefetch(key) if ctl is not None else None
            # Read from the backed-up end, before device-only nodes (not skipped as not_backed_up).
            device_only_reads += op is not None and op.status != "skipped" and op.tree_end > op.start
            waiting.append((key, op))
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
    return {
        "digests": digests,
        "served": served,
        "fired": fired,
        "storage_tokens": cache.metrics.storage_hit_tokens,
        "host_tokens_loaded": cache.metrics.loaded_tokens,
        "device_only_reads": device_only_reads,
    }


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
    req.key = RadixKey(key.token_ids[: hit * p])
    req.extend(key, new)
    cache.cache_finished_req(req)
    return hit * p


# ---------------------------------------------------------------------------------------------- SWA caches
def _engines(cache) -> list:
    return list(cache.components.engines.values())


def run_swa_trace(
    cache, be, *, divergence: set[str] = frozenset(), steps: int = 40, on_step=None, seed: int = SEED
) -> dict:
    """The trace over an SWA cache (``rank_cache(components="swa" | "draft+swa")``; see the
    module docstring). Returns what ``run_trace`` does, plus ``exchanges`` (agreement calls
    made during the steps) and the SWA metrics."""
    rng = np.random.default_rng(seed)
    p = cache.page_size
    divergence = set(divergence)
    fired = inject(cache, None, divergence)
    slow = "slow_d2h" in divergence
    late = "late_slide" in divergence
    drv = _TraceDriver(cache, be, be.swa_be, be.swa)
    draft = KVOracle(be.draft_be, DRAFT_SALT) if be.draft_be is not None else None
    convs = [list(rng.integers(0, 997, 6 * p)) for _ in range(5)]
    waiting: deque = deque()
    active: list = []  # [req, conv, tokens still to decode]
    issued: dict = {}
    digests, served = [], []

    def extend(req, key) -> bool:
        before = len(req.key)
        if not drv.extend(req, key):
            return False
        if draft is not None:
            start = before // p
            draft.write(key, req.device_pages[start:], start)
        if late:
            cache.slide_window(req, written=before)  # this rank wrote only the previous pass
            if before < len(req.key):
                fired["late_slide"] += 1
        return True

    def finish(entry) -> None:
        req, c, _ = entry
        convs[c] = list(req.key.token_ids)
        cache.cache_finished_req(req)

    steps_before = cache.step_agreement.exchanges
    for step in range(steps):
        for _ in range(int(rng.integers(1, 3))):
            c = int(rng.integers(0, len(convs)))
            grow = list(rng.integers(0, 997, p * int(rng.integers(1, 4))))
            waiting.append((c, grow, list(rng.integers(0, 997, p * int(rng.integers(1, 4))))))
        # decode: one page per active request and step
        still = []
        for entry in active:
            req, c, todo = entry
            key = RadixKey(np.concatenate([req.key.token_ids, np.asarray(todo[:p], np.int64)]))
            if not extend(req, key):
                drv.abort(req)
                continue
            entry[2] = todo[p:]
            if entry[2]:
                still.append(entry)
            else:
                finish(entry)
        active = still
        # admission: up to two, if no other request of that conversation is active
        for _ in range(min(2, len(waiting))):
            c, grow, out = waiting.popleft()
            if any(e[1] == c for e in active):
                waiting.append((c, grow, out))
                continue
            key = RadixKey(np.asarray(convs[c] + grow, np.int64))
            req, _lb = drv.admit(key)
            drv.check_prefix(req)
            if draft is not None:
                draft.check_device(req.key, req.device_pages[: req.cached_pages])
            served.append(req.cached_pages * p)
            if not extend(req, key):
                drv.abort(req)
                continue
            cache.cache_unfinished_req(req, chunked=True)
            drv.check_prefix(req)
            active.append([req, c, out])
        action = int(rng.integers(0, 5))
        if action == 0:
            cache.evict(max(p, cache.evictable_tokens // 2))
        elif action == 1:
            cache.evict_host(max(p, cache.host_tokens // 2))
        for eng in _engines(cache):
            for h in getattr(eng, "pending", []):
                issued.setdefault(h, step)
            for h in list(getattr(eng, "pending", [])):
                if not slow or step - issued[h] >= SLOW_STEPS:
                    eng.complete(h)
                elif not h.completed:
                    fired["slow_d2h"] += 1
        cache.check_events()
        d = cache.debug_view().digest()
        digests.append(d)
        if on_step is not None:
            on_step(step, d)
    exchanges = cache.step_agreement.exchanges - steps_before
    for entry in active:
        finish(entry)
    for eng in _engines(cache):
        if hasattr(eng, "complete_all"):
            eng.complete_all()
    cache.flush()
    for eng in _engines(cache):
        if hasattr(eng, "complete_all"):
            eng.complete_all()
    cache.flush()
    digests.append(cache.debug_view().digest())
    cache.sanity_check(0, {"swa": 0})
    return {
        "digests": digests,
        "served": served,
        "fired": fired,
        "exchanges": exchanges,
        "steps": steps,
        "swa": dict(cache.stats()["components"]["swa"]["metrics"]),
        "host_tokens_loaded": cache.metrics.loaded_tokens,
    }


class _TraceDriver(SWADriver):
    """``SWADriver`` whose abort is the cache's ``abort_request`` (with ranks the cache must
    hear of it: the request's agreed slides stop there)."""

    def abort(self, req) -> None:
        self.cache.abort_request(req)
