"""The public request lifecycle as the README's "own engine" flow uses it: a request begun on a
cached prefix whose pages for the rest cannot be had is aborted; a request's ``retain`` field
is validated like ``priority`` before anything changes. The stateful fuzz of the whole
lifecycle is ``test_request_lifecycle_fuzz``."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert
from test_bad_input import snapshot

from hicache_jax.cache import RadixKey
from hicache_jax.cache.retention import RetentionConfig, RetentionHint, enable_retention


def state(cache, be, req=None):
    """Everything a refused call must leave as it was: the cache (``test_bad_input``'s
    snapshot), the retention entries and counters, and the request's fields."""
    ret = cache.retention
    r = None
    if ret is not None:
        r = (
            sorted((n.id, e.until, e.bonus) for n, e in ret.entries.items()),
            copy.deepcopy(ret.stats()),
            ret.scheduled_expiries,
        )
    q = None
    if req is not None:
        q = (
            req.key.token_ids.tolist(),
            req.device_pages.tolist(),
            req.cached_pages,
            req.last_node,
            req.released,
            req.priority,
            req.retain,
        )
    return snapshot(cache, be), r, q


def own_pages(req) -> int:
    """Device pages the request owns (not the tree's): ``sanity_check``'s external pages."""
    return 0 if req.released else req.device_pages.shape[0] - req.cached_pages


# ---------------------------------------------------------------------------------------------- abort (README flow)
def test_the_readme_flow_aborts_a_request_whose_pages_cannot_be_allocated():
    """Page size 3, 9 tokens cached; a 14-token prompt is begun on ``prompt[:-1]`` (13 tokens,
    3 pages held); ``alloc_device`` finds no room; the caller gives up with ``abort_request``,
    which frees what the request holds and releases its lock."""
    p = 3
    cache, be = make_cache(numpy_backend_factory, page_size=p, device_pages=4, host_pages=16)
    oracle = KVOracle(be)
    prompt = np.arange(14, dtype=np.int64)
    prefill_insert(cache, oracle, RadixKey(prompt[:9]))
    hold = cache.alloc_device(1)  # the one free page is another request's: the device is full
    assert hold is not None
    req, load = cache.begin_request(RadixKey(prompt[:-1]))
    assert load is None and len(req.key) == 13 and req.device_pages.shape[0] == 3 and req.cached_pages == 3
    assert cache.protected_tokens == 9
    assert cache.alloc_device(-(-13 // p) - len(req.device_pages)) is None
    nodes = sorted((n.id, len(n)) for n in cache.all_nodes())
    cache.abort_request(req)
    assert cache.protected_tokens == 0 and cache.evictable_tokens == 9  # the lock is released, the prefix kept
    assert sorted((n.id, len(n)) for n in cache.all_nodes()) == nodes
    assert req.released and req.last_node is None and req.device_pages.size == 0
    be.device.allocator.free(hold)
    cache.sanity_check(0)


def test_abort_of_a_request_holding_part_of_its_own_pages_frees_them():
    """Between ``begin_request`` and a whole ``extend`` the request may hold some own pages:
    those are freed too; ids that are not its own are still refused with nothing changed."""
    p = 2
    cache, be = make_cache(numpy_backend_factory, page_size=p, device_pages=16, host_pages=16)
    prefill_insert(cache, KVOracle(be), RadixKey(np.arange(4)))
    free = be.device.allocator.available
    req, _ = cache.begin_request(RadixKey(np.arange(4)))
    req.key = RadixKey(np.arange(10))  # 5 pages needed; it gets 1 own page of the 3 missing
    req.device_pages = np.concatenate([req.device_pages, cache.alloc_device(1)])
    tree_page = req.device_pages[0]
    bad = copy.copy(req)
    bad.device_pages = np.concatenate([req.device_pages, [tree_page]])
    before = state(cache, be, req)
    with pytest.raises(ValueError, match="not the request's to free"):
        cache.abort_request(bad)
    assert state(cache, be, req) == before
    short = copy.copy(req)
    short.device_pages = req.device_pages[:1]  # fewer pages than its cached_pages
    with pytest.raises(ValueError, match="req.cached_pages"):
        cache.abort_request(short)
    assert state(cache, be, req) == before
    cache.abort_request(req)
    assert be.device.allocator.available == free and cache.protected_tokens == 0
    cache.sanity_check(0)


def test_finishing_a_request_with_too_few_pages_is_still_refused():
    cache, be = make_cache(numpy_backend_factory, page_size=2, device_pages=16, host_pages=16)
    prefill_insert(cache, KVOracle(be), RadixKey(np.arange(4)))
    req, _ = cache.begin_request(RadixKey(np.arange(9)))
    before = state(cache, be, req)
    for call in (cache.cache_finished_req, cache.cache_unfinished_req):
        with pytest.raises(ValueError, match="9 tokens need 5 device pages, it holds 2"):
            call(req)
        assert state(cache, be, req) == before
    cache.abort_request(req)
    cache.sanity_check(0)


# ---------------------------------------------------------------------------------------------- retain
class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def retained_cache():
    cache, be = make_cache(numpy_backend_factory, page_size=2, device_pages=32, host_pages=32)
    enable_retention(cache, RetentionConfig(64, 100, Clock()))
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, RadixKey(np.arange(4)))
    req, _ = cache.begin_request(RadixKey(np.arange(4)), retain=RetentionHint(5))
    req.extend(RadixKey(np.arange(9)), cache.alloc_device(3))
    oracle.write(req.key, req.device_pages, 2)
    return cache, be, req


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (10, TypeError, "req.retain: expected a RetentionHint or None, got int"),
        (10.0, TypeError, "req.retain: expected a RetentionHint or None, got float"),
        ({"seconds": 5}, TypeError, "req.retain: expected a RetentionHint or None, got dict"),
    ],
)
@pytest.mark.parametrize("call", ["cache_finished_req", "cache_unfinished_req", "abort_request"])
def test_a_bad_retain_is_refused_before_anything_changes(bad, exc, match, call):
    cache, be, req = retained_cache()
    req.retain = bad
    before = state(cache, be, req)
    with pytest.raises(exc, match=match):
        getattr(cache, call)(req)
    assert state(cache, be, req) == before  # tree, clock, counters, hint count, the request
    cache.sanity_check(own_pages(req))
    req.retain = RetentionHint(5)  # fixed, the same call goes through
    getattr(cache, call)(req)
    cache.sanity_check(own_pages(req))


