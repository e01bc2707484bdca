"""Unit tests per API call of HiRadixCache: match, insert, locks, evict, evict_host,
load-back, request helpers, reset, stats, and bad input (clear error, no state change)."""

import copy

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, node_path_pages, prefill_insert
from hicache_jax.cache import CacheInvariantError, HiCacheConfig, HiRadixCache, RadixKey


def K(*toks, ns=None, salt=None):
    return RadixKey(np.array(toks, dtype=np.int64), ns, salt)


def seq(start, n, ns=None):
    return RadixKey(np.arange(start, start + n, dtype=np.int64), ns)


@pytest.fixture(params=[1, 4], ids=["page1", "page4"])
def page_size(request):
    return request.param


def snapshot(cache, be):
    """Everything a failed call must leave unchanged."""
    nodes = sorted(
        (
            n.id,
            len(n),
            None if n.value is None else n.value.tolist(),
            None if n.host_value is None else n.host_value.tolist(),
            n.lock_ref,
            n.host_lock_ref,
            n.hit_count,
            n.last_access,
        )
        for n in cache.all_nodes()
    )
    return (
        nodes,
        cache.evictable_tokens,
        cache.protected_tokens,
        cache.host_tokens,
        be.device.allocator.available,
        be.host.allocator.available,
        copy.deepcopy(cache.metrics.as_dict()),
        cache.in_flight,
    )


# ---------------------------------------------------------------- match / insert
def test_match_empty_tree(backend_factory, page_size):
    cache, _ = make_cache(backend_factory, page_size=page_size)
    r = cache.match_prefix(seq(0, 3 * page_size))
    assert r.device_hit_length == 0 and r.host_hit_length == 0
    assert r.last_device_node is cache.root and r.last_host_node is cache.root
    cache.sanity_check(0)


def test_insert_then_match_returns_inserted_pages(backend_factory, page_size):
    cache, be = make_cache(backend_factory, page_size=page_size)
    oracle = KVOracle(be)
    key = seq(0, 5 * page_size + (page_size - 1))  # a trailing partial page is never cached
    pages = cache.alloc_device(5)
    oracle.write(key, pages)
    res = cache.insert(key, pages)
    assert res.prefix_len == 0 and len(res.last_node) == 5 * page_size
    m = cache.match_prefix(key)
    assert m.device_indices.tolist() == pages.tolist()
    assert m.device_hit_length == 5 * page_size
    oracle.check_device(key, m.device_indices)
    cache.sanity_check(0)


