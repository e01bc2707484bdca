"""Failed KV copies: retried from the still-locked source, or the cache stops.

The numpy engine's ``inject_failures`` makes a copy write random bytes into its destination
and report a TransferError, so a cache that served those pages would return wrong bytes."""

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, node_path_pages, prefill_insert
from hicache_jax.cache import CacheFailedError, HiCacheConfig, RadixKey
from hicache_jax.transfer import TransferError


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


def _cache(backend_factory, **cfg):
    cache, be = make_cache(backend_factory, page_size=2, deferred=True, **cfg)
    if not hasattr(be.engine, "inject_failures"):
        pytest.skip("this backend cannot inject copy failures")
    return cache, be, KVOracle(be)


def _host_round_trip(cache, be, oracle, key):
    """Evict the device copy, load the host copy back, check the bytes."""
    cache.evict(len(key))
    m = cache.match_prefix(key)
    assert m.device_hit_length == 0 and m.host_hit_length == len(key)
    lb = cache.load_back(m.last_host_node)
    be.complete_all()
    cache.loading_check(block=True)
    oracle.check_device(key, lb.device_pages)


@pytest.mark.parametrize("failures", [1, 2])
def test_failed_backup_is_retried_from_the_locked_source(backend_factory, failures):
    cache, be, oracle = _cache(backend_factory)
    key = seq(0, 12)
    be.engine.inject_failures(failures, "backup")
    prefill_insert(cache, oracle, key)
    be.complete_all()  # the first copy wrote garbage into the host pages
    assert cache.writing_check(block=True) == 1
    assert cache.metrics.transfer_retries == failures and cache.metrics.transfer_failures == 0
    oracle.check_host(key, node_path_pages(cache, cache.match_prefix(key).last_device_node, host=True))
    _host_round_trip(cache, be, oracle, key)
    cache.sanity_check(0)


def test_failed_load_back_is_retried_and_its_caller_sees_the_failure(backend_factory):
    cache, be, oracle = _cache(backend_factory)
    key = seq(0, 12)
    prefill_insert(cache, oracle, key)
    be.complete_all()
    cache.flush()
    cache.evict(len(key))
    be.engine.inject_failures(1, "load")
    lb = cache.load_back(cache.match_prefix(key).last_host_node)
    with pytest.raises(TransferError):  # the forward pass waiting on this load learns of it
        lb.wait_layer(0)
    assert cache.loading_check() == 1  # the retry re-copies the host pages
    assert cache.metrics.transfer_retries == 1
    oracle.check_device(key, cache.match_prefix(key).device_indices)
    cache.sanity_check(0)


def test_write_back_eviction_retries_a_failed_copy(backend_factory):
    cache, be, oracle = _cache(backend_factory, write_policy="write_back")
    key = seq(0, 12)
    prefill_insert(cache, oracle, key)
    be.engine.inject_failures(1, "backup")
    assert cache.evict(len(key)) == len(key)  # write_back: the copy happens here
    assert cache.metrics.transfer_retries == 1
    m = cache.match_prefix(key)
    oracle.check_host(key, node_path_pages(cache, m.last_host_node, host=True))
    cache.sanity_check(0)


@pytest.mark.parametrize("kind", ["backup", "load"])
def test_copy_that_keeps_failing_stops_the_cache_until_reset(backend_factory, kind):
    cache, be, oracle = _cache(backend_factory, transfer_retries=1)
    key = seq(0, 12)
    if kind == "backup":
        be.engine.inject_failures(2, "backup")
    prefill_insert(cache, oracle, key)
    if kind == "load":
        be.complete_all()
        cache.flush()
        cache.evict(len(key))
        be.engine.inject_failures(2, "load")
        cache.load_back(cache.match_prefix(key).last_host_node)
        check = cache.loading_check
    else:
        check = cache.writing_check
    be.complete_all()
    with pytest.raises(CacheFailedError, match=f"{'load-back' if kind == 'load' else 'backup'} of 12 tokens"):
        check(block=True)
    assert cache.metrics.transfer_retries == 1 and cache.metrics.transfer_failures == 1
    # Nothing is served any more: not the garbage, not anything else.
    for call in (
        lambda: cache.match_prefix(key),
        lambda: cache.peek_prefix(key),
        lambda: cache.evict(2),
        lambda: cache.evict_host(2),
        lambda: cache.alloc_device(1),
        lambda: cache.begin_request(key),
        cache.flush,
        cache.check_events,
    ):
        with pytest.raises(CacheFailedError):
            call()
    cache.reset()
    assert cache.peek_prefix(key) == (0, 0)
    cache.sanity_check(0)
    prefill_insert(cache, oracle, key)  # usable again, and the bytes are right
    be.complete_all()
    cache.flush()
    _host_round_trip(cache, be, oracle, key)
    cache.sanity_check(0)


@pytest.mark.parametrize("value, exc", [(-1, ValueError), (11, ValueError), (1.5, TypeError), (True, TypeError)])
def test_transfer_retries_validated(value, exc):
    with pytest.raises(exc, match="transfer_retries"):
        HiCacheConfig(transfer_retries=value)
