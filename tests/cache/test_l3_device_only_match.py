"""An L3 prefetch whose match ends on device-only nodes (on the device, no host copy: the copy
was reclaimed, or never made).

Storage holds the whole prompt; the tree holds its first part on the device only. The pages
after that part must still come from storage: the prefetch reads from the end of the backed-up
path, the device-only nodes get their host copies from the pages read (so the backed-up path
stays a prefix from the root) and the rest attaches after them. Counted independently: the
store's own read counters, the cache's prefetch counters, the request's tiers, and the bytes
served against the oracle; ``sanity_check`` after each step."""

from __future__ import annotations

import numpy as np
import pytest

from cache_harness import (
    KVOracle,
    device_only_path,
    make_cache,
    node_path_pages,
    numpy_backend_factory,
    prefill_insert,
    serve_checked,
)
from hicache_jax.cache import RadixKey
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig

P = 2


def seq(*runs):
    return RadixKey(np.concatenate([np.arange(a, a + n) for a, n in runs]).astype(np.int64))


def _rig(store, tmp_path):
    cache, be = make_cache(numpy_backend_factory, page_size=P, device_pages=32, host_pages=64, load_back_threshold=0)
    cfg = StorageConfig(
        backend=store,
        path=None if store == "memory" else str(tmp_path),
        prefetch_threshold_tokens=4,
        prefetch_policy="wait_complete",
    )
    ctl = StorageController(cache, cfg, model="m")
    return cache, KVOracle(be), ctl


def _to_storage_only(cache, ctl):
    """Every backup written to L3, then both tiers emptied."""
    cache.flush()
    assert ctl.flush(10)
    cache.evict(cache.evictable_tokens)
    cache.evict_host(cache.host_tokens)
    assert cache.host_tokens == 0 and cache.evictable_tokens == 0


@pytest.mark.parametrize("store,nodes", [("memory", 1), ("file", 1), ("memory", 2)])
def test_a_continuation_after_a_reclaimed_prefix_comes_from_storage(store, nodes, tmp_path):
    cache, oracle, ctl = _rig(store, tmp_path)
    try:
        whole = seq((0, 16))
        prefill_insert(cache, oracle, whole)  # write_through: backed up, then written to L3
        _to_storage_only(cache, ctl)
        head = seq((0, 8))
        if nodes == 2:
            prefill_insert(cache, oracle, seq((0, 4)))  # the head as two nodes: 4 + 4 tokens
        prefill_insert(cache, oracle, head)  # the first 8 tokens again, on the device
        cache.flush()
        assert ctl.flush(10)
        cache.evict_host(cache.host_tokens)  # the head's host copy is reclaimed (device keeps it)
        assert device_only_path(cache, whole) == [True] * nodes
        cache.sanity_check()
        reads0 = ctl.storage.metrics.hits

        op = ctl.prefetch(whole)
        attached = ctl.finish_prefetch(op)
        assert op.reason_code != "not_backed_up", op.reason
        assert op.status == "finished", (op.status, op.reason)
        # Read from storage: the head (its host copy) and the 8 tokens after it.
        assert ctl.storage.metrics.hits - reads0 == 16 // P
        assert cache.metrics.prefetched_tokens == 16
        assert attached == 16
        cache.sanity_check()
        # The head is on both tiers now (host bytes = the oracle's), the rest host-only.
        node = cache.match_prefix(head).last_device_node
        assert device_only_path(cache, head) == [False] * nodes
        oracle.check_host(head, node_path_pages(cache, node, host=True))
        assert serve_checked(cache, oracle, whole) == {"device": 8, "host": 0, "storage": 8}
        cache.sanity_check()
    finally:
        ctl.close()


@pytest.mark.parametrize("store", ["memory", "file"])
def test_a_match_ending_inside_a_device_only_node_is_split_and_continued(store, tmp_path):
    cache, oracle, ctl = _rig(store, tmp_path)
    try:
        wanted = seq((0, 8), (100, 8))  # in L3 only
        prefill_insert(cache, oracle, wanted)
        _to_storage_only(cache, ctl)
        other = seq((0, 12))  # shares 8 tokens with `wanted`, one node on the device only
        prefill_insert(cache, oracle, other)
        cache.flush()
        assert ctl.flush(10)
        cache.evict_host(cache.host_tokens)
        assert device_only_path(cache, other) == [True]
        reads0 = ctl.storage.metrics.hits

        op = ctl.prefetch(wanted)
        assert ctl.finish_prefetch(op) == 16 and op.status == "finished", (op.status, op.reason)
        assert ctl.storage.metrics.hits - reads0 == 16 // P
        cache.sanity_check()
        # `other`'s node was split at 8: its head has a host copy now, its last 4 tokens do not.
        assert device_only_path(cache, other) == [False, True]
        assert serve_checked(cache, oracle, wanted) == {"device": 8, "host": 0, "storage": 8}
        assert serve_checked(cache, oracle, other) == {"device": 12, "host": 0, "storage": 0}
        cache.sanity_check()
    finally:
        ctl.close()


def test_a_key_the_tree_holds_whole_reads_nothing(tmp_path):
    """All of the key on the device (no host copy): nothing after the match to fetch, so no
    storage read for the device-only pages (the skip as before)."""
    cache, oracle, ctl = _rig("memory", tmp_path)
    try:
        key = seq((0, 16))
        prefill_insert(cache, oracle, key)
        cache.flush()
        assert ctl.flush(10)
        cache.evict_host(cache.host_tokens)
        assert device_only_path(cache, key) == [True]
        op = ctl.prefetch(key)
        assert ctl.finish_prefetch(op) == 0 and op.status == "skipped"
        assert ctl.storage.metrics.hits == 0 and cache.metrics.prefetched_tokens == 0
        cache.sanity_check()
    finally:
        ctl.close()


def test_with_ranks_a_device_only_match_is_walked_and_attached_as_in_one_process():
    """A collective agreement (one rank without the exchange: the ranks' code paths) walks and
    attaches as one process does: the walk ends at the backed-up end (the root), the head's
    node takes its 4 pages as its host copy and 4 attach after it. Two ranks, the prefetch and
    a backup reserved for the step's agreement: ``tests/l3/test_ranks_device_only_match.py``."""
    from hicache_jax.cache import HiCacheConfig, HiRadixCache, NoExchangeAgreement

    for agreement in (None, NoExchangeAgreement(0, 1)):
        cache, be = make_cache(numpy_backend_factory, page_size=P, device_pages=32, host_pages=64)
        if agreement is not None:
            cache = HiRadixCache(HiCacheConfig(page_size=P), be.engine, be.device.allocator, agreement=agreement)
        oracle = KVOracle(be)
        head, whole = seq((0, 8)), seq((0, 16))
        prefill_insert(cache, oracle, head)
        cache.flush()
        cache.evict_host(cache.host_tokens)
        assert device_only_path(cache, head) == [True]
        node, tokens, _ = cache.backed_up_prefix(whole)
        assert node is cache.root and tokens == 0
        ids = cache.reserve_host_pages(16 // P)  # as a prefetch of the whole key from the root
        got, leaf = cache.insert_host(whole, ids, 0)
        assert got == 16 and len(leaf.key) == 8
        assert device_only_path(cache, head) == [False]
        assert cache.host_tokens == 16 and cache.host_allocator.used == 16 // P  # every page taken once
        cache.sanity_check()