def test_match_mid_node_splits_and_keeps_pages(backend_factory, page_size):
    cache, be = make_cache(backend_factory, page_size=page_size)
    oracle = KVOracle(be)
    key = seq(0, 6 * page_size)
    prefill_insert(cache, oracle, key)
    m = cache.match_prefix(seq(0, 2 * page_size + page_size // 2))  # rounds down to 2 pages
    assert m.device_hit_length == 2 * page_size
    assert len(m.last_device_node) == 2 * page_size
    assert len(cache.all_nodes()) == 3  # root + split parent + rest
    full = cache.match_prefix(key)
    assert full.device_hit_length == 6 * page_size
    oracle.check_device(key, full.device_indices)
    cache.sanity_check(0)


def test_peek_prefix_reports_tiers_and_changes_nothing(backend_factory, page_size):
    cache, be = make_cache(backend_factory, page_size=page_size, write_policy="write_through")
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 6 * page_size))
    cache.flush()
    cache.evict(6 * page_size)  # backed up: the whole path becomes host-only
    prefill_insert(cache, oracle, seq(0, 2 * page_size))  # the first 2 pages back on the device
    before = snapshot(cache, be)
    # Ends inside a node and has a trailing partial page: 5 whole pages, 2 of them on device.
    assert cache.peek_prefix(seq(0, 5 * page_size + page_size // 2)) == (2 * page_size, 3 * page_size)
    assert cache.peek_prefix(seq(0, 8 * page_size)) == (2 * page_size, 4 * page_size)
    assert cache.peek_prefix(seq(100, 3 * page_size)) == (0, 0)
    assert cache.peek_prefix(seq(0, 6 * page_size, ns="other")) == (0, 0)
    assert snapshot(cache, be) == before  # no split, no access time, no metrics
    with pytest.raises(TypeError, match="key"):
        cache.peek_prefix("abc")
    cache.sanity_check(0)


def test_insert_frees_duplicate_pages(backend_factory, page_size):
    cache, be = make_cache(backend_factory, page_size=page_size)
    oracle = KVOracle(be)
    key = seq(0, 4 * page_size)
    a = cache.alloc_device(4)
    oracle.write(key, a)
    cache.insert(key, a)
    free_before = be.device.allocator.available
    b = cache.alloc_device(6)
    longer = seq(0, 6 * page_size)
    oracle.write(longer, b)
    res = cache.insert(longer, b)
    assert res.prefix_len == 4 * page_size
    # 4 duplicates freed, 2 new pages kept.
    assert be.device.allocator.available == free_before - 2
    assert not be.device.allocator.is_allocated(b[:4]).any()
    m = cache.match_prefix(longer)
    assert m.device_indices.tolist() == a.tolist() + b[4:].tolist()
    cache.sanity_check(0)


def test_insert_with_tree_prefix_pages_frees_nothing(backend_factory, page_size):
    cache, be = make_cache(backend_factory, page_size=page_size)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 3 * page_size))
    m = cache.match_prefix(seq(0, 5 * page_size))
    new = cache.alloc_device(2)
    oracle.write(seq(0, 5 * page_size), new, 3)
    avail = be.device.allocator.available
    cache.insert(seq(0, 5 * page_size), np.concatenate([m.device_indices, new]))
    assert be.device.allocator.available == avail
    cache.sanity_check(0)


def test_namespaces_never_share_nodes(backend_factory, page_size):
    cache, be = make_cache(backend_factory, page_size=page_size)
    oracle = KVOracle(be)
    toks = np.arange(3 * page_size)
    for ns, salt in ((None, None), ("lora1", None), (None, "salt"), ("lora1", "salt")):
        prefill_insert(cache, oracle, RadixKey(toks, ns, salt))
    assert len(cache.root.children) == 4
    for ns, salt in ((None, None), ("lora1", None), (None, "salt"), ("lora1", "salt")):
        key = RadixKey(toks, ns, salt)
        m = cache.match_prefix(key)
        assert m.device_hit_length == 3 * page_size
        oracle.check_device(key, m.device_indices)
    assert cache.match_prefix(RadixKey(toks, "other")).device_hit_length == 0
    cache.sanity_check(0)


def test_match_does_not_count_hits_insert_does(backend_factory):
    # write_through: write_back counts no hits at all (test_tree_decisions)
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    res = prefill_insert(cache, oracle, seq(0, 4))
    assert res.last_node.hit_count == 1
    cache.match_prefix(seq(0, 4))
    assert res.last_node.hit_count == 1
    prefill_insert(cache, oracle, seq(0, 4))
    assert res.last_node.hit_count == 2
    prefill_insert(cache, oracle, seq(0, 4), chunked=True)
    assert res.last_node.hit_count == 2


