"""L3 controller (hicache_jax/l3/controller.py): backups L2 -> L3, prefetch L3 -> L2 -> L1.

Backend-neutral over the cache's backend factory (numpy here; the torch env collects this
file too) and parametrised over the storage backends importable here (memory, file, and
orbax where orbax-checkpoint/tensorstore are installed). KV bytes are checked against the
harness oracle after every round trip; ``sanity_check`` runs after every step that matters.
"""

from __future__ import annotations

import importlib.util
import threading
import time

import numpy as np
import pytest

from cache_harness import Backend, KVOracle, make_cache, numpy_backend_factory, prefill_insert, small_geom
from hicache_jax.backends.numpy_backend import NumpyTransferEngine
from hicache_jax.cache import HiCacheConfig, HiRadixCache, RadixKey
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig
from hicache_jax.storage.memory import MemoryStorage

HAVE_ORBAX = (
    all(importlib.util.find_spec(m) is not None for m in ("orbax", "tensorstore", "google_crc32c"))
    and importlib.util.find_spec("orbax.checkpoint") is not None
)
STORE_BACKENDS = ["memory", "file"] + (["orbax"] if HAVE_ORBAX else [])
P = 2  # page size of these tests
GATE_S = 20.0


def seq(start, n, **ns):
    return RadixKey(np.arange(start, start + n, dtype=np.int64), **ns)


def scfg(backend="memory", path=None, **kw):
    kw.setdefault("prefetch_threshold_tokens", 4)
    kw.setdefault("prefetch_policy", "wait_complete")
    if backend == "orbax":
        kw.setdefault("segment_pages", 8)
        kw.setdefault("flush_interval_s", 0.05)
    return StorageConfig(backend=backend, path=None if backend == "memory" else str(path), **kw)


def setup(
    backend_factory,
    backend="memory",
    path=None,
    *,
    device_pages=32,
    host_pages=64,
    model="m",
    storage=None,
    ctl_kw=None,
    **kw,
):
    cache, be = make_cache(backend_factory, page_size=P, device_pages=device_pages, host_pages=host_pages)
    ctl = StorageController(cache, scfg(backend, path, **kw), model=model, storage=storage, **(ctl_kw or {}))
    return cache, be, ctl


def drop_everything(cache):
    """Evict device and host tiers entirely (what a long idle period or memory pressure does)."""
    cache.flush()
    if cache.storage_hook is not None:
        assert cache.storage_hook.flush(60)  # L3 backups hold host locks until stored
    cache.evict(cache.evictable_tokens)
    cache.evict_host(cache.host_tokens)
    assert cache.host_tokens == 0 and cache.evictable_tokens == 0
    cache.sanity_check(0)


def fetch_and_check(cache, ctl, oracle, key, expect_storage):
    """Prefetch + finish + begin_request, then the device pages must equal the oracle's KV."""
    op = ctl.prefetch(key)
    got = ctl.finish_prefetch(op)
    assert got == expect_storage, op
    cache.sanity_check()
    req, _ = cache.begin_request(key)
    cache.flush()
    oracle.check_device(key, req.device_pages)
    if req.last_node is not None:
        cache.dec_lock_ref(req.last_node)
    cache.sanity_check(0)
    return req


class GatedStorage(MemoryStorage):
    """Memory storage whose page reads wait for permits (one per ``_read`` call = one batch)
    and whose writes and existence checks can be held; used to control prefetch timing.
    Every wait gives up after ``GATE_S`` so a failing test never leaves a worker blocked (the
    interpreter joins worker threads at exit)."""

    def __init__(self, *a, read_permits=0, **kw):
        super().__init__(*a, **kw)
        self.exists_gate = threading.Event()
        self.exists_gate.set()
        self.reads = threading.Semaphore(read_permits)
        self.writes = threading.Event()
        self.writes.set()
        self.read_calls = 0

    def exists_multi(self, transfers):
        self.exists_gate.wait(GATE_S)
        return super().exists_multi(transfers)

    def _read(self, pool, keys):
        self.read_calls += 1
        self.reads.acquire(timeout=GATE_S)
        return super()._read(pool, keys)

    def _write(self, pool, keys, pages):
        self.writes.wait(GATE_S)
        return super()._write(pool, keys, pages)


def gated(cache, cfg, **kw):
    pools = {"target": cache.components.engines["full"].host_pool}
    return GatedStorage(cfg, pools, **kw)


# ---------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("backend", STORE_BACKENDS)
def test_round_trip_through_storage_after_dropping_both_tiers(backend_factory, backend, tmp_path):
    cache, be, ctl = setup(backend_factory, backend, tmp_path)
    oracle = KVOracle(be)
    a, b = seq(0, 20), RadixKey(np.concatenate([np.arange(12), np.arange(500, 510)]))  # b splits a's node
    prefill_insert(cache, oracle, a)
    cache.flush()
    prefill_insert(cache, oracle, b)
    cache.flush()
    assert ctl.flush(60)
    m = cache.metrics
    assert m.storage_backup_tokens == 20 + 10  # b's shared prefix is not written again
    assert m.storage_backup_bytes == 15 * be.geom.bytes_per_page and m.storage_backup_failed_tokens == 0
    assert all(n.host_lock_ref == 0 for n in cache.all_nodes() if n is not cache.root)  # L3 locks dropped
    drop_everything(cache)
    fetch_and_check(cache, ctl, oracle, a, 20)
    # b: its first 12 tokens are in the tree inside a's node; the rest chains from the middle of it.
    drop_everything(cache)
    fetch_and_check(cache, ctl, oracle, a, 20)
    fetch_and_check(cache, ctl, oracle, b, 10)
    # Again from a node that ends where b branches off.
    drop_everything(cache)
    fetch_and_check(cache, ctl, oracle, RadixKey(b.token_ids[:12]), 12)
    fetch_and_check(cache, ctl, oracle, b, 10)
    assert m.storage_hit_tokens == 72 and m.prefetched_tokens == 72 and m.prefetch_calls == 5
    assert ctl.storage.metrics.hits >= 21
    ctl.close()
    assert cache.storage_hook is None
    cache.sanity_check(0)


