"""KV events (issue 31 part 1): a trace's events alone rebuild every tier's contents.

After every step of a trace (inserts, hits, splits, requests with load-backs, device
evictions, host demotions and evictions, L3 writes and prefetches, resets) the view folded
from the drained events equals, for device and host, the page keys of the nodes
``debug_view()`` lists on that tier (keys computed here from each node's whole token path,
not by the source's incremental chain), and for storage the keys the store holds.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import replace

import numpy as np
import pytest
from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_jax.cache import RadixKey
from hicache_jax.cache.event_source import KVEventSource, target_namespace
from hicache_jax.cache.events import EventBatch, KVEvent, TierContents
from hicache_jax.cache.radix_key import encode_namespace
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig, page_keys

P = 2
MODEL = "tiny"


def expected_keys(cache, salt: str = "") -> dict[str, set]:
    """Page keys per tier from ``debug_view()``: each node's keys from its root path's tokens."""
    base = target_namespace(cache, MODEL)
    out = {"device": set(), "host": set()}
    root = cache.debug_view().root
    for node in cache.debug_view().nodes():
        if node is root:
            continue
        parts, n = [], node
        while n is not root:
            parts.append(n.key)
            n = n.parent
        toks = np.concatenate(parts[::-1])
        ns = replace(base, extra_key=encode_namespace(salt, node.namespace))
        ks = page_keys(ns, toks)[-(node.size // P) :]
        if node.value is not None:
            out["device"].update(ks)
        if node.host_value is not None:
            out["host"].update(ks)
    return out


def stored_keys(storage) -> set:
    """The ``target`` keys a memory or file store holds, from its own record (not its API)."""
    if storage.backend_name == "memory":
        return {k for (pool, k) in storage._pages if pool == "target"}
    base = os.path.join(storage.root, "target")
    return {
        bytes.fromhex(f[:-3]) for d in os.listdir(base) for f in os.listdir(os.path.join(base, d)) if f.endswith(".kv")
    }


def checked(batch: EventBatch) -> None:
    """Every event of ``batch`` (the source builds device / host events with ``unchecked``) is
    the event the checking constructor builds from its fields."""
    for e in batch.events:
        again = KVEvent(e.kind, e.tier, e.keys, e.parent_key, e.token_count, e.model, e.namespace)
        assert again == e and type(e.keys) is tuple and type(e.token_count) is int, e
        assert all(type(k) is bytes and len(k) == 32 for k in e.keys)
        assert e.parent_key is None or type(e.parent_key) is bytes and len(e.parent_key) == 32


class Trace:
    """A small cache with an L3 (memory store) and an event source; ``do(op)`` runs one step."""

    def __init__(
        self,
        seed: int,
        *,
        device_pages: int = 20,
        host_pages: int = 28,
        max_pending: int = 1 << 16,
        with_l3: bool = True,
        storage: dict | None = None,
    ) -> None:
        self.cache, self.be = make_cache(
            numpy_backend_factory,
            page_size=P,
            device_pages=device_pages,
            host_pages=host_pages,
            write_through_threshold=1,
            load_back_threshold=1,
        )
        self.oracle = KVOracle(self.be)
        self.ctl = None
        if with_l3:
            cfg = StorageConfig(
                **{
                    "backend": "memory",
                    "prefetch_threshold_tokens": P,
                    "prefetch_policy": "wait_complete",
                    **(storage or {}),
                }
            )
            self.ctl = StorageController(self.cache, cfg, model=MODEL)
        self.src = KVEventSource(self.cache, model=MODEL, engine="e0", max_pending=max_pending)
        if with_l3:
            self.src.observe_storage(self.ctl.storage)
        self.view = TierContents()
        self.view.apply(self.src.drain())  # the first batch: a snapshot (of an empty cache here)
        self.events: list = []  # every event check() applied since
        self.rng = random.Random(seed)
        # Conversation families: shared system prompts, two tenants.
        self.keys = []
        for fam in range(3):
            sys_prompt = list(range(1000 * fam, 1000 * fam + 6))
            for turn in range(3):
                toks = sys_prompt + list(
                    range(1000 * fam + 100 + 10 * turn, 1000 * fam + 100 + 10 * turn + 4 + 2 * turn)
                )
                self.keys.append(RadixKey(np.array(toks, np.int64), extra_key="t1" if fam == 2 else None))

    def do(self, op: str) -> None:
        c, rng = self.cache, self.rng
        key = rng.choice(self.keys)
        if op == "insert":
            if c.device_fit(len(key) // P).name == "FITS":
                prefill_insert(c, self.oracle, key)
        elif op == "request":
            req, lb = c.begin_request(key)
            need = len(key) // P - req.device_pages.shape[0]
            pages = c.alloc_device(need)
            if pages is None:
                if req.last_node is not None:
                    c.dec_lock_ref(req.last_node)
            else:
                self.oracle.write(key, pages, req.device_pages.shape[0])
                req.extend(key, pages)
                c.cache_finished_req(req)
        elif op == "match":  # a match ending inside a node splits it
            cut = rng.randrange(1, len(key) // P + 1) * P
            c.match_prefix(RadixKey(key.token_ids[:cut], extra_key=key.extra_key))
        elif op == "evict":
            c.evict(rng.randrange(1, 4) * P)
        elif op == "evict_host":
            c.evict_host(rng.randrange(1, 4) * P)
        elif op == "step":
            c.check_events()
        elif op == "flush":
            c.flush()
            if self.ctl is not None:
                assert self.ctl.flush(10)
            c.check_events()
        elif op == "prefetch" and self.ctl is not None:
            prefetch = self.ctl.prefetch(key)
            self.ctl.finish_prefetch(prefetch)
        elif op == "reset":
            c.flush()
            if self.ctl is not None:
                assert self.ctl.flush(10)
            c.check_events()
            c.reset()

    def check(self, settle: bool = True) -> EventBatch:
        batch = self.src.drain()
        checked(batch)
        self.view.apply(batch)
        self.events += batch.events
        exp = expected_keys(self.cache)
        assert self.view.keys("device") == exp["device"]
        assert self.view.keys("host") == exp["host"]
        if self.ctl is not None:
            # The store reports its changes from the backup thread: while L3 writes are in
            # flight the view lags the store (a subset while nothing is evicted), equal once
            # they are flushed.
            if not self.ctl.storage.config.capacity_bytes:
                assert self.view.keys("storage") <= stored_keys(self.ctl.storage)
            if settle:
                assert self.ctl.flush(10)  # L3 writes done: their events are queued
                more = self.src.drain()
                self.view.apply(more)
                self.events += more.events
                assert all(e.tier == "storage" for e in more.events)
                assert self.view.keys("storage") == stored_keys(self.ctl.storage)
        return batch

    def close(self) -> None:
        self.src.close()
        if self.ctl is not None:
            self.ctl.close()


OPS = ["insert", "insert", "request", "request", "match", "evict", "evict_host", "step", "flush", "prefetch", "reset"]
WEIGHTS = [4, 0, 4, 0, 2, 2, 2, 2, 1, 1, 0.15]


def test_a_fixed_trace_rebuilds_every_tier_after_every_step():
    t = Trace(0)
    kinds = set()
    try:
        for i in range(400):
            op = t.rng.choices(OPS, WEIGHTS)[0]
            t.do(op)
            batch = t.check(settle=i % 4 == 0)
            kinds.update((e.kind, e.tier) for e in batch.events)
            if i % 50 == 0:
                t.cache.sanity_check()
    finally:
        t.close()
    # The trace saw every kind of event the acceptance names.
    assert {
        ("stored", "device"),
        ("removed", "device"),
        ("stored", "host"),
        ("removed", "host"),
        ("stored", "storage"),
        ("cleared", "device"),
        ("cleared", "host"),
    } <= kinds
    m = t.cache.metrics
    assert m.demoted_tokens and m.evicted_host_tokens and m.prefetch_attached_tokens


def test_host_keys_are_the_l3_controllers_keys():
    """The event keys are the L3 controller's page keys: after write-through backups reach L3,
    every host page's key is one the store holds."""
    t = Trace(1)
    try:
        for _ in range(6):
            t.do("insert")
        t.do("flush")
        t.check()
        host = t.view.keys("host")
        assert host and host <= t.view.keys("storage") == stored_keys(t.ctl.storage)
    finally:
        t.close()


