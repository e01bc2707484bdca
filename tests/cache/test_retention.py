"""Soft retention (issue 31 part 3): hinted prefixes outlive unhinted ones of similar age,
for a while, within a per-namespace budget, and are still evicted under pressure."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert, small_geom

from hicache_jax.cache import HiCacheConfig, HiRadixCache, NoExchangeAgreement, RadixKey
from hicache_jax.cache.retention import RetentionConfig, RetentionHint, enable_retention


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def seq(start: int, n: int, **ns) -> RadixKey:
    return RadixKey(np.arange(start, start + n, dtype=np.int64), **ns)


def setup(cap=64, bonus=100, device_pages=32, host_pages=64, **kw):
    cache, be = make_cache(numpy_backend_factory, page_size=1, device_pages=device_pages, host_pages=host_pages, **kw)
    clock = Clock()
    ret = enable_retention(cache, RetentionConfig(cap, bonus, clock))
    return cache, be, KVOracle(be), ret, clock


def on_device(cache, key) -> int:
    return cache.peek_prefix(key)[0]


def test_a_retained_prefix_leaves_after_unhinted_ones_of_similar_age_but_still_leaves():
    cache, be, oracle, ret, clock = setup(write_policy="write_back")
    r, a, b = seq(0, 4), seq(100, 4), seq(200, 4)
    for k in (r, a, b):  # r is the oldest
        prefill_insert(cache, oracle, k)
    cache.insert(r, cache.match_prefix(r).device_indices, retain=RetentionHint(seconds=10))
    cache.match_prefix(a)  # the retain re-touched nothing: a and b are still younger than r
    cache.match_prefix(b)
    assert ret.retained_tokens == 4
    cache.evict(4)
    assert on_device(cache, a) == 0 and on_device(cache, r) == 4
    cache.evict(4)
    assert on_device(cache, b) == 0 and on_device(cache, r) == 4
    assert ret.overridden_tokens["device"] == 0
    cache.evict(4)  # under pressure the hint is overridden: no pin
    assert on_device(cache, r) == 0
    assert ret.overridden_tokens["device"] == 4
    cache.sanity_check(0)


def test_the_bonus_is_bounded_younger_unhinted_data_outlives_it():
    cache, be, oracle, ret, clock = setup(bonus=2)
    r = seq(0, 4)
    prefill_insert(cache, oracle, r)
    cache.insert(r, cache.match_prefix(r).device_indices, retain=RetentionHint(seconds=10))
    others = [seq(100 * i, 4) for i in range(1, 6)]
    for k in others:
        prefill_insert(cache, oracle, k)  # each insert is a tick: r's bonus of 2 ticks is passed
    cache.evict(4)
    assert on_device(cache, r) == 0 and on_device(cache, others[0]) == 4


def test_expiry_is_lazy_and_restores_plain_lru_order():
    cache, be, oracle, ret, clock = setup()
    r, a = seq(0, 4), seq(100, 4)
    prefill_insert(cache, oracle, r)
    cache.insert(r, cache.match_prefix(r).device_indices, retain=RetentionHint(seconds=5))
    prefill_insert(cache, oracle, a)
    clock.t = 5.0  # expired; nothing happens until an eviction starts
    assert ret.retained_tokens == 4
    cache.evict(4)
    assert on_device(cache, r) == 0 and on_device(cache, a) == 4
    assert ret.retained_tokens == 0 and ret.expired_tokens == 4 and ret.overridden_tokens["device"] == 0
    cache.sanity_check(0)


def test_a_hint_is_clamped_to_the_namespace_budget_and_namespaces_are_separate():
    cache, be, oracle, ret, clock = setup(cap=6)
    sys_prompt = seq(0, 4)
    long = RadixKey(np.arange(0, 10, dtype=np.int64))
    prefill_insert(cache, oracle, sys_prompt)
    prefill_insert(cache, oracle, long)  # nodes [0,4) and [4,10)
    req, _ = cache.begin_request(long, retain=RetentionHint(seconds=10))
    # [0,4) fits (4 <= 6), [4,10) would make 10 > 6: clamped whole.
    assert ret.retained_tokens == 4 and ret.clamped_hints == 1 and ret.clamped_tokens == 6
    cache.dec_lock_ref(req.last_node)
    other = seq(0, 4, extra_key="tenant-b")
    prefill_insert(cache, oracle, other)
    cache.insert(other, cache.match_prefix(other).device_indices, retain=RetentionHint(seconds=10))
    assert ret.stats()["retained_tokens_by_namespace"] == {"(None, None)": 4, "('tenant-b', None)": 4}
    assert cache.stats()["retention"]["clamped_tokens"] == 6


def test_dropping_a_redundant_host_copy_overrides_no_hint():
    cache, be, oracle, ret, clock = setup()
    k = seq(0, 4)
    prefill_insert(cache, oracle, k)
    cache.insert(k, cache.match_prefix(k).device_indices, retain=RetentionHint(seconds=10))
    cache.flush()  # write_through: backed up, on both tiers
    assert cache.evict_host(4) == 4  # host reclaim drops the copy; the prefix stays on the device
    assert on_device(cache, k) == 4 and cache.host_tokens == 0
    assert ret.overridden_tokens == {"device": 0, "host": 0} and ret.retained_tokens == 4
    cache.evict(4)  # now it leaves its last tier: that overrides the hint
    assert ret.overridden_tokens["device"] == 4 and ret.retained_tokens == 0


def test_the_metrics_families_export_retention_on_stats_and_prometheus():
    """retained_tokens and the retention_* families read the live Retention (absent before
    enable_retention), in stats() and in a Prometheus scrape."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from hicache_jax.cache import register_prometheus

    cache, be, oracle, ret, clock = setup(cap=6)
    a, b = seq(0, 4), seq(100, 8, extra_key="t")
    prefill_insert(cache, oracle, a)
    prefill_insert(cache, oracle, b)
    cache.insert(a, cache.match_prefix(a).device_indices, retain=RetentionHint(seconds=10))
    cache.insert(b, cache.match_prefix(b).device_indices, retain=RetentionHint(seconds=10))  # 8 > cap 6
    cache.flush()
    cache.evict(32)  # a leaves the device with its hint live; b was never retained
    s = cache.stats()
    assert s["retained_tokens"] == 4 and s["retention_hint_calls"] == 2
    assert s["retention_clamped_calls"] == 1 and s["retention_clamped_tokens"] == 8
    assert s["retention_overridden_tokens"] == {"device": 4, "host": 0}
    cache.evict_host(64)  # a leaves its last tier: its budget is free again, host overrode it too
    clock.t = 11.0
    s = cache.stats()
    assert s["retained_tokens"] == 0 and s["retention_overridden_tokens"] == {"device": 4, "host": 4}
    registry = prometheus_client.CollectorRegistry()
    register_prometheus(cache, registry)
    get = registry.get_sample_value
    assert get("hicache_retained_tokens") == 0
    assert get("hicache_retention_clamped_tokens_total") == 8
    assert get("hicache_retention_overridden_tokens_total", {"tier": "device"}) == 4
    assert get("hicache_retention_hint_calls_total") == 2


