"""Issue 21 points 8, 10 and 11 (the cache's parts): bad input raises ValueError/TypeError
naming the argument, and changes nothing (nodes, locks, access times, counters, metrics,
allocators: compared by snapshot before and after). One test case per input."""

import copy

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, prefill_insert, small_geom
from hicache_jax.allocator import PageAllocator
from hicache_jax.cache import CacheRequest, HiCacheConfig, HiRadixCache, RadixKey

P = 2


def snapshot(cache, be):
    nodes = sorted(
        (
            n.id,
            len(n),
            n.namespace,
            None if n.value is None else n.value.tolist(),
            None if n.host_value is None else n.host_value.tolist(),
            n.lock_ref,
            n.host_lock_ref,
            n.hit_count,
            n.last_access,
        )
        for n in cache.all_nodes()
    )
    view = cache.debug_view()
    return (
        nodes,
        view.counters,
        view.caller_locks,
        be.device.allocator.available,
        be.host.allocator.available,
        view.device_owned.tolist(),
        view.host_owned.tolist(),
        copy.deepcopy(cache.metrics.as_dict()),
        cache.in_flight,
    )


@pytest.fixture
def setup(backend_factory):
    """A cache holding [0, 8) on both tiers and [20, 28) on the host only."""
    cache, be = make_cache(backend_factory, page_size=P, device_pages=32, host_pages=32)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, RadixKey(np.arange(8)))
    prefill_insert(cache, oracle, RadixKey(np.arange(20, 28)))
    cache.flush()
    cache.evict(8)  # LRU: [0, 8) leaves the device, [20, 28) stays
    cache.flush()
    m = cache.match_prefix(RadixKey(np.arange(8)))
    assert m.device_hit_length == 0 and m.host_hit_length == 8
    cache.sanity_check(0)
    return cache, be


def open_request(cache, be):
    """A request on the cached [20, 28) grown to 11 tokens (two fresh pages: one whole, one tail)."""
    req, _ = cache.begin_request(RadixKey(np.arange(20, 28)))
    req.extend(RadixKey(np.r_[np.arange(20, 28), 50, 51, 52]), be.device.allocator.alloc(2))
    return req


def expect_rejected(cache, be, call, exc, match, external=0):
    before = snapshot(cache, be)
    with pytest.raises(exc, match=match):
        call()
    assert snapshot(cache, be) == before
    cache.sanity_check(external)


U64_HIGH = np.array([2**63 + 5, 1], np.uint64)  # wraps negative as int64
TOKEN_CASES = [
    ("2**70", [2**70, 1, 2, 3]),  # was OverflowError inside radix_key
    ("negative", [-1, 1, 2, 3]),
    ("2**32", [2**32, 1]),
    ("uint64 above 2**63", U64_HIGH),
    ("uint64 2**32", np.array([2**32, 1], np.uint64)),
    ("int64 array negative", np.array([5, -7])),
]


@pytest.mark.parametrize(
    "call", ["match_prefix", "peek_prefix", "insert", "begin_request", "backed_up_prefix", "insert_host"]
)
@pytest.mark.parametrize("label, tokens", TOKEN_CASES, ids=[c[0] for c in TOKEN_CASES])
def test_token_ids_outside_uint32_are_refused(setup, call, label, tokens):
    cache, be = setup
    fn = getattr(cache, call)
    args = {"insert": ([0],), "insert_host": ([0], 0)}.get(call, ())
    expect_rejected(cache, be, lambda: fn(tokens, *args), ValueError, r"key: token ids must be in \[0, 2\*\*32\)")


@pytest.mark.parametrize("label, tokens", TOKEN_CASES, ids=[c[0] for c in TOKEN_CASES])
def test_radix_key_refuses_token_ids_outside_uint32(label, tokens):
    with pytest.raises(ValueError, match=r"token_ids: token ids must be in \[0, 2\*\*32\)"):
        RadixKey(tokens)


def test_token_id_bounds_are_inclusive_exclusive(setup):
    cache, be = setup
    key = RadixKey(np.array([0, 2**32 - 1, 2**32 - 1, 0], np.uint64))
    assert key.token_ids.tolist() == [0, 2**32 - 1, 2**32 - 1, 0]
    prefill_insert(cache, KVOracle(be), key)
    assert cache.match_prefix([0, 2**32 - 1, 2**32 - 1, 0]).device_hit_length == 4
    cache.sanity_check(0)


