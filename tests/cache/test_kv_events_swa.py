"""KV events with a sliding-window component: its own evictions (whole leaves when its pool is
short, ``Evictor.evict_leaf``; host leaves, ``drop_host_leaf``) are events like any other."""

from __future__ import annotations

import random

import numpy as np
from swa_harness import SWADriver, make_swa_cache
from test_kv_events import MODEL, expected_keys

from hicache_jax.cache import RadixKey
from hicache_jax.cache.event_source import KVEventSource
from hicache_jax.cache.events import TierContents


def test_swa_evictions_rebuild_every_tier():
    cache, full, swa_be, swa = make_swa_cache(device_pages=40, host_pages=40, swa_device_pages=8, swa_host_pages=12)
    drv = SWADriver(cache, full, swa_be, swa)
    src = KVEventSource(cache, model=MODEL)
    view = TierContents()
    view.apply(src.drain())
    rng = random.Random(0)
    bases = [list(range(1000 * i, 1000 * i + 8)) for i in range(3)]
    removed = 0
    for step in range(60):
        toks = rng.choice(bases) + [rng.randrange(10**5, 10**6) for _ in range(rng.choice((2, 4, 6)))]
        drv.serve(RadixKey(np.array(toks, np.int64)))
        if step % 7 == 0:
            cache.flush()
            cache.evict_host(4)
        cache.check_events()
        batch = src.drain()
        view.apply(batch)
        removed += sum(e.kind == "removed" for e in batch.events)
        exp = expected_keys(cache)
        assert view.keys("device") == exp["device"] and view.keys("host") == exp["host"]
    assert removed
    cache.sanity_check(0)
