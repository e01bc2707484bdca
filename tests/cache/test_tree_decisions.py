"""Issue 21 point 17: each choice where the tree differs from upstream's, pinned by behaviour.

``decisions`` resolves them from ``HiCacheConfig.tree_decisions`` (docs/deviations-from-upstream.md
gives the reasons and the differential benchmark's numbers). Each test
below builds the smallest case where the two choices cache different things, and checks the
one the cache makes (so it fails if the other one is made).
"""

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, prefill_insert
from hicache_jax.cache import HiCacheConfig, RadixKey, TreeDecisions
from hicache_jax.cache.decisions import HOST_ONLY_FIRST_RATIO, Decisions, resolve


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


# ---------------------------------------------------------------- resolution
@pytest.mark.parametrize(
    "policy, mode, host_pages, expect",
    [
        # auto: write_through(_selective) takes upstream's split stamp and batches; host eviction
        # ages below HOST_ONLY_FIRST_RATIO device pools, keeps upstream's order from there.
        ("write_through", "auto", 2 * 16, Decisions(True, True, True, "aging")),
        # ... aging only under LRU: under any other eviction policy copies go first.
        ("write_through|lfu", "auto", 2 * 16, Decisions(True, True, True, "copies_first")),
        ("write_through_selective|fifo", "auto", 16, Decisions(True, True, True, "copies_first")),
        ("write_through|lfu", "auto", HOST_ONLY_FIRST_RATIO * 16, Decisions(True, True, True, "host_only_first")),
        ("write_through|mru", "own", 16, Decisions(True, False, False, "copies_first")),
        ("write_through_selective", "auto", HOST_ONLY_FIRST_RATIO * 16 - 1, Decisions(True, True, True, "aging")),
        ("write_through", "auto", HOST_ONLY_FIRST_RATIO * 16, Decisions(True, True, True, "host_only_first")),
        # auto under write_back: ours (no hits counted, as upstream).
        ("write_back", "auto", 4 * 16, Decisions(False, False, False, "copies_first")),
        ("write_back", "auto", 16, Decisions(False, False, False, "copies_first")),
        ("write_through", "upstream", 16, Decisions(True, True, True, "host_only_first")),
        ("write_back", "upstream", 16, Decisions(False, True, True, "host_only_first")),
        ("write_through", "own", 4 * 16, Decisions(True, False, False, "aging")),
        ("write_back", "own", 16, Decisions(False, False, False, "copies_first")),
    ],
)
def test_resolve(policy, mode, host_pages, expect):
    policy, _, eviction = policy.partition("|")
    cfg = HiCacheConfig(write_policy=policy, eviction_policy=eviction or "lru", tree_decisions=mode)
    assert resolve(cfg, 16, host_pages) == expect


def test_cache_resolves_its_pool_sizes(backend_factory):
    cache, _ = make_cache(backend_factory, device_pages=16, host_pages=HOST_ONLY_FIRST_RATIO * 16)
    assert cache.config.tree_decisions is TreeDecisions.AUTO
    assert cache.decisions.host_eviction_order == "host_only_first"
    cache, _ = make_cache(backend_factory, device_pages=16, host_pages=2 * 16)
    assert cache.decisions.host_eviction_order == "aging"


def test_bad_tree_decisions():
    with pytest.raises(ValueError, match="tree_decisions"):
        HiCacheConfig(tree_decisions="mine")


# ---------------------------------------------------------------- always upstream's
def test_write_back_counts_no_hits_so_lfu_orders_by_access(backend_factory):
    """Upstream counts no hits under write_back: its LFU acts as LRU there. A (inserted
    twice) and B (once, later): a real LFU would evict B; this evicts A, the older."""
    cache, be = make_cache(backend_factory, write_policy="write_back", eviction_policy="lfu")
    oracle = KVOracle(be)
    a = prefill_insert(cache, oracle, seq(0, 4)).last_node
    prefill_insert(cache, oracle, seq(0, 4))
    b = prefill_insert(cache, oracle, seq(100, 4)).last_node
    assert a.hit_count == b.hit_count == 0
    assert cache.evict(4) == 4
    assert a.evicted and not b.evicted
    cache.sanity_check(0)