@pytest.mark.parametrize("call", ["cache_finished_req", "cache_unfinished_req"])
def test_a_retain_on_a_cache_without_retention_is_refused_like_begin_requests(call):
    cache, be = make_cache(numpy_backend_factory, page_size=2, device_pages=32, host_pages=32)
    prefill_insert(cache, KVOracle(be), RadixKey(np.arange(4)))
    with pytest.raises(ValueError, match="retain: retention is not enabled"):
        cache.begin_request(RadixKey(np.arange(4)), retain=RetentionHint(5))
    req, _ = cache.begin_request(RadixKey(np.arange(4)))
    req.retain = RetentionHint(5)
    before = state(cache, be, req)
    with pytest.raises(ValueError, match="req.retain: retention is not enabled"):
        getattr(cache, call)(req)
    assert state(cache, be, req) == before
    req.retain = None
    getattr(cache, call)(req)
    cache.sanity_check(own_pages(req))


def test_aborting_a_request_begun_on_no_match_ends_it():
    """Found by the lifecycle fuzz: a request begun on nothing cached holds nothing, and its
    abort was a silent no-op that left it open (``released`` False): a later
    ``cache_finished_req`` of it was then accepted."""
    cache, be = make_cache(numpy_backend_factory, page_size=2, device_pages=16, host_pages=16)
    req, _ = cache.begin_request(RadixKey(np.arange(5)))
    assert req.last_node is None and req.device_pages.size == 0
    cache.abort_request(req)
    assert req.released
    req.extend(RadixKey(np.arange(6)), cache.alloc_device(3))
    before = state(cache, be, req)
    with pytest.raises(ValueError, match="already finished or aborted"):
        cache.cache_finished_req(req)
    assert state(cache, be, req) == before
    be.device.allocator.free(req.device_pages)
    cache.sanity_check(0)