def test_order_is_the_order_of_effect_and_split_emits_nothing():
    t = Trace(2, with_l3=False)
    try:
        c = t.cache
        k = t.keys[0]
        prefill_insert(c, t.oracle, k)
        b = t.check()
        assert [(e.kind, e.tier) for e in b.events] == [("stored", "device"), ("stored", "host")]
        assert b.events[0].keys == b.events[1].keys and b.events[0].parent_key is None
        assert b.events[0].token_count == len(k) and b.events[0].namespace == "" and b.events[0].model == MODEL
        c.match_prefix(RadixKey(k.token_ids[:4]))  # splits the node: no page changes tier
        assert t.check().events == ()
        c.flush()
        c.evict(len(k))
        b = t.check()
        # Leaf first, then its parent (demoted: its host copies stay).
        assert [(e.kind, e.tier, e.token_count) for e in b.events] == [
            ("removed", "device", len(k) - 4),
            ("removed", "device", 4),
        ]
        assert b.events[0].parent_key == b.events[1].keys[-1]
    finally:
        t.close()


def test_overflow_resyncs_with_a_snapshot():
    t = Trace(3, max_pending=3, with_l3=False)
    try:
        for _ in range(30):
            t.do(t.rng.choice(["insert", "request", "evict", "evict_host"]))
        b = t.check()  # exact after the resync
        assert b.resync and t.src.stats()["resyncs"] == 1
        assert [e.kind for e in b.events[:2]] == ["cleared", "cleared"]
        t.do("insert")
        assert not t.check().resync
    finally:
        t.close()


