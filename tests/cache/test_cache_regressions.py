"""Regression tests for upstream failure modes (sglang issues and PRs, each cited by number below) that apply here."""

import numpy as np

from cache_harness import KVOracle, make_cache, node_path_pages, prefill_insert
from hicache_jax.cache import RadixKey


def seq(start, n, ns=None):
    return RadixKey(np.arange(start, start + n, dtype=np.int64), ns)


def garbage(be, ids):
    """Overwrite pages the way a new request's prefill would."""
    for c in be.geom.components:
        shape = (be.geom.num_layers, len(ids)) + be.geom.page_shape
        be.device.write(c, ids, np.full(shape, 0xDEAD, be.geom.container_dtype))


# ---------------------------------------------------------------- lock_ref during cascade eviction
def test_cascade_eviction_under_pressure_keeps_locked_path(backend_factory):
    cache, be = make_cache(backend_factory, device_pages=40, host_pages=160)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 8))  # P
    a = prefill_insert(cache, oracle, seq(0, 16)).last_node  # P -> A
    prefill_insert(cache, oracle, seq(0, 24))  # P -> A -> C
    d = prefill_insert(cache, oracle, seq(0, 32)).last_node  # P -> A -> C -> D
    c = d.parent
    b = prefill_insert(cache, oracle, RadixKey(np.r_[np.arange(8), np.arange(500, 508)])).last_node  # P -> B
    cache.flush()
    assert be.device.allocator.available == 0
    p_node = a.parent
    cache.inc_lock_ref(a)  # a running request holds P -> A
    assert (a.lock_ref, p_node.lock_ref) == (1, 1)
    # Allocation pressure: D is evicted, then C (a leaf only once D is gone); the cascade
    # stops at the locked A even though A is now the oldest device leaf.
    got = cache.alloc_device(16)
    assert got is not None and d.evicted and c.evicted and not b.evicted
    more = cache.alloc_device(8)  # B goes next
    assert more is not None and b.evicted
    assert cache.alloc_device(1) is None  # only the locked path is left
    got = np.r_[got, more]
    garbage(be, got)  # the reused pages are overwritten
    assert (a.lock_ref, p_node.lock_ref) == (1, 1)
    assert not a.evicted and not p_node.evicted
    oracle.check_device(seq(0, 16), cache.match_prefix(seq(0, 16)).device_indices)
    assert cache.evict(100) == 0
    cache.sanity_check(external_device_pages=len(got))
    cache.dec_lock_ref(a)
    assert cache.evictable_tokens == 16 and cache.protected_tokens == 0
    be.device.allocator.free(got)
    cache.sanity_check(0)
    # The demoted chain comes back intact.
    m = cache.match_prefix(seq(0, 32))
    assert m.host_hit_length == 16
    lb = cache.load_back(m.last_host_node)
    cache.flush()
    oracle.check_device(seq(0, 32), np.r_[m.device_indices, lb.device_pages])


def test_load_back_under_pressure_never_evicts_its_anchor(backend_factory):
    cache, be = make_cache(backend_factory, device_pages=32, host_pages=128)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 4))
    child = prefill_insert(cache, oracle, seq(0, 16)).last_node
    cache.flush()
    anchor = child.parent
    cache.inc_lock_ref(anchor)
    cache.evict(12)  # child host-only
    cache.dec_lock_ref(anchor)
    prefill_insert(cache, oracle, seq(100, 14))  # newer than the anchor: the anchor is now LRU-oldest
    prefill_insert(cache, oracle, seq(200, 14))  # device full: 4 + 14 + 14 = 32
    cache.flush()
    assert be.device.allocator.available == 0
    lb = cache.load_back(child)
    assert lb is not None and not anchor.evicted
    cache.flush()
    full = cache.match_prefix(seq(0, 16))
    assert full.device_hit_length == 16
    oracle.check_device(seq(0, 16), full.device_indices)
    cache.sanity_check(0)


