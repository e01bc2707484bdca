"""What a new user of the cache meets (issue 29): the owner-thread check, the request helpers
(``abort_request``, hits by tier on the request, ``device_fit``), an idle cache's gauges, the
``build_info`` metric."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, prefill_insert
from hicache_jax.cache import DeviceFit, HiCacheConfig, OwnerThreadError, RadixKey
from hicache_jax.cache.call_gate import REFUSED_AFTER_FAILURE


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


def on_thread(fn, *args, **kwargs):
    """Run ``fn`` on a new thread; its result, or the exception it raised."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    t = threading.Thread(target=run, name="not-the-owner")
    t.start()
    t.join(30)
    return out.get("error", out.get("value"))


# ---------------------------------------------------------------- owner thread
def test_a_call_from_another_thread_raises_naming_the_rule_and_changes_nothing(backend_factory):
    cache, be = make_cache(backend_factory, page_size=2)
    prefill_insert(cache, KVOracle(be), seq(0, 8))  # the test's thread is now the owner
    before = (cache.metrics.match_calls, cache.evictable_tokens, cache.protected_tokens, be.device.allocator.available)
    err = on_thread(cache.begin_request, seq(0, 8))
    assert isinstance(err, OwnerThreadError), err
    msg = str(err)
    assert "begin_request" in msg and "not-the-owner" in msg and "MainThread" in msg
    assert "one thread" in msg and "release_owner" in msg and "check_owner_thread=False" in msg
    after = (cache.metrics.match_calls, cache.evictable_tokens, cache.protected_tokens, be.device.allocator.available)
    assert after == before
    cache.sanity_check(0)


def test_every_call_that_changes_the_cache_is_checked_before_its_arguments(backend_factory):
    cache, _ = make_cache(backend_factory)
    cache.check_events()  # binds the owner
    n_args = {
        "match_prefix": 1,
        "peek_prefix": 1,
        "insert": 2,
        "insert_host": 3,
        "inc_lock_ref": 1,
        "dec_lock_ref": 1,
        "alloc_device": 1,
        "evict": 1,
        "evict_host": 1,
        "load_back": 1,
        "begin_request": 1,
        "cache_unfinished_req": 1,
        "cache_finished_req": 1,
        "alloc_component": 2,
        "reserve_component_host_pages": 2,
        "reserve_component_host_pages_agreed": 2,
        "slide_window": 1,
        "abort_request": 1,
        "device_fit": 1,
    }
    for name in [*REFUSED_AFTER_FAILURE, "reset", "device_fit", "release_owner"]:
        method = getattr(cache, name)
        err = on_thread(method, *([None] * n_args.get(name, 0)))  # bad arguments: the thread check comes first
        assert isinstance(err, OwnerThreadError), (name, err)
        assert name in str(err)


def test_the_owner_is_the_first_caller_not_the_constructing_thread(backend_factory):
    cache, be = make_cache(backend_factory)  # built on this thread
    assert cache.owner_thread is None
    res = on_thread(lambda: (prefill_insert(cache, KVOracle(be), seq(0, 4)), cache.owner_thread)[1])
    assert isinstance(res, int) and res != threading.get_ident()
    with pytest.raises(OwnerThreadError, match="match_prefix"):
        cache.match_prefix(seq(0, 4))
    # Read-only snapshots are not checked (a Prometheus scrape runs on its own thread).
    assert cache.stats()["device_used_tokens"] == 4 and cache.gauges()["device_used_tokens"] == 4


def test_release_owner_hands_the_cache_to_the_next_caller(backend_factory):
    cache, _ = make_cache(backend_factory)
    cache.check_events()
    assert isinstance(on_thread(cache.check_events), OwnerThreadError)
    cache.release_owner()
    assert on_thread(cache.check_events) is None  # the worker became the owner ...
    with pytest.raises(OwnerThreadError):
        cache.check_events()  # ... and the test's thread no longer is


def test_the_check_can_be_turned_off(backend_factory):
    cache, be = make_cache(backend_factory, check_owner_thread=False)
    prefill_insert(cache, KVOracle(be), seq(0, 4))
    assert on_thread(cache.match_prefix, seq(0, 4)).device_hit_length == 4
    assert cache.match_prefix(seq(0, 4)).device_hit_length == 4
    with pytest.raises(TypeError, match="check_owner_thread"):
        HiCacheConfig(check_owner_thread=1)


def test_check_owner_guards_a_callers_own_entry_points(backend_factory):
    cache, _ = make_cache(backend_factory)
    cache.check_owner("StorageController.prefetch")  # binds
    err = on_thread(cache.check_owner, "StorageController.prefetch")
    assert isinstance(err, OwnerThreadError) and str(err).startswith("StorageController.prefetch:")


