"""Operator metrics: one naming scheme (FAMILIES) across stats(), Prometheus and
docs/metrics.md; non-overlapping cache_source; durations to completion, not to the poll; gauges;
several caches on one registry."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import threading
import time

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert, small_geom
from hicache_jax.backends.numpy_backend import NumpyTransferEngine
from hicache_jax.cache import HiCacheConfig, HiRadixCache, RadixKey, register_prometheus
from hicache_jax.cache.metrics import FAMILIES, FAMILY_NAMES, CacheMetrics, Histogram, family_values
from hicache_jax.transfer import FutureHandle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UNITS = (
    "_tokens",
    "_pages",
    "_bytes",
    "_seconds",
    "_calls",
    "_errors",
    "_retries",
    "_failures",
    "_rate",
    "_files",
    "_operations",
    "_pending",
    "_skipped",
    "_revoked",
    "_timeouts",
    "_truncated",
    "_info",
)  # _info: Prometheus's convention for a constant 1 whose labels carry the facts (build_info)


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


def test_family_names_carry_their_unit_and_are_unique():
    assert len(set(FAMILY_NAMES)) == len(FAMILY_NAMES)
    for f in FAMILIES:
        assert f.name.endswith(UNITS), f"{f.name}: the name must end in its unit"
        assert not f.name.endswith("_total"), f"{f.name}: Prometheus adds _total to counters"
        assert f.kind in ("counter", "gauge", "histogram") and f.help
        if f.kind == "histogram":
            assert f.name.endswith("_seconds")


def test_every_counter_is_exported():
    """Each CacheMetrics field feeds a family: set every field to a distinct value and find it."""
    m = CacheMetrics()
    want = {}
    for i, name in enumerate(CacheMetrics.__dataclass_fields__):
        v = getattr(m, name)
        if isinstance(v, Histogram):
            v.observe(0.001 * (i + 1))
            want[name] = v.sum
        elif isinstance(v, dict):
            v["some_reason"] = 1000 + i
            want[name] = 1000 + i
        else:
            setattr(m, name, type(v)(1000 + i))
            want[name] = 1000 + i

    class Fake:  # what family_values reads of a cache
        metrics = m
        storage_hook = None
        build_info = {"version": "0", "backend": "numpy", "platform": "host"}

        @staticmethod
        def gauges():
            return {
                "backups_in_flight": 0,
                "load_backs_in_flight": 0,
                "pool_capacity_bytes": {},
                **{
                    k: 0
                    for k in (
                        "device_capacity_tokens",
                        "device_free_tokens",
                        "device_used_tokens",
                        "device_evictable_tokens",
                        "device_protected_tokens",
                        "host_capacity_tokens",
                        "host_free_tokens",
                        "host_used_tokens",
                    )
                },
            }

    values = family_values(Fake())
    seen = []

    def walk(v):
        if isinstance(v, dict):
            if "sum" in v and "count" in v:
                seen.append(v["sum"])
            for x in v.values():
                walk(x)
        else:
            seen.append(v)

    walk(values)
    # cached_tokens{host} is loaded - loaded_storage (both show through the other sources);
    # prefetch_skipped is the sum of prefetch_skipped{reason}
    derived = {"loaded_storage_tokens", "prefetch_skipped"}
    missing = [n for n, v in want.items() if n not in derived and not any(x == pytest.approx(v) for x in seen)]
    assert not missing, f"counters no family exports: {missing}"


def test_docs_document_every_family():
    text = open(os.path.join(ROOT, "docs", "metrics.md")).read()
    missing = [n for n in FAMILY_NAMES if f"`{n}`" not in text]
    assert not missing, f"docs/metrics.md's table lacks {missing}"


def test_stats_use_the_family_names(backend_factory):
    cache, be = make_cache(backend_factory)
    prefill_insert(cache, KVOracle(be), seq(0, 12))
    cache.flush()
    s = cache.stats()
    # Only the L3 store's families (no storage controller attached) and retention's (not
    # enabled) are absent.
    l3_only = {f.name for f in FAMILIES if f.name.startswith("storage_") and not f.name.startswith("storage_backup")}
    retention = {f.name for f in FAMILIES if f.name.startswith(("retention_", "retained_"))}
    assert len(retention) == 6
    assert set(FAMILY_NAMES) - set(s) == l3_only | retention | {"prefetch_reserved_host_pages"}
    assert s["cached_tokens"] == {"device": 0, "host": 0, "storage": 0}
    assert s["backup_tokens"] == 12 and s["device_used_tokens"] == 12 and s["host_used_tokens"] == 12
    assert s["backup_duration_seconds"]["count"] == 1
    assert s["in_flight_operations"] == {"backup": 0, "load_back": 0}


def _attached_from_l3(backend_factory):
    """A cache whose 8 tokens were dropped from both tiers (as after a restart) and attached
    again with ``insert_host``, their host pages holding the right bytes (what an L3 read
    writes): (cache, oracle, key)."""
    cache, be = make_cache(backend_factory, page_size=2, load_back_threshold=0)
    oracle = KVOracle(be)
    key = seq(0, 8)
    prefill_insert(cache, oracle, key)
    cache.flush()
    cache.evict(8)
    cache.evict_host(8)
    ids = cache.host_allocator.alloc(4)
    for c, arr in oracle.pages(key, 0, 4).items():
        be.host.write_pages(
            c,
            ids,
            {"lnp": arr, "nlp": arr.transpose(1, 0, 2, 3, 4), "npl": arr.transpose(1, 2, 0, 3, 4)}[
                be.host.layout.transfer_order
            ],
        )
    assert cache.insert_host(key, ids, 0)[0] == 8
    return cache, oracle, key


def test_cached_tokens_sources_do_not_overlap(backend_factory):
    """Pages attached with insert_host (an L3 prefetch) count as storage when loaded back, once;
    the next load-back of the same tokens is a host hit."""
    cache, oracle, key = _attached_from_l3(backend_factory)
    m = cache.metrics
    loaded0 = m.loaded_tokens
    req, lb = cache.begin_request(key)
    cache.flush()
    oracle.check_device(key, req.device_pages)
    cache.dec_lock_ref(req.last_node)
    cached = cache.stats()["cached_tokens"]
    assert m.loaded_tokens - loaded0 == 8 and cached == {"device": 0, "host": 0, "storage": 8}
    cache.evict(8)
    req, lb = cache.begin_request(key)
    cache.flush()
    cache.dec_lock_ref(req.last_node)
    assert cache.stats()["cached_tokens"] == {"device": 0, "host": 8, "storage": 8}
    assert sum(cache.stats()["cached_tokens"].values()) == m.device_hit_tokens + m.loaded_tokens
    cache.sanity_check()


def test_durations_end_at_completion_not_at_the_poll():
    """A deferred copy completed 50 ms after issue and polled 400 ms later counts ~50 ms."""
    be = numpy_backend_factory(small_geom(1), 32, 64, "page_first", deferred=True)
    cache = HiRadixCache(HiCacheConfig(page_size=1), be.engine, be.device.allocator)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 8))  # write_through: a backup in flight
    assert cache.in_flight == (1, 0) and cache.stats()["in_flight_operations"]["backup"] == 1
    time.sleep(0.05)
    be.complete_all()
    time.sleep(0.4)
    cache.writing_check()
    h = cache.metrics.backup_duration_seconds
    assert h.count == 1 and 0.04 <= h.sum < 0.3, h.sum
    assert cache.stats()["in_flight_operations"]["backup"] == 0


def test_future_handle_stamps_completion_on_the_worker():
    pool = cf.ThreadPoolExecutor(1)
    gate = threading.Event()
    h = FutureHandle(pool.submit(gate.wait))
    assert h.completed_at is None
    gate.set()
    h.wait()
    t = h.completed_at
    time.sleep(0.05)
    assert t is not None and time.perf_counter() - t >= 0.05  # stamped when it ended, not now
    pool.shutdown()


def test_gauges_per_tier_and_pool():
    target = numpy_backend_factory(small_geom(2, "mha", layers=3), 16, 32, "page_first")
    draft = numpy_backend_factory(small_geom(2, "mla", layers=1), 16, 32, "layer_first")
    cache = HiRadixCache(
        HiCacheConfig(page_size=2),
        target.engine,
        target.device.allocator,
        sidecars={"draft": NumpyTransferEngine(draft.device, draft.host)},
    )
    g = cache.stats()
    assert g["device_capacity_tokens"] == 32 and g["host_capacity_tokens"] == 64
    assert g["pool_capacity_bytes"] == {
        "device/full": 16 * target.geom.bytes_per_page,
        "host/full": 32 * target.geom.bytes_per_page,
        "device/draft": 16 * draft.geom.bytes_per_page,
        "host/draft": 32 * draft.geom.bytes_per_page,
    }
    pages = cache.alloc_device(3)
    cache.insert(seq(0, 6), pages)
    g = cache.stats()
    assert g["device_used_tokens"] == 6 and g["device_free_tokens"] == 32 - 6 and g["host_used_tokens"] == 6


def test_several_caches_share_a_registry_with_labels(backend_factory):
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    a, be_a = make_cache(backend_factory)
    b, be_b = make_cache(backend_factory)
    c, _ = make_cache(backend_factory)
    ea = register_prometheus(a, registry, labels={"cache": "target", "rank": "0", "model": "m"})
    register_prometheus(b, registry, labels={"cache": "draft", "rank": "0", "model": "m"})
    with pytest.raises(ValueError, match="distinct labels"):
        register_prometheus(c, registry, labels={"cache": "draft", "rank": "0", "model": "m"})
    with pytest.raises(ValueError, match="same label names"):
        register_prometheus(c, registry, labels={"cache": "x"})
    with pytest.raises(ValueError, match="own families"):
        register_prometheus(c, registry, labels={"tier": "x"})
    prefill_insert(a, KVOracle(be_a), seq(0, 12))
    prefill_insert(b, KVOracle(be_b), seq(0, 4))
    a.flush()
    b.flush()
    get = registry.get_sample_value
    assert get("hicache_backup_tokens_total", {"cache": "target", "rank": "0", "model": "m"}) == 12
    assert get("hicache_backup_tokens_total", {"cache": "draft", "rank": "0", "model": "m"}) == 4
    assert (
        get("hicache_cached_tokens_total", {"cache": "draft", "rank": "0", "model": "m", "cache_source": "device"}) == 0
    )
    text = prometheus_client.generate_latest(registry).decode()  # one family per name, both caches in it
    assert len(re.findall(r"^# TYPE hicache_backup_tokens_total counter", text, re.M)) == 1
    ea.unregister()
    assert get("hicache_backup_tokens_total", {"cache": "target", "rank": "0", "model": "m"}) is None
    assert get("hicache_backup_tokens_total", {"cache": "draft", "rank": "0", "model": "m"}) == 4
    register_prometheus(c, registry, labels={"cache": "target", "rank": "0", "model": "m"})  # the slot is free


def test_register_prometheus_rejects_bad_arguments(backend_factory):
    prometheus_client = pytest.importorskip("prometheus_client")
    cache, _ = make_cache(backend_factory)
    registry = prometheus_client.CollectorRegistry()
    with pytest.raises(TypeError, match="labels"):
        register_prometheus(cache, registry, labels=["rank"])
    with pytest.raises(ValueError, match="prefix"):
        register_prometheus(cache, registry, prefix="bad prefix")
    register_prometheus(cache, registry)
    with pytest.raises(ValueError, match="already registered"):
        register_prometheus(cache, registry)


def test_a_storage_attached_node_split_before_its_load_back_counts_both_parts_as_storage(backend_factory):
    """A request that shares only the first half of an L3-attached node splits it before any
    load-back: the upper part (a new node) came from storage too, and so its load-back counts."""
    cache, oracle, key = _attached_from_l3(backend_factory)
    half = RadixKey(np.concatenate([key.token_ids[:4], [900, 901]]))  # shares two pages: splits the node there
    req, lb = cache.begin_request(half)
    cache.flush()
    oracle.check_device(key.prefix(4), req.device_pages[:2])
    cache.dec_lock_ref(req.last_node)
    assert cache.stats()["cached_tokens"] == {"device": 0, "host": 0, "storage": 4}
    req, lb = cache.begin_request(key)  # the lower part
    cache.flush()
    oracle.check_device(key, req.device_pages)
    cache.dec_lock_ref(req.last_node)
    assert cache.stats()["cached_tokens"] == {"device": 4, "host": 0, "storage": 8}
    cache.sanity_check()