def test_a_stronger_hint_reorders_the_node_where_it_is_listed():
    cache, be, oracle, ret, clock = setup()
    k = seq(0, 4)
    prefill_insert(cache, oracle, k)
    ids = cache.match_prefix(k).device_indices
    cache.insert(k, ids, retain=RetentionHint(seconds=10, weight=0.5))
    cache.insert(k, ids, retain=RetentionHint(seconds=20, weight=1.0))  # an unlocked device leaf: listed
    (node,) = ret.entries
    assert ret.entries[node].bonus == 100 and ret.entries[node].until == 20
    cache.sanity_check(0)  # its index entry carries the larger bonus


def test_splits_keep_the_budget_and_the_indexes_consistent():
    cache, be, oracle, ret, clock = setup()
    k = seq(0, 8)
    prefill_insert(cache, oracle, k)
    cache.insert(k, cache.match_prefix(k).device_indices, retain=RetentionHint(seconds=10))
    cache.match_prefix(seq(0, 3))  # splits the retained node
    assert ret.retained_tokens == 8 and len(ret.entries) == 2
    cache.sanity_check(0)
    cache.evict(8)
    cache.flush()
    cache.evict_host(64)
    assert ret.retained_tokens == 0 and not ret.entries  # deleted nodes gave their budget back
    cache.sanity_check(0)