def test_partial_tree_hit_continues_from_storage(backend_factory):
    cache, be, ctl = setup(backend_factory)
    oracle = KVOracle(be)
    key = seq(0, 30)
    prefill_insert(cache, oracle, key)
    drop_everything(cache)
    prefill_insert(cache, oracle, seq(0, 8))  # the tree has the first 8 tokens again (device + host)
    cache.flush()
    op = ctl.prefetch(key)
    assert op.start == 8 and op.requested_tokens == 22
    assert ctl.finish_prefetch(op) == 22
    req = fetch_and_check(cache, ctl, oracle, key, 0)
    assert len(req.device_pages) == 15


def test_unaligned_key_and_per_tier_counts(backend_factory):
    cache, be, ctl = setup(backend_factory)
    oracle = KVOracle(be)
    key = seq(7, 21)  # 10 whole pages + 1 token
    prefill_insert(cache, oracle, key)
    drop_everything(cache)
    prefill_insert(cache, oracle, seq(7, 6))
    cache.flush()
    cache.evict(cache.evictable_tokens)  # first 6 tokens: host only
    prefill_insert(cache, oracle, seq(7, 2))  # first 2 tokens: device again
    cache.flush()
    storage = ctl.finish_prefetch(ctl.prefetch(key))
    assert storage == 14
    loaded0 = cache.metrics.loaded_tokens
    res = cache.match_prefix(key)
    req, lb = cache.begin_request(key)
    device, host = res.device_hit_length, cache.metrics.loaded_tokens - loaded0 - storage
    assert (device, host, storage) == (2, 4, 14)
    cache.flush()
    oracle.check_device(key, req.device_pages[:10])
    cache.dec_lock_ref(req.last_node)


@pytest.mark.parametrize("backend", ["file"] + (["orbax"] if HAVE_ORBAX else []))
def test_new_cache_on_the_same_directory_hits(backend_factory, backend, tmp_path):
    cache, be, ctl = setup(backend_factory, backend, tmp_path)
    keys = [seq(0, 24), seq(1000, 16)]
    for k in keys:
        prefill_insert(cache, KVOracle(be), k)
    cache.flush()
    ctl.close()  # flushes the L3 writes
    cache2, be2, ctl2 = setup(backend_factory, backend, tmp_path)  # a "restarted" server
    oracle2 = KVOracle(be2)
    for k in keys:
        fetch_and_check(cache2, ctl2, oracle2, k, len(k))
    assert cache2.metrics.storage_hit_tokens == 40
    ctl2.close()


def test_draft_sidecar_pages_come_back_with_target_pages():
    target = numpy_backend_factory(small_geom(2, "mha", layers=3), 16, 32, "page_first", False)
    draft_be = numpy_backend_factory(small_geom(2, "mla", layers=1), 16, 32, "layer_first", False)
    draft_engine = NumpyTransferEngine(draft_be.device, draft_be.host)
    draft = Backend(draft_be.geom, draft_be.device, draft_be.host, draft_engine)
    cache = HiRadixCache(
        HiCacheConfig(page_size=2, storage=scfg()),
        target.engine,
        target.device.allocator,
        sidecars={"draft": draft_engine},
    )
    ctl = StorageController(cache, model="m")  # the cache config carries the storage settings
    assert sorted(ctl.pools) == ["draft", "target"]
    t_oracle, d_oracle = KVOracle(target), KVOracle(draft)
    key, other = seq(0, 12), seq(100, 12)
    for k in (key, other):
        pages = cache.alloc_device(6)
        t_oracle.write(k, pages)
        d_oracle.write(k, pages)
        cache.insert(k, pages)
    cache.flush()
    ctl.flush()
    assert cache.metrics.storage_backup_bytes == 12 * (target.geom.bytes_per_page + draft.geom.bytes_per_page)
    drop_everything(cache)
    # Garbage in both device pools so a missing draft load would show.
    junk = cache.alloc_device(16)
    for be in (target, draft):
        for c in be.geom.components:
            be.device.write(c, junk, np.full((be.geom.num_layers, 16) + be.geom.page_shape, 7, be.geom.container_dtype))
    cache.device_allocator.free(junk)
    # And in every (free) host page: a prefetch that read only the target's pages would leave
    # the draft's old host copies, which hold the right bytes, in the pages it reuses.
    for be in (target, draft):
        for c in be.geom.components:
            be.host.component_view(c)[...] = 7
    assert ctl.finish_prefetch(ctl.prefetch(key)) == 12
    req, _ = cache.begin_request(key)
    cache.flush()
    t_oracle.check_device(key, req.device_pages)
    d_oracle.check_device(key, req.device_pages)
    cache.dec_lock_ref(req.last_node)
    # A draft page missing from storage makes the target page a miss too (no page without its draft).
    store = ctl.storage
    ns = ctl._namespaces(other.namespace)
    from hicache_jax.storage import page_keys

    dkeys = page_keys(ns["draft"], other.token_ids)
    with store._lock:
        store._pages.pop(("draft", dkeys[3]))
    assert ctl.finish_prefetch(ctl.prefetch(other)) == 6  # pages 0..2 only
    cache.sanity_check()
    ctl.close()


