"""The cache's public surface for the L3 controller (backed_up_prefix, reserve_host_pages,
pin_host / unpin_host, insert_host) and the read-only debug view."""

from __future__ import annotations

import numpy as np
import pytest
from cache_harness import KVOracle, make_cache, prefill_insert

from hicache_jax.cache import RadixKey


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


def test_backed_up_prefix_walks_without_changing_anything(backend_factory):
    cache, be = make_cache(backend_factory, page_size=2)
    oracle = KVOracle(be)
    leaf = prefill_insert(cache, oracle, seq(0, 8)).last_node
    cache.flush()
    before = [(n.id, n.last_access, n.size) for n in cache.all_nodes()]
    node, matched, inside = cache.backed_up_prefix(seq(0, 5))  # ends inside the leaf: no split
    assert (node, matched, inside) == (leaf, 4, 4)
    assert [(n.id, n.last_access, n.size) for n in cache.all_nodes()] == before
    assert cache.backed_up_prefix(seq(0, 20))[:2] == (leaf, 8)
    assert cache.backed_up_prefix(seq(500, 8)) == (cache.root, 0, 0)
    with pytest.raises(TypeError, match="key"):
        cache.backed_up_prefix("tokens")


def test_reserve_host_pages_evicts_host_leaves_and_hands_pages_over(backend_factory):
    cache, be = make_cache(backend_factory, device_pages=16, host_pages=8)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 8))
    cache.flush()
    cache.evict(100)  # host-only now, filling the host pool
    assert be.host.allocator.available == 0
    ids = cache.reserve_host_pages(4)
    assert ids is not None and len(ids) == 4 and be.host.allocator.is_allocated(ids).all()
    assert cache.metrics.evicted_host_tokens >= 4
    assert not cache.debug_view().host_owned[ids].any()  # the caller's, not the tree's
    assert cache.reserve_host_pages(100) is None
    with pytest.raises(ValueError, match="num_pages"):
        cache.reserve_host_pages(-1)
    # insert_host takes them back (attached or freed).
    tokens, node = cache.insert_host(seq(900, 4), ids, 0)
    assert tokens == 4 and node is not None and node.host_value.tolist() == ids.tolist()
    cache.sanity_check(0)


def test_debug_view_is_read_only_copies(backend_factory):
    cache, be = make_cache(backend_factory, deferred=True)
    oracle = KVOracle(be)
    leaf = prefill_insert(cache, oracle, seq(0, 4)).last_node
    view = cache.debug_view()
    owned = view.device_owned
    owned[:] = False  # a copy: the cache's bitmap is untouched
    assert view.device_owned[leaf.value].all()
    assert view.pending() == [("backup", leaf)]
    assert view.counters == {"evictable_tokens": 0, "protected_tokens": 4, "host_tokens": 4}
    assert view.caller_locks == 0
    be.complete_all()
    cache.flush()
    assert cache.debug_view().pending() == []
    cache.sanity_check(0)