def test_bad_input_changes_nothing():
    with pytest.raises(ValueError, match="seconds"):
        RetentionHint(seconds=0)
    with pytest.raises(ValueError, match="weight"):
        RetentionHint(seconds=1, weight=1.5)
    with pytest.raises(TypeError, match="seconds"):
        RetentionHint(seconds=float("nan"))
    with pytest.raises(ValueError, match="max_tokens_per_namespace"):
        RetentionConfig(-1)
    cache, be = make_cache(numpy_backend_factory, page_size=1)
    oracle = KVOracle(be)
    k = seq(0, 4)
    prefill_insert(cache, oracle, k)
    ids = cache.match_prefix(k).device_indices
    with pytest.raises(ValueError, match="retain: retention is not enabled"):
        cache.insert(k, ids, retain=RetentionHint(seconds=1))
    with pytest.raises(ValueError, match="retain: retention is not enabled"):
        cache.begin_request(k, retain=RetentionHint(seconds=1))
    assert cache.protected_tokens == 0  # refused before the match locked anything
    with pytest.raises(TypeError, match="config"):
        enable_retention(cache, {"max_tokens_per_namespace": 4})
    ret = enable_retention(cache, RetentionConfig(8))
    with pytest.raises(TypeError, match="retain: expected a RetentionHint"):
        cache.insert(k, ids, retain=10)
    with pytest.raises(ValueError, match="already enabled"):
        enable_retention(cache, RetentionConfig(8))
    assert ret.hints == 0
    lfu, _ = make_cache(numpy_backend_factory, page_size=1, eviction_policy="lfu")
    with pytest.raises(ValueError, match="LRU"):
        enable_retention(lfu, RetentionConfig(8))
    geom = small_geom(1)
    be2 = numpy_backend_factory(geom, 8, 8)
    ranked = HiRadixCache(
        HiCacheConfig(page_size=1), be2.engine, be2.device.allocator, agreement=NoExchangeAgreement(0, 2)
    )
    with pytest.raises(ValueError, match="several ranks"):
        enable_retention(ranked, RetentionConfig(8))
    assert ranked.retention is None


# ------------------------------------------------------------------ the agent trace
def run_agent_trace(
    retain: bool,
    cap: int,
    device_pages: int = 96,
    host_pages: int = 96,
    seed: int = 0,
    agents: bool = True,
    sessions: int = 16,
) -> dict:
    """Agent sessions (a prompt, then a tool call during which other traffic runs, then the
    session returns with its history + the tool's result) mixed with unhinted chat traffic
    that reuses a few popular prefixes. The agent hints its prompt for the tool call's
    expected length (``retain``); its return carries no hint (the session ends). One request
    per second of the test clock. Returns hit tokens (device + host) per kind of traffic."""
    cache, be = make_cache(numpy_backend_factory, page_size=1, device_pages=device_pages, host_pages=host_pages)
    oracle = KVOracle(be)
    clock = Clock()
    ret = enable_retention(cache, RetentionConfig(cap, 10_000, clock)) if retain else None
    rng = random.Random(seed)
    hits = {"agent": 0, "chat": 0}
    popular = [list(range(50_000 + 1000 * i, 50_000 + 1000 * i + 16)) for i in range(3)]

    def request(tokens: list, kind: str, hint: RetentionHint | None) -> None:
        key = RadixKey(np.array(tokens, np.int64), extra_key="agents" if kind == "agent" else None)
        req, lb = cache.begin_request(key, retain=hint)
        hits[kind] += req.device_hit_tokens + req.host_hit_tokens
        need = len(tokens) - req.device_pages.shape[0]
        pages = cache.alloc_device(need)
        assert pages is not None
        oracle.write(key, pages, req.device_pages.shape[0])
        req.extend(key, pages)
        cache.cache_finished_req(req)
        cache.check_events()
        clock.t += 1.0
        if ret is not None:
            assert ret.by_namespace.get(key.namespace, 0) <= cap

    def chat() -> None:
        base = rng.choice(popular)
        request(base + [rng.randrange(10**6, 2 * 10**6) for _ in range(8)], "chat", None)

    for s in range(1, sessions + 1):
        history = list(range(s * 10_000, s * 10_000 + 32))
        pause = rng.randrange(5, 9)
        if agents:
            request(history, "agent", RetentionHint(seconds=pause + 2) if retain else None)
        for _ in range(pause):  # the tool call: other traffic meanwhile
            chat()
        if agents:
            request(history + list(range(s * 10_000 + 5000, s * 10_000 + 5008)), "agent", None)
    cache.sanity_check(0)
    out = dict(hits)
    if ret is not None:
        out["stats"] = ret.stats()
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_agent_sessions_hit_more_with_retention_and_chat_loses_no_more_than_the_cap_allows(seed):
    cap = 40
    lru = run_agent_trace(False, cap, seed=seed)
    kept = run_agent_trace(True, cap, seed=seed)
    assert kept["agent"] > lru["agent"], (kept, lru)
    # The unhinted traffic does at least as well as the same trace under plain LRU on tiers
    # cap tokens smaller: retention took at most the budget from it.
    floor = run_agent_trace(False, cap, device_pages=96 - cap, host_pages=96 - cap, seed=seed)
    assert kept["chat"] >= floor["chat"], (kept, floor)
    print({"seed": seed, "lru": lru, "retained": kept, "chat_floor": floor["chat"]})