def test_subscribers_get_one_batch_per_check_events_and_json_round_trips():
    t = Trace(4, with_l3=False)
    got = []
    try:
        t.src.subscribe(got.append)
        prefill_insert(t.cache, t.oracle, t.keys[1])
        assert got == []
        t.cache.check_events()
        t.cache.check_events()
        assert [b.seq for b in got] == [1, 2] and got[1].events == () and not got[1].resync
        # Subscribed after the source's first batch: its first batch is a resync (it missed seq 0).
        assert got[0].resync and [(e.kind, e.tier) for e in got[0].events] == [
            ("cleared", "device"),
            ("cleared", "host"),
            ("stored", "device"),
            ("stored", "host"),
        ]
        d = json.loads(json.dumps(got[0].to_dict()))
        assert d["schema"] == 1 and d["events"][0]["schema"] == 1
        assert EventBatch.from_dict(d) == got[0]
        with pytest.raises(ValueError, match="schema"):
            KVEvent.from_dict({**d["events"][0], "schema": 2})
        view = TierContents()
        view.apply(got[1])
        with pytest.raises(ValueError, match="seq"):
            view.apply(got[0])
    finally:
        t.close()


def test_unchecked_builds_the_event_the_constructor_builds_and_the_constructor_still_checks():
    k = (b"a" * 32, b"b" * 32)
    fields = ("stored", "host", k, b"c" * 32, 4, MODEL, "")
    e = KVEvent.unchecked(*fields)
    assert e == KVEvent(*fields) and hash(e) == hash(KVEvent(*fields)) and e.to_dict() == KVEvent(*fields).to_dict()
    with pytest.raises(AttributeError):
        e.kind = "removed"  # frozen, as the constructor's
    for bad, exc in (((b"a" * 32, "b"), TypeError), ([b"a", 1], TypeError), ("ab", TypeError)):
        with pytest.raises(exc, match="keys"):
            KVEvent("stored", "device", bad)
    with pytest.raises(TypeError, match="events"):
        EventBatch("e", 0, (e, "x"))
    assert EventBatch("e", 0, [e]).events == (e,)


def test_node_keys_are_kept_as_tuples_and_split_with_the_node():
    t = Trace(5, with_l3=False)
    try:
        k = t.keys[2]  # 14 tokens: 7 pages
        node = prefill_insert(t.cache, t.oracle, k).last_node
        ks = t.src.node_keys(node)
        assert type(ks) is tuple and ks is t.src.node_keys(node)
        assert list(ks) == page_keys(replace(target_namespace(t.cache, MODEL), extra_key=""), k.token_ids)
        t.cache.match_prefix(RadixKey(k.token_ids[:4]))  # splits the node after 2 pages
        upper = t.cache.match_prefix(RadixKey(k.token_ids[:4])).last_device_node
        assert t.src.node_keys(upper) == ks[:2] and t.src.node_keys(node) == ks[2:]
        assert type(t.src.node_keys(upper)) is tuple
    finally:
        t.close()