def test_access_time_is_logical_and_monotonic(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    a = prefill_insert(cache, oracle, seq(0, 4)).last_node
    b = prefill_insert(cache, oracle, seq(100, 4)).last_node
    assert a.last_access < b.last_access
    cache.match_prefix(seq(0, 4))
    assert a.last_access > b.last_access


# ---------------------------------------------------------------- locks
def test_lock_protects_path_and_moves_counts(backend_factory, page_size):
    cache, be = make_cache(backend_factory, page_size=page_size, device_pages=8)
    oracle = KVOracle(be)
    node = prefill_insert(cache, oracle, seq(0, 6 * page_size)).last_node
    cache.flush()
    assert cache.evictable_tokens == 6 * page_size
    cache.inc_lock_ref(node)
    assert cache.protected_tokens == 6 * page_size and cache.evictable_tokens == 0
    assert cache.evict(100) == 0
    assert cache.alloc_device(3) is None
    cache.dec_lock_ref(node)
    assert cache.evictable_tokens == 6 * page_size
    cache.sanity_check(0)


def test_unlock_below_zero_raises_without_change(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    node = prefill_insert(cache, oracle, seq(0, 4)).last_node
    cache.flush()
    before = snapshot(cache, be)
    with pytest.raises(ValueError, match="node: unlock below zero"):
        cache.dec_lock_ref(node)
    assert snapshot(cache, be) == before


def test_lock_rejects_foreign_evicted_and_deleted_nodes(backend_factory):
    cache, be = make_cache(backend_factory)
    other, _ = make_cache(backend_factory)
    oracle = KVOracle(be)
    node = prefill_insert(cache, oracle, seq(0, 4)).last_node
    with pytest.raises(TypeError, match="node"):
        cache.inc_lock_ref("not a node")
    with pytest.raises(ValueError, match="does not belong"):
        other.inc_lock_ref(node)
    cache.flush()
    cache.evict(4)  # demoted: host-only
    with pytest.raises(ValueError, match="not on the device"):
        cache.inc_lock_ref(node)
    cache.evict_host(4)
    with pytest.raises(ValueError, match="removed"):
        cache.inc_lock_ref(node)
    cache.sanity_check(0)


# ---------------------------------------------------------------- evict
def test_evict_demotes_backed_up_and_deletes_others(backend_factory):
    cache, be = make_cache(backend_factory, write_policy="write_through_selective")
    oracle = KVOracle(be)
    a = prefill_insert(cache, oracle, seq(0, 4)).last_node
    prefill_insert(cache, oracle, seq(0, 4))  # second hit: backed up
    b = prefill_insert(cache, oracle, seq(50, 4)).last_node  # one hit: not backed up
    cache.flush()
    assert a.backuped and not b.backuped
    assert cache.evict(8) == 8
    assert a.evicted and not a.deleted and a.backuped
    assert b.deleted
    assert cache.metrics.demoted_tokens == 4 and cache.metrics.deleted_device_tokens == 4
    cache.sanity_check(0)


def test_evict_cascades_leaf_first_in_lru_order(backend_factory):
    cache, be = make_cache(backend_factory, write_policy="write_back", device_pages=64, host_pages=0 + 64)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 4))
    prefill_insert(cache, oracle, seq(0, 8))  # child of the first
    prefill_insert(cache, oracle, seq(100, 4))
    cache.match_prefix(seq(100, 4))  # most recent
    freed = cache.evict(8)
    assert freed == 8
    # The chain [0..8) went first (leaf, then its parent); seq(100) was touched last.
    assert cache.match_prefix(seq(100, 4)).device_hit_length == 4
    assert cache.match_prefix(seq(0, 8)).device_hit_length == 0
    cache.sanity_check(0)


def test_evict_bad_input(backend_factory):
    cache, be = make_cache(backend_factory)
    for bad, exc in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="num_tokens"):
            cache.evict(bad)
        with pytest.raises(exc, match="num_tokens"):
            cache.evict_host(bad)


# ---------------------------------------------------------------- evict_host
def test_evict_host_skips_in_use_nodes(backend_factory):
    cache, be = make_cache(backend_factory, deferred=True)
    oracle = KVOracle(be)
    node = prefill_insert(cache, oracle, seq(0, 12)).last_node
    # Backup in flight: host-locked, so neither tier may drop it.
    assert cache.evict_host(100) == 0 and cache.evict(100) == 0
    be.complete_all()
    cache.flush()
    cache.evict(12)
    assert node.evicted and node.backuped
    m = cache.match_prefix(seq(0, 12))
    lb = cache.load_back(m.last_host_node)
    assert lb is not None
    assert cache.evict_host(100) == 0  # being loaded: host-locked
    be.complete_all()
    cache.flush()
    oracle.check_device(seq(0, 12), cache.match_prefix(seq(0, 12)).device_indices)
    # On device and backed up: host eviction reclaims only the host copy.
    assert cache.evict_host(12) == 12
    assert not node.deleted and not node.backuped and not node.evicted
    assert cache.metrics.reclaimed_host_tokens == 12
    cache.sanity_check(0)


