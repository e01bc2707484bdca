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


# ---- pools sharded over a mesh on the KV-head axis (8 forced CPU devices: conftest) -----------
def _mesh(n: int):
    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.skip(f"needs {n} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count), have {len(devices)}")
    return jax.sharding.Mesh(np.array(devices[:n]), ("tp",))


def _check_round_trip_per_shard(pool: JaxDevicePool, layout: HostLayout) -> None:
    """Random bits into every page; D2H of some pages, H2D of them into others: the host pages
    hold exactly the written bits, and every device shard holds exactly its heads of them
    (all heads when the pool is replicated), its other pages untouched."""
    g = pool.geom
    rng = np.random.default_rng(g.num_kv_heads)
    info = np.iinfo(g.container_dtype)
    data = {
        c: rng.integers(1, info.max, (g.num_layers, pool.num_pages) + g.page_shape, dtype=g.container_dtype)
        for c in g.components
    }
    for c in g.components:
        pool.write_pages_host(c, np.arange(pool.num_pages), data[c])
    host = HostKVPool(pool.local_geom, 8, layout)
    eng = JaxTransferEngine(pool, host)
    src, hst, dst = np.array([3, 11, 0]), np.array([7, 1, 4]), np.array([9, 2, 15])
    eng.backup(src, hst).wait()
    order = layout.transfer_order
    for c in g.components:
        got = host.read_pages(c, hst)
        got = {"lnp": got, "nlp": got.transpose(1, 0, 2, 3, 4), "npl": got.transpose(2, 0, 1, 3, 4)}[order]
        np.testing.assert_array_equal(got, data[c][:, src])
    eng.load(hst, dst).wait()
    want = {c: data[c].copy() for c in g.components}
    for c in g.components:
        want[c][:, dst] = data[c][:, src]
    heads_per_shard = g.num_kv_heads if pool.replicated else g.num_kv_heads // pool.mesh.shape["tp"]
    for c in g.components:
        for layer, arr in enumerate(pool.layers(c)):
            assert len(arr.addressable_shards) == pool.mesh.size
            for sh in arr.addressable_shards:
                heads = sh.index[2]
                got = np.asarray(sh.data).view(g.container_dtype)
                assert got.shape[2] == heads_per_shard, (c, layer, sh.device)
                np.testing.assert_array_equal(got, want[c][layer][:, :, heads], err_msg=f"{c} {layer} {sh.device}")
    eng.close()


@pytest.mark.parametrize("layout", [HostLayout.PAGE_FIRST, HostLayout.LAYER_FIRST])
def test_swa_and_draft_pools_shard_on_the_kv_heads_and_round_trip_per_shard(layout):
    """The hybrid model's SWA pool and the draft pool as the engine builds them on a mesh:
    sharded on the KV heads where they split (2 heads over 2 devices, 8 over 8), the draft
    replicated where it has fewer heads than devices (2 over 8); byte-exact both ways."""
    from hicache_jax.reference_model import HYBRID_TINY
    from hicache_jax.reference_model.draft import draft_kv_geometry

    swa = JaxDevicePool(HYBRID_TINY.swa_kv_geometry(4), 16, mesh=_mesh(2))
    assert not swa.replicated and swa.layers("k")[0].sharding.spec[2] == "tp"
    assert swa.copier_sharding == (swa.mesh, "tp")
    wide = dict(HYBRID_TINY.__dict__, num_heads=8, num_kv_heads=8)
    wide_draft = JaxDevicePool(
        draft_kv_geometry(type(HYBRID_TINY)(**wide), 4), 16, mesh=_mesh(8), replicate_fewer_heads=True
    )
    assert not wide_draft.replicated
    narrow_draft = JaxDevicePool(draft_kv_geometry(HYBRID_TINY, 4), 16, mesh=_mesh(8), replicate_fewer_heads=True)
    assert narrow_draft.replicated and narrow_draft.copier_sharding == (narrow_draft.mesh, None)
    assert narrow_draft.layers("k")[0].sharding.spec == jax.sharding.PartitionSpec()
    for pool in (swa, wide_draft, narrow_draft):
        _check_round_trip_per_shard(pool, layout)