def test_nothing_is_attached_until_a_source_is_built_and_close_detaches():
    cache, be = make_cache(numpy_backend_factory, page_size=P)
    view = cache.debug_view()
    assert view.watch is None
    src = KVEventSource(cache, model=MODEL)
    assert view.watch is src
    with pytest.raises(ValueError, match="already attached"):
        cache.add_watch(src)
    src.close()
    assert view.watch is None
    with pytest.raises(ValueError, match="not attached"):
        cache.remove_watch(src)
    with pytest.raises(TypeError, match="watch"):
        cache.add_watch(object())
    with pytest.raises(ValueError, match="model"):
        KVEventSource(cache, model="")
    with pytest.raises(ValueError, match="max_pending"):
        KVEventSource(cache, model=MODEL, max_pending=0)
    assert view.watch is None  # a refused source attached nothing


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=40))
def test_any_trace_rebuilds_every_tier(seed, ops):
    t = Trace(seed, device_pages=14, host_pages=18)
    try:
        for i, op in enumerate(ops):
            t.do(op)
            t.check(settle=i % 3 == 0)
        t.cache.sanity_check()
    finally:
        t.close()


def test_storage_events_carry_only_the_target_pools_successful_writes(tmp_path):
    from hicache_jax import HostKVPool, KVGeometry
    from hicache_jax.storage import PoolSpec, create_storage

    cache, be = make_cache(numpy_backend_factory, page_size=P)
    src = KVEventSource(cache, model=MODEL)
    geom = KVGeometry.mha(2, P, 2, 8, "float32")
    pools = {"target": HostKVPool(geom, 4, "page_first"), "draft": HostKVPool(geom, 4, "page_first")}
    store = create_storage(
        StorageConfig(backend="file", path=str(tmp_path)), pools, [PoolSpec("target"), PoolSpec("draft")]
    )
    src.observe_storage(store)
    src.drain()  # the first batch (a snapshot of the empty cache)
    k = [bytes([i]) * 32 for i in range(3)]
    real = store._write_page
    store._write_page = lambda pool, path, key, *a: key != k[1] and real(pool, path, key, *a)  # the 2nd page fails
    assert store.batch_set(k, [0, 1, 2], "target") == [True, False, True]
    store.batch_set(k, [0, 1, 2], "draft")
    b = src.drain()
    # Each page's event when its file lands: writes run in parallel, so in either order.
    assert sorted((e.kind, e.tier, e.keys, e.token_count) for e in b.events) == [
        ("stored", "storage", (k[0],), P),
        ("stored", "storage", (k[2],), P),
    ]
    with pytest.raises(ValueError, match="already observed"):
        src.observe_storage(store)
    with pytest.raises(TypeError, match="add_listener"):
        src.observe_storage(object())
    with pytest.raises(ValueError, match="probe_pages"):
        src.observe_storage(store, probe_pages=-1)
    with pytest.raises(ValueError, match="probe_interval_s"):
        src.observe_storage(store, probe_pages=1, probe_interval_s=float("nan"))
    src.close()
    assert store._notify is None  # detached
    store.close()


def test_a_source_attached_to_a_live_cache_or_restarted_starts_with_a_snapshot():
    t = Trace(5, with_l3=False)
    try:
        for _ in range(12):
            t.do(t.rng.choice(["insert", "request", "evict"]))
        t.check()
        late = KVEventSource(t.cache, model=MODEL, engine="e0")  # attached to a cache holding pages
        first = late.drain()
        assert first.seq == 0 and first.resync and [e.kind for e in first.events[:2]] == ["cleared", "cleared"]
        fresh = TierContents()
        fresh.apply(first)
        exp = expected_keys(t.cache)
        assert fresh.keys("device") == exp["device"] and fresh.keys("host") == exp["host"] and exp["device"]
        # The receiver that followed the old source accepts the new one's seq 0 (a restart).
        t.src.close()
        t.src = late
        t.view.apply(first)
        t.do("insert")
        t.check()
        assert late.stats()["resyncs"] == 0
        with pytest.raises(ValueError, match="seq"):
            t.view.apply(EventBatch("e0", 0, ()))  # seq 0 without a snapshot: a replay
    finally:
        t.close()