def test_evict_host_reclaims_on_device_copies_first(backend_factory):
    """The host copy of an on-device node is redundant (the device holds it): it goes before
    a host-only leaf that left the device recently (``evictor.evict_host``)."""
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    a = prefill_insert(cache, oracle, seq(0, 4)).last_node
    b = prefill_insert(cache, oracle, seq(100, 4)).last_node
    cache.flush()
    cache.inc_lock_ref(b)
    cache.evict(4)  # a demoted
    assert a.evicted
    assert cache.evict_host(4) == 4
    assert a.backuped and not b.backuped and not b.evicted
    assert cache.evict_host(4) == 4  # then the host-only leaf
    assert a.deleted
    cache.dec_lock_ref(b)
    cache.sanity_check(0)


def test_host_reclaim_can_be_disabled(backend_factory):
    cache, be = make_cache(backend_factory, host_reclaim=False)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 4))
    cache.flush()
    assert cache.evict_host(4) == 0
    cache.sanity_check(0)


# ---------------------------------------------------------------- load-back
def test_load_back_round_trip_per_layer(backend_factory, page_size):
    cache, be = make_cache(backend_factory, page_size=page_size, deferred=True)
    oracle = KVOracle(be)
    key = seq(0, 5 * page_size if page_size > 1 else 12)
    prefill_insert(cache, oracle, key)
    be.complete_all()
    cache.flush()
    cache.evict(len(key))
    m = cache.match_prefix(key)
    assert m.device_hit_length == 0 and m.host_hit_length == len(key)
    lb = cache.load_back(m.last_host_node)
    assert lb.num_tokens == len(key) and not lb.layer_ready(0)
    # Loaded pages count as on-device (and locked) at once.
    m2 = cache.match_prefix(key)
    assert m2.device_indices.tolist() == lb.device_pages.tolist()
    assert cache.protected_tokens == len(key)
    lb.wait_layer(0)
    assert lb.layer_ready(0) and lb.layer_ready(be.geom.num_layers - 1)
    assert cache.loading_check() == 1
    assert cache.protected_tokens == 0
    oracle.check_device(key, m2.device_indices)
    cache.sanity_check(0)


def test_load_back_partial_chain_continues_device_prefix(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 8))
    prefill_insert(cache, oracle, seq(0, 24))
    cache.flush()
    tail = cache.match_prefix(seq(0, 24)).last_device_node
    head = tail.parent
    cache.inc_lock_ref(head)
    cache.evict(16)
    cache.dec_lock_ref(head)
    m = cache.match_prefix(seq(0, 24))
    assert m.device_hit_length == 8 and m.host_hit_length == 16
    lb = cache.load_back(m.last_host_node)
    cache.flush()
    full = np.concatenate([m.device_indices, lb.device_pages])
    assert cache.match_prefix(seq(0, 24)).device_indices.tolist() == full.tolist()
    oracle.check_device(seq(0, 24), full)
    cache.sanity_check(0)


def test_load_back_threshold_and_quota(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 8))  # 8 < 10 tokens
    prefill_insert(cache, oracle, seq(100, 12))
    cache.flush()
    cache.evict(20)
    m = cache.match_prefix(seq(0, 8))
    assert m.host_hit_length == 8
    before = snapshot(cache, be)
    assert cache.load_back(m.last_host_node) is None
    assert snapshot(cache, be)[:6] == before[:6]  # all or nothing: only the skip counter moved
    m = cache.match_prefix(seq(100, 12))
    assert cache.load_back(m.last_host_node, mem_quota=11) is None
    assert cache.metrics.load_back_skipped == 2
    assert cache.load_back(m.last_host_node, mem_quota=12) is not None
    with pytest.raises(ValueError, match="mem_quota"):
        cache.load_back(m.last_host_node, mem_quota=-1)
    cache.flush()
    cache.sanity_check(0)