# ---------------------------------------------------------------------------------------------- backups
def test_backup_keeps_host_pages_until_the_storage_copied_them(backend_factory):
    cache, be = make_cache(backend_factory, page_size=P)
    store = gated(cache, scfg(), read_permits=1000)
    store.writes.clear()
    ctl = StorageController(cache, scfg(), model="m", storage=store)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 10))
    cache.writing_check(block=True)
    node = cache.match_prefix(seq(0, 10)).last_host_node
    assert node.host_lock_ref == 1 and ctl.stats()["storage_backups_in_flight"] == 1
    cache.evict(10)
    assert cache.evict_host(10) == 0  # the L3 job still reads these host pages
    cache.sanity_check(0)
    store.writes.set()
    assert ctl.flush(60)
    assert node.host_lock_ref == 0 and cache.evict_host(10) == 10
    assert cache.metrics.storage_backup_tokens == 10
    fetch_and_check(cache, ctl, oracle, seq(0, 10), 10)
    ctl.close()


def test_backup_write_faults_are_counted_and_retried(backend_factory):
    cache, be = make_cache(backend_factory, page_size=P)

    class Failing(MemoryStorage):
        fail = True

        def _write(self, pool, keys, pages):
            if self.fail:
                raise OSError(28, "No space left on device")
            return super()._write(pool, keys, pages)

    store = Failing(scfg(), {"target": be.host})
    ctl = StorageController(cache, scfg(), model="m", storage=store)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 10))
    cache.flush()
    ctl.flush()
    assert cache.metrics.storage_backup_failed_tokens == 10 and cache.metrics.storage_backup_tokens == 0
    assert store.metrics.write_errors == 1
    store.fail = False
    prefill_insert(cache, oracle, seq(0, 16))  # the child's backup retries the failed parent
    cache.flush()
    ctl.flush()
    assert cache.metrics.storage_backup_tokens == 16
    drop_everything(cache)
    fetch_and_check(cache, ctl, oracle, seq(0, 16), 16)
    ctl.close()


def test_write_back_policy_backs_up_to_storage_on_eviction(backend_factory):
    cache, be = make_cache(backend_factory, page_size=P, write_policy="write_back")
    ctl = StorageController(cache, scfg(), model="m")
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 12))
    assert cache.metrics.backup_tokens == 0
    cache.evict(12)  # write_back: D2H now, then L3
    ctl.flush()
    assert cache.metrics.storage_backup_tokens == 12
    cache.evict_host(12)
    fetch_and_check(cache, ctl, oracle, seq(0, 12), 12)
    ctl.close()


# ---------------------------------------------------------------------------------------------- policies
def _fill(backend_factory, key_len=32, **cfg_kw):
    """A cache whose storage holds key_len tokens of seq(0, ...), both tiers dropped; reads gated
    (``store.reads`` permits, one per 4-page batch)."""
    cache, be = make_cache(backend_factory, page_size=P, device_pages=32, host_pages=64)
    cfg = scfg(**cfg_kw)
    store = gated(cache, cfg)
    ctl = StorageController(cache, cfg, model="m", storage=store, batch_pages=4)
    oracle = KVOracle(be)
    store.reads.release(1000)  # no gating while writing
    prefill_insert(cache, oracle, seq(0, key_len))
    cache.flush()
    ctl.flush()
    drop_everything(cache)
    while store.reads.acquire(blocking=False):  # close the gate again
        pass
    return cache, be, ctl, store, oracle


def _wait_for(pred, timeout=5.0):
    t = time.perf_counter() + timeout
    while not pred():
        assert time.perf_counter() < t, "timed out"
        time.sleep(0.005)


def test_best_effort_takes_what_arrived(backend_factory):
    cache, be, ctl, store, oracle = _fill(backend_factory, prefetch_policy="best_effort")
    key = seq(0, 32)  # 16 pages = 4 batches of 4
    op = ctl.prefetch(key)
    _wait_for(lambda: op.hit_tokens is not None)
    cache.check_events()  # the owner thread reserves host pages and starts the reads
    assert op.status == "loading" and ctl.stats()["prefetch_reserved_host_pages"] == 16
    store.reads.release(1)  # one batch may arrive
    _wait_for(lambda: op.loaded_tokens == 8)
    assert ctl.prefetch_ready(op)  # best_effort is always ready
    t0 = time.perf_counter()
    assert ctl.finish_prefetch(op) == 8
    assert time.perf_counter() - t0 < 0.5
    cache.sanity_check()  # the rest stays reserved while the IO thread may still write it
    # A backup now must not get host pages the IO thread is still writing (the allocator is
    # LIFO: pages freed too early would be the very next ones handed out).
    other = seq(500, 16)
    prefill_insert(cache, oracle, other)
    cache.flush()
    store.reads.release(1000)
    _wait_for(lambda: (cache.check_events(), ctl.stats()["prefetch_reserved_host_pages"] == 0)[1])
    _wait_for(lambda: op._io_finished)
    cache.sanity_check()
    cache.evict(cache.evictable_tokens)
    fetch_and_check(cache, ctl, oracle, other, 0)  # loaded back from its host copy: intact
    fetch_and_check(cache, ctl, oracle, seq(0, 8), 0)  # what arrived is bit-exact
    assert cache.metrics.prefetched_tokens == 8 and cache.metrics.storage_hit_tokens == 8
    ctl.close()


