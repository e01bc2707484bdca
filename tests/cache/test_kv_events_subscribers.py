"""KV event delivery to subscribers: one subscriber that raises does not break the stream (the
others still get the batch, the error is counted and logged, the failing subscriber alone gets a
resync next, and one that keeps raising is detached); a callable is subscribed at most once; a
late subscriber starts with a resync; the bounded queue overflows exactly past ``max_pending``;
storage events' ``parent_key`` is null and their pages are folded without a chain."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from cache_harness import make_cache, numpy_backend_factory, prefill_insert
from test_kv_events import MODEL, P, Trace, expected_keys, stored_keys

from hicache_jax.cache import RadixKey
from hicache_jax.cache.event_source import MAX_SUBSCRIBER_FAILURES, KVEventSource
from hicache_jax.cache.events import EventBatch, KVEvent, TierContents
from hicache_jax.routing import PrefixRouter


class Flaky:
    """A subscriber that raises on the batches listed in ``fail_on`` (by delivery count)."""

    def __init__(self, fail_on=(0,)) -> None:
        self.fail_on = set(fail_on)
        self.calls = 0
        self.got: list[EventBatch] = []

    def __call__(self, batch: EventBatch) -> None:
        n = self.calls
        self.calls += 1
        if n in self.fail_on:
            raise RuntimeError(f"subscriber broke on delivery {n}")
        self.got.append(batch)


def test_a_raising_subscriber_does_not_keep_the_batch_from_the_others_and_gets_a_resync(caplog):
    """The issue's scenario: ``subscribe(raises_once); subscribe(router.apply)``, an 8-token
    insert, ``check_events()``: the router still gets the batch (its score is the 4 pages)."""
    t = Trace(20, with_l3=False)
    try:
        src = t.src
        flaky = Flaky(fail_on=(0,))
        router = PrefixRouter(["e0"])
        view = TierContents()
        src.subscribe(flaky)
        src.subscribe(router.apply)
        src.subscribe(view.apply)
        key = RadixKey(np.arange(8, dtype=np.int64))
        prefill_insert(t.cache, t.oracle, key)
        with caplog.at_level(logging.WARNING, logger="hicache_jax.cache.event_source"):
            t.cache.check_events()  # flaky raises: no exception out of check_events
        assert "raised on batch" in caplog.text
        keys = src.request_keys(key)
        assert router.score("e0", keys)[1]["device"] == 4  # the router got the batch
        assert view.keys("device") == expected_keys(t.cache)["device"] and len(keys) == 4
        st = src.stats()
        assert st["subscriber_errors"] == 1 and st["subscribers_detached"] == 0
        # The next step: the failing subscriber alone gets a resync (exact again), the others
        # the plain batch, all with the same seq.
        prefill_insert(t.cache, t.oracle, RadixKey(np.arange(100, 106, dtype=np.int64)))
        n_router = router.views["e0"].last_seq
        t.cache.check_events()
        resync = flaky.got[-1]
        assert resync.resync and resync.seq == router.views["e0"].last_seq == n_router + 1
        mine = TierContents()
        mine.apply(resync)
        assert mine.keys("device") == view.keys("device") == expected_keys(t.cache)["device"]
        assert mine.keys("host") == view.keys("host") == expected_keys(t.cache)["host"]
        t.cache.check_events()  # recovered: plain batches again
        assert not flaky.got[-1].resync and flaky.got[-1].seq == resync.seq + 1
        assert src.subscribers == (flaky, router.apply, view.apply)
    finally:
        t.close()


def test_a_subscriber_that_keeps_raising_is_detached(caplog):
    t = Trace(21, with_l3=False)
    try:
        bad = Flaky(fail_on=range(100))
        good = Flaky(fail_on=())
        t.src.subscribe(bad)
        t.src.subscribe(good)
        with caplog.at_level(logging.WARNING, logger="hicache_jax.cache.event_source"):
            for i in range(MAX_SUBSCRIBER_FAILURES + 2):
                prefill_insert(t.cache, t.oracle, t.keys[i % len(t.keys)])
                t.cache.check_events()
        assert bad.calls == MAX_SUBSCRIBER_FAILURES  # detached after that many in a row
        assert len(good.got) == MAX_SUBSCRIBER_FAILURES + 2
        assert t.src.subscribers == (good,)
        st = t.src.stats()
        assert st["subscriber_errors"] == MAX_SUBSCRIBER_FAILURES and st["subscribers_detached"] == 1
        assert "detached" in caplog.text
    finally:
        t.close()


def test_failures_that_are_not_in_a_row_do_not_detach():
    t = Trace(22, with_l3=False)
    try:
        f = Flaky(fail_on=range(0, 4 * MAX_SUBSCRIBER_FAILURES, 2))  # every other batch
        t.src.subscribe(f)
        for i in range(4 * MAX_SUBSCRIBER_FAILURES):
            prefill_insert(t.cache, t.oracle, t.keys[i % len(t.keys)])
            t.cache.check_events()
        assert t.src.subscribers == (f,) and t.src.stats()["subscribers_detached"] == 0
        assert all(b.resync for b in f.got)  # each good delivery follows a failure: a resync
    finally:
        t.close()


def test_a_failing_subscriber_of_a_source_with_storage_forgets_the_lost_storage_events():
    t = Trace(23)
    try:
        f = Flaky(fail_on=(0,))
        view = TierContents()
        t.src.subscribe(f)
        t.src.subscribe(view.apply)
        for _ in range(4):
            t.do("insert")
        t.do("flush")  # storage events in this step's batch: lost to f
        assert view.keys("storage") == stored_keys(t.ctl.storage) != set()
        t.do("insert")
        t.do("flush")
        mine = TierContents()
        for b in f.got:
            mine.apply(b)
        b = f.got[-1]
        assert b.resync and ("cleared", "storage") in [(e.kind, e.tier) for e in b.events]
        # Under-reports storage (never over-reports); device and host are exact.
        assert mine.keys("storage") <= stored_keys(t.ctl.storage)
        assert mine.keys("device") == view.keys("device") and mine.keys("host") == view.keys("host")
    finally:
        t.close()


def test_subscribing_the_same_callable_twice_is_refused_and_unsubscribe_works():
    t = Trace(24, with_l3=False)
    try:
        router = PrefixRouter(["e0"])
        t.src.subscribe(router.apply)
        with pytest.raises(ValueError, match="fn: .*already subscribed"):
            t.src.subscribe(router.apply)  # an equal bound method: the same subscriber
        assert t.src.subscribers == (router.apply,)  # unchanged
        prefill_insert(t.cache, t.oracle, t.keys[0])
        t.cache.check_events()
        t.cache.check_events()  # (twice subscribed, the second delivery raised "seq 1 is not after 1")
        assert router.views["e0"].last_seq == 2
        t.src.unsubscribe(router.apply)
        assert t.src.subscribers == ()
        with pytest.raises(ValueError, match="fn: .*not subscribed"):
            t.src.unsubscribe(router.apply)
        with pytest.raises(TypeError, match="fn"):
            t.src.subscribe(42)
    finally:
        t.close()


def test_a_subscriber_added_before_the_first_batch_gets_no_extra_resync():
    cache, _be = make_cache(numpy_backend_factory, page_size=P)
    src = KVEventSource(cache, model=MODEL)
    got = []
    src.subscribe(got.append)
    cache.check_events()
    cache.check_events()
    assert [(b.seq, b.resync) for b in got] == [(0, True), (1, False)]
    src.close()


@pytest.mark.parametrize("spare", [0, -1])
def test_the_queue_overflows_exactly_past_max_pending(spare):
    """``max_pending`` events wait without a resync; one more is a resync (an overflow one event
    late, ``> max_pending + 1``, or early, ``>=``, fails here)."""
    cache, be = make_cache(
        numpy_backend_factory, page_size=P, device_pages=20, host_pages=28, write_through_threshold=1
    )
    from cache_harness import KVOracle

    oracle = KVOracle(be)
    # One insert gives 2 events (device and host stored); an eviction of its pages 1 more.
    src = KVEventSource(cache, model=MODEL, max_pending=3 + spare)
    src.drain()
    prefill_insert(cache, oracle, RadixKey(np.arange(6, dtype=np.int64)))
    cache.flush()
    cache.evict(6)
    b = src.drain()
    if spare == 0:
        assert not b.resync and [(e.kind, e.tier) for e in b.events] == [
            ("stored", "device"),
            ("stored", "host"),
            ("removed", "device"),
        ]
        assert src.stats()["resyncs"] == 0
    else:
        assert b.resync and src.stats()["resyncs"] == 1
    src.close()


def test_a_source_needs_a_cache():
    for bad in (None, object(), "cache"):
        with pytest.raises(TypeError, match="cache: expected a HiRadixCache"):
            KVEventSource(bad, model=MODEL)


def test_storage_events_have_no_parent_and_are_folded_without_a_chain():
    """Storage events carry ``parent_key`` None (the store reports keys only, in its own order,
    not one run of one prefix); ``TierContents`` does not chain their keys."""
    t = Trace(25)
    try:
        for _ in range(5):
            t.do("insert")
        t.do("flush")
        t.check()
        evs = [e for e in t.events if e.tier == "storage" and e.kind == "stored"]
        assert evs and all(e.parent_key is None for e in evs)
        assert set(t.view.tiers["storage"].values()) == {None}
    finally:
        t.close()
    view = TierContents()
    view.apply(EventBatch("e", 0, (KVEvent("stored", "storage", (b"a" * 32, b"b" * 32), None, 2 * P),), True))
    assert view.tiers["storage"] == {b"a" * 32: None, b"b" * 32: None}


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("tp", [(1, 0), (2, 1)])
def test_event_keys_are_the_l3_keys_under_tensor_parallelism(kind, tp):
    """The source's namespace is the L3 controller's for the ``target`` pool, also with several
    TP ranks, where an MLA latent (the same on every rank) is keyed rank-independently."""
    from hicache_jax.l3.pools import L3Pools
    from hicache_jax.storage import page_keys

    cache, _be = make_cache(numpy_backend_factory, page_size=P, kind=kind)
    tp_size, tp_rank = tp
    src = KVEventSource(cache, model=MODEL, weights_revision="r1", salt="s", tp_size=tp_size, tp_rank=tp_rank)
    pools = L3Pools(cache.components, model=MODEL, weights_revision="r1", tp_size=tp_size, tp_rank=tp_rank, salt="s")
    key = RadixKey(np.arange(8, dtype=np.int64), extra_key="t1")
    assert src.request_keys(key) == page_keys(pools.namespaces(key.namespace)["target"], key.token_ids)
    src.close()
    if kind == "mla" and tp_size > 1:
        with pytest.raises(ValueError, match="tp_rank"):
            KVEventSource(cache, model=MODEL, tp_size=2, tp_rank=5)  # checked before the rank is dropped
