"""Metrics (stats object and Prometheus export) and multi-component (sidecar) transfers."""

import numpy as np
import pytest

from cache_harness import Backend, KVOracle, make_cache, numpy_backend_factory, prefill_insert, small_geom
from hicache_jax.backends.numpy_backend import NumpyTransferEngine
from hicache_jax.cache import HiCacheConfig, HiRadixCache, MultiLoadHandle, RadixKey, register_prometheus


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


def test_metrics_count_tiers_bytes_and_evictions(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 12))
    cache.flush()
    cache.evict(12)
    m0 = cache.match_prefix(seq(0, 16))
    cache.load_back(m0.last_host_node)
    cache.flush()
    cache.match_prefix(seq(0, 16))
    m = cache.metrics
    assert m.host_match_tokens == 12 and m.loaded_tokens == 12
    assert m.loaded_bytes == 12 * be.geom.bytes_per_page
    assert m.backup_tokens == 12 and m.backup_bytes == 12 * be.geom.bytes_per_page
    assert m.evicted_device_tokens == 12 and m.demoted_tokens == 12
    assert m.device_hit_tokens == 12 + 0  # the last match; prefill_insert's first match found nothing
    assert m.eviction_seconds > 0
    assert m.load_back_duration_seconds.count == 1 and m.backup_duration_seconds.count == 1
    s = cache.stats()
    assert 0 < s["cache_hit_rate"] <= 1
    m.reset()
    assert cache.metrics.loaded_tokens == 0


def test_prometheus_export(backend_factory):
    prometheus_client = pytest.importorskip("prometheus_client")
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    registry = prometheus_client.CollectorRegistry()
    register_prometheus(cache, registry=registry, prefix="hc")
    prefill_insert(cache, oracle, seq(0, 12))
    cache.flush()
    cache.evict(12)
    cache.load_back(cache.match_prefix(seq(0, 12)).last_host_node)
    cache.flush()
    get = registry.get_sample_value
    assert get("hc_backup_tokens_total") == 12
    assert get("hc_cached_tokens_total", {"cache_source": "host"}) == 12
    assert get("hc_evicted_tokens_total", {"tier": "device"}) == 12
    assert get("hc_host_used_tokens") == 12
    assert get("hc_load_back_duration_seconds_count") == 1
    text = prometheus_client.generate_latest(registry).decode()
    assert "hc_load_back_duration_seconds_bucket" in text and "hc_cache_hit_rate" in text


def _sidecar_setup(deferred):
    target = numpy_backend_factory(small_geom(2, "mha", layers=3), 16, 32, "page_first", deferred)
    draft_be = numpy_backend_factory(small_geom(2, "mla", layers=1), 16, 32, "layer_first", deferred)
    draft_engine = NumpyTransferEngine(draft_be.device, draft_be.host, deferred=deferred)
    cache = HiRadixCache(
        HiCacheConfig(page_size=2), target.engine, target.device.allocator, sidecars={"draft": draft_engine}
    )
    return cache, target, Backend(draft_be.geom, draft_be.device, draft_be.host, draft_engine)


@pytest.mark.parametrize("deferred", [False, True])
def test_sidecar_component_follows_full_page_ids(deferred):
    cache, target, draft = _sidecar_setup(deferred)
    t_oracle, d_oracle = KVOracle(target), KVOracle(draft)
    key = seq(0, 12)
    pages = cache.alloc_device(6)
    t_oracle.write(key, pages)
    d_oracle.write(key, pages)  # the draft model writes the same page ids in its own pool
    cache.insert(key, pages)
    draft.complete_all()
    cache.writing_check()
    assert cache.in_flight == ((1, 0) if deferred else (0, 0))  # done only when every component is
    target.complete_all()
    cache.writing_check()
    assert cache.in_flight == (0, 0)
    assert cache.metrics.backup_bytes == 6 * (target.geom.bytes_per_page + draft.geom.bytes_per_page)
    cache.evict(12)
    garbage_ids = cache.alloc_device(6)
    for be in (target, draft):
        for c in be.geom.components:
            be.device.write(
                c, garbage_ids, np.zeros((be.geom.num_layers, 6) + be.geom.page_shape, be.geom.container_dtype)
            )
    target.device.allocator.free(garbage_ids)
    m = cache.match_prefix(key)
    lb = cache.load_back(m.last_host_node)
    assert isinstance(lb.handle, MultiLoadHandle)
    target.complete_all()
    draft.complete_all()
    assert lb.layer_ready(2) and lb.handle.layer_done(0, component="draft")
    cache.flush()
    t_oracle.check_device(key, lb.device_pages)
    d_oracle.check_device(key, lb.device_pages)
    cache.sanity_check(0)


def test_sidecar_validation():
    target = numpy_backend_factory(small_geom(2), 16, 32)
    small = numpy_backend_factory(small_geom(2), 8, 32)
    other_page = numpy_backend_factory(small_geom(1), 16, 32)
    for bad, match in ((small.engine, "device pages"), (other_page.engine, "page_size"), ("x", "KVTransferEngine")):
        with pytest.raises((ValueError, TypeError), match=match):
            HiRadixCache(HiCacheConfig(page_size=2), target.engine, target.device.allocator, sidecars={"draft": bad})
    with pytest.raises(ValueError, match="reserved"):
        HiRadixCache(
            HiCacheConfig(page_size=2), target.engine, target.device.allocator, sidecars={"full": target.engine}
        )