# ---------------------------------------------------------------- flags are bools
@pytest.mark.parametrize("value", [1, 0, None, "yes", 1.0, [True]])
def test_insert_chunked_must_be_a_bool(setup, value):
    cache, be = setup
    pages = be.device.allocator.alloc(1)
    expect_rejected(
        cache,
        be,
        lambda: cache.insert([70, 71], pages, chunked=value),
        TypeError,
        "chunked: expected a bool",
        external=1,
    )


@pytest.mark.parametrize("value", [1, None, "no"])
def test_cache_unfinished_req_chunked_must_be_a_bool(setup, value):
    cache, be = setup
    req = open_request(cache, be)
    expect_rejected(
        cache,
        be,
        lambda: cache.cache_unfinished_req(req, chunked=value),
        TypeError,
        "chunked: expected a bool",
        external=2,
    )


@pytest.mark.parametrize("value", [1, 0, None, "no"])
def test_begin_request_load_back_must_be_a_bool(setup, value):
    cache, be = setup
    # [0, 8) is a host hit: a truthy non-bool used to load it back.
    expect_rejected(
        cache,
        be,
        lambda: cache.begin_request(RadixKey(np.arange(8)), load_back=value),
        TypeError,
        "load_back: expected a bool",
    )


@pytest.mark.parametrize("call", ["writing_check", "loading_check"])
@pytest.mark.parametrize("value", [1, None, "no"])
def test_block_must_be_a_bool(setup, call, value):
    cache, be = setup
    expect_rejected(cache, be, lambda: getattr(cache, call)(block=value), TypeError, "block: expected a bool")


def test_numpy_bools_are_bools(setup):
    cache, be = setup
    cache.writing_check(block=np.bool_(True))
    pages = be.device.allocator.alloc(1)
    cache.insert([70, 71], pages, chunked=np.bool_(False))
    cache.sanity_check(0)


# ---------------------------------------------------------------- mem_quota: validated first
@pytest.mark.parametrize(
    "key", [np.arange(8), np.arange(20, 28), np.arange(40, 48)], ids=["host hit", "device hit", "miss"]
)
@pytest.mark.parametrize("quota, exc", [(-1, ValueError), ("8", TypeError), (True, TypeError), (1.5, TypeError)])
def test_begin_request_mem_quota_is_validated_before_the_match(setup, key, quota, exc):
    """Point 11: the match (access times, counters, a split) used to run before the failure,
    and with no host hit the quota was not validated at all."""
    cache, be = setup
    expect_rejected(cache, be, lambda: cache.begin_request(RadixKey(key[:7]), mem_quota=quota), exc, "mem_quota")


def test_begin_request_bad_priority_changes_nothing(setup):
    cache, be = setup
    expect_rejected(
        cache, be, lambda: cache.begin_request(RadixKey(np.arange(7)), priority=None), TypeError, "priority"
    )


# ---------------------------------------------------------------- requests
def test_cache_finished_req_tail_page_out_of_range(setup):
    """Point 8: was IndexError from indexing the ownership bitmap."""
    cache, be = setup
    req = open_request(cache, be)
    req.device_pages[-1] = 10**6
    expect_rejected(
        cache,
        be,
        lambda: cache.cache_finished_req(req),
        ValueError,
        r"req.device_pages: tail page ids out of range \[0, 32\)",
        external=2,
    )


def test_cache_finished_req_negative_tail_page(setup):
    cache, be = setup
    req = open_request(cache, be)
    tail = int(req.device_pages[-1])
    req.device_pages[-1] = -1
    expect_rejected(
        cache,
        be,
        lambda: cache.cache_finished_req(req),
        ValueError,
        r"req.device_pages: tail page ids out of range",
        external=2,
    )
    req.device_pages[-1] = tail
    cache.cache_finished_req(req)
    cache.sanity_check(0)


@pytest.mark.parametrize("call", ["cache_finished_req", "cache_unfinished_req"])
def test_request_whole_page_out_of_range(setup, call):
    cache, be = setup
    req = open_request(cache, be)
    req.device_pages[4] = 10**6
    expect_rejected(
        cache, be, lambda: getattr(cache, call)(req), ValueError, r"req.device_pages: ids out of range", external=2
    )


