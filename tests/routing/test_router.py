"""The reference router (issue 31 part 2): longest weighted prefix over the engines' events,
load-balance fallback. Unit tests on hand-made events, then on real caches' events."""

from __future__ import annotations

import numpy as np
import pytest

from hicache_jax import KVGeometry
from hicache_jax.backends.numpy_backend import make_numpy_backend
from hicache_jax.cache import HiCacheConfig, HiRadixCache, RadixKey
from hicache_jax.cache.event_source import KVEventSource
from hicache_jax.cache.events import EventBatch, KVEvent
from hicache_jax.routing import PrefixRouter, TierWeights, tier_costs_from_stats

K = [bytes([i]) * 32 for i in range(8)]  # one request's page keys, in order


def batch(engine, seq, *events):
    return EventBatch(engine, seq, tuple(events))


def stored(tier, keys):
    return KVEvent("stored", tier, tuple(keys), None, len(keys))


def test_longest_prefix_wins_and_device_beats_host_of_the_same_length():
    r = PrefixRouter(["a", "b", "c"])
    r.apply(batch("a", 0, stored("device", K[:2])))
    r.apply(batch("b", 0, stored("host", K[:4])))
    r.apply(batch("c", 0, stored("host", K[:2])))
    d = r.route(K)
    assert (d.engine, d.reason, d.pages) == ("b", "prefix", {"device": 0, "host": 4, "storage": 0})
    assert d.score == pytest.approx(4 * 0.7)
    r.apply(batch("a", 1, stored("device", K[2:3])))  # a: 3 device pages = 3.0 > 2.8
    assert r.route(K).engine == "a"
    r.apply(batch("a", 2, KVEvent("removed", "device", tuple(K[1:3]))))
    assert r.route(K).engine == "b"  # a's prefix now stops after page 0


def test_a_gap_ends_the_prefix_and_storage_is_shared():
    r = PrefixRouter(["a", "b"])
    r.apply(batch("a", 0, stored("device", [K[0]] + K[2:6])))  # page 1 missing: prefix of 1
    r.apply(batch("b", 0, stored("device", K[:2])))
    assert r.route(K).engine == "b"
    r.apply(batch("b", 1, stored("storage", K[:8])))  # b wrote to the shared L3
    d = r.route(K)
    # a: page 0 on device, page 1 from the shared L3, pages 2-5 on device, 6-7 from L3.
    assert d.engine == "a" and d.pages == {"device": 5, "host": 0, "storage": 3}
    alone = PrefixRouter(["a", "b"], shared_storage=False)
    alone.apply(batch("a", 0, stored("device", [K[0]] + K[2:6])))
    alone.apply(batch("b", 0, stored("device", K[:2]), stored("storage", K[:8])))
    assert alone.route(K).engine == "b"


def test_cleared_forgets_a_tier():
    r = PrefixRouter(["a", "b"])
    r.apply(batch("a", 0, stored("device", K[:4]), stored("host", K[:2])))
    r.apply(batch("b", 0, stored("host", K[:3])))
    assert r.route(K).engine == "a"
    r.apply(batch("a", 1, KVEvent("cleared", "device")))
    assert r.route(K).engine == "b"


def test_imbalance_falls_back_to_the_least_loaded_and_no_prefix_round_robins():
    r = PrefixRouter(["a", "b", "c"], balance_abs=4, balance_rel=2)
    r.apply(batch("a", 0, stored("device", K)))
    assert r.route(K, {"a": 6, "b": 3, "c": 3}).engine == "a"  # 6 - 3 <= 4: cache wins
    d = r.route(K, {"a": 10, "b": 3, "c": 2})
    assert (d.engine, d.reason) == ("c", "balance")
    other = [bytes([99]) * 32]
    got = [r.route(other).engine for _ in range(4)]
    assert sorted(got[:3]) == ["a", "b", "c"] and got[3] == got[0] and r.decisions["no_prefix"] == 4
    assert r.route(other, {"a": 1, "b": 0, "c": 1}).engine == "b"
    # Equal scores: the less loaded engine.
    r.apply(batch("b", 0, stored("device", K)))
    assert r.route(K, {"a": 2, "b": 1}).engine == "b"


def test_bad_input():
    with pytest.raises(ValueError, match="engines"):
        PrefixRouter(["a", "a"])
    with pytest.raises(ValueError, match="weights"):
        TierWeights(device=0.5, host=0.7)
    with pytest.raises(ValueError, match="storage"):
        TierWeights(storage=2)
    r = PrefixRouter(["a"])
    with pytest.raises(ValueError, match="engine 'z'"):
        r.apply(batch("z", 0))
    with pytest.raises(TypeError, match="batch"):
        r.apply({"engine": "a"})
    with pytest.raises(TypeError, match="keys"):
        r.route(b"abc")
    with pytest.raises(ValueError, match="loads"):
        r.route(K, {"z": 1})
    r.apply(batch("a", 0))
    with pytest.raises(ValueError, match="seq"):
        r.apply(batch("a", 0))  # a replayed batch