def test_best_effort_before_the_storage_answered_gets_nothing(backend_factory):
    cache, be, ctl, store, oracle = _fill(backend_factory, prefetch_policy="best_effort")
    op = ctl.prefetch(seq(0, 32))
    assert ctl.finish_prefetch(op) == 0  # nothing arrived yet (the reads are gated)
    store.reads.release(1000)
    _wait_for(lambda: (cache.check_events(), ctl.stats()["prefetch_reserved_host_pages"] == 0)[1])
    cache.sanity_check(0)
    assert cache.host_tokens == 0
    ctl.close()


def test_wait_complete_waits_for_every_page(backend_factory):
    cache, be, ctl, store, oracle = _fill(backend_factory, prefetch_policy="wait_complete")
    op = ctl.prefetch(seq(0, 32))
    assert not ctl.prefetch_ready(op)
    threading.Timer(0.3, lambda: store.reads.release(1000)).start()
    t0 = time.perf_counter()
    assert ctl.finish_prefetch(op) == 32
    assert time.perf_counter() - t0 >= 0.25
    assert cache.metrics.prefetch_timeouts == 0
    fetch_and_check(cache, ctl, oracle, seq(0, 32), 0)
    ctl.close()


def test_timeout_stops_at_the_deadline(backend_factory):
    cache, be, ctl, store, oracle = _fill(
        backend_factory, prefetch_policy="timeout", prefetch_timeout_base_s=0.3, prefetch_timeout_per_ki_token_s=0.0
    )
    assert ctl.config.prefetch_timeout(32) == pytest.approx(0.3)
    op = ctl.prefetch(seq(0, 32))
    _wait_for(lambda: op.hit_tokens is not None)
    cache.check_events()
    store.reads.release(2)  # two of four batches arrive in time
    _wait_for(lambda: op.loaded_tokens == 16)
    t0 = time.perf_counter()
    assert not ctl.prefetch_ready(op)
    assert ctl.finish_prefetch(op) == 16
    assert time.perf_counter() - op.t0 >= 0.3 and time.perf_counter() - t0 < 2.0
    assert cache.metrics.prefetch_timeouts == 1
    store.reads.release(1000)
    _wait_for(lambda: (cache.check_events(), ctl.stats()["prefetch_reserved_host_pages"] == 0)[1])
    fetch_and_check(cache, ctl, oracle, seq(0, 16), 0)
    ctl.close()


def test_timeout_completes_early_when_everything_arrives(backend_factory):
    cache, be, ctl, store, oracle = _fill(backend_factory, prefetch_policy="timeout", prefetch_timeout_base_s=30.0)
    store.reads.release(1000)
    op = ctl.prefetch(seq(0, 32))
    t0 = time.perf_counter()
    assert ctl.finish_prefetch(op) == 32
    assert time.perf_counter() - t0 < 5 and cache.metrics.prefetch_timeouts == 0
    ctl.close()


# ---------------------------------------------------------------------------------------------- threshold
def test_threshold_skip_and_revoke(backend_factory):
    cache, be, ctl = setup(backend_factory, prefetch_threshold_tokens=8)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 6))  # storage will hold 3 pages of the longer key
    drop_everything(cache)
    ctl.flush()
    m = cache.metrics
    short = ctl.prefetch(seq(0, 6))
    assert short.status == "skipped" and m.prefetch_skipped == 1  # continuation 6 < 8
    assert ctl.finish_prefetch(short) == 0
    op = ctl.prefetch(seq(0, 20))  # continuation 20 >= 8, but the storage has only 6
    assert ctl.finish_prefetch(op) == 0
    assert op.status == "revoked" and op.hit_tokens == 6 and m.prefetch_revoked == 1
    miss = ctl.prefetch(seq(900, 20))
    assert ctl.finish_prefetch(miss) == 0 and m.prefetch_revoked == 1  # a plain miss is not a revoke
    with pytest.raises(ValueError, match="already finished"):
        ctl.finish_prefetch(op)
    cache.sanity_check(0)
    assert cache.host_allocator.available == cache.host_allocator.num_pages
    ctl.close()


def test_threshold_skip_is_visible(backend_factory, caplog):
    """A prefetch under the threshold says why (reason, reason_code), counts per reason and logs:
    once at info, then at debug."""
    import logging

    cache, be, ctl = setup(backend_factory, prefetch_threshold_tokens=8)
    m = cache.metrics
    with caplog.at_level(logging.DEBUG, logger="hicache_jax.cache.storage"):
        a = ctl.prefetch(seq(0, 6))
        b = ctl.prefetch(seq(100, 7))
    assert a.status == b.status == "skipped" and a.reason_code == b.reason_code == "below_threshold"
    assert "6 tokens" in a.reason and "< 8" in a.reason and "prefetch_threshold_tokens" in a.reason
    assert m.prefetch_skipped_by_reason == {"below_threshold": 2} and m.prefetch_skipped == 2
    recs = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert [r.levelno for r in recs] == [logging.INFO, logging.DEBUG], [r.getMessage() for r in recs]
    ctl.close()
    closed = ctl.prefetch(seq(0, 20))
    assert closed.status == "closed" and closed.reason_code == "closed"
    assert m.prefetch_skipped_by_reason == {"below_threshold": 2, "closed": 1}