def test_load_back_all_or_nothing_when_device_full(backend_factory):
    cache, be = make_cache(backend_factory, device_pages=16, host_pages=64)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 12))
    cache.flush()
    cache.evict(12)
    hold = be.device.allocator.alloc(10)  # only 6 free now, nothing evictable
    m = cache.match_prefix(seq(0, 12))
    before = snapshot(cache, be)
    assert cache.load_back(m.last_host_node) is None
    after = snapshot(cache, be)
    assert before[:6] == after[:6]  # nothing moved but the skip counter
    be.device.allocator.free(hold)
    cache.sanity_check(0)


def test_load_back_evicts_to_make_room_but_keeps_anchor(backend_factory):
    cache, be = make_cache(backend_factory, device_pages=24, host_pages=96)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 4))
    prefill_insert(cache, oracle, seq(0, 16))  # anchor [0,4) + child [4,16)
    cache.flush()
    anchor = cache.match_prefix(seq(0, 4)).last_device_node
    cache.inc_lock_ref(anchor)
    cache.evict(12)
    cache.dec_lock_ref(anchor)
    prefill_insert(cache, oracle, seq(200, 20))  # device now full: 4 + 20 = 24
    cache.flush()
    m = cache.match_prefix(seq(0, 16))
    assert m.device_hit_length == 4 and m.host_hit_length == 12
    lb = cache.load_back(m.last_host_node)
    assert lb is not None
    cache.flush()
    full = cache.match_prefix(seq(0, 16))
    assert full.device_hit_length == 16
    oracle.check_device(seq(0, 16), full.device_indices)
    cache.sanity_check(0)


def _host_only(cache, oracle, key):
    """Insert ``key``, back it up, evict it from the device: a host-only chain to load."""
    prefill_insert(cache, oracle, key)
    cache.flush()
    cache.evict(len(key))
    m = cache.match_prefix(key)
    assert m.device_hit_length == 0 and m.host_hit_length == len(key)
    return m.last_host_node


def test_load_back_into_evicted_and_free_pages(backend_factory):
    """The load's pages: first the ones its eviction took off the tree (passed on without a
    free), then free ones; every page ends up owned once, and the bytes are the key's."""
    cache, be = make_cache(backend_factory, device_pages=24, host_pages=96)
    oracle = KVOracle(be)
    node = _host_only(cache, oracle, seq(0, 16))
    prefill_insert(cache, oracle, seq(100, 12))  # evictable, 12 pages
    cache.flush()
    hold = be.device.allocator.alloc(8)  # 4 pages left free: 16 = 12 evicted + 4 free
    evicted_pages = cache.match_prefix(seq(100, 12)).device_indices.tolist()
    free_before = be.device.allocator.available
    lb = cache.load_back(node)
    assert lb is not None and lb.num_tokens == 16
    assert set(evicted_pages) < set(lb.device_pages.tolist())
    assert be.device.allocator.available == free_before - 4 == 0
    assert cache.metrics.evicted_device_tokens == 16 + 12
    cache.flush()
    oracle.check_device(seq(0, 16), cache.match_prefix(seq(0, 16)).device_indices)
    assert cache.match_prefix(seq(100, 12)).device_hit_length == 0
    be.device.allocator.free(hold)
    cache.sanity_check(0)


def test_load_back_without_room_returns_the_evicted_pages(backend_factory):
    """Eviction frees too little: the load is refused, and the pages its eviction took are
    freed (not kept, not leaked); the eviction itself stays done, as with alloc_device."""
    cache, be = make_cache(backend_factory, device_pages=24, host_pages=96)
    oracle = KVOracle(be)
    node = _host_only(cache, oracle, seq(0, 16))
    prefill_insert(cache, oracle, seq(100, 6))
    cache.flush()
    hold = be.device.allocator.alloc(be.device.allocator.available - 2)  # 6 evictable + 2 free < 16
    assert cache.load_back(node) is None
    assert be.device.allocator.available == 8
    assert cache.match_prefix(seq(100, 6)).device_hit_length == 0
    assert cache.metrics.load_back_skipped == 1
    cache.sanity_check(len(hold))
    be.device.allocator.free(hold)
    lb = cache.load_back(cache.match_prefix(seq(0, 16)).last_host_node)
    assert lb is not None
    cache.flush()
    oracle.check_device(seq(0, 16), lb.device_pages)
    cache.sanity_check(0)


