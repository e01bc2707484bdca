"""``hicache_jax.l3.pools``: storage pool names, write order, replication, markers and the
per-pool key namespaces of a cache (no storage, no threads)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from cache_harness import make_cache, numpy_backend_factory
from hicache_jax.cache import RadixKey
from hicache_jax.l3.pools import COMMIT_POOL, TARGET_POOL, L3Pools

P = 2
NS = RadixKey(np.arange(2)).namespace  # the default tree namespace


def pools_of(cache, **kw):
    kw = {"model": "m", "weights_revision": "r", "tp_size": 1, "tp_rank": 0, "salt": "", **kw}
    return L3Pools(cache.components, **kw)


def test_one_rank_has_the_target_pool_only():
    cache, be = make_cache(numpy_backend_factory, page_size=P)
    lp = pools_of(cache)
    assert list(lp.pools) == [TARGET_POOL] and lp.pools[TARGET_POOL] is be.host
    assert lp.order == [TARGET_POOL] and lp.all_pools == [TARGET_POOL] and lp.trailing == {}
    assert not lp.markers and lp.replicated == set()
    assert lp.queried_pools() == lp.read_pools() == [TARGET_POOL]


def test_sharded_pool_on_two_ranks_gets_commit_markers_queried_on_rank_0_only():
    cache, _ = make_cache(numpy_backend_factory, page_size=P)  # MHA: sharded over the ranks
    r0, r1 = pools_of(cache, tp_size=2, tp_rank=0), pools_of(cache, tp_size=2, tp_rank=1)
    for lp in (r0, r1):
        assert lp.markers and COMMIT_POOL in lp.pools and lp.replicated == set()
        assert lp.read_pools() == [TARGET_POOL]  # a marker is checked, never read
    assert r0.queried_pools() == [TARGET_POOL, COMMIT_POOL] and r1.queried_pools() == [TARGET_POOL]
    ns0, ns1 = r0.namespaces(NS), r1.namespaces(NS)
    assert ns0[TARGET_POOL] != ns1[TARGET_POOL]  # each rank's shard under its own keys
    assert ns0[COMMIT_POOL] == ns1[COMMIT_POOL]  # markers: keys every rank shares


def test_replicated_mla_pool_is_shared_and_needs_no_markers():
    cache, _ = make_cache(numpy_backend_factory, page_size=P, kind="mla")
    r0, r1 = pools_of(cache, tp_size=2, tp_rank=0), pools_of(cache, tp_size=2, tp_rank=1)
    assert r0.replicated == {TARGET_POOL} and not r0.markers and COMMIT_POOL not in r0.pools
    assert r0.namespaces(NS)[TARGET_POOL] == r1.namespaces(NS)[TARGET_POOL]


def test_namespaces_separate_models_revisions_salts_and_tree_namespaces():
    cache, _ = make_cache(numpy_backend_factory, page_size=P)
    base = pools_of(cache).namespaces(NS)[TARGET_POOL]
    assert pools_of(cache).namespaces(NS)[TARGET_POOL] == base  # deterministic
    others = [
        pools_of(cache, model="m2").namespaces(NS),
        pools_of(cache, weights_revision="r2").namespaces(NS),
        pools_of(cache, salt="s").namespaces(NS),
        pools_of(cache).namespaces(RadixKey(np.arange(2), extra_key="t").namespace),
    ]
    assert all(o[TARGET_POOL] != base for o in others)
    assert len({o[TARGET_POOL] for o in others}) == len(others)


def test_unencodable_namespace_is_none_and_logged_once(caplog):
    cache, _ = make_cache(numpy_backend_factory, page_size=P)
    lp = pools_of(cache)
    bad = (object(), None)  # no RadixKey can carry it; the pools refuse it too
    with caplog.at_level(logging.WARNING, "hicache_jax.cache.storage"):
        assert lp.namespaces(bad) is None and lp.namespaces(bad) is None
    assert sum("not supported" in r.message for r in caplog.records) == 1


def test_sidecar_named_like_the_commit_pool_is_refused():
    from hicache_jax.backends.numpy_backend import make_numpy_backend
    from hicache_jax.cache import HiCacheConfig, HiRadixCache

    from cache_harness import small_geom

    _d, _h, target = make_numpy_backend(small_geom(P), 16, 16)
    _d2, _h2, side = make_numpy_backend(small_geom(P), 16, 16)
    cache = HiRadixCache(HiCacheConfig(page_size=P), target, _d.allocator, sidecars={COMMIT_POOL: side})
    with pytest.raises(ValueError, match="clashes with the storage pool name"):
        pools_of(cache)
