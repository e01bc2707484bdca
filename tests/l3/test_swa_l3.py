"""L3 with the SWA component: its pages stored beside the full pages under the same chained
page keys in an ``swa`` pool (trailing-pages hit rule), round trips through the controller
(memory store after dropping both tiers; file store across a restart), the existence rule
(only the window before the stop point must be stored for the swa pool, every page for the
target) and all-or-nothing window prefetch (a short read of the swa pool attaches nothing).

Bytes are checked against the shadow model of both pools (``swa_harness``) and
``sanity_check`` (both pools, both tiers, the controller's reserved pages) runs after each step.
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


def scfg(backend="memory", path=None):
    # worker_nice 0: the L3 threads are not starved on a loaded test machine (flush waits on them)
    return StorageConfig(
        backend=backend,
        path=None if backend == "memory" else str(path),
        prefetch_threshold_tokens=4,
        prefetch_policy="wait_complete",
        worker_nice=0,
    )


class CountingStorage(MemoryStorage):
    """Memory storage that records the keys written per pool and can fail reads of chosen keys
    (a short read: those pages come back missing, as a storage fault would)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.written: dict[str, set] = {}
        self.fail_reads: set = set()

    def _write(self, pool, keys, pages):
        self.written.setdefault(pool, set()).update(keys)
        return super()._write(pool, keys, pages)

    def _read(self, pool, keys):
        got = super()._read(pool, keys)
        return [None if (pool, k) in self.fail_reads else g for k, g in zip(keys, got)]


def make(storage_cls=None, backend="memory", path=None):
    cache, full, swa_be, swa = make_swa_cache(
        page_size=P, window=W, device_pages=48, host_pages=64, swa_device_pages=24, swa_host_pages=32
    )
    storage = None
    if storage_cls is not None:
        pools = {"target": full.host, "swa": swa_be.host}
        storage = storage_cls(scfg(), pools, [PoolSpec("target"), PoolSpec("swa", PoolHitPolicy.TRAILING_PAGES, 3)])
    ctl = StorageController(cache, scfg(backend, path), model="m", storage=storage)
    return cache, SWADriver(cache, full, swa_be, swa), swa, ctl


def drop_everything(cache, ctl):
    cache.flush()
    assert ctl.flush(120)
    cache.evict(cache.evictable_tokens)
    cache.evict_host(cache.host_tokens)
    assert cache.host_tokens == 0 and cache.evictable_tokens == 0
    cache.sanity_check(0, {"swa": 0})


def admit_and_check(cache, drv, key):
    req, lb = drv.admit(key)
    drv.check_prefix(req)
    got = req.cached_pages * P
    drv.abort(req)
    cache.flush()
    cache.sanity_check(0, {"swa": 0})
    return got


def test_swa_pages_round_trip_through_a_memory_store_after_dropping_both_tiers():
    cache, drv, swa, ctl = make(CountingStorage)
    store = ctl.storage
    final = drv.serve(RadixKey(np.arange(1, 25)), chunk=6, out=list(range(100, 110)))  # tombstones inside
    assert final is not None and len(final) == 34
    drop_everything(cache, ctl)
    # Every target page is stored; of the swa pool only what the tree held on the host: no
    # tombstone's pages, the window at the end included.
    assert len(store.written["target"]) == 17
    assert 3 <= len(store.written["swa"]) < 17
    key = RadixKey(np.r_[final.token_ids, 7])
    op = ctl.prefetch(key)
    assert ctl.finish_prefetch(op) == 34
    cache.sanity_check(0, {"swa": 0})
    loaded = swa.metrics.loaded_tokens
    assert admit_and_check(cache, drv, key) == 34
    assert swa.metrics.loaded_tokens - loaded == 3 * P  # only the window came back to the device
    ctl.close()


def test_swa_pages_round_trip_through_a_file_store_across_a_restart(tmp_path):
    cache, drv, swa, ctl = make(backend="file", path=tmp_path)
    final = drv.serve(RadixKey(np.arange(1, 21)), chunk=4, out=list(range(100, 106)))
    cache.flush()
    assert ctl.flush(120)
    ctl.close()
    cache2, drv2, swa2, ctl2 = make(backend="file", path=tmp_path)  # a new process on the same directory
    key = RadixKey(np.r_[final.token_ids, 7])
    op = ctl2.prefetch(key)
    assert ctl2.finish_prefetch(op) == len(final) - len(final) % P
    assert admit_and_check(cache2, drv2, key) == len(final) - len(final) % P
    ctl2.close()


def test_existence_needs_every_target_page_but_only_the_window_of_swa_pages():
    cache, drv, swa, ctl = make(CountingStorage)
    k = RadixKey(np.arange(100, 132))  # 16 pages: SWA for pages 10..15 only (a frontier at page 10)
    insert_with_frontier(cache, drv, k, 10)
    drop_everything(cache, ctl)
    assert len(ctl.storage.written["target"]) == 16 and len(ctl.storage.written["swa"]) == 6

    def hit(n_pages):
        op = ctl.prefetch(RadixKey(np.r_[k.token_ids[: n_pages * P], 1]))
        got = ctl.finish_prefetch(op)
        assert got in (0, op.hit_tokens)
        drop_everything(cache, ctl)
        return op.hit_tokens or 0

    assert hit(16) == 32  # window [13, 16): stored
    assert hit(14) == 28  # window [11, 14): stored
    assert hit(13) == 26  # window [10, 13): stored
    # Window [9, 12) lacks page 9, and no shorter stop has its window either (from the root a
    # stop h needs pages [0, h) of the swa pool): no hit, although every target page is there.
    assert hit(12) == 0


def test_a_short_read_of_the_window_attaches_nothing():
    cache, drv, swa, ctl = make(CountingStorage)
    k = RadixKey(np.arange(200, 224))  # 12 pages, SWA everywhere
    insert_with_frontier(cache, drv, k, 0)
    drop_everything(cache, ctl)
    store = ctl.storage
    key = RadixKey(np.r_[k.token_ids, 1])
    # Every swa page fails to read while the index says it is there: the window read is short
    # (the target pages read fine).
    store.fail_reads = {("swa", x) for x in store.written["swa"]}
    op = ctl.prefetch(key)
    host_free = (cache.host_allocator.available, swa.host_allocator.available)
    revoked = cache.metrics.prefetch_revoked
    assert ctl.finish_prefetch(op) == 0
    assert op.hit_tokens == 24  # the storage had all of it...
    assert cache.metrics.prefetch_revoked == revoked + 1  # ...but nothing of that window is attached
    assert (cache.host_allocator.available, swa.host_allocator.available) == host_free
    assert cache.peek_prefix(key) == (0, 0)
    cache.sanity_check(0, {"swa": 0})
    # The same prefetch with the reads healed attaches everything.
    store.fail_reads = set()
    op = ctl.prefetch(key)
    assert ctl.finish_prefetch(op) == 24
    assert admit_and_check(cache, drv, key) == 24
    ctl.close()


def test_a_storage_with_the_wrong_swa_policy_is_refused():
    cache, full, swa_be, swa = make_swa_cache(page_size=P, window=W)
    pools = {"target": full.host, "swa": swa_be.host}
    wrong = MemoryStorage(scfg(), pools)  # swa as ALL_PAGES
    with pytest.raises(ValueError, match="spec"):
        StorageController(cache, scfg(), model="m", storage=wrong)