# ---------------------------------------------------------------- request helpers
def test_abort_request_frees_what_the_request_holds_and_inserts_nothing(backend_factory):
    p = 2
    cache, be = make_cache(backend_factory, page_size=p, device_pages=16)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 4 * p))  # 4 cached pages
    nodes_before = sorted((n.id, len(n)) for n in cache.all_nodes())
    free_before = be.device.allocator.available
    req, _ = cache.begin_request(seq(0, 4 * p))
    assert cache.protected_tokens == 4 * p
    longer = RadixKey(np.concatenate([np.arange(4 * p), np.arange(100, 100 + 3 * p + 1)]).astype(np.int64))
    pages = cache.alloc_device(4)
    req.extend(longer, pages)
    oracle.write(longer, pages, 4)
    cache.abort_request(req)
    assert be.device.allocator.available == free_before  # its 4 own pages are free again
    assert cache.protected_tokens == 0 and cache.evictable_tokens == 4 * p  # lock released, cache kept
    assert sorted((n.id, len(n)) for n in cache.all_nodes()) == nodes_before  # nothing inserted
    assert req.last_node is None and req.device_pages.size == 0 and req.cached_pages == 0
    cache.abort_request(req)  # emptied: a second abort does nothing
    assert be.device.allocator.available == free_before
    cache.sanity_check(0)


def test_abort_request_refuses_pages_that_are_not_the_requests(backend_factory):
    cache, be = make_cache(backend_factory, page_size=1, device_pages=16)
    prefill_insert(cache, KVOracle(be), seq(0, 4))
    req, _ = cache.begin_request(seq(0, 4))
    tree_page = int(req.device_pages[0])
    req.extend(seq(0, 5), np.array([tree_page]))  # a tree page passed off as the request's own
    free = be.device.allocator.available
    with pytest.raises(ValueError, match="not the request's to free"):
        cache.abort_request(req)
    assert be.device.allocator.available == free and cache.protected_tokens == 4  # nothing changed
    req.device_pages = req.device_pages[:4]
    req.key = seq(0, 4)
    cache.abort_request(req)
    cache.sanity_check(0)


def test_the_request_carries_its_hit_tokens_by_tier(backend_factory):
    p = 2
    cache, be = make_cache(backend_factory, page_size=p, device_pages=32, host_pages=64, load_back_threshold=0)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 6 * p))  # write_through: backed up to the host
    cache.flush()
    cache.match_prefix(seq(0, 4 * p))  # splits the node after 4 pages
    cache.evict(2 * p)  # the last 2 pages leave the device, stay on the host
    # L3, as the StorageController does it: host pages read from storage, attached after the path.
    key = RadixKey(np.concatenate([np.arange(6 * p), np.arange(500, 500 + 3 * p)]).astype(np.int64))
    host = cache.reserve_host_pages(3)
    attached, _ = cache.insert_host(key, host, 6 * p)
    assert attached == 3 * p
    before = cache.stats()["cached_tokens"]
    req, lb = cache.begin_request(key)
    assert lb is not None
    assert req.hit_tokens == {"device": 4 * p, "host": 2 * p, "storage": 3 * p}
    assert (req.device_hit_tokens, req.host_hit_tokens, req.storage_hit_tokens) == (4 * p, 2 * p, 3 * p)
    after = cache.stats()["cached_tokens"]
    assert {k: after[k] - before[k] for k in after} == req.hit_tokens  # the same split as the metric
    cache.flush()
    cache.cache_finished_req(req)
    req2, _ = cache.begin_request(key)  # everything on the device now
    assert req2.hit_tokens == {"device": 9 * p, "host": 0, "storage": 0}
    cache.abort_request(req2)


def test_device_fit_says_whether_a_failed_allocation_can_ever_succeed(backend_factory):
    cache, be = make_cache(backend_factory, page_size=1, device_pages=8)
    oracle = KVOracle(be)
    assert cache.device_fit(8) is DeviceFit.FITS
    assert cache.device_fit(9) is DeviceFit.TOO_LARGE and cache.alloc_device(9) is None
    prefill_insert(cache, oracle, seq(0, 6))
    assert cache.device_fit(8) is DeviceFit.FITS  # 2 free + 6 evictable
    req, _ = cache.begin_request(seq(0, 6))  # locks the 6 pages
    assert cache.device_fit(3) is DeviceFit.FULL_NOW and cache.alloc_device(3) is None
    assert cache.device_fit(2) is DeviceFit.FITS
    cache.abort_request(req)
    assert cache.device_fit(3) is DeviceFit.FITS and cache.alloc_device(3) is not None
    with pytest.raises(TypeError, match="num_pages"):
        cache.device_fit("3")