def make_engine(name):
    geom = KVGeometry.mha(2, 4, 1, 2, "float32")
    device, host, engine = make_numpy_backend(geom, 32, 64, "page_first", False)
    cache = HiRadixCache(HiCacheConfig(page_size=4), engine, device.allocator)
    return cache, device, KVEventSource(cache, model="m", engine=name)


def serve(cache, key):
    req, _ = cache.begin_request(key)
    pages = cache.alloc_device(len(key) // 4 - req.device_pages.shape[0])
    req.extend(key, pages)
    cache.cache_finished_req(req)
    cache.check_events()


def test_routes_real_engines_by_their_events():
    engines = {n: make_engine(n) for n in ("e0", "e1")}
    r = PrefixRouter(list(engines))
    for _cache, _dev, src in engines.values():
        src.subscribe(r.apply)
    conv = RadixKey(np.arange(32, dtype=np.int64))
    serve(engines["e1"][0], RadixKey(np.arange(16, dtype=np.int64)))
    keys = engines["e0"][2].request_keys(conv)
    assert keys == engines["e1"][2].request_keys(conv)  # the same keys on every engine
    d = r.route(keys)
    assert (d.engine, d.pages["device"]) == ("e1", 4)
    serve(engines["e0"][0], conv)
    assert r.route(keys).engine == "e0"
    # e0 evicts the conversation from the device; its host copy still counts (write_through).
    cache0 = engines["e0"][0]
    cache0.flush()
    cache0.evict(32)
    cache0.check_events()
    d = r.route(keys)
    assert d.engine == "e0" and d.pages == {"device": 0, "host": 8, "storage": 0}


# ------------------------------------------------------------------ measured tier weights
def test_weights_from_load_cost_are_the_share_of_a_recompute_saved():
    w = TierWeights.from_load_cost(1e-3, host_s_per_token=2e-4, storage_s_per_token=5e-4)
    assert (w.device, w.host, w.storage) == (1.0, pytest.approx(0.8), pytest.approx(0.5))
    # Slower than recomputing: no saving; free: the whole recompute.
    w = TierWeights.from_load_cost(1e-3, host_s_per_token=0.0, storage_s_per_token=3e-3)
    assert (w.host, w.storage) == (1.0, 0.0)
    # A storage page loads through the host: never weighted above it.
    w = TierWeights.from_load_cost(1e-3, host_s_per_token=9e-4, storage_s_per_token=1e-4)
    assert w.storage == pytest.approx(w.host) == pytest.approx(0.1)
    # Nothing measured for a tier: it keeps the base (default) weight.
    assert TierWeights.from_load_cost(1e-3) == TierWeights()
    base = TierWeights(1.0, 0.9, 0.2)
    w = TierWeights.from_load_cost(1e-3, storage_s_per_token=7e-4, base=base)
    assert (w.host, w.storage) == (0.9, pytest.approx(0.3))


def test_weights_from_load_cost_bad_input():
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1", None):
        with pytest.raises(ValueError, match="prefill_s_per_token"):
            TierWeights.from_load_cost(bad)
    with pytest.raises(ValueError, match="host_s_per_token"):
        TierWeights.from_load_cost(1e-3, host_s_per_token=-1e-4)
    with pytest.raises(ValueError, match="storage_s_per_token"):
        TierWeights.from_load_cost(1e-3, storage_s_per_token=float("nan"))
    with pytest.raises(TypeError, match="base"):
        TierWeights.from_load_cost(1e-3, base=(1, 0.5, 0.1))
    r = PrefixRouter(["a"])
    with pytest.raises(TypeError, match="stats"):
        r.set_measured_weights("stats", 1e-3)
    with pytest.raises(ValueError, match="prefill"):
        r.set_measured_weights([], 0)
    assert r.weights == TierWeights()  # nothing changed


def hist(total):
    return {"count": 1, "sum": total, "buckets": {}}


def test_costs_from_stats_sum_over_engines_and_storage_includes_the_load_back():
    a = {
        "load_back_duration_seconds": hist(0.02),
        "load_back_tokens": 100,
        "prefetch_duration_seconds": hist(0.3),
        "prefetched_tokens": 200,
        "storage_read_seconds": 0.05,
    }
    b = {"load_back_duration_seconds": hist(0.01), "load_back_tokens": 200}  # no L3 attached: no prefetch keys
    c = tier_costs_from_stats([a, b])
    assert c["host"] == pytest.approx(0.03 / 300)
    # The store's read time per token read, not the prefetch durations (0.3 s: queries, waits).
    assert c["storage"] == pytest.approx(0.05 / 200 + 0.03 / 300)
    assert tier_costs_from_stats(b)["storage"] is None
    nothing = {"load_back_duration_seconds": hist(0.0), "load_back_tokens": 0}
    assert tier_costs_from_stats(nothing) == {"host": None, "storage": None}


def test_measured_weights_change_the_choice():
    """Default weights: 4 host pages (2.8) beat 2 device pages (2.0). Measured: loading from
    the host costs 60% of a recompute, so 4 host pages score 1.6 and the device engine wins."""
    r = PrefixRouter(["a", "b"])
    r.apply(batch("a", 0, stored("device", K[:2])))
    r.apply(batch("b", 0, stored("host", K[:4])))
    assert r.route(K).engine == "b"
    stats = {"load_back_duration_seconds": hist(0.6), "load_back_tokens": 1000}
    w = r.set_measured_weights(stats, prefill_s_per_token=1e-3)
    assert w.host == pytest.approx(0.4) and w.storage == pytest.approx(0.4)  # storage: capped by host
    d = r.route(K)
    assert d.engine == "a" and d.score == pytest.approx(2.0)
    m = PrefixRouter.from_measured(["a", "b"], stats, 1e-3, balance_abs=4)
    assert m.weights == w and m.balance_abs == 4


def test_a_removal_from_the_shared_store_leaves_every_engines_view():
    r = PrefixRouter(["a", "b"])
    r.apply(batch("a", 0, stored("storage", K[:4])))
    r.apply(batch("b", 0, stored("storage", K[:4])))  # both wrote the same pages to the one L3
    r.apply(batch("b", 1, KVEvent("removed", "storage", tuple(K[2:4]))))  # b's store evicted two
    assert r.route(K).pages["storage"] == 2  # a's report of them no longer counts either
    alone = PrefixRouter(["a", "b"], shared_storage=False)
    alone.apply(batch("a", 0, stored("storage", K[:4])))
    alone.apply(batch("b", 0, KVEvent("removed", "storage", tuple(K[2:4]))))
    assert alone.route(K).pages["storage"] == 4  # separate stores: b's eviction is b's alone


def test_storage_cost_is_the_stores_read_time_not_the_prefetch_durations(tmp_path):
    """A real cache with an L3 store whose ``exists`` is slow: prefetches that find nothing
    still observe a duration (their query), and a prefetch that hits waits for its query too;
    the storage cost is the store's read time per token read, well below the durations per
    token (the ratio that set the measured storage weight to 0)."""
    import time

    from hicache_jax.l3 import StorageController
    from hicache_jax.storage import StorageConfig

    cache, _dev, _src = make_engine("e0")
    ctl = StorageController(
        cache, StorageConfig(backend="memory", prefetch_threshold_tokens=4, prefetch_policy="wait_complete"), model="m"
    )
    try:
        key = RadixKey(np.arange(32, dtype=np.int64))
        serve(cache, key)
        cache.flush()
        assert ctl.flush(10)
        cache.check_events()
        cache.reset()  # device and host empty; L3 keeps the pages
        real = ctl.storage._contains
        ctl.storage._contains = lambda pool, keys: time.sleep(0.05) or real(pool, keys)
        for i in range(4):  # misses: nothing of these is in L3
            ctl.finish_prefetch(ctl.prefetch(RadixKey(np.arange(1000 + 100 * i, 1032 + 100 * i, dtype=np.int64))))
        ctl.finish_prefetch(ctl.prefetch(key))  # a hit: 32 tokens read
        s = cache.stats()
        assert s["prefetched_tokens"] == 32 and s["prefetch_duration_seconds"]["count"] == 5
        cost = tier_costs_from_stats(s)
        assert cost["storage"] == pytest.approx(s["storage_read_seconds"] / 32)  # nothing loaded back yet
        assert s["prefetch_duration_seconds"]["sum"] / 32 > 10 * cost["storage"]
    finally:
        ctl.close()


def test_measured_weights_from_a_real_caches_load_backs():
    cache, _dev, _src = make_engine("e0")
    key = RadixKey(np.arange(32, dtype=np.int64))
    serve(cache, key)
    cache.flush()
    cache.evict(32)
    serve(cache, key)  # loaded back from the host
    cache.flush()
    s = cache.stats()
    assert s["load_back_tokens"] == 32 and s["load_back_duration_seconds"]["sum"] > 0
    cost = tier_costs_from_stats(s)
    assert cost["host"] == pytest.approx(s["load_back_duration_seconds"]["sum"] / 32) and cost["storage"] is None
    prefill = cost["host"] * 4  # a recompute four times dearer than the load
    r = PrefixRouter.from_measured(["e0"], s, prefill)
    assert r.weights.host == pytest.approx(0.75) and r.weights.storage == 0.4  # storage: nothing measured
