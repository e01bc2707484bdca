"""The prefetch threshold after a device-only match (``StorageConfig.prefetch_threshold_tokens``).

A match that ends on nodes held on the device only (no host copy) makes the read start where
the backed-up prefix ends, so it also reads the pages of those nodes (they get host copies
from it). The threshold is about what the read brings that the tree does not hold: the tokens
after the whole match (device or host), never the device-only pages read again. Checked at
each of the three points it applies: the continuation at ``prefetch`` (skip), the storage hit
(revoke) and the pages that arrived (revoke at ``finish_prefetch``), each just below and at
the threshold; counted by the store's own read counter and the tokens served per tier, bytes
checked against the oracle.
"""

from __future__ import annotations

import numpy as np

from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert, serve_checked
from hicache_jax.cache import RadixKey
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig
from hicache_jax.storage.memory import MemoryStorage

P = 2
T = 8  # the threshold of these tests, in tokens (4 pages)


class FailingReads(MemoryStorage):
    """Memory storage recording the target pool's keys in write order (page order for one
    chain) and failing reads of chosen keys (a short read, as a storage fault would)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.order: list[bytes] = []
        self.fail: set = set()

    def _write(self, pool, keys, pages):
        if pool == "target":
            self.order.extend(k for k in keys if k not in self.order)
        return super()._write(pool, keys, pages)

    def _read(self, pool, keys):
        got = super()._read(pool, keys)
        return [None if k in self.fail else g for k, g in zip(keys, got)]


def seq(n):
    return RadixKey(np.arange(n, dtype=np.int64))


def rig():
    cache, be = make_cache(numpy_backend_factory, page_size=P, device_pages=32, host_pages=64, load_back_threshold=0)
    cfg = StorageConfig(backend="memory", prefetch_threshold_tokens=T, prefetch_policy="wait_complete", worker_nice=0)
    store = FailingReads(cfg, {"target": be.host})
    return cache, KVOracle(be), StorageController(cache, cfg, model="m", storage=store)


def stored_then_device_only_head(cache, oracle, ctl, stored, head):
    """``stored`` tokens of ``seq`` in L3 only, then its first ``head`` tokens on the device
    only (recomputed, host copy reclaimed)."""
    prefill_insert(cache, oracle, seq(stored))
    cache.flush()
    assert ctl.flush(60)
    cache.evict(cache.evictable_tokens)
    cache.evict_host(cache.host_tokens)
    assert cache.host_tokens == 0 and cache.evictable_tokens == 0
    prefill_insert(cache, oracle, seq(head))
    cache.flush()
    assert ctl.flush(60)
    cache.evict_host(cache.host_tokens)
    assert cache.peek_prefix(seq(head)) == (head, 0) and cache.host_tokens == 0
    cache.sanity_check()


def serve(cache, oracle, key):
    """``serve_checked``, then every invariant."""
    hits = serve_checked(cache, oracle, key)
    cache.sanity_check(0)
    return hits


def test_a_continuation_below_the_threshold_after_a_device_only_match_is_skipped():
    cache, oracle, ctl = rig()
    try:
        stored_then_device_only_head(cache, oracle, ctl, 24, 18)  # 6 tokens after the match
        reads0 = ctl.storage.metrics.hits
        op = ctl.prefetch(seq(24))
        assert op.status == "skipped" and op.reason_code == "below_threshold", op
        assert "6 tokens after the 18" in op.reason, op.reason
        assert ctl.finish_prefetch(op) == 0
        assert ctl.storage.metrics.hits == reads0 and cache.metrics.prefetched_tokens == 0
        assert serve(cache, oracle, seq(24)) == {"device": 18, "host": 0, "storage": 0}
    finally:
        ctl.close()


def test_a_continuation_at_the_threshold_after_a_device_only_match_is_read():
    cache, oracle, ctl = rig()
    try:
        stored_then_device_only_head(cache, oracle, ctl, 24, 16)  # 8 tokens after the match
        reads0 = ctl.storage.metrics.hits
        op = ctl.prefetch(seq(24))
        assert op.status == "querying", op
        assert ctl.finish_prefetch(op) == 24 and op.status == "finished", op  # host copies + the rest
        assert ctl.storage.metrics.hits - reads0 == 24 // P
        assert serve(cache, oracle, seq(24)) == {"device": 16, "host": 0, "storage": 8}
    finally:
        ctl.close()


def test_a_storage_hit_below_the_threshold_past_a_device_only_match_is_revoked():
    """The continuation asked for is long, but storage holds only 6 tokens past the match."""
    cache, oracle, ctl = rig()
    try:
        stored_then_device_only_head(cache, oracle, ctl, 14, 8)
        reads0 = ctl.storage.metrics.hits
        op = ctl.prefetch(seq(24))
        assert op.status == "querying", op
        assert ctl.finish_prefetch(op) == 0
        assert op.status == "revoked" and op.reason == "storage hit below the threshold", op
        assert op.hit_tokens == 14  # what storage had from the read's start (the root)
        assert ctl.storage.metrics.hits == reads0 and cache.metrics.prefetched_tokens == 0
        assert serve(cache, oracle, seq(24)) == {"device": 8, "host": 0, "storage": 0}
    finally:
        ctl.close()
    # At the threshold: 8 tokens stored past the match are read.
    cache, oracle, ctl = rig()
    try:
        stored_then_device_only_head(cache, oracle, ctl, 16, 8)
        op = ctl.prefetch(seq(24))
        assert ctl.finish_prefetch(op) == 16 and op.status == "finished", op
        assert serve(cache, oracle, seq(24)) == {"device": 8, "host": 0, "storage": 8}
    finally:
        ctl.close()


def test_pages_arriving_below_the_threshold_past_a_device_only_match_are_not_attached():
    """Storage has 24 tokens, the read stops at a failed page: 6 tokens past the match arrive."""
    for fail_page, past in ((7, 6), (8, 8)):
        cache, oracle, ctl = rig()
        try:
            stored_then_device_only_head(cache, oracle, ctl, 24, 8)
            store = ctl.storage
            assert len(store.order) == 12
            store.fail = {store.order[fail_page]}
            host_free = cache.host_allocator.available
            op = ctl.prefetch(seq(24))
            got = ctl.finish_prefetch(op)
            assert op.hit_tokens == 24 and op.loaded_tokens == fail_page * P, op
            if past < T:
                assert got == 0 and op.status == "revoked" and op.reason == "arrived below the threshold", op
                assert cache.host_allocator.available == host_free  # every page read is freed
                assert serve(cache, oracle, seq(24)) == {"device": 8, "host": 0, "storage": 0}
            else:
                assert got == fail_page * P and op.status == "finished", op
                assert serve(cache, oracle, seq(24)) == {"device": 8, "host": 0, "storage": past}
        finally:
            ctl.close()


def test_a_truncated_reservation_counts_only_the_tokens_past_a_device_only_match():
    """Storage holds 24 tokens, the device 8 of them only; the host has room for 7 or 8 pages
    of the 12 the read needs (the rest held outside the tree until the prefetch is done, so host
    eviction cannot free them). 7 pages bring 6 tokens past the match: below the threshold, revoked; 8 bring 8: the
    truncated read runs and its pages serve."""
    for room, past in ((7, 6), (8, 8)):
        cache, oracle, ctl = rig()
        try:
            stored_then_device_only_head(cache, oracle, ctl, 24, 8)
            held = cache.host_allocator.alloc(cache.host_allocator.available - room)
            op = ctl.prefetch(seq(24))
            got = ctl.finish_prefetch(op)
            cache.host_allocator.free(held)  # before any sanity check (it counts them as leaked)
            assert op.hit_tokens == 24, op
            if past < T:
                assert got == 0 and op.status == "revoked" and op.reason == "no host memory for the hit", op
                assert cache.metrics.prefetch_truncated == 0
                assert serve(cache, oracle, seq(24)) == {"device": 8, "host": 0, "storage": 0}
            else:
                assert got == room * P and op.status == "finished", op
                assert cache.metrics.prefetch_truncated == 1
                assert serve(cache, oracle, seq(24)) == {"device": 8, "host": 0, "storage": past}
        finally:
            ctl.close()