# ---------------------------------------------------------------- idle gauges
def test_an_idle_cache_shows_nothing_in_flight_once_its_copies_are_done(backend_factory):
    cache, be = make_cache(backend_factory, page_size=2, deferred=True)
    prefill_insert(cache, KVOracle(be), seq(0, 10))  # write_through: a backup in flight, locked
    g = cache.gauges()
    assert g["backups_in_flight"] == 1 and g["device_protected_tokens"] == 10  # the copy is still running
    be.complete_all()  # the copy finishes; the engine goes idle: no check_events
    # A read on another thread (a Prometheus HTTP server's) changes nothing ...
    g = on_thread(cache.gauges)
    assert g["backups_in_flight"] == 1 and g["device_protected_tokens"] == 10
    # ... the owner's read acknowledges what finished first.
    s = cache.stats()
    assert s["in_flight_operations"]["backup"] == 0 and s["device_protected_tokens"] == 0
    assert s["backup_tokens"] == 10
    cache.sanity_check(0)


def test_an_idle_cache_exports_zero_in_flight_through_prometheus(backend_factory):
    prometheus_client = pytest.importorskip("prometheus_client")
    from hicache_jax.cache import register_prometheus

    cache, be = make_cache(backend_factory, page_size=2, deferred=True)
    reg = prometheus_client.CollectorRegistry()
    register_prometheus(cache, reg, labels={"cache": "main"})
    prefill_insert(cache, KVOracle(be), seq(0, 10))
    be.complete_all()
    sample = reg.get_sample_value
    assert sample("hicache_in_flight_operations", {"cache": "main", "operation": "backup"}) == 0
    assert sample("hicache_device_protected_tokens", {"cache": "main"}) == 0


# ---------------------------------------------------------------- build_info
def test_build_info_names_version_backend_and_platform(backend_factory):
    prometheus_client = pytest.importorskip("prometheus_client")
    import hicache_jax
    from hicache_jax.cache import register_prometheus

    cache, _ = make_cache(backend_factory)
    assert cache.build_info == {"version": hicache_jax.__version__, "backend": "numpy", "platform": "host"}
    assert cache.stats()["build_info"] == {f"{hicache_jax.__version__}/numpy/host": 1}
    reg = prometheus_client.CollectorRegistry()
    register_prometheus(cache, reg)
    labels = {"version": hicache_jax.__version__, "backend": "numpy", "platform": "host"}
    assert reg.get_sample_value("hicache_build_info", labels) == 1


# ---------------------------------------------------------------- class docstrings
def test_the_classes_a_user_builds_say_how_to_use_them():
    from hicache_jax.cache import HiRadixCache

    doc = HiRadixCache.__doc__
    for call in (
        "begin_request",
        "alloc_device",
        "device_fit",
        "cache_finished_req",
        "abort_request",
        "check_events",
        "hit_tokens",
        "owner",
        "CacheFailedError",
    ):
        assert call in doc, f"HiRadixCache's docstring does not mention {call}"
    pytest.importorskip("jax")
    from hicache_jax.backends.jax import JaxDevicePool, JaxTransferEngine

    assert JaxDevicePool.__doc__ and all(w in JaxDevicePool.__doc__ for w in ("allocator", "apply", "thread"))
    assert all(w in JaxTransferEngine.__doc__ for w in ("HiRadixCache", "precompile", "close", "thread"))


# ---------------------------------------------------------------- metric HELP
def test_backup_and_written_metrics_say_what_each_counts():
    """``storage_backup_tokens`` (accepted by the store) and ``storage_written_pages`` (made
    durable) differ on a buffering backend: an operator seeing 96 vs 0 must read why."""
    from hicache_jax.cache.metrics import FAMILIES

    helps = {f.name: f.help for f in FAMILIES}
    assert "accepted" in helps["storage_backup_tokens"] and "storage_written_pages" in helps["storage_backup_tokens"]
    assert "durable" in helps["storage_written_pages"] and "lags" in helps["storage_written_pages"]
    assert "check_events" in helps["in_flight_operations"]
    assert "copies in flight" in helps["device_protected_tokens"]


def test_abort_request_frees_a_sliding_window_requests_own_pages_of_both_pools():
    from swa_harness import SWADriver, make_swa_cache

    cache, full, swa_be, swa = make_swa_cache(
        page_size=2, window=5, device_pages=60, host_pages=120, swa_device_pages=30, swa_host_pages=60
    )
    drv = SWADriver(cache, full, swa_be, swa)
    k1 = drv.serve(RadixKey(np.arange(1, 19)), chunk=6)
    cache.flush()
    free = (cache.device_allocator.available, swa.device_allocator.available)
    req, _ = drv.admit(RadixKey(np.concatenate([k1.token_ids, [70, 71, 72, 73, 74, 75, 76]])))
    assert drv.extend(req, RadixKey(np.concatenate([k1.token_ids, np.arange(200, 209)])))
    own_full, own_swa = SWADriver.own_pages(req)
    assert own_full > 0 and own_swa > 0  # pages of both pools outside the tree
    cache.abort_request(req)
    assert (cache.device_allocator.available, swa.device_allocator.available) == free
    assert cache.protected_tokens == 0
    cache.sanity_check(0, {"swa": 0})
