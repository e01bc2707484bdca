"""JaxDevicePool's KV-writing helpers (``write_pages``, ``apply``) and the stale-donation error."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hicache_jax import HostKVPool, HostLayout, KVGeometry
from hicache_jax.backends.jax import JaxDevicePool, JaxTransferEngine, StaleDevicePoolError
from hicache_jax.cache import HiCacheConfig, HiRadixCache, RadixKey

GEOM = KVGeometry.mha(num_layers=3, page_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")


def _raw(pool: JaxDevicePool, c: str, ids) -> np.ndarray:
    return pool.read_pages_host(c, np.asarray(ids))


@pytest.mark.parametrize("n", [1, 3, 5])  # 3 and 5 are padded to 4 and 8 (the padding must be dropped)
def test_write_pages_writes_exactly_those_pages(n):
    pool = JaxDevicePool(GEOM, 16)
    rng = np.random.default_rng(n)
    before = {c: _raw(pool, c, np.arange(16)) for c in GEOM.components}
    ids = rng.permutation(16)[:n]
    kv = {c: jnp.asarray(rng.standard_normal((3, n, 4, 2, 8)), jnp.float32) for c in GEOM.components}
    pool.write_pages(ids, kv)
    for c in GEOM.components:
        after = _raw(pool, c, np.arange(16))
        want = np.asarray(kv[c].astype(jnp.bfloat16)).view(GEOM.container_dtype)
        np.testing.assert_array_equal(after[:, ids], want)
        rest = np.setdiff1d(np.arange(16), ids)
        np.testing.assert_array_equal(after[:, rest], before[c][:, rest])  # padding wrote nothing


def test_write_pages_rejects_bad_input_and_changes_nothing():
    pool = JaxDevicePool(GEOM, 8)
    arrays = {c: list(pool.buffers[c]) for c in GEOM.components}
    good = {c: jnp.zeros((3, 2, 4, 2, 8)) for c in GEOM.components}
    with pytest.raises(ValueError, match="page_ids"):
        pool.write_pages([0, 8], good)
    with pytest.raises(ValueError, match=r"kv\['k'\]: expected shape \(3, 2, 4, 2, 8\)"):
        pool.write_pages([0, 1], {**good, "k": jnp.zeros((3, 2, 4, 2, 4))})
    with pytest.raises(ValueError, match="components"):
        pool.write_pages([0, 1], {"k": good["k"]})
    assert all(a is b for c in GEOM.components for a, b in zip(pool.buffers[c], arrays[c]))


@functools.partial(jax.jit, donate_argnums=(0,))
def _user_step(pools, page, value):
    """A caller's own KV write: sets slot 0 of ``page`` in every layer to ``value``."""
    new = {c: [a.at[page, 0].set(value.astype(a.dtype)) for a in layers] for c, layers in pools.items()}
    return jnp.sum(value), new


def test_apply_installs_the_step_outputs():
    pool = JaxDevicePool(GEOM, 8)
    out = pool.apply(_user_step, 3, jnp.full((2, 8), 1.5))
    assert float(out) == 1.5 * 16
    got = _raw(pool, "v", [3])
    want = np.asarray(jnp.full((2, 8), 1.5, jnp.bfloat16)).view(GEOM.container_dtype)
    for layer in range(3):
        np.testing.assert_array_equal(got[layer, 0, 0], want)
    pool.check()  # nothing stale: apply installed every layer


def test_apply_rejects_a_step_that_returns_the_wrong_pools():
    pool = JaxDevicePool(GEOM, 8)
    with pytest.raises(ValueError, match="expected 3 layers for 'k'"):
        pool.apply(lambda p: (None, {"k": p["k"][:2], "v": p["v"]}))
    with pytest.raises(TypeError, match=r"\(result, new_buffers\)"):
        pool.apply(lambda p: p)
    pool.check()  # the steps above did not donate: the pool is intact


def _cache(pool: JaxDevicePool):
    host = HostKVPool(GEOM, 16, HostLayout.PAGE_FIRST)
    engine = JaxTransferEngine(pool, host)
    return HiRadixCache(HiCacheConfig(page_size=4), engine, pool.allocator), engine


def test_forgotten_install_is_named_at_the_next_backup_and_changes_nothing():
    """A caller donates the pool to its own step and forgets to install the result: the next
    backup raises StaleDevicePoolError naming the fix (not JAX's 'Array has been deleted'),
    the cache keeps no host pages for it, and after the fix the same insert backs up."""
    pool = JaxDevicePool(GEOM, 8)
    cache, engine = _cache(pool)
    try:
        pages = cache.alloc_device(2)
        _user_step(pool.buffers, 0, jnp.ones((2, 8)))  # the outputs are dropped: the pool is stale
        with pytest.raises(StaleDevicePoolError, match=r"layer 0 of component 'k'.*JaxDevicePool.apply"):
            pool.check()
        host_free = cache.host_allocator.available
        with pytest.raises(StaleDevicePoolError, match="set_layer"):
            cache.insert(RadixKey(np.arange(8)), pages)  # write_through: backs up at once
        assert cache.host_allocator.available == host_free  # the refused backup took no host page
        cache.sanity_check()
        # The fix: fresh arrays in every layer, then the next insert's backup goes through.
        for c in GEOM.components:
            for layer in range(GEOM.num_layers):
                pool.set_layer(c, layer, jnp.zeros((8,) + GEOM.page_shape, pool.dtype))
        more = cache.alloc_device(1)
        cache.insert(RadixKey(np.arange(12)), np.concatenate([pages, more]))
        cache.flush()
        assert cache.host_tokens == 12
        cache.sanity_check()
    finally:
        engine.close()


def test_set_layer_refuses_a_deleted_array():
    pool = JaxDevicePool(GEOM, 8)
    arr = jnp.zeros((8,) + GEOM.page_shape, pool.dtype)
    arr.delete()
    with pytest.raises(ValueError, match="already deleted"):
        pool.set_layer("k", 0, arr)
    with pytest.raises(ValueError, match="layer: expected an int"):
        pool.set_layer("k", 7, jnp.zeros((8,) + GEOM.page_shape, pool.dtype))


def test_layers_stay_committed_after_a_load_so_steps_do_not_recompile():
    """jit caches on committedness: a load's scatter output installed uncommitted made the next
    model step compile again (seconds per request in the serving benchmark)."""
    pool = JaxDevicePool(GEOM, 8)
    host = HostKVPool(GEOM, 8, HostLayout.PAGE_FIRST)
    engine = JaxTransferEngine(pool, host)
    try:
        engine.load(np.array([0, 1]), np.array([3, 4])).wait()
        assert all(a.committed for c in GEOM.components for a in pool.buffers[c])
        step = jax.jit(lambda pools: (None, pools), donate_argnums=(0,))
        pool.apply(step)  # compiles once for committed inputs
        size = step._cache_size()
        engine.load(np.array([2]), np.array([5])).wait()
        pool.apply(step)
        assert step._cache_size() == size  # no second compilation after the load
    finally:
        engine.close()
