"""Issue 28 point 3 (the cache's parts): inputs that crashed, passed silently or changed state
before failing. Each raises ValueError/TypeError naming the argument (or returns None as
documented) with the cache unchanged: nodes, locks, counters, metrics, allocators (the
``test_bad_input`` snapshot) and ``sanity_check``."""

from __future__ import annotations

import numpy as np
import pytest
from cache_harness import KVOracle, make_cache, prefill_insert
from rank_threads import ThreadGroup, run_ranks
from rank_trace import rank_cache
from swa_harness import make_swa_cache
from test_bad_input import expect_rejected, open_request, setup, snapshot  # noqa: F401 (setup: a fixture)

from hicache_jax.cache import (
    NoExchangeAgreement,
    RadixKey,
    RankDivergenceError,
    SingleProcessAgreement,
    register_prometheus,
)


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


# ---------------------------------------------------------------------------------------------- metrics labels
def test_a_label_value_of_none_is_refused(setup):
    prometheus_client = pytest.importorskip("prometheus_client")
    cache, be = setup
    registry = prometheus_client.CollectorRegistry()
    for bad in (None, 1.5, True, ["0"]):
        expect_rejected(
            cache,
            be,
            lambda: register_prometheus(cache, registry, labels={"rank": bad}),
            TypeError,
            "labels: the value of 'rank'",
        )
    assert list(registry.collect()) == []  # nothing registered
    register_prometheus(cache, registry, labels={"rank": 0})  # an int is a fine value
    assert registry.get_sample_value("hicache_backup_tokens_total", {"rank": "0"}) is not None


def test_the_same_label_names_in_another_order_are_accepted(backend_factory):
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    a, be_a = make_cache(backend_factory)
    b, be_b = make_cache(backend_factory)
    register_prometheus(a, registry, labels={"cache": "target", "rank": "0"})
    register_prometheus(b, registry, labels={"rank": "1", "cache": "draft"})
    prefill_insert(a, KVOracle(be_a), seq(0, 6))
    prefill_insert(b, KVOracle(be_b), seq(0, 4))
    a.flush()
    b.flush()
    get = registry.get_sample_value
    assert get("hicache_backup_tokens_total", {"cache": "target", "rank": "0"}) == 6
    assert get("hicache_backup_tokens_total", {"cache": "draft", "rank": "1"}) == 4  # values follow their names


# ---------------------------------------------------------------------------------------------- requests
def test_a_request_of_another_cache_is_refused(setup, backend_factory):
    cache, be = setup
    other, other_be = make_cache(backend_factory, page_size=2, device_pages=32, host_pages=32)
    prefill_insert(other, KVOracle(other_be), seq(20, 8))
    foreign = open_request(other, other_be)  # holds other's pages and lock
    for call in (
        lambda: cache.cache_finished_req(foreign),
        lambda: cache.abort_request(foreign),
        lambda: cache.cache_unfinished_req(foreign),
    ):
        expect_rejected(cache, be, call, ValueError, "another cache")
    other.cache_finished_req(foreign)  # its own cache takes it
    other.sanity_check(0)


def test_finishing_a_request_twice_says_it_is_finished(setup):
    cache, be = setup
    req = open_request(cache, be)
    cache.cache_finished_req(req)
    cache.sanity_check(0)
    expect_rejected(cache, be, lambda: cache.cache_finished_req(req), ValueError, "already finished")
    expect_rejected(cache, be, lambda: cache.cache_unfinished_req(req), ValueError, "already finished")
    before = snapshot(cache, be)
    cache.abort_request(req)  # a documented no-op: it holds nothing
    assert snapshot(cache, be) == before
    req2 = open_request(cache, be)
    cache.abort_request(req2)
    expect_rejected(cache, be, lambda: cache.cache_finished_req(req2), ValueError, "already finished")


