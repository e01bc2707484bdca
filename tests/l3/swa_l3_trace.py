"""A deterministic serving trace over an SWA (+ draft) cache with an L3 controller, for
several ranks: ``rank_trace.run_swa_trace``'s requests (admission, prefill, a page of decode
per step, the window slid after each pass) with a prefetch per arriving request, finished at
admission, and every third step both tiers dropped so prefixes come back from storage. The
L3 divergences of ``rank_trace.inject`` (``short_read``, ``missing_page``) fire on the ranks
given. Prefetches whose match ends on device-only nodes (a backup the ranks have not agreed
yet) read from the backed-up end (``device_only_reads``). Every byte served (target, SWA
window, draft) is checked against the oracles; the tree's digest is recorded after every step.

Threading: one call per rank thread (``rank_threads``); pure numpy.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from cache_harness import KVOracle
from rank_trace import DRAFT_SALT, SEED, _engines, _TraceDriver, inject, rank_cache

from hicache_jax.cache import RadixKey
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig


def swa_l3_rank(agreement, storage_dir, components="draft+swa"):
    """One rank's SWA cache and its controller over the file store every rank shares."""
    cache, be, _ = rank_cache(
        agreement, components=components, policy="write_through", host_pages=64, swa_host_pages=48
    )
    ctl = StorageController(
        cache,
        StorageConfig(
            backend="file",
            path=str(storage_dir),
            prefetch_threshold_tokens=4,
            prefetch_policy="wait_complete",
            worker_nice=0,
        ),
        model="swa-trace",
    )
    return cache, be, ctl


def run_swa_l3_trace(cache, be, ctl, *, divergence=frozenset(), steps=30, seed=SEED) -> dict:
    rng = np.random.default_rng(seed)
    p = cache.page_size
    fired = inject(cache, ctl, set(divergence))
    drv = _TraceDriver(cache, be, be.swa_be, be.swa)
    draft = KVOracle(be.draft_be, DRAFT_SALT) if be.draft_be is not None else None
    convs = [list(rng.integers(0, 997, 6 * p)) for _ in range(4)]
    waiting: deque = deque()
    active: list = []
    digests, served, from_l3, device_only_reads = [], [], 0, 0

    def extend(req, key) -> bool:
        before = len(req.key)
        if not drv.extend(req, key):
            return False
        if draft is not None:
            start = before // p
            draft.write(key, req.device_pages[start:], start)
        return True

    def complete_copies():
        for eng in _engines(cache):
            for h in list(getattr(eng, "pending", [])):
                eng.complete(h)

    for step in range(steps):
        for _ in range(int(rng.integers(1, 3))):
            c = int(rng.integers(0, len(convs)))
            grow = list(rng.integers(0, 997, p * int(rng.integers(1, 4))))
            out = list(rng.integers(0, 997, p * int(rng.integers(1, 3))))
            key = RadixKey(np.asarray(convs[c] + grow, np.int64))
            op = ctl.prefetch(key)
            # Read from the backed-up end, before device-only nodes (a backup not yet agreed):
            # the read's pages for them are freed, or become their host copies.
            device_only_reads += op.status != "skipped" and op.tree_end > op.start
            waiting.append((c, key, out, op))
        still = []
        for entry in active:
            req, c, todo = entry
            key = RadixKey(np.concatenate([req.key.token_ids, np.asarray(todo[:p], np.int64)]))
            if not extend(req, key):
                cache.abort_request(req)
                continue
            entry[2] = todo[p:]
            if entry[2]:
                still.append(entry)
            else:
                convs[c] = list(req.key.token_ids)
                cache.cache_finished_req(req)
        active = still
        for _ in range(min(2, len(waiting))):
            c, key, out, op = waiting.popleft()
            if any(e[1] == c for e in active):
                ctl.cancel(op)  # the conversation moved on: its key is stale
                continue
            from_l3 += ctl.finish_prefetch(op)
            req, _lb = drv.admit(key)
            drv.check_prefix(req)
            if draft is not None:
                draft.check_device(req.key, req.device_pages[: req.cached_pages])
            served.append(req.cached_pages * p)
            if not extend(req, key):
                cache.abort_request(req)
                continue
            cache.cache_unfinished_req(req, chunked=True)
            drv.check_prefix(req)
            active.append([req, c, out])
        if step % 3 == 2:  # both tiers dropped: what comes back, comes from storage
            complete_copies()  # the backups land first (agreed steps), so storage holds them
            cache.flush()
            complete_copies()
            cache.flush()
            ctl.flush()
            cache.evict(cache.evictable_tokens)
            cache.evict_host(cache.host_tokens)
        complete_copies()
        cache.check_events()
        digests.append(cache.debug_view().digest())
    for req, _c, _todo in active:
        cache.cache_finished_req(req)
    for _, _, _, op in waiting:
        ctl.cancel(op)
    complete_copies()
    cache.flush()
    complete_copies()
    cache.flush()
    ctl.flush()
    digests.append(cache.debug_view().digest())
    cache.sanity_check(0, {"swa": 0})
    return {
        "digests": digests,
        "served": served,
        "fired": fired,
        "from_l3": from_l3,
        "swa_loaded": be.swa.metrics.loaded_tokens,
        "device_only_reads": device_only_reads,
    }