# ---------------------------------------------------------------- a node in both device and host LRU
def test_revived_node_leaves_host_lru(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    node = prefill_insert(cache, oracle, seq(0, 12)).last_node
    cache.flush()
    cache.evict(12)
    assert node in cache.host_lru and node not in cache.device_lru
    prefill_insert(cache, oracle, seq(0, 12))  # revives it on the device with new pages
    assert node not in cache.host_lru and node in cache.reclaim_lru
    cache.flush()
    assert node in cache.device_lru and node not in cache.host_lru
    oracle.check_device(seq(0, 12), node.value)
    cache.sanity_check(0)


def test_loaded_node_leaves_host_lru_and_split_keeps_sets_disjoint(backend_factory):
    cache, be = make_cache(backend_factory, deferred=True)
    oracle = KVOracle(be)
    node = prefill_insert(cache, oracle, seq(0, 12)).last_node
    be.complete_all()
    cache.flush()
    cache.evict(12)
    cache.match_prefix(seq(0, 6))  # split a host-only node: both halves tracked correctly
    cache.sanity_check(0)
    lb = cache.load_back(node)
    assert node not in cache.host_lru and node not in cache.device_lru  # locked until the ack
    cache.sanity_check(0)
    be.complete_all()
    cache.loading_check()
    assert node in cache.device_lru and not (cache.device_lru.members & cache.host_lru.members)
    oracle.check_device(seq(0, 12), node_path_pages(cache, node))
    del lb
    cache.sanity_check(0)


# ---------------------------------------------------------------- double-counted evictable size
def test_shared_prefix_is_counted_once(backend_factory):
    cache, be = make_cache(backend_factory, device_pages=64, host_pages=128)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 16))
    cache.flush()
    total = be.device.allocator.num_pages

    def accounted():
        return be.device.allocator.available + cache.evictable_tokens + cache.protected_tokens

    r1, _ = cache.begin_request(seq(0, 16))
    r2, _ = cache.begin_request(seq(0, 16))
    assert cache.protected_tokens == 16 and cache.evictable_tokens == 0
    assert accounted() == total
    # Both requests insert the same continuation with their own pages: one copy is kept.
    for r in (r1, r2):
        key = seq(0, 24)
        r.extend(key, cache.alloc_device(8))
        oracle.write(key, r.device_pages[16:], 16)
    cache.cache_finished_req(r1)
    cache.cache_finished_req(r2)
    cache.flush()
    assert cache.evictable_tokens == 24 and cache.protected_tokens == 0
    assert accounted() == total
    assert cache.stats()["device_tree_tokens"] == 24
    # Splits keep counts exact too.
    cache.match_prefix(seq(0, 5))
    cache.match_prefix(seq(0, 20))
    assert cache.evictable_tokens == 24 and accounted() == total
    cache.sanity_check(0)


