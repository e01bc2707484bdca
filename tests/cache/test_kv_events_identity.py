"""The model identity of a KV event source comes from the cache's L3 controller: given once
(to ``StorageController``), the source's page keys are the controller's; a different
``model`` / ``weights_revision`` / ``salt`` / TP rank given to the source (which would key
every page otherwise, so a router never joins device/host pages with the L3's) is refused,
before anything is attached."""

from __future__ import annotations

import numpy as np
import pytest
from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert
from test_kv_events import stored_keys

from hicache_jax.cache import RadixKey
from hicache_jax.cache.event_source import KVEventSource
from hicache_jax.cache.radix_key import DEFAULT_NAMESPACE
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig, page_keys

P = 2


def _cache_with_l3(**ctl):
    cache, be = make_cache(
        numpy_backend_factory,
        page_size=P,
        device_pages=16,
        host_pages=24,
        write_through_threshold=1,
        load_back_threshold=1,
    )
    cfg = StorageConfig(backend="memory", prefetch_threshold_tokens=P)
    return cache, be, StorageController(cache, cfg, **{"model": "tiny", **ctl})


def _record_watches(cache, monkeypatch) -> list:
    added = []
    real = cache.add_watch
    monkeypatch.setattr(cache, "add_watch", lambda w: (added.append(w), real(w))[1])
    return added


def test_a_source_on_a_cache_with_l3_is_keyed_as_the_controller_without_repeating_its_identity():
    cache, be, ctl = _cache_with_l3(weights_revision="r2", salt="s")
    try:
        src = KVEventSource(cache, engine="e0")  # no model, revision or salt: the controller's
        src.observe_storage(ctl.storage)
        assert (src.model, src.weights_revision, src.salt) == ("tiny", "r2", "s")
        key = RadixKey(np.arange(8, dtype=np.int64), extra_key="t1")
        assert src.request_keys(key) == page_keys(ctl.key_namespace("target", key.namespace), key.token_ids)
        src.drain()
        prefill_insert(cache, KVOracle(be), key)
        cache.flush()
        assert ctl.flush(10)
        cache.check_events()
        events = src.drain().events
        stored = {k for e in events if e.tier == "storage" and e.kind == "stored" for k in e.keys}
        device = {k for e in events if e.tier == "device" and e.kind == "stored" for k in e.keys}
        assert stored == stored_keys(ctl.storage) == device == set(src.request_keys(key))
        assert {e.model for e in events} == {"tiny"}
        src.close()
        # Repeating the controller's own values is accepted (as before).
        KVEventSource(cache, model="tiny", weights_revision="r2", salt="s").close()
    finally:
        ctl.close()


@pytest.mark.parametrize(
    "arg, value",
    [("model", "other"), ("weights_revision", "r1"), ("weights_revision", ""), ("salt", ""), ("salt", "t")],
)
def test_a_source_given_another_identity_than_the_controller_is_refused_and_attaches_nothing(arg, value, monkeypatch):
    cache, _be, ctl = _cache_with_l3(weights_revision="r2", salt="s")
    try:
        added = _record_watches(cache, monkeypatch)
        with pytest.raises(ValueError, match=rf"^{arg}: .*StorageController"):
            KVEventSource(cache, **{arg: value})
        assert added == []
    finally:
        ctl.close()


def test_a_source_keyed_for_another_tp_rank_than_the_controller_is_refused(monkeypatch):
    cache, _be, ctl = _cache_with_l3()
    try:
        added = _record_watches(cache, monkeypatch)
        with pytest.raises(ValueError, match="^tp_size/tp_rank: "):
            KVEventSource(cache, tp_size=2, tp_rank=1)
        assert added == []
    finally:
        ctl.close()


def test_a_source_built_before_the_controller_is_checked_when_it_observes_its_store(monkeypatch):
    cache, _be = make_cache(numpy_backend_factory, page_size=P)
    src = KVEventSource(cache, model="tiny", weights_revision="r1")
    ctl = StorageController(cache, StorageConfig(backend="memory"), model="tiny", weights_revision="r2")
    try:
        listeners = []
        monkeypatch.setattr(ctl.storage, "add_listener", listeners.append)
        with pytest.raises(ValueError, match="^weights_revision: the source was built with 'r1'.*'r2'"):
            src.observe_storage(ctl.storage)
        assert listeners == [] and src.stats()["storage_changes_queued"] == 0
        src.close()
        ok = KVEventSource(cache, model="tiny")  # before the controller: it sees "r2" as the controller's
        assert ok.weights_revision == "r2"
        ok.close()
    finally:
        ctl.close()


def test_without_a_controller_the_model_is_required():
    cache, _be = make_cache(numpy_backend_factory, page_size=P)
    with pytest.raises(ValueError, match="^model: .*no StorageController"):
        KVEventSource(cache)


def test_key_namespace_refuses_an_unknown_pool_or_a_bad_namespace():
    cache, _be, ctl = _cache_with_l3(salt="s")
    try:
        ns = ctl.key_namespace()
        assert ns == ctl.key_namespace("target", DEFAULT_NAMESPACE) and ns.pool == "target"
        assert ns.extra_key  # the salt
        with pytest.raises(ValueError, match="^pool: "):
            ctl.key_namespace("nope")
        with pytest.raises(TypeError, match="^namespace: "):
            ctl.key_namespace("target", ())
    finally:
        ctl.close()