def test_a_tenant_asking_more_than_its_cap_is_clamped_in_the_trace():
    kept = run_agent_trace(True, cap=24)  # every session's 32-token prompt exceeds 24
    s = kept["stats"]
    assert s["clamped_hints"] > 0 and s["clamped_tokens"] > 0


def test_a_requests_hint_covers_its_chunks_and_its_finished_insert():
    cache, be, oracle, ret, clock = setup()
    k = seq(0, 6)
    req, _ = cache.begin_request(seq(0, 0), retain=RetentionHint(seconds=10))
    assert ret.retained_tokens == 0  # nothing cached yet
    pages = cache.alloc_device(4)
    oracle.write(seq(0, 4), pages, 0)
    req.extend(seq(0, 4), pages)
    cache.cache_unfinished_req(req, chunked=True)
    assert ret.retained_tokens == 4
    more = cache.alloc_device(2)
    oracle.write(k, more, 4)
    req.extend(k, more)
    cache.cache_finished_req(req)
    assert ret.retained_tokens == 6 and cache.protected_tokens == 0
    cache.sanity_check(0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    ops=st.lists(
        st.sampled_from(["insert", "hint", "request", "match", "evict", "evict_host", "tick", "flush", "reset"]),
        min_size=1,
        max_size=50,
    ),
)
def test_any_trace_keeps_the_budget_and_the_indexes_exact(seed, ops):
    cache, be, oracle, ret, clock = setup(cap=10, bonus=3, device_pages=24, host_pages=24)
    rng = random.Random(seed)
    keys = [
        RadixKey(
            np.array(
                list(range(100 * f, 100 * f + 4)) + list(range(1000 * f + 10 * t, 1000 * f + 10 * t + 2 + t)), np.int64
            ),
            extra_key=f % 2,
        )
        for f in range(3)
        for t in range(3)
    ]
    for op in ops:
        key = rng.choice(keys)
        hint = RetentionHint(seconds=rng.choice((1, 3, 10)), weight=rng.choice((0.5, 1.0)))
        if op in ("insert", "hint") and cache.device_fit(len(key)).name == "FITS":
            prefill_insert(cache, oracle, key)
            if op == "hint":
                cache.insert(key, cache.match_prefix(key).device_indices, retain=hint)
        elif op == "request":
            req, _lb = cache.begin_request(key, retain=hint)
            pages = cache.alloc_device(len(key) - req.device_pages.shape[0])
            if pages is None:
                if req.last_node is not None:
                    cache.dec_lock_ref(req.last_node)
            else:
                oracle.write(key, pages, req.device_pages.shape[0])
                req.extend(key, pages)
                cache.cache_finished_req(req)
        elif op == "match":
            cache.match_prefix(RadixKey(key.token_ids[: rng.randrange(1, len(key))], extra_key=key.extra_key))
        elif op == "evict":
            cache.evict(rng.randrange(1, 8))
        elif op == "evict_host":
            cache.evict_host(rng.randrange(1, 8))
        elif op == "tick":
            clock.t += rng.choice((0.5, 2.0, 5.0))
        elif op == "flush":
            cache.flush()
        elif op == "reset":
            cache.flush()
            cache.reset()
        cache.check_events()
        cache.sanity_check(0)  # includes every index's keys matching the strategy's (retention bonus)
        live = {n for n in cache.all_nodes() if not n.deleted}
        per_ns = {}
        for node in ret.entries:
            assert node in live and (node.value is not None or node.host_value is not None)
            per_ns[node.namespace] = per_ns.get(node.namespace, 0) + node.size
        assert {k: v for k, v in ret.by_namespace.items() if v} == per_ns
        assert ret.retained_tokens == sum(per_ns.values())  # the running total the metrics read
        assert all(v <= 10 for v in per_ns.values())