def test_threshold_is_at_least_a_page(backend_factory):
    cache, be = make_cache(backend_factory, page_size=4)
    ctl = StorageController(cache, StorageConfig(backend="memory", prefetch_threshold_tokens=0), model="m")
    assert ctl.threshold == 4
    ctl.close()


def test_inflight_budget_skips_prefetches(backend_factory):
    cache, be = make_cache(backend_factory, page_size=P, host_pages=20)
    store = gated(cache, scfg())
    store.exists_gate.clear()  # queries stay in flight
    ctl = StorageController(cache, scfg(), model="m", storage=store)
    ops = [ctl.prefetch(seq(100 * i, 8)) for i in range(4)]  # 4 pages each; budget 10 pages
    assert [o.status for o in ops] == ["querying", "querying", "querying", "skipped"]
    assert cache.metrics.prefetch_skipped == 1
    store.exists_gate.set()
    for o in ops:
        ctl.finish_prefetch(o)
    ctl.close()


def _hold_host_pages(cache, ctl, store, oracle, keys):
    """Fill the host with pages that stay host-locked: their L3 writes hang (writes gated)."""
    store.writes.clear()
    for key in keys:
        prefill_insert(cache, oracle, key)
        cache.flush()  # D2H acknowledged: the L3 write is queued and holds the host pages
        cache.evict(cache.evictable_tokens)


