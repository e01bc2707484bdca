"""Eviction strategies (upstream's --radix-eviction-policy): the order in which unlocked device
leaves leave, for every policy, against orders written out by hand; priorities through
``insert`` and the request helpers; the strategy objects' keys."""

from __future__ import annotations

import numpy as np
import pytest
from cache_harness import KVOracle, make_cache, prefill_insert

from hicache_jax.cache import RadixKey
from hicache_jax.cache.eviction_policies import STRATEGIES, strategy_for
from hicache_jax.cache.tree_node import TreeNode


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


def _three_leaves(cache, oracle, priorities=(0, 0, 0)):
    """A, B, C inserted in that order (4 tokens each); then A is inserted again (a hit, newest
    access) and matched."""
    nodes = []
    for start, prio in zip((0, 100, 200), priorities):
        m = cache.match_prefix(seq(start, 4))
        new = cache.alloc_device(4)
        oracle.write(seq(start, 4), new)
        nodes.append(cache.insert(seq(start, 4), np.concatenate([m.device_indices, new]), priority=prio).last_node)
    cache.insert(seq(0, 4), cache.match_prefix(seq(0, 4)).device_indices)  # A: 2nd hit, newest access
    cache.flush()
    return nodes


def _evicted_order(cache, nodes):
    order = []
    for _ in nodes:
        assert cache.evict(4) == 4
        gone = [i for i, n in enumerate(nodes) if n.evicted and i not in order]
        assert len(gone) == 1
        order += gone
    return "".join("ABC"[i] for i in order)


@pytest.mark.parametrize(
    "policy, expect",
    [
        ("lru", "BCA"),  # oldest access first; A was touched last
        ("mru", "ACB"),  # newest access first
        ("fifo", "ABC"),  # creation order, whatever the accesses
        ("lfu", "BCA"),  # A has 2 hits; B and C one each, the older access first
    ],
)
def test_eviction_order_by_policy(backend_factory, policy, expect):
    cache, be = make_cache(backend_factory, device_pages=16, eviction_policy=policy)
    nodes = _three_leaves(cache, KVOracle(be))
    assert _evicted_order(cache, nodes) == expect
    cache.sanity_check(0)


def test_priority_policy_evicts_the_lowest_priority_first(backend_factory):
    cache, be = make_cache(backend_factory, device_pages=16, eviction_policy="priority")
    nodes = _three_leaves(cache, KVOracle(be), priorities=(1, 5, 3))
    assert [n.priority for n in nodes] == [1, 5, 3]
    assert _evicted_order(cache, nodes) == "ACB"  # LRU alone would give BCA
    cache.sanity_check(0)


def test_priority_ties_fall_back_to_lru(backend_factory):
    cache, be = make_cache(backend_factory, device_pages=16, eviction_policy="priority")
    nodes = _three_leaves(cache, KVOracle(be), priorities=(2, 2, 2))
    assert _evicted_order(cache, nodes) == "BCA"


def test_a_node_keeps_the_highest_priority_that_inserted_through_it(backend_factory):
    cache, be = make_cache(backend_factory, device_pages=32, eviction_policy="priority")
    oracle = KVOracle(be)
    key = seq(0, 8)
    req, _ = cache.begin_request(key, priority=7)
    new = cache.alloc_device(8)
    oracle.write(key, new)
    req.extend(key, new)
    cache.cache_finished_req(req)
    leaf = cache.match_prefix(key).last_device_node
    assert leaf.priority == 7
    cache.insert(seq(0, 4), cache.match_prefix(seq(0, 4)).device_indices, priority=2)  # splits; lower: kept
    upper = leaf.parent
    assert (upper.priority, leaf.priority) == (7, 7)
    cache.insert(seq(0, 4), cache.match_prefix(seq(0, 4)).device_indices, priority=9)
    assert (upper.priority, leaf.priority) == (9, 7)
    cache.sanity_check(0)


def test_priority_must_be_an_int_and_changes_nothing_otherwise(backend_factory):
    cache, be = make_cache(backend_factory, eviction_policy="priority")
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 4))
    cache.flush()
    before = [(n.id, n.priority, n.hit_count) for n in cache.all_nodes()]
    for bad in (1.5, "high", True, None):
        with pytest.raises(TypeError, match="priority"):
            cache.insert(seq(0, 4), cache.match_prefix(seq(0, 4)).device_indices, priority=bad)
        with pytest.raises(TypeError, match="priority"):
            cache.begin_request(seq(0, 4), priority=bad)
    assert [(n.id, n.priority, n.hit_count) for n in cache.all_nodes()] == before
    cache.sanity_check(0)


def test_strategy_keys():
    n = TreeNode(np.arange(4, dtype=np.int64), None, None)
    n.last_access, n.hit_count, n.created, n.priority = 10, 3, 2, 5
    assert strategy_for("lru").key(n) == (10,)
    assert strategy_for("lfu").key(n) == (3, 10)
    assert strategy_for("fifo").key(n) == (2, 10)
    assert strategy_for("mru").key(n) == (-10,)
    assert strategy_for("priority").key(n) == (5, 10)
    assert sorted(s.value for s in STRATEGIES) == ["fifo", "lfu", "lru", "mru", "priority"]
    with pytest.raises(ValueError, match="eviction_policy"):
        strategy_for("slru")