def test_alloc_device_hands_evicted_pages_to_the_caller(backend_factory):
    """Short of free pages, alloc_device gives the caller the pages its eviction took off the
    tree (no longer the tree's, still allocated), then free ones; too little room: None, and
    the evicted pages are free again."""
    cache, be = make_cache(backend_factory, device_pages=24, host_pages=96)
    oracle = KVOracle(be)
    lru = prefill_insert(cache, oracle, seq(0, 12)).last_node.value.tolist()
    prefill_insert(cache, oracle, seq(100, 8))
    cache.flush()
    got = cache.alloc_device(8)  # 4 free, 4 short: evicts the LRU node (12 pages), hands over 8
    assert got is not None and len(set(got.tolist())) == 8 and set(got.tolist()) <= set(lru)
    assert be.device.allocator.available == 4 + 4
    assert be.device.allocator.is_allocated(got).all()
    assert cache.match_prefix(seq(0, 12)).device_hit_length == 0
    cache.sanity_check(8)
    oracle.write(seq(500, 8), got)  # the caller's pages: insert them
    cache.insert(seq(500, 8), got)
    cache.flush()
    oracle.check_device(seq(500, 8), cache.match_prefix(seq(500, 8)).device_indices)
    cache.sanity_check(0)
    hold = be.device.allocator.alloc(be.device.allocator.available)
    free_before = be.device.allocator.available
    assert cache.alloc_device(30) is None  # more pages than the pool has: never fits, evicts nothing
    assert be.device.allocator.available == free_before and cache.evictable_tokens == 16
    assert cache.alloc_device(20) is None  # fits the pool, not now: evicts everything evictable, still short
    assert be.device.allocator.available == free_before + 16  # both 8-page nodes, freed
    cache.sanity_check(len(hold))


def test_load_back_engine_error_gives_the_pages_back(backend_factory, monkeypatch):
    cache, be = make_cache(backend_factory, device_pages=24, host_pages=96)
    oracle = KVOracle(be)
    node = _host_only(cache, oracle, seq(0, 16))
    prefill_insert(cache, oracle, seq(100, 20))  # the load must evict 12 of these 20 pages
    cache.flush()
    free_before = be.device.allocator.available

    def refuse(host_ids, device_ids):
        raise RuntimeError("engine refused")

    monkeypatch.setattr(cache.components, "load", refuse)
    with pytest.raises(RuntimeError, match="refused"):
        cache.load_back(node)
    assert be.device.allocator.available == free_before + 20  # the evicted node's pages, all free
    assert cache.protected_tokens == 0 and cache.in_flight == (0, 0)
    cache.sanity_check(0)
    monkeypatch.undo()
    lb = cache.load_back(cache.match_prefix(seq(0, 16)).last_host_node)
    cache.flush()
    oracle.check_device(seq(0, 16), lb.device_pages)
    cache.sanity_check(0)