@pytest.mark.parametrize("free_pages, attached", [(6, 12), (1, 0)])
def test_prefetch_reads_what_fits_when_the_host_is_held(backend_factory, free_pages, attached):
    """Host pages held by L3 writes cannot be evicted: a 16-page hit then reads its first
    pages into the host pages that are free (if they reach the threshold, 4 tokens here)."""
    cache, be, ctl, store, oracle = _fill(backend_factory)
    held = cache.host_allocator.num_pages - free_pages  # 64 host pages in all
    sizes = [min(28, held - 28 * k) for k in range(-(-held // 28))]  # pages; the device holds 32
    _hold_host_pages(cache, ctl, store, oracle, [seq(1000 * (k + 1), 2 * n) for k, n in enumerate(sizes)])
    assert cache.host_allocator.available == free_pages and cache.evict_host(cache.host_tokens) == 0
    store.reads.release(1000)
    op = ctl.prefetch(seq(0, 32))
    assert ctl.finish_prefetch(op) == attached
    assert op.hit_tokens == 32  # what the storage had
    m = cache.metrics
    if attached:
        assert op.status == "finished" and m.prefetch_truncated == 1 and m.prefetched_tokens == attached
        req = fetch_and_check(cache, ctl, oracle, seq(0, 32), 0)  # the attached pages are bit-exact
        assert req.cached_pages == attached // P
    else:
        assert op.status == "revoked" and op.reason == "no host memory for the hit"
        assert m.prefetch_truncated == 0 and m.prefetch_revoked == 1
    cache.sanity_check()
    store.writes.set()
    assert ctl.flush(60)
    cache.sanity_check(0)
    ctl.close()


def test_prefix_not_backed_up_prefetches_from_the_backed_up_end(backend_factory):
    """A match ending on device-only nodes with more of the key after it is prefetched from
    where the backed-up path ends (here the root; the pages read then give those nodes their
    host copies: tests/cache/test_l3_device_only_match.py); a key matched whole still skips."""
    cache, be = make_cache(backend_factory, page_size=P, write_policy="write_back")
    ctl = StorageController(cache, scfg(), model="m")
    prefill_insert(cache, KVOracle(be), seq(0, 8))  # device only (write_back)
    op = ctl.prefetch(seq(0, 30))
    assert op.status == "querying" and op.start == 0
    assert ctl.finish_prefetch(op) == 0 and op.reason == "no storage hit"
    op = ctl.prefetch(seq(0, 9))  # its whole pages are the tree's 8 tokens: nothing to read
    assert op.status == "skipped" and "backed up" in op.reason
    cache.sanity_check()
    ctl.close()


# ---------------------------------------------------------------------------------------------- namespaces
def test_namespace_isolation(backend_factory, tmp_path):
    cache, be = make_cache(backend_factory, page_size=P)
    oracle = KVOracle(be)
    cfg = scfg("file", tmp_path)
    ctl = StorageController(cache, cfg, model="m", salt="tenant-a")
    prefill_insert(cache, oracle, seq(0, 16))
    prefill_insert(cache, oracle, seq(0, 16, extra_key="lora1"))
    cache.flush()
    ctl.close()
    drop_everything(cache)

    def hit(key, **kw):
        kw.setdefault("model", "m")
        kw.setdefault("salt", "tenant-a")
        c = StorageController(cache, cfg, **kw)
        try:
            return c.finish_prefetch(c.prefetch(key))
        finally:
            c.close()
            drop_everything(cache)

    assert hit(seq(0, 16)) == 16
    assert hit(seq(0, 16, extra_key="lora1")) == 16
    assert hit(seq(0, 16, extra_key="lora2")) == 0
    assert hit(seq(0, 16, extra_key=1)) == 0 and hit(seq(0, 16, cache_salt="lora1")) == 0
    assert hit(seq(0, 16), salt="tenant-b") == 0
    assert hit(seq(0, 16), model="m2") == 0
    assert hit(seq(0, 16), weights_revision="r2") == 0
    assert hit(seq(0, 16), tp_size=2, tp_rank=1) == 0
    # Another host layout (same page bytes, another order) never hits either.
    cl, bel = make_cache(backend_factory, page_size=P, layout="layer_first")
    ctll = StorageController(cl, cfg, model="m", salt="tenant-a")
    assert ctll.finish_prefetch(ctll.prefetch(seq(0, 16))) == 0
    assert ctll.storage.metrics.corrupt == 0  # a key miss, not a caught size mismatch
    ctll.close()


def test_kv_dtype_isolation(backend_factory, tmp_path):
    """bf16 and fp16 pages have equal sizes: only the key keeps them apart (sglang #33268)."""
    from hicache_jax import KVGeometry

    cfg = scfg("file", tmp_path)
    caches = {}
    for dt in ("bfloat16", "float16"):
        be = backend_factory(KVGeometry.mha(2, P, 1, 2, dt), 32, 64, "page_first", False)
        cache = HiRadixCache(HiCacheConfig(page_size=P), be.engine, be.device.allocator)
        caches[dt] = (cache, be, StorageController(cache, cfg, model="m"))
    cache, be, ctl = caches["bfloat16"]
    prefill_insert(cache, KVOracle(be), seq(0, 16))
    drop_everything(cache)
    assert ctl.finish_prefetch(ctl.prefetch(seq(0, 16))) == 16  # the writer's own dtype hits
    cache16, _, ctl16 = caches["float16"]
    assert ctl16.finish_prefetch(ctl16.prefetch(seq(0, 16))) == 0
    assert ctl16.storage.metrics.corrupt == 0
    for _, _, c in caches.values():
        c.close()


def test_unsupported_namespace_values_are_refused_in_every_tier(backend_factory):
    """Tenant identity is one typed rule in every tier (issue 21, point 4): a namespace value
    without a stable encoding used to live in L1/L2 and silently skip L3; now no key can be
    built with it, so no tier ever holds it."""
    cache, be, ctl = setup(backend_factory)

    class Opaque:
        pass

    with pytest.raises(TypeError, match="extra_key"):
        seq(0, 12, extra_key=Opaque())
    assert cache.metrics.storage_backup_tokens == 0 and len(cache.all_nodes()) == 1
    cache.sanity_check(0)
    ctl.close()


# ---------------------------------------------------------------------------------------------- faults
class Faulty(MemoryStorage):
    mode = "ok"

    def _read(self, pool, keys):
        if self.mode == "read":
            raise OSError(5, "Input/output error")
        return super()._read(pool, keys)

    def exists_multi(self, transfers):
        if self.mode == "exists":
            raise RuntimeError("index exploded")  # not a storage fault: the controller must still contain it
        return super().exists_multi(transfers)


@pytest.mark.parametrize("mode", ["read", "exists", "corrupt"])
def test_storage_faults_during_prefetch_are_misses(backend_factory, mode, caplog):
    cache, be = make_cache(backend_factory, page_size=P)
    store = Faulty(scfg(), {"target": be.host})
    ctl = StorageController(cache, scfg(), model="m", storage=store, batch_pages=4)
    oracle = KVOracle(be)
    key = seq(0, 20)
    prefill_insert(cache, oracle, key)
    cache.flush()
    ctl.flush()
    drop_everything(cache)
    if mode == "corrupt":
        k = ctl._namespaces(key.namespace)["target"]
        from hicache_jax.storage import page_keys

        store._corrupt_for_test("target", page_keys(k, key.token_ids)[6], offset=3)
    else:
        store.mode = mode
    got = ctl.finish_prefetch(ctl.prefetch(key))
    cache.sanity_check()
    if mode == "corrupt":
        assert got == 12 and store.metrics.corrupt == 1  # pages 0..5; never the corrupt one
        fetch_and_check(cache, ctl, oracle, RadixKey(key.token_ids[:12]), 0)
    else:
        assert got == 0
        assert cache.host_allocator.available == cache.host_allocator.num_pages
    if mode == "read":
        assert store.metrics.read_errors >= 1 and cache.metrics.prefetch_revoked == 1
    ctl.close()
    cache.sanity_check(0)


# ---------------------------------------------------------------------------------------------- races
def _racing(backend_factory, **kw):
    cache, be, ctl, store, oracle = _fill(backend_factory, key_len=24, prefetch_policy="wait_complete", **kw)
    return cache, be, ctl, store, oracle


def test_race_another_request_inserted_the_same_prefix(backend_factory):
    cache, be, ctl, store, oracle = _racing(backend_factory)
    key = seq(0, 24)
    op = ctl.prefetch(key)
    prefill_insert(cache, oracle, seq(0, 10))  # meanwhile a request computes the first 10 tokens
    cache.flush()
    store.reads.release(1000)
    assert ctl.finish_prefetch(op) == 14  # duplicates freed, the rest attached below the new node
    cache.sanity_check()
    fetch_and_check(cache, ctl, oracle, key, 0)
    ctl.close()


def test_race_the_whole_key_was_inserted_meanwhile(backend_factory):
    cache, be, ctl, store, oracle = _racing(backend_factory)
    key = seq(0, 24)
    op = ctl.prefetch(key)
    prefill_insert(cache, oracle, key)
    cache.flush()
    store.reads.release(1000)
    assert ctl.finish_prefetch(op) == 0
    assert op.reason == "the tree no longer connects"
    cache.sanity_check(0)
    fetch_and_check(cache, ctl, oracle, key, 0)
    ctl.close()


def test_race_reset_while_prefetching(backend_factory):
    cache, be, ctl, store, oracle = _racing(backend_factory)
    rooted = ctl.prefetch(seq(0, 24))  # starts at the root
    prefill_insert(cache, oracle, seq(0, 6))  # anchor: the next prefetch continues after 6 tokens
    cache.flush()
    ctl.flush()
    anchored = ctl.prefetch(seq(0, 24))
    assert rooted.start == 0 and anchored.start == 6 and anchored._anchor is not None
    cache.reset()
    cache.sanity_check(0)
    store.reads.release(1000)
    assert ctl.finish_prefetch(anchored) == 0  # its anchor is gone: the pages do not connect
    cache.sanity_check(0)
    assert ctl.finish_prefetch(rooted) == 24  # keys cover the whole prefix: valid in the new tree
    fetch_and_check(cache, ctl, oracle, seq(0, 24), 0)
    ctl.close()


def test_race_host_eviction_cannot_take_the_anchor(backend_factory):
    cache, be, ctl, store, oracle = _racing(backend_factory)
    prefill_insert(cache, oracle, seq(0, 6))
    cache.flush()
    ctl.flush()
    cache.evict(cache.evictable_tokens)
    op = ctl.prefetch(seq(0, 24))
    assert op.start == 6
    assert cache.evict_host(6) == 0  # host-locked by the prefetch
    store.reads.release(1000)
    assert ctl.finish_prefetch(op) == 18
    fetch_and_check(cache, ctl, oracle, seq(0, 24), 0)
    ctl.close()


def test_cancel_and_close_free_everything(backend_factory):
    cache, be, ctl, store, oracle = _racing(backend_factory)
    a = ctl.prefetch(seq(0, 24))
    b = ctl.prefetch(seq(0, 24))
    _wait_for(lambda: a.hit_tokens is not None and b.hit_tokens is not None)
    cache.check_events()
    assert a.status == b.status == "loading"
    ctl.cancel(a)
    cache.sanity_check(0)
    store.reads.release(1000)
    ctl.close()  # b is cancelled here; its pages come back
    assert b.status == "closed" and ctl.finish_prefetch(b) == 0
    cache.sanity_check(0)
    assert cache.host_allocator.available == cache.host_allocator.num_pages
    assert ctl.prefetch(seq(0, 24)).status == "closed"


# ---------------------------------------------------------------------------------------------- config, metrics
def test_storage_config_through_the_cache_config():
    c = HiCacheConfig(storage={"backend": "file", "path": "/tmp/x", "prefetch_policy": "best_effort"})
    assert isinstance(c.storage, StorageConfig) and c.storage.prefetch_policy == "best_effort"
    for bad, exc, match in (
        ({"backend": "s3"}, ValueError, "storage: backend"),
        ({"backend": "file"}, ValueError, "storage: path"),
        ({"backend": "memory", "prefetch_policy": "eager"}, ValueError, "prefetch_policy"),
        ({"backend": "memory", "prefetch_threshold_tokens": -1}, ValueError, "prefetch_threshold_tokens"),
        ({"backend": "memory", "prefetch_timeout_base_s": "1"}, TypeError, "prefetch_timeout_base_s"),
        ({"backend": "memory", "prefetch_timeout_max_s": 0}, ValueError, "prefetch_timeout_max_s"),
        ({"bogus": 1}, ValueError, "unknown keys"),
        (5, TypeError, "storage"),
    ):
        with pytest.raises(exc, match=match):
            HiCacheConfig(storage=bad)


def test_controller_argument_errors(backend_factory):
    cache, be = make_cache(backend_factory, page_size=P)
    with pytest.raises(ValueError, match="storage_config"):
        StorageController(cache, model="m")
    with pytest.raises(TypeError, match="storage_config"):
        StorageController(cache, {"backend": "memory"}, model="m")
    with pytest.raises(ValueError, match="model"):
        StorageController(cache, scfg(), model="")
    with pytest.raises(ValueError, match="batch_pages"):
        StorageController(cache, scfg(), model="m", batch_pages=0)
    other, be2 = make_cache(backend_factory, page_size=P)
    with pytest.raises(ValueError, match="host pools"):
        StorageController(cache, scfg(), model="m", storage=MemoryStorage(scfg(), {"target": be2.host}))
    ctl = StorageController(cache, scfg(), model="m")
    with pytest.raises(ValueError, match="already attached"):
        StorageController(cache, scfg(), model="m")
    with pytest.raises(TypeError, match="op"):
        ctl.finish_prefetch("op")
    ctl2 = StorageController(other, scfg(), model="m")
    with pytest.raises(ValueError, match="another controller"):
        ctl.finish_prefetch(ctl2.prefetch(seq(0, 10)))
    ctl.close()
    ctl2.close()
    ctl.close()  # idempotent


def test_storage_metrics_are_exported(backend_factory):
    prometheus_client = pytest.importorskip("prometheus_client")
    from hicache_jax.cache import register_prometheus

    cache, be, ctl = setup(backend_factory)
    registry = prometheus_client.CollectorRegistry()
    register_prometheus(cache, registry=registry, prefix="hc")
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 12))
    drop_everything(cache)
    ctl.flush()
    fetch_and_check(cache, ctl, oracle, seq(0, 12), 12)
    get = registry.get_sample_value
    assert get("hc_cached_tokens_total", {"cache_source": "storage"}) == 12
    assert get("hc_prefetched_tokens_total") == 12 and get("hc_storage_backup_tokens_total") == 12
    assert get("hc_storage_backup_bytes_total") == 6 * be.geom.bytes_per_page
    assert get("hc_prefetch_duration_seconds_count") == 1 and get("hc_prefetch_duration_seconds_sum") > 0
    assert get("hc_prefetch_revoked_total") == 0
    # The sources do not overlap: the 12 tokens that came back from L3 are not host hits too.
    assert get("hc_cached_tokens_total", {"cache_source": "host"}) == 0
    # The store's own counters, in pages, under the same naming scheme as cache.stats().
    assert get("hc_storage_read_hit_pages_total") == 6 == ctl.stats()["storage_read_hit_pages"]
    assert get("hc_storage_written_pages_total") == 6 and get("hc_storage_corrupt_pages_total") == 0
    assert cache.stats()["storage_read_hit_pages"] == 6
    assert get("hc_in_flight_operations", {"operation": "prefetch"}) == 0
    ctl.close()


def test_a_split_trims_every_pool_so_storage_hits_continue_after_it():
    """A node split in the tree trims the L3 digests of every pool the same way. With only the
    first pool trimmed, a prefetch anchored at the split's lower half chained the draft pool's
    keys from the wrong page, found no draft pages, and lost the storage hit (tokens stayed
    right: the prefix was silently recomputed)."""
    target = numpy_backend_factory(small_geom(2, "mha", layers=2), 32, 64, "page_first", False)
    draft_be = numpy_backend_factory(small_geom(2, "mla", layers=1), 32, 64, "layer_first", False)
    draft_engine = NumpyTransferEngine(draft_be.device, draft_be.host)
    draft = Backend(draft_be.geom, draft_be.device, draft_be.host, draft_engine)
    cache = HiRadixCache(
        HiCacheConfig(page_size=2, storage=scfg()),
        target.engine,
        target.device.allocator,
        sidecars={"draft": draft_engine},
    )
    ctl = StorageController(cache, model="m")
    t_oracle, d_oracle = KVOracle(target), KVOracle(draft)

    def put(k):
        pages = cache.alloc_device(len(k) // 2)
        t_oracle.write(k, pages)
        d_oracle.write(k, pages)
        cache.insert(k, pages)
        cache.flush()
        ctl.flush()

    put(seq(0, 24))  # node A0: pages 0..11
    put(seq(0, 40))  # its child: pages 12..19; everything backed up to storage
    cache.evict(cache.evictable_tokens)  # device emptied: both nodes host-only
    cache.evict_host(16)  # the child leaves the host: pages 12..19 only in storage
    assert cache.host_tokens == 24
    put(RadixKey(np.concatenate([np.arange(8), np.arange(500, 508)]).astype(np.int64)))  # splits A0 at page 4
    cache.evict(cache.evictable_tokens)
    cache.sanity_check(0)
    key = RadixKey(np.concatenate([np.arange(36), np.arange(900, 904)]).astype(np.int64))
    req = fetch_and_check(cache, ctl, t_oracle, key, expect_storage=12)  # pages 12..17 from storage
    d_oracle.check_device(RadixKey(key.token_ids[:36]), req.device_pages[:18])
    ctl.close()


def test_cancel_keeps_the_host_pages_until_the_read_lets_go(backend_factory):
    """A cancelled prefetch whose read is still in flight must not hand its host pages back
    until the read is done: the IO thread is still writing them, and a page reused meanwhile
    (a backup, another prefetch) would be overwritten by the late read."""
    cache, be, ctl, store, oracle = _racing(backend_factory)
    op = ctl.prefetch(seq(0, 24))
    _wait_for(lambda: op.hit_tokens is not None)
    cache.check_events()
    assert op.status == "loading"
    total = cache.host_allocator.num_pages
    held = total - cache.host_allocator.available
    assert held > 0
    ctl.cancel(op)
    assert op.status == "revoked"
    for _ in range(3):
        cache.check_events()
        assert total - cache.host_allocator.available == held  # still the IO thread's
        assert ctl.stats()["prefetch_reserved_host_pages"] == held
    store.reads.release(1000)
    _wait_for(lambda: (cache.check_events(), cache.host_allocator.available == total)[1])
    assert ctl.stats()["prefetch_reserved_host_pages"] == 0
    cache.sanity_check(0)
    ctl.close()


def test_controller_calls_from_another_thread_are_refused(backend_factory):
    """The controller's entry points follow the cache's owner-thread rule."""
    from hicache_jax.cache import OwnerThreadError

    cache, be, ctl = setup(backend_factory)
    op = ctl.prefetch(seq(0, 8))  # binds the owner (this thread)
    errors = []

    def other():
        for call in (
            lambda: ctl.prefetch(seq(0, 8)),
            lambda: ctl.prefetch_ready(op),
            lambda: ctl.finish_prefetch(op),
            lambda: ctl.cancel(op),
        ):
            try:
                call()
            except OwnerThreadError as e:
                errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 4 and all("StorageController." in e for e in errors), errors
    ctl.finish_prefetch(op)  # the owner still can
    ctl.close()