def test_sliding_window_evictions_sweep_expired_hints_first():
    """A sliding-window pool short of pages evicts whole leaves on its own (``evict_leaf``,
    ``drop_host_leaf``); an expired hint must be swept before, so its node's eviction counts as
    expired, not as an eviction that overrode a live hint."""
    from swa_harness import SWADriver, make_swa_cache

    cache, full, swa_be, swa = make_swa_cache(device_pages=64, host_pages=64, swa_device_pages=8, swa_host_pages=12)
    drv = SWADriver(cache, full, swa_be, swa)
    clock = Clock()
    ret = enable_retention(cache, RetentionConfig(64, 4, clock))
    a = RadixKey(np.arange(0, 9, dtype=np.int64))
    drv.serve(a)
    req, _lb = cache.begin_request(RadixKey(a.token_ids[:8]), retain=RetentionHint(seconds=5))
    cache.dec_lock_ref(req.last_node)
    assert ret.retained_tokens == 8
    clock.t = 6.0  # expired; no eviction of the full pool runs below (it has room)
    for i in range(1, 8):
        drv.serve(RadixKey(np.arange(100 * i, 100 * i + 9, dtype=np.int64)))
        cache.check_events()
    assert cache.metrics.evict_calls == 0  # only the window's own evictions ran (they must sweep)
    assert swa.metrics.leaf_evictions > 0
    assert ret.expired_tokens == 8 and ret.retained_tokens == 0
    assert ret.overridden_tokens == {"device": 0, "host": 0}
    cache.sanity_check(0)


def test_an_extended_hint_outlives_its_first_deadline():
    """A hint renewed before its time is up stays until the later deadline: the first deadline's
    schedule entry is stale and skipped, not taken as the end."""
    cache, be, oracle, ret, clock = setup()
    r = seq(0, 4)
    prefill_insert(cache, oracle, r)
    ids = cache.match_prefix(r).device_indices
    cache.insert(r, ids, retain=RetentionHint(seconds=5))
    clock.t = 1.0
    cache.insert(r, ids, retain=RetentionHint(seconds=20))  # until 21
    clock.t = 10.0
    ret.expire()
    assert ret.retained_tokens == 4 and ret.expired_tokens == 0
    clock.t = 21.0
    ret.expire()
    assert ret.retained_tokens == 0 and ret.expired_tokens == 4
    cache.sanity_check(0)


def test_a_hint_whose_node_left_the_tree_expires_quietly():
    """The schedule still lists a retained node that pressure evicted from every tier; when its
    time comes it is skipped (nothing is counted twice, nothing raises)."""
    cache, be, oracle, ret, clock = setup(device_pages=8, host_pages=8)
    r = seq(0, 4)
    prefill_insert(cache, oracle, r)
    cache.insert(r, cache.match_prefix(r).device_indices, retain=RetentionHint(seconds=5))
    cache.evict(8)
    cache.evict_host(8)
    assert cache.peek_prefix(r) == (0, 0)  # on no tier
    assert ret.retained_tokens == 0 and ret.scheduled_expiries >= 1
    clock.t = 6.0
    ret.expire()
    assert ret.retained_tokens == 0 and ret.expired_tokens == 0 and ret.scheduled_expiries == 0
    cache.sanity_check(0)
