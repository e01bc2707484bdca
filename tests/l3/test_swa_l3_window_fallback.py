"""A hybrid (SWA) prefix whose L3 read stops early: the longest prefix that still has its window.

A two-turn conversation is stored: full pages 0..23 and the SWA windows the tree held when it
was backed up, those at the end of each turn (pages 9..11 and 21..23; the pages between were
out of the window, never stored). A prefetch of the whole prefix finds all of it. When the
read then stops at a failed page (a storage fault), the window before that stop is not in
storage, so that stop cannot be served; the end of the first turn can (its window is stored),
and is. A page missing from storage's index is the same case seen by the query, which the
storage's trailing-pages rule already answers with that shorter stop (checked too).
Checked: the tokens attached and served per tier, the bytes of both pools served (the model's
window rule, ``swa_harness``), the host pools left as they were for what is not attached,
``sanity_check`` of both pools.
"""

from __future__ import annotations

import numpy as np
import pytest
from swa_harness import SWADriver, insert_with_frontier, make_swa_cache

from hicache_jax.cache import RadixKey
from hicache_jax.l3 import StorageController
from hicache_jax.storage import PoolHitPolicy, PoolSpec, StorageConfig
from hicache_jax.storage.memory import MemoryStorage

P, W = 2, 6  # SWA context W - 1 = 5 tokens: 3 window pages


class FaultyStore(MemoryStorage):
    """Records each pool's keys in write order (page order here) and fails reads of, or hides
    from the index, chosen keys."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.order: dict[str, list[bytes]] = {}
        self.fail_reads: set = set()
        self.hidden: set = set()

    def _write(self, pool, keys, pages):
        seen = self.order.setdefault(pool, [])
        seen.extend(k for k in keys if k not in seen)
        return super()._write(pool, keys, pages)

    def _contains(self, pool, keys):
        return [c and k not in self.hidden for k, c in zip(keys, super()._contains(pool, keys))]

    def _read(self, pool, keys):
        got = super()._read(pool, keys)
        return [None if k in self.fail_reads or k in self.hidden else g for k, g in zip(keys, got)]


def make():
    cache, full, swa_be, swa = make_swa_cache(
        page_size=P, window=W, device_pages=64, host_pages=64, swa_device_pages=24, swa_host_pages=32
    )
    cfg = StorageConfig(backend="memory", prefetch_threshold_tokens=4, prefetch_policy="wait_complete", worker_nice=0)
    store = FaultyStore(
        cfg,
        {"target": full.host, "swa": swa_be.host},
        [PoolSpec("target"), PoolSpec("swa", PoolHitPolicy.TRAILING_PAGES, 3)],
    )
    return cache, SWADriver(cache, full, swa_be, swa), swa, StorageController(cache, cfg, model="m", storage=store)


def insert_turn(cache, drv, k, frontier_page):
    out = insert_with_frontier(cache, drv, k, frontier_page)
    cache.flush()
    return out


@pytest.mark.parametrize("fault", ["read", "index", "window"])
def test_a_read_stopping_where_no_window_is_stored_serves_the_last_stop_with_one(fault):
    cache, drv, swa, ctl = make()
    try:
        turn2 = RadixKey(np.arange(300, 348))  # 24 pages
        insert_turn(cache, drv, RadixKey(turn2.token_ids[:24]), 9)  # turn 1: SWA pages 9..11
        insert_turn(cache, drv, turn2, 21)  # turn 2: SWA pages 21..23 (12..20: out of the window)
        assert ctl.flush(30)
        cache.evict(cache.evictable_tokens)
        cache.evict_host(cache.host_tokens)
        assert cache.host_tokens == 0 and cache.evictable_tokens == 0
        store = ctl.storage
        assert len(store.order["target"]) == 24 and len(store.order["swa"]) == 6  # windows 9..11, 21..23
        if fault == "window":  # the index has turn 2's window, a page of it fails to read
            store.fail_reads.add(store.order["swa"][4])
        else:  # target page 20 fails to read, or is not in the index
            (store.fail_reads if fault == "read" else store.hidden).add(store.order["target"][20])
        free = (cache.host_allocator.available, swa.host_allocator.available)

        key = RadixKey(np.r_[turn2.token_ids, 7])
        op = ctl.prefetch(key)
        got = ctl.finish_prefetch(op)
        assert op.hit_tokens == (24 if fault == "index" else 48), op  # the index: up to turn 1, or all of it
        assert got == 24 and op.status == "finished", (op, op.reason)  # turn 1, with its window
        cache.sanity_check(0, {"swa": 0})
        # Nothing read past the stop stays reserved or attached.
        assert cache.host_allocator.available == free[0] - 12 and swa.host_allocator.available == free[1] - 3
        req, _lb = drv.admit(key)
        assert dict(req.hit_tokens) == {"device": 0, "host": 0, "storage": 24}
        drv.check_prefix(req)  # full pages and the window's SWA pages, byte-exact
        drv.abort(req)
        cache.flush()
        cache.sanity_check(0, {"swa": 0})
    finally:
        ctl.close()