def test_revival_counts_no_hit(backend_factory):
    """An insert that re-supplies a host-only node's pages (the caller recomputed them: no
    load-back) counts no hit there. Under LFU, revived A (1 hit) then leaves before B (2 hits),
    although B was used longer ago; counting the revival (2 hits) would keep A."""
    cache, be = make_cache(backend_factory, eviction_policy="lfu", device_pages=32, host_pages=64)
    oracle = KVOracle(be)
    a = prefill_insert(cache, oracle, seq(0, 8)).last_node
    cache.flush()
    assert cache.evict(8) == 8 and a.evicted and a.backuped
    b = prefill_insert(cache, oracle, seq(100, 4)).last_node
    prefill_insert(cache, oracle, seq(100, 4))
    assert b.hit_count == 2
    prefill_insert(cache, oracle, seq(0, 8))  # host hit, not loaded back: revives A
    assert not a.evicted and a.hit_count == 1
    assert cache.evict(8) == 8
    assert a.evicted and not b.evicted
    cache.sanity_check(0)


# ---------------------------------------------------------------- split remainder
@pytest.mark.parametrize("via", ["match", "insert"])
@pytest.mark.parametrize("mode, stamped", [("upstream", True), ("own", False)])
def test_split_remainder_access_time(backend_factory, via, mode, stamped):
    """A match or insert ending inside A splits it. Upstream stamps A before splitting, so
    the unmatched remainder is as recent as the match and B (used after A, before the match)
    is the LRU leaf; ours leaves the remainder its old time, so it goes first."""
    cache, be = make_cache(backend_factory, tree_decisions=mode)
    oracle = KVOracle(be)
    a = prefill_insert(cache, oracle, seq(0, 8)).last_node
    b = prefill_insert(cache, oracle, seq(100, 4)).last_node
    if via == "match":
        cache.match_prefix(seq(0, 4))
    else:  # an insert that splits A itself (no match before it)
        key = RadixKey(np.r_[np.arange(4), np.arange(50, 54)])
        new = cache.alloc_device(4)
        oracle.write(key, new, 4)
        cache.insert(key, np.concatenate([a.value[:4], new]))
    assert len(a) == 4 and a.parent is not cache.root  # ``a`` is the remainder now
    assert (a.last_access > b.last_access) is stamped
    assert cache.evict(4) == 4
    assert a.evicted is not stamped and b.evicted is stamped
    cache.sanity_check(0)


# ---------------------------------------------------------------- eviction batches
@pytest.mark.parametrize("mode, whole", [("upstream", True), ("own", False)])
def test_load_back_eviction_batch(backend_factory, mode, whole):
    """Loading back X (12 pages) with 6 free: upstream evicts the load's whole size (Y and Z),
    ours only the shortfall (Y, the least recently used)."""
    cache, be = make_cache(backend_factory, device_pages=16, host_pages=64, tree_decisions=mode)
    oracle = KVOracle(be)
    x = prefill_insert(cache, oracle, seq(0, 12)).last_node
    cache.flush()
    cache.evict(12)
    y = prefill_insert(cache, oracle, seq(100, 6)).last_node
    z = prefill_insert(cache, oracle, seq(200, 4)).last_node
    cache.flush()
    assert be.device.allocator.available == 6
    lb = cache.load_back(cache.match_prefix(seq(0, 12)).last_host_node)
    assert lb is not None and lb.node is x
    be.complete_all()
    cache.flush()
    oracle.check_device(seq(0, 12), lb.device_pages)
    assert y.evicted and z.evicted is whole
    assert cache.metrics.evicted_device_tokens == 12 + (10 if whole else 6)
    assert be.device.allocator.available == (4 if whole else 0)
    cache.sanity_check(0)


@pytest.mark.parametrize("mode, whole", [("upstream", True), ("own", False)])
def test_backup_host_eviction_batch(backend_factory, mode, whole):
    """Backing up X (6 pages) with 2 host pages free: upstream evicts at least X's size (H1
    and H2), ours only the shortfall (H1, the least recently used)."""
    cache, be = make_cache(backend_factory, device_pages=32, host_pages=10, tree_decisions=mode)
    oracle = KVOracle(be)
    h1 = prefill_insert(cache, oracle, seq(0, 4)).last_node
    h2 = prefill_insert(cache, oracle, seq(100, 4)).last_node
    cache.flush()
    cache.evict(8)
    assert h1.evicted and h2.evicted and be.host.allocator.available == 2
    x = prefill_insert(cache, oracle, seq(200, 6)).last_node
    cache.flush()
    assert x.backuped and h1.deleted and h2.deleted is whole
    oracle.check_host(seq(200, 6), x.host_value)
    assert be.host.allocator.available == (4 if whole else 0)
    cache.sanity_check(0)