def test_load_back_of_on_device_node_is_none(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    node = prefill_insert(cache, oracle, seq(0, 12)).last_node
    assert cache.load_back(node) is None
    with pytest.raises(TypeError, match="node"):
        cache.load_back(None)


# ---------------------------------------------------------------- request helpers
def test_request_flow_unfinished_then_finished(backend_factory, page_size):
    cache, be = make_cache(backend_factory, page_size=page_size, device_pages=64, host_pages=128)
    oracle = KVOracle(be)
    p = page_size
    prefill_insert(cache, oracle, seq(0, 3 * p))
    cache.flush()
    tail = p - 1  # a partial tail page when page_size > 1
    prompt = seq(0, 5 * p + tail)
    req, lb = cache.begin_request(prompt)
    assert lb is None and req.cached_pages == 3 and req.last_node is not None
    need = -(-len(prompt) // p) - req.cached_pages
    new = cache.alloc_device(need)
    req.extend(prompt, new)
    oracle.write(prompt, req.device_pages[: len(prompt) // p])
    cache.cache_unfinished_req(req)
    assert req.cached_pages == 5
    assert cache.protected_tokens == 5 * p
    cache.sanity_check(external_device_pages=int(tail > 0))  # the tail page is the request's
    full = seq(0, 7 * p + tail)
    out = cache.alloc_device(2)
    req.extend(full, out)
    oracle.write(full, req.device_pages[5:7], 5)
    cache.cache_finished_req(req)
    assert req.last_node is None
    # Only backups in flight hold a lock now. An engine that copies when a transfer is issued
    # (numpy) had each backup acknowledged at once, locking nothing; an asynchronous one
    # (torch workers) may still have them in flight, locking the path.
    assert cache.protected_tokens == (7 * p if cache.in_flight[0] else 0)
    cache.flush()
    assert cache.protected_tokens == 0
    m = cache.match_prefix(full)
    assert m.device_hit_length == 7 * p
    oracle.check_device(full, m.device_indices)
    cache.sanity_check(0)


def test_request_duplicate_pages_are_replaced_by_tree_pages(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    key = seq(0, 6)
    req, _ = cache.begin_request(key)  # empty tree: no prefix
    req.extend(key, cache.alloc_device(6))
    oracle.write(key, req.device_pages)
    # Meanwhile another request inserts the same tokens.
    other = prefill_insert(cache, oracle, key).last_node
    cache.cache_unfinished_req(req)
    assert req.device_pages.tolist() == other.value.tolist()
    cache.cache_finished_req(req)
    cache.sanity_check(0)


def test_request_extend_validates(backend_factory):
    cache, _ = make_cache(backend_factory)
    req, _ = cache.begin_request(seq(0, 4))
    with pytest.raises(ValueError, match="new_pages"):
        req.extend(seq(0, 4), [1, 2])
    with pytest.raises(ValueError, match="key"):
        req.extend(seq(1, 4), [1, 2, 3, 4])
    with pytest.raises(TypeError, match="req"):
        cache.cache_finished_req("req")


def test_radix_key_owns_its_tokens(backend_factory):
    """A key copies the caller's tokens once: reusing the buffer afterwards changes neither
    the key nor what the tree matches with it, and the key's arrays are read-only."""
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    buf = np.arange(10, 22, dtype=np.int64)
    key = RadixKey(buf)
    assert key.token_bytes == buf.tobytes() and not key.token_ids.flags.writeable
    with pytest.raises(ValueError):
        key.token_ids[0] = 1
    prefill_insert(cache, oracle, key)
    buf[:] = 99  # the caller reuses its buffer
    assert key.token_ids.tolist() == list(range(10, 22))
    m = cache.match_prefix(key)
    assert m.device_hit_length == 12
    oracle.check_device(RadixKey(np.arange(10, 22, dtype=np.int64)), m.device_indices)
    assert cache.match_prefix(RadixKey(buf)).device_hit_length == 0
    # Non-int64 input is converted once; the bytes are always native int64.
    assert RadixKey(np.arange(3, dtype=np.int32)).token_bytes == np.arange(3, dtype=np.int64).tobytes()
    cache.sanity_check(0)


# ---------------------------------------------------------------- bad input: error, no state change
@pytest.mark.parametrize(
    "bad_key, exc",
    [
        ([1.0, 2.0], TypeError),
        (["a"], TypeError),
        ("abc", TypeError),
        ([True, 1], TypeError),
        (np.array([1.5]), TypeError),
        (np.zeros((2, 2), np.int64), ValueError),
        (7, TypeError),
    ],
)
def test_bad_tokens(backend_factory, bad_key, exc):
    cache, be = make_cache(backend_factory)
    before = snapshot(cache, be)
    with pytest.raises(exc, match="token_ids|key"):
        cache.match_prefix(bad_key)
    with pytest.raises(exc, match="token_ids|key"):
        cache.insert(bad_key, [])
    assert snapshot(cache, be) == before


def test_bad_insert_indices_change_nothing(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    tree_pages = prefill_insert(cache, oracle, seq(0, 4)).last_node.value.copy()
    cache.flush()
    fresh = be.device.allocator.alloc(4)
    before = snapshot(cache, be)
    cases = [
        ([1, 2, 3], ValueError, "device_pages: expected 4"),  # length mismatch
        ([0.0, 1.0, 2.0, 3.0], TypeError, "device_pages"),  # non-integer
        ([fresh[0]] * 4, ValueError, "device_pages: duplicate"),
        ([-1, 1, 2, 3], ValueError, "device_pages"),
        (np.r_[fresh[:3], tree_pages[0]], ValueError, "already owned"),  # double ownership
    ]
    for pages, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            cache.insert(seq(10, 4), pages)
        assert snapshot(cache, be) == before
    # Pages that are not allocated (a double free once inserted and freed as duplicates).
    be.device.allocator.free(fresh)
    before = snapshot(cache, be)
    with pytest.raises(ValueError, match="not allocated"):
        cache.insert(seq(0, 8), np.r_[tree_pages, fresh])
    with pytest.raises(ValueError, match="not allocated"):
        cache.insert(seq(0, 4), fresh)  # duplicates would be freed: they are not the caller's
    assert snapshot(cache, be) == before
    cache.sanity_check(0)


def test_insert_empty_key_is_noop(backend_factory):
    cache, be = make_cache(backend_factory, page_size=4)
    res = cache.insert(RadixKey([1, 2, 3]), [])
    assert res.prefix_len == 0 and res.last_node is cache.root
    cache.sanity_check(0)


def test_constructor_validation(backend_factory):
    from cache_harness import small_geom

    be = backend_factory(small_geom(2), 8, 16)
    with pytest.raises(ValueError, match="page_size"):
        HiRadixCache(HiCacheConfig(page_size=1), be.engine, be.device.allocator)
    with pytest.raises(TypeError, match="config"):
        HiRadixCache({"page_size": 2}, be.engine, be.device.allocator)
    with pytest.raises(TypeError, match="engine"):
        HiRadixCache(HiCacheConfig(page_size=2), object(), be.device.allocator)
    be.host.allocator.alloc(1)
    with pytest.raises(ValueError, match="host pool must start empty"):
        HiRadixCache(HiCacheConfig(page_size=2), be.engine, be.device.allocator)


# ---------------------------------------------------------------- reset / stats / sanity
def test_reset_frees_everything(backend_factory):
    cache, be = make_cache(backend_factory, deferred=True)
    oracle = KVOracle(be)
    node = prefill_insert(cache, oracle, seq(0, 12)).last_node
    prefill_insert(cache, oracle, seq(50, 12))
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locks"):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert be.device.allocator.available == be.device.allocator.num_pages
    assert be.host.allocator.available == be.host.allocator.num_pages
    assert cache.match_prefix(seq(0, 12)).device_hit_length == 0
    assert node.deleted
    cache.sanity_check(0)
    prefill_insert(cache, oracle, seq(0, 12))
    cache.sanity_check(0)


def test_stats_report_tiers(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 12))
    cache.flush()
    s = cache.stats()
    assert s["device_used_tokens"] == 12 and s["host_used_tokens"] == 12
    assert s["device_free_tokens"] + 12 == s["device_capacity_tokens"]
    assert s["backup_tokens"] == 12


def test_sanity_check_reports_all_violations_at_once(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    node = prefill_insert(cache, oracle, seq(0, 12)).last_node
    cache.flush()
    node.lock_ref = 3  # corrupt: locked, counts not moved
    cache.debug_view().inject_counter_error("evictable_tokens", 1)  # corrupt: count
    with pytest.raises(CacheInvariantError) as ei:
        cache.sanity_check(0)
    msg = str(ei.value)
    assert "device counts" in msg and "device_leaves" in msg
    assert msg.count("\n") >= 2


def test_sanity_check_detects_device_leak(backend_factory):
    cache, be = make_cache(backend_factory)
    be.device.allocator.alloc(3)  # held by nobody the cache knows of
    with pytest.raises(CacheInvariantError, match="device pool memory leak"):
        cache.sanity_check(0)
    cache.sanity_check(3)


def test_node_path_pages_helper(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    node = prefill_insert(cache, oracle, seq(0, 12)).last_node
    assert node_path_pages(cache, node).tolist() == cache.match_prefix(seq(0, 12)).device_indices.tolist()