def test_nested_locks_and_unlock_order(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    leaf = prefill_insert(cache, oracle, seq(0, 12)).last_node
    cache.flush()
    mid = cache.match_prefix(seq(0, 6)).last_device_node
    cache.inc_lock_ref(leaf)
    cache.inc_lock_ref(mid)
    assert cache.protected_tokens == 12
    cache.dec_lock_ref(leaf)
    assert cache.protected_tokens == 6 and cache.evictable_tokens == 6
    cache.dec_lock_ref(mid)
    assert cache.protected_tokens == 0 and cache.evictable_tokens == 12
    cache.sanity_check(0)


# ---------------------------------------------------------------- host starvation (host < device)
def _churn(cache, oracle, n):
    for i in range(n):
        prefill_insert(cache, oracle, seq(1000 * i, 8))
        cache.check_events()
    cache.flush()


def test_write_through_does_not_starve_when_host_smaller_than_device(backend_factory):
    cache, be = make_cache(backend_factory, device_pages=64, host_pages=16)
    oracle = KVOracle(be)
    _churn(cache, oracle, 40)
    # Every insert found host room: old host copies were reclaimed or evicted, never starved.
    assert cache.metrics.backup_failed_tokens == 0
    assert cache.metrics.backup_tokens == 40 * 8
    assert cache.metrics.reclaimed_host_tokens > 0
    # The most recent sequence is backed up and survives a device flush.
    cache.evict(10**6)
    m = cache.match_prefix(seq(1000 * 39, 8))
    assert m.host_hit_length == 8
    oracle.check_host(seq(1000 * 39, 8), m.last_host_node.host_value)
    cache.sanity_check(0)


def test_host_reclaim_keeps_the_copies_of_the_nodes_about_to_leave_the_device(backend_factory):
    """Issue 21 point 5: reclaiming the least recently used device nodes' copies dropped
    exactly the ones device eviction demotes next, so a host smaller than the device served
    almost nothing. The most recently used node's copy goes first now."""
    cache, be = make_cache(backend_factory, device_pages=64, host_pages=16)
    oracle = KVOracle(be)
    a = prefill_insert(cache, oracle, seq(0, 8)).last_node
    b = prefill_insert(cache, oracle, seq(100, 8)).last_node
    cache.flush()
    assert a.backuped and b.backuped and be.host.allocator.available == 0
    c = prefill_insert(cache, oracle, seq(200, 8)).last_node  # reclaims B's copy, not A's
    cache.flush()
    assert a.backuped and not b.backuped and c.backuped
    assert cache.evict(8) == 8 and a.evicted  # A leaves the device first: served by the host
    m = cache.match_prefix(seq(0, 8))
    assert m.host_hit_length == 8
    oracle.check_host(seq(0, 8), m.last_host_node.host_value)
    cache.sanity_check(0)


def test_host_only_leaf_long_off_the_device_goes_before_a_copy(backend_factory):
    """The other side of point 5's order: a host-only leaf does not stay forever. H left the
    device long (100 clock ticks) before D1, the device's next victim, was used, and X (the
    most recently used copy) leads D1 by a few: H goes, every copy stays."""
    cache, be = make_cache(backend_factory, device_pages=64, host_pages=24)
    oracle = KVOracle(be)
    h = prefill_insert(cache, oracle, seq(0, 8)).last_node
    cache.flush()
    assert cache.evict(8) == 8 and h.evicted and h.backuped
    for _ in range(100):
        cache.match_prefix(seq(9000, 4))  # a miss: only the clock moves
    d1 = prefill_insert(cache, oracle, seq(100, 8)).last_node
    x = prefill_insert(cache, oracle, seq(200, 8)).last_node
    cache.flush()
    assert be.host.allocator.available == 0
    y = prefill_insert(cache, oracle, seq(300, 8)).last_node
    cache.flush()
    assert h.deleted and d1.backuped and x.backuped and y.backuped
    cache.sanity_check(0)


def test_without_host_reclaim_host_smaller_than_device_starves(backend_factory):
    """Documents the upstream failure mode (sglang #33862) that host_reclaim avoids."""
    cache, be = make_cache(backend_factory, device_pages=64, host_pages=16, host_reclaim=False)
    oracle = KVOracle(be)
    _churn(cache, oracle, 40)
    assert cache.metrics.backup_failed_tokens > 0
    cache.sanity_check(0)


# ---------------------------------------------------------------- contiguity during a backup's host eviction
def test_backup_host_eviction_never_reclaims_its_anchor(backend_factory):
    """Backing up X under the backed-up A evicts host pages. Evicting A's last backed-up
    child (host-only H) makes A a reclaim candidate again; A's copy must still survive (X's
    copy hangs below it), so the backup fails for lack of room instead (found by the L3
    stress test when backups started to be acknowledged at issue time)."""
    cache, be = make_cache(backend_factory, device_pages=32, host_pages=16)
    oracle = KVOracle(be)
    a = prefill_insert(cache, oracle, seq(0, 4)).last_node  # A: 4 host pages
    prefill_insert(cache, oracle, seq(0, 10))  # H under A: 6
    cache.flush()
    assert cache.evict(6) == 6  # H: host-only now, the only host-only leaf
    prefill_insert(cache, oracle, seq(100, 6))  # B: 6, the host is full
    cache.flush()
    assert be.host.allocator.available == 0
    key = RadixKey(np.r_[np.arange(4), np.arange(1000, 1013)])  # X under A: needs 13 host pages
    x = prefill_insert(cache, oracle, key).last_node
    cache.flush()
    assert a.backuped and not x.backuped  # H (6) + B (6) freed, A kept: 12 < 13
    assert cache.metrics.backup_failed_tokens == 13
    cache.sanity_check(0)
    oracle.check_host(seq(0, 4), a.host_value)


# ---------------------------------------------------------------- a backup chain longer than the host's room
def _long_chain_scenario(backend_factory, **cfg):
    """B (30) and its answer (20) could not be backed up (the host is full of O's copy, on
    the device); then O leaves the device (host-only: 64 evictable host tokens) and B +
    answer + X (25) is inserted: 75 un-backed tokens against 64 of host room."""
    cache, be = make_cache(backend_factory, device_pages=256, host_pages=64, host_reclaim=False, **cfg)
    oracle = KVOracle(be)
    o = prefill_insert(cache, oracle, seq(5000, 64)).last_node
    cache.flush()
    assert o.backuped and be.host.allocator.available == 0
    b = prefill_insert(cache, oracle, seq(0, 30)).last_node
    ans = prefill_insert(cache, oracle, seq(0, 50)).last_node
    cache.flush()
    assert not b.backuped and not ans.backuped and ans.parent is b
    assert cache.evict(64) == 64 and o.evicted  # O: host-only now, evictable
    return cache, be, oracle, b, ans


def test_backup_chain_longer_than_host_room_backs_up_the_prefix_that_fits(backend_factory):
    """Issue 21 point 15: upstream backs up B and the answer (parent first) and skips only
    X; an all-or-nothing chain backup left the host empty with 75 un-backed device tokens."""
    cache, be, oracle, b, ans = _long_chain_scenario(backend_factory)
    failed = cache.metrics.backup_failed_tokens
    x = prefill_insert(cache, oracle, seq(0, 75)).last_node
    cache.flush()
    assert x.parent is ans
    assert b.backuped and ans.backuped and not x.backuped
    assert cache.metrics.backup_failed_tokens - failed == 25
    assert cache.host_tokens == 50
    oracle.check_host(seq(0, 50), node_path_pages(cache, ans, host=True))
    cache.sanity_check(0)
    # X is backed up once there is room again (its next hit), under the backed-up answer.
    cache.evict(10**6)
    m = cache.match_prefix(seq(0, 75))
    assert m.host_hit_length == 50
    cache.sanity_check(0)


def test_write_back_eviction_backs_up_the_ancestors_that_fit(backend_factory):
    """The same under write_back: evicting X (its chain B + answer + X is 75 tokens, the
    host's room 64) backs up B and the answer and drops only X."""
    cache, be = make_cache(backend_factory, device_pages=256, host_pages=64, write_policy="write_back")
    oracle = KVOracle(be)
    o = prefill_insert(cache, oracle, seq(5000, 64)).last_node
    b = prefill_insert(cache, oracle, seq(0, 30)).last_node
    ans = prefill_insert(cache, oracle, seq(0, 50)).last_node
    x = prefill_insert(cache, oracle, seq(0, 75)).last_node
    cache.flush()
    assert cache.evict(64) == 64 and o.evicted and o.backuped  # the host is full of O
    dropped = cache.metrics.dropped_tokens
    assert cache.evict(25) == 25 and x.deleted
    assert b.backuped and ans.backuped and not ans.evicted
    assert cache.metrics.dropped_tokens - dropped == 25
    oracle.check_host(seq(0, 50), node_path_pages(cache, ans, host=True))
    cache.sanity_check(0)


# ---------------------------------------------------------------- write_back: one eviction's staged copies
def test_write_back_eviction_keeps_the_copies_it_staged(backend_factory):
    """Issue 21 point 16: one eviction backs up X1, then X2 with no host room left; evicting
    X1's fresh copy to make room for X2 wastes X1's blocking copy. X2 is dropped instead."""
    cache, be = make_cache(backend_factory, device_pages=64, host_pages=16, write_policy="write_back")
    oracle = KVOracle(be)
    x1 = prefill_insert(cache, oracle, seq(0, 16)).last_node
    x2 = prefill_insert(cache, oracle, seq(100, 16)).last_node
    cache.flush()
    assert cache.evict(32) == 32
    assert x1.evicted and x1.backuped and x2.deleted
    assert cache.metrics.evicted_host_tokens == 0 and cache.metrics.backup_tokens == 16
    assert cache.metrics.dropped_tokens == 16
    assert x1 in cache.host_lru  # a host eviction candidate again once the eviction ended
    oracle.check_host(seq(0, 16), x1.host_value)
    cache.sanity_check(0)