def test_a_pool_with_fewer_heads_than_devices_is_replicated_only_when_asked():
    one_head = KVGeometry.mha(num_layers=2, page_size=4, num_kv_heads=1, head_dim=8, dtype="bfloat16")
    mesh = _mesh(8)
    with pytest.raises(ValueError, match="1 KV heads do not split over 8 devices.*replicate_fewer_heads"):
        JaxDevicePool(one_head, 8, mesh=mesh)
    with pytest.raises(TypeError, match="replicate_fewer_heads"):
        JaxDevicePool(one_head, 8, mesh=mesh, replicate_fewer_heads=1)
    with pytest.raises(ValueError, match="3 KV heads do not split over 2"):  # more heads than devices: split or fail
        JaxDevicePool(KVGeometry.mha(1, 4, 3, 8, "float32"), 8, mesh=_mesh(2), replicate_fewer_heads=True)
    pool = JaxDevicePool(one_head, 8, mesh=mesh, replicate_fewer_heads=True)
    assert pool.replicated and pool.local_geom == one_head
    host = HostKVPool(pool.local_geom, 4, HostLayout.PAGE_FIRST)
    assert JaxTransferEngine(pool, host).replicated  # what the L3 tier reads: rank 0 alone writes it
    sharded = JaxDevicePool(GEOM, 8, mesh=_mesh(2))
    assert not sharded.replicated
    assert not JaxTransferEngine(sharded, HostKVPool(sharded.local_geom, 4, HostLayout.PAGE_FIRST)).replicated
    mla = JaxDevicePool(KVGeometry.mla(2, 4, 8, 4, "float32"), 8, mesh=mesh)
    assert mla.replicated
    _check_round_trip_per_shard(
        JaxDevicePool(one_head, 16, mesh=mesh, replicate_fewer_heads=True), HostLayout.PAGE_FIRST
    )


def test_the_spec_decoder_builds_its_draft_pool_on_the_target_pools_mesh():
    """Sharded like the target's pool (the reference draft has the target's KV heads, so they
    split wherever the target's do; fewer heads than devices: the pool tests above), an MLA
    draft replicated; its host pool holds this process's share."""
    from dataclasses import replace

    from hicache_jax.engine import EngineCacheConfig, SpecConfig
    from hicache_jax.engine.speculative import SpecDecoder
    from hicache_jax.reference_model import ModelConfig, PagedRunner
    from pallas_kernels.page_copy import PageCopyConfig

    base = ModelConfig(vocab_size=64, num_layers=1, hidden=32, num_heads=8, num_kv_heads=2, head_dim=8, ffn=64)
    cfg = EngineCacheConfig(page_size=4, device_pages=16)
    for model, tp, replicated in (
        (base, 2, False),
        (replace(base, num_kv_heads=8), 8, False),
        (replace(base, attention="mla"), 8, True),
    ):
        runner = PagedRunner(model, 4, max_pages_per_seq=8)
        target = JaxDevicePool(model.kv_geometry(4), 16, mesh=_mesh(tp))
        spec = SpecDecoder(SpecConfig(num_draft_tokens=2), runner, target, cfg, 8, PageCopyConfig(max_pages=16))
        draft = spec.device_pool
        assert draft.mesh is target.mesh and draft.replicated == replicated and spec.transfer.replicated == replicated
        want = jax.sharding.PartitionSpec() if replicated else jax.sharding.PartitionSpec(None, None, "tp", None)
        assert draft.layers(draft.geom.components[0])[0].sharding.spec == want
        assert spec.transfer.host_pool.geom == draft.local_geom
        spec.close()