# ---------------------------------------------------------------------------------------------- allocation
def test_an_allocation_that_can_never_fit_evicts_nothing(setup):
    cache, be = setup
    assert cache.evictable_tokens == 8  # [20, 28) on the device, unlocked
    for n in (10**9, be.device.allocator.num_pages + 1):
        before = snapshot(cache, be)
        assert cache.alloc_device(n) is None
        assert snapshot(cache, be) == before and cache.evictable_tokens == 8
        cache.sanity_check(0)
    got = cache.alloc_device(be.device.allocator.num_pages)  # the whole pool: evicts, and fits
    assert got is not None and cache.evictable_tokens == 0
    be.device.allocator.free(got)


def test_an_swa_allocation_that_can_never_fit_evicts_nothing():
    cache, full, swa_be, swa = make_swa_cache(
        page_size=2, window=5, device_pages=24, host_pages=48, swa_device_pages=12, swa_host_pages=24
    )
    n = 8
    pages = cache.alloc_device(n // 2)
    ids = cache.alloc_component("swa", n // 2)
    cache.insert(seq(0, n), pages, component_pages={"swa": ids.astype(np.int32)})
    cache.flush()
    used, stats = swa.device_allocator.used, cache.stats()
    for bad in (10**6, swa.device_allocator.num_pages + 1):
        assert cache.alloc_component("swa", bad) is None
        assert swa.device_allocator.used == used and swa.metrics.tombstoned_tokens == 0
        assert swa.metrics.leaf_evictions == 0 and cache.stats() == stats
        cache.sanity_check(0, {"swa": 0})
    got = cache.alloc_component("swa", swa.device_allocator.num_pages)  # fits after evicting
    assert got is not None
    swa.device_allocator.free(got)


# ---------------------------------------------------------------------------------------------- agreement
@pytest.mark.parametrize("agreement", [SingleProcessAgreement(), NoExchangeAgreement(0, 1)], ids=repr)
def test_agree_min_needs_a_1d_integer_vector(agreement):
    with pytest.raises(ValueError, match=r"values: expected a 1-D vector .* shape \(2, 3\)"):
        agreement.agree_min(np.zeros((2, 3), np.int64))
    with pytest.raises(TypeError, match="values: expected a 1-D integer vector"):
        agreement.agree_min(np.zeros(3, np.float64))
    assert agreement.agree_min(np.arange(3)).tolist() == [0, 1, 2]


def test_kvstore_agree_min_needs_a_1d_vector_before_it_posts_anything():
    from hicache_jax.distributed.agreements import KVStoreAgreement

    class Client:  # records what the agreement would post
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            return lambda *a, **kw: self.calls.append(name)

    client = Client()
    ag = KVStoreAgreement("t", client=client, rank=0, num_processes=2)
    with pytest.raises(ValueError, match=r"values: expected a 1-D vector .* shape \(2, 3\)"):
        ag.agree_min(np.zeros((2, 3), np.int64))
    assert client.calls == [] and ag.calls == 0


def test_an_exchange_that_fails_gives_back_the_steps_reservations():
    """A participant on one rank reports an extra value: every rank's exchange raises
    (RankDivergenceError, an AgreementError) after the backup participant reserved host pages
    in ``prepare``. Nothing stays reserved: ``sanity_check`` is clean right after, the host
    allocator is where it was, and the backup is committed at the next good step."""
    group = ThreadGroup(2, timeout=30)

    class Extra:
        def prepare(self):
            pass

        def report(self, out):
            out.append(5)

        def apply(self, agreed):
            pass

    def rank(r):
        cache, be, _ = rank_cache(group.agreement(r))
        prefill_insert(cache, KVOracle(be), seq(0, 8))  # a backup is wanted: reserved at the next step
        host_used, failed = cache.host_allocator.used, cache.metrics.backup_failed_tokens
        extra = Extra()
        if r == 1:
            cache.step_agreement.add(extra)
        with pytest.raises(RankDivergenceError, match="different agreement vectors"):
            cache.check_events()
        out = [cache.host_allocator.used == host_used, cache.metrics.backup_failed_tokens == failed]
        cache.sanity_check(0)
        cache.step_agreement.remove(extra)
        cache.check_events()  # a good step: reserved, agreed, committed
        cache.flush()
        cache.sanity_check(0)
        return out + [cache.host_tokens]

    assert run_ranks(group, rank) == [[True, True, 8]] * 2