# ---------------------------------------------------------------- host eviction order
@pytest.mark.parametrize("host_pages, order", [(3 * 16, "host_only_first"), (2 * 16, "aging")])
def test_write_through_host_eviction_order_by_host_size(backend_factory, host_pages, order):
    """write_through, auto: with a host of at least 3 device pools, host eviction takes the
    host-only leaf A (upstream's order) and keeps the copy of the on-device B; a smaller host
    drops B's copy first (point 5's order: A left the device recently)."""
    assert HOST_ONLY_FIRST_RATIO == 3
    cache, be = make_cache(backend_factory, device_pages=16, host_pages=host_pages)
    assert cache.decisions.host_eviction_order == order
    oracle = KVOracle(be)
    a = prefill_insert(cache, oracle, seq(0, 4)).last_node
    b = prefill_insert(cache, oracle, seq(100, 4)).last_node
    cache.flush()
    cache.inc_lock_ref(b)  # kept on the device (and no device victim: nothing ages)
    cache.evict(4)
    assert a.evicted and a.backuped and b.backuped and not b.evicted
    assert cache.evict_host(4) == 4
    if order == "host_only_first":
        assert a.deleted and b.backuped
    else:
        assert not a.deleted and not b.backuped and not b.evicted
    cache.dec_lock_ref(b)
    cache.sanity_check(0)


@pytest.mark.parametrize(
    "policy, eviction, mode, order",
    [
        ("write_back", "lru", "auto", "copies_first"),
        ("write_back", "lfu", "auto", "copies_first"),
        ("write_back", "lru", "upstream", "host_only_first"),
        ("write_through", "lfu", "auto", "copies_first"),
        ("write_through_selective", "mru", "auto", "copies_first"),
        ("write_through", "lru", "auto", "aging"),
        ("write_through", "lfu", "upstream", "host_only_first"),
    ],
)
def test_copies_go_before_aged_host_only_leaves(backend_factory, policy, eviction, mode, order):
    """A host smaller than 3 device pools: the copy of the loaded-back L goes before H, a
    host-only leaf long off the device, under write_back (dropping L's copy costs a copy when
    L leaves the device, not a hit) and under write_through with any eviction policy but LRU
    (aging compares access times with the device's next victim's, an LRU notion). Under LRU
    write_through H goes first (it aged out: ``aging``), as in upstream's order."""
    cache, be = make_cache(
        backend_factory,
        write_policy=policy,
        eviction_policy=eviction,
        device_pages=32,
        host_pages=64,
        tree_decisions=mode,
    )
    assert cache.decisions.host_eviction_order == order
    oracle = KVOracle(be)
    h = prefill_insert(cache, oracle, seq(0, 8)).last_node
    prefill_insert(cache, oracle, seq(0, 8))  # a second hit: write_through_selective backs it up
    cache.flush()
    assert cache.evict(8) == 8 and h.evicted and h.backuped
    for _ in range(100):
        cache.match_prefix(seq(9000, 4))  # a miss: only the clock moves
    ll = prefill_insert(cache, oracle, seq(100, 12)).last_node
    prefill_insert(cache, oracle, seq(100, 12))
    cache.flush()
    assert cache.evict(12) == 12 and ll.evicted and ll.backuped
    lb = cache.load_back(cache.match_prefix(seq(100, 12)).last_host_node)
    be.complete_all()
    cache.flush()
    oracle.check_device(seq(100, 12), lb.device_pages)
    assert not ll.evicted and ll.backuped
    copies_first = order == "copies_first"
    assert cache.evict_host(8) == (12 if copies_first else 8)
    if copies_first:
        assert not h.deleted and h.backuped and not ll.backuped and not ll.evicted
        oracle.check_host(seq(0, 8), h.host_value)
    else:
        assert h.deleted and ll.backuped
    cache.sanity_check(0)