@pytest.mark.parametrize("call", ["cache_finished_req", "cache_unfinished_req"])
@pytest.mark.parametrize(
    "field, value, exc, match",
    [
        ("device_pages", None, TypeError, "req.device_pages: expected a 1-D integer array"),
        ("device_pages", [0, 1, 2, 3, 4, 5], TypeError, "req.device_pages: expected a 1-D integer array"),
        ("device_pages", np.zeros(6), TypeError, "req.device_pages: expected a 1-D integer array"),
        ("device_pages", np.zeros((6, 1), np.int64), TypeError, "req.device_pages: expected a 1-D integer array"),
        ("key", None, TypeError, "req.key: expected a RadixKey"),
        ("key", [20, 21], TypeError, "req.key: expected a RadixKey"),
        ("cached_pages", -1, ValueError, "req.cached_pages"),
        ("cached_pages", 99, ValueError, "req.cached_pages"),
        ("cached_pages", None, TypeError, "req.cached_pages"),
        ("priority", None, TypeError, "req.priority"),
    ],
)
def test_request_fields_are_validated(setup, call, field, value, exc, match):
    cache, be = setup
    req = open_request(cache, be)
    setattr(req, field, value)
    expect_rejected(cache, be, lambda: getattr(cache, call)(req), exc, match, external=2)


def test_cache_finished_req_with_a_never_locked_last_node_is_refused(setup):
    """Point 11: a ``last_node`` the caller never locked used to drive lock_ref to -1; the
    caller-lock registry refuses it before anything changes."""
    cache, be = setup
    m = cache.match_prefix(RadixKey(np.arange(20, 28)))
    node = m.last_device_node
    assert node is not cache.root and node.lock_ref == 0
    req = CacheRequest(RadixKey(np.arange(20, 28)), P, m.device_indices.copy(), node, 4)
    expect_rejected(cache, be, lambda: cache.cache_finished_req(req), ValueError, "req.last_node: .* was released")
    assert node.lock_ref == 0
    # Also after a real lock on that node by someone else: the request still did not take it.
    receipt = cache.inc_lock_ref(node)
    cache.dec_lock_ref(receipt)
    expect_rejected(cache, be, lambda: cache.cache_finished_req(req), ValueError, "req.last_node")


# ---------------------------------------------------------------- None where a list is expected
def test_none_page_lists(setup):
    cache, be = setup
    expect_rejected(cache, be, lambda: cache.insert([70, 71], None), TypeError, "device_pages: expected a sequence")
    expect_rejected(
        cache, be, lambda: cache.insert_host([70, 71], None, 0), TypeError, "host_pages: expected a sequence"
    )
    expect_rejected(cache, be, lambda: cache.match_prefix(None), TypeError, "key: expected a sequence")
    expect_rejected(cache, be, lambda: cache.begin_request(None), TypeError, "key: expected a sequence")
    req = CacheRequest(RadixKey([1]), P, np.array([0]))
    with pytest.raises(TypeError, match="new_pages"):
        req.extend(RadixKey([1, 2, 3]), None)


def test_sanity_check_external_pages_is_an_int(setup):
    cache, _ = setup
    with pytest.raises(TypeError, match="external_device_pages"):
        cache.sanity_check("0")
    with pytest.raises(ValueError, match="external_device_pages"):
        cache.sanity_check(-1)


# ---------------------------------------------------------------- constructor
def test_constructor_refuses_the_host_allocator_as_device_allocator(backend_factory):
    be = backend_factory(small_geom(P), 16, 16)  # same sizes: the page-count check cannot tell
    with pytest.raises(ValueError, match="device_allocator: this is the engine's host pool's allocator"):
        HiRadixCache(HiCacheConfig(page_size=P), be.engine, be.host.allocator)
    assert be.host.allocator.used == 0 and be.device.allocator.used == 0


def test_constructor_refuses_an_allocator_that_is_not_the_device_pools(backend_factory):
    be = backend_factory(small_geom(P), 16, 16)
    with pytest.raises(ValueError, match="device_allocator: expected the engine's device pool's allocator"):
        HiRadixCache(HiCacheConfig(page_size=P), be.engine, PageAllocator(16))
    HiRadixCache(HiCacheConfig(page_size=P), be.engine, be.device.allocator).sanity_check(0)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"components": None}, "components: expected a list or tuple"),
        ({"components": "abc"}, "components: expected a list or tuple"),
        ({"sidecars": []}, "sidecars: expected a mapping"),
    ],
)
def test_constructor_collections(backend_factory, kw, match):
    be = backend_factory(small_geom(P), 16, 16)
    with pytest.raises(TypeError, match=match):
        HiRadixCache(HiCacheConfig(page_size=P), be.engine, be.device.allocator, **kw)
