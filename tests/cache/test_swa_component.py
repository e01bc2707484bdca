"""The SWA component in the tree, by behaviour: tombstones on insert, the usable-prefix rule
(device and any-tier anchors), window holds, per-component eviction, L2 backup and window
load-back, the request call sequence (``SWADriver``), pool accounting and bad input.

Every byte served is checked against the shadow model of both pools (``swa_harness``)."""

from __future__ import annotations

import numpy as np
import pytest
from swa_harness import SWADriver, insert_with_frontier, make_swa_cache

from hicache_jax.cache import CacheRequest, RadixKey
from hicache_jax.cache.components import SWAComponent


def key(*parts):
    return RadixKey(np.concatenate([np.asarray(p, np.int64) for p in parts]))


def setup(**kw):
    cache, full, swa_be, swa = make_swa_cache(**kw)
    return cache, SWADriver(cache, full, swa_be, swa), swa


def states(cache, swa, k):
    """(node size, has SWA dev, has SWA host) along ``k``'s matched path, root first."""
    out = []
    node = cache.match_prefix(k).last_host_node
    path = []
    while node is not cache.root:
        path.append(node)
        node = node.parent
    for n in reversed(path):
        st = swa.state(n)
        out.append((len(n), st is not None and st.dev is not None, st is not None and st.host is not None))
    return out


def insert_with_swa(cache, drv, k, frontier_page=0):
    """Raw insert of ``k``'s whole pages with full pages and SWA pages from ``frontier_page`` on."""
    return insert_with_frontier(cache, drv, k, frontier_page)


# ---------------------------------------------------------------- insert
def test_insert_makes_out_of_window_spans_tombstones_and_caps_the_window_leaf():
    cache, drv, swa = setup(page_size=2, window=6, device_pages=40, swa_device_pages=20)  # window: 3 pages
    k = key(np.arange(20))
    insert_with_swa(cache, drv, k, frontier_page=4)  # pages 0..3 out of the window, 4..9 in
    # [0, 8) a tombstone (nothing to back up either), [8, 14) SWA (the leaf's upper part after
    # the cap), [14, 20) the capped leaf; write_through backed the SWA pages up with the full ones
    assert states(cache, swa, k) == [(8, False, False), (6, True, True), (6, True, True)]
    cache.sanity_check(0, {"swa": 0})
    m = cache.match_prefix(k)
    assert m.device_hit_length == 20
    # A match is usable only where the W - 1 = 5 tokens before its end have SWA KV.
    assert cache.match_prefix(RadixKey(np.arange(10))).device_hit_length == 0  # [5, 10) crosses the tombstone
    assert cache.match_prefix(RadixKey(np.arange(12))).device_hit_length == 0  # [7, 12): one token short
    assert cache.match_prefix(RadixKey(np.arange(14))).device_hit_length == 14


def test_a_path_without_tombstones_is_usable_at_any_length():
    cache, drv, swa = setup(page_size=2, window=8)
    k = key(np.arange(12))
    insert_with_swa(cache, drv, k)
    for n in (2, 4, 6, 8, 12):
        assert cache.match_prefix(RadixKey(np.arange(n))).device_hit_length == n
    cache.sanity_check(0, {"swa": 0})


def test_insert_over_a_tombstone_recovers_only_the_in_window_part_and_frees_duplicates():
    cache, drv, swa = setup(page_size=2, window=4, device_pages=40, swa_device_pages=20)  # window: 2 pages
    k = key(np.arange(12))
    insert_with_swa(cache, drv, k, frontier_page=4)  # [0, 8) tombstone, [8, 12) SWA
    assert cache.match_prefix(RadixKey(np.arange(8))).device_hit_length == 0
    swa_free = swa.device_allocator.available
    full_free = cache.device_allocator.available
    # A request with SWA pages from page 2 on: [4, 8) of the tombstone is recovered (split
    # at the frontier), [0, 4) stays a tombstone; its pages for [8, 12) are duplicates. (The
    # recovered part has no SWA host copy: its full KV was backed up without one.)
    insert_with_swa(cache, drv, k, frontier_page=2)
    assert states(cache, swa, k) == [(4, False, False), (4, True, False), (4, True, True)]
    assert swa.device_allocator.available == swa_free - 2  # took 2 pages, freed 2 of its 4... net -2
    assert cache.device_allocator.available == full_free  # every full page was a duplicate
    assert cache.match_prefix(RadixKey(np.arange(8))).device_hit_length == 8
    m = cache.match_prefix(k)
    drv.full.check_device(k, m.device_indices)
    pages = swa.request_pages(m.last_device_node, 6)
    drv.sw.check_device(k, pages[pages >= 0], int(np.flatnonzero(pages >= 0)[0]))
    cache.sanity_check(0, {"swa": 0})


@pytest.mark.parametrize("page_size, window", [(1, 4), (2, 5), (3, 4), (4, 9)])
def test_a_prefix_needs_exactly_the_w_minus_1_tokens_a_step_after_it_reads(page_size, window):
    """The tree's rule is the model's (``reference_model.window``): a step after a prefix of
    ``m`` tokens reads the SWA KV of ``[m - W + 1, m)``. SWA pages from there on make the
    prefix usable (even when upstream's ``>= W`` rule would refuse it: with these pairs
    ``W - 1`` is a page multiple); one page less does not."""
    from hicache_jax.reference_model.window import swa_first_needed_page

    p = page_size
    m = 6 * p
    first = swa_first_needed_page(m, window, p)  # the model's own arithmetic
    assert (m - window) // p < first  # upstream's rule would also want page first - 1
    for frontier, usable in ((first, True), (first + 1, False)):
        cache, drv, swa = setup(page_size=p, window=window, device_pages=40, swa_device_pages=20)
        k = key(np.arange(m))
        insert_with_swa(cache, drv, k, frontier_page=frontier)
        assert cache.match_prefix(k).device_hit_length == (m if usable else 0)
        if usable:  # the engine's view: the request's SWA table has every page the step reads
            req, _ = drv.admit(key(np.arange(m), [99]))
            assert req.cached_pages * p == m
            drv.check_prefix(req)
            drv.abort(req)
        cache.sanity_check(0, {"swa": 0})


# ---------------------------------------------------------------- the request call sequence
@pytest.mark.parametrize("page_size, window, chunk", [(1, 4, 3), (2, 5, 4), (3, 7, 5), (4, 3, 8)])
def test_driver_serves_requests_with_windows_that_end_inside_a_page(page_size, window, chunk):
    cache, drv, swa = setup(
        page_size=page_size, window=window, device_pages=60, host_pages=120, swa_device_pages=24, swa_host_pages=48
    )
    base = np.arange(1, 23)
    k1 = drv.serve(RadixKey(base), chunk=chunk, out=[100, 101, 102, 103, 104, 105, 106])
    cache.sanity_check(0, {"swa": 0})
    # A second request shares the whole first conversation: it hits it on the device.
    req, _ = drv.admit(key(k1.token_ids, [7, 8, 9]))
    drv.check_prefix(req)
    assert req.cached_pages * page_size == (len(k1) // page_size) * page_size
    drv.abort(req)
    cache.sanity_check(0, {"swa": 0})
    # Everything leaves the device; the host copies serve it back, only the window's SWA pages.
    cache.flush()
    cache.evict(10_000)
    loaded_before = swa.metrics.loaded_tokens
    req, lb = drv.admit(key(k1.token_ids, [7, 8, 9]))
    assert lb is not None and req.cached_pages == len(k1) // page_size
    drv.check_prefix(req)
    assert swa.metrics.loaded_tokens - loaded_before == -(-(window - 1) // page_size) * page_size
    drv.abort(req)
    cache.flush()
    cache.sanity_check(0, {"swa": 0})
    cache.reset()
    assert swa.device_allocator.available == swa.device_allocator.num_pages
    assert swa.host_allocator.available == swa.host_allocator.num_pages


def test_decode_frees_the_requests_out_of_window_pages_and_its_window_hold():
    cache, drv, swa = setup(page_size=2, window=5, device_pages=60, swa_device_pages=30)
    drv.serve(RadixKey(np.arange(8)))
    req, _ = drv.admit(key(np.arange(8), [50]))
    assert req.cached_pages == 4 and swa.protected_tokens == 4  # the window [4, 8) is held
    held = swa.protected_tokens
    for t in range(51, 60):
        assert drv.extend(req, key(req.key.token_ids, [t]))
        full_own, swa_own = SWADriver.own_pages(req)
        cache.sanity_check(full_own, {"swa": swa_own})
        assert swa_own <= swa.window_pages + 1
    assert swa.protected_tokens == 0 < held  # the window moved past the tree's part: released
    assert swa.metrics.released_windows == 1 and swa.metrics.freed_request_pages > 0
    assert req.last_node.lock_ref == 1  # the full lock stays
    cache.cache_finished_req(req)
    cache.sanity_check(0, {"swa": 0})
    # The finished request left tombstones below its frontier and a one-window leaf.
    st = states(cache, swa, key(np.arange(8), np.arange(50, 60)))
    assert st[-1][1] and st[-1][0] <= swa.window_pages * 2 and not all(s[1] for s in st)


# ---------------------------------------------------------------- eviction
def test_swa_allocation_tombstones_internal_nodes_and_evicts_unlocked_leaves_whole():
    cache, drv, swa = setup(
        page_size=1,
        window=3,
        device_pages=40,
        host_pages=40,
        swa_device_pages=10,
        swa_host_pages=10,
        write_policy="write_back",
    )
    insert_with_swa(cache, drv, key(np.arange(4)))  # capped: [0, 2) + [2, 4)
    leaf = insert_with_swa(cache, drv, key(np.arange(4), [10, 11])).last_node  # [4, 6)
    other = insert_with_swa(cache, drv, key([30, 31, 32])).last_node  # [30] + [31, 32], used last
    assert swa.device_allocator.available == 1
    got = cache.alloc_component("swa", 6)  # 5 short: the least recently used windows go
    assert got is not None and got.size == 6
    swa.device_allocator.free(got)
    cache.sanity_check(0, {"swa": 0})
    # The two internal nodes became tombstones (their full KV stays on the device); the
    # unlocked leaf left the device whole (write_back: backed up first, now host-only).
    assert swa.metrics.tombstoned_tokens == 4 and swa.metrics.leaf_evictions == 1
    assert leaf.value is None and leaf.host_value is not None and swa.node_host_pages(leaf) is not None
    inner = leaf.parent
    assert inner.value is not None and swa.node_device_pages(inner) is None
    assert other.value is not None and swa.node_device_pages(other) is not None
    m = cache.match_prefix(key(np.arange(4), [10, 11]))
    assert (m.device_hit_length, m.host_hit_length) == (0, 6)  # usable again through a load-back


def test_host_swa_allocation_drops_host_leaves_whole_and_tombstones_the_rest():
    cache, drv, swa = setup(
        page_size=1, window=3, device_pages=40, host_pages=40, swa_device_pages=20, swa_host_pages=6
    )
    insert_with_swa(cache, drv, key(np.arange(4)))  # capped: [0, 2) + [2, 4)
    leaf = insert_with_swa(cache, drv, key(np.arange(4), [10, 11])).last_node
    cache.flush()
    cache.evict(100)  # everything host-only, SWA on host: 6 pages, the SWA host pool is full
    assert swa.host_allocator.available == 0
    host_full = cache.host_allocator.available
    got = cache.reserve_component_host_pages("swa", 6)
    assert got is not None and got.size == 6
    swa.host_allocator.free(got)
    cache.sanity_check(0, {"swa": 0})
    # The two internal nodes keep their full host copies (host tombstones); the host-only
    # leaf left whole, its full host pages with it.
    assert swa.metrics.host_tombstoned_tokens == 4 and swa.metrics.host_leaf_evictions == 1
    assert leaf.deleted and cache.host_allocator.available == host_full + 2
    assert cache.peek_prefix(key(np.arange(4))) == (0, 0)  # no window on any tier: nothing usable


# ---------------------------------------------------------------- L2
def test_load_back_splits_the_window_top_and_loads_only_the_window():
    cache, drv, swa = setup(
        page_size=2, window=6, device_pages=60, host_pages=60, swa_device_pages=30, swa_host_pages=30
    )
    k = key(np.arange(20))
    insert_with_swa(cache, drv, k)  # SWA everywhere, backed up; the cap: [0, 14) + the leaf [14, 20)
    cache.flush()
    cache.evict(100)
    k10 = key(np.arange(10))  # a prefix that ends inside [0, 14): its window [5, 10) is pages 2..4
    m = cache.match_prefix(k10)
    assert m.device_hit_length == 0 and m.host_hit_length == 10
    lb = cache.load_back(m.last_host_node)
    for layer in range(swa.engine.geom.num_layers):  # the SWA layers' readiness, per layer
        lb.handle.wait_layer(layer, component="swa")
        assert lb.handle.layer_done(layer, component="swa")
    with pytest.raises(ValueError, match="component"):
        lb.handle.layer_done(0, component="draft")
    lb.handle.wait()
    cache.flush()
    # The window's top node was split at the window's first page: only pages 2..4 came back.
    assert states(cache, swa, k10) == [(4, False, True), (6, True, True)]
    assert swa.metrics.loaded_tokens == 6
    drv.full.check_device(k10, lb.device_pages)
    pages = swa.request_pages(lb.node, 5)
    assert (pages[2:] >= 0).all() and (pages[:2] < 0).all()
    drv.sw.check_device(k10, pages[2:], 2)
    cache.sanity_check(0, {"swa": 0})


def test_a_window_evicted_from_the_device_alone_comes_back_without_its_full_pages():
    cache, drv, swa = setup(
        page_size=1, window=4, device_pages=40, host_pages=40, swa_device_pages=10, swa_host_pages=20
    )
    k = key(np.arange(6))
    insert_with_swa(cache, drv, k)
    leaf = insert_with_swa(cache, drv, key(np.arange(6), [9, 10, 11, 12])).last_node  # k is now internal
    cache.flush()
    receipt = cache.inc_lock_ref(leaf)  # holds k's full pages and the leaf's window, not k's SWA
    node = cache.match_prefix(k).last_host_node
    assert swa.lock_count(node) == 0 and node.lock_ref == 1
    got = cache.alloc_component("swa", swa.device_allocator.available + 6)  # SWA pressure: k is tombstoned
    assert got is not None and swa.state(node).dev is None and node.value is not None
    swa.device_allocator.free(got)
    cache.dec_lock_ref(receipt)
    m = cache.match_prefix(k)
    assert (m.device_hit_length, m.host_hit_length) == (0, 6)
    full_free = cache.device_allocator.available
    lb = cache.load_back(m.last_host_node)
    assert lb is not None and cache.device_allocator.available == full_free  # no full page moved
    lb.handle.wait()
    cache.flush()
    got = np.concatenate([m.device_indices, lb.device_pages])
    drv.full.check_device(k, got)
    assert cache.match_prefix(k).device_hit_length == 6
    cache.sanity_check(0, {"swa": 0})


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "pages, exc, match",
    [
        ([0, -1, 1], ValueError, "-1 .* before the first page id"),
        ([0, 1], ValueError, "expected 3 ids"),
        ([0, 1, 99], ValueError, "out of range"),
        ([0, 1, -2], ValueError, "out of range"),
        ([0.0, 1.0, 2.0], TypeError, "integer"),
    ],
)
def test_bad_component_pages_are_refused_before_any_change(pages, exc, match):
    cache, drv, swa = setup(page_size=1, window=3, swa_device_pages=12)
    full = cache.alloc_device(3)
    sw = cache.alloc_component("swa", 3)
    before = (cache.device_allocator.available, swa.device_allocator.available, len(cache.all_nodes()))
    with pytest.raises(exc, match=match):
        cache.insert(key([1, 2, 3]), full, component_pages={"swa": pages})
    assert before == (cache.device_allocator.available, swa.device_allocator.available, len(cache.all_nodes()))
    with pytest.raises(ValueError, match="not a component"):
        cache.insert(key([1, 2, 3]), full, component_pages={"draft": sw})
    with pytest.raises(ValueError, match="name"):
        cache.alloc_component("full", 1)
    cache.insert(key([1, 2, 3]), full, component_pages={"swa": sw})
    with pytest.raises(ValueError, match="already owned"):  # the tree's pages again, at other positions
        f2 = cache.alloc_device(3)
        cache.insert(key([7, 8, 9]), f2, component_pages={"swa": sw[::-1]})
    cache.sanity_check(3, {"swa": 0})


def test_swa_component_construction_is_validated():
    from cache_harness import numpy_backend_factory, small_geom

    be = numpy_backend_factory(small_geom(2), 8, 8)
    with pytest.raises(ValueError, match="window"):
        SWAComponent(be.engine, be.device.allocator, 0)
    with pytest.raises(ValueError, match="allocator"):
        SWAComponent(be.engine, be.host.allocator, 4)
    with pytest.raises(TypeError, match="device_allocator"):
        SWAComponent(be.engine, object(), 4)
    with pytest.raises(ValueError, match="reserved"):
        SWAComponent(be.engine, be.device.allocator, 4, name="full")


def test_request_component_pages_are_validated():
    cache, drv, swa = setup(page_size=1, window=3)
    req = CacheRequest(key([1, 2]), 1, np.array([0, 1], np.int32), component_pages={"swa": np.array([0], np.int32)})
    with pytest.raises(ValueError, match="1 ids for 2 device pages"):
        cache.cache_finished_req(req)
    req.component_pages = {"draft": np.array([0, 1], np.int32)}
    with pytest.raises(ValueError, match="not a component"):
        cache.cache_finished_req(req)
    with pytest.raises(ValueError, match="one id per new page"):
        r2, _ = cache.begin_request(key([5]))
        r2.extend(key([5, 6]), [3, 4])


def test_bad_insert_host_component_pages_are_refused_before_any_change():
    cache, drv, swa = setup(page_size=1, window=3, swa_host_pages=12)
    host = cache.reserve_host_pages(3)
    sw = cache.reserve_component_host_pages("swa", 2)
    k = key([1, 2, 3])

    def state():
        return (cache.host_allocator.available, swa.host_allocator.available, len(cache.all_nodes()))

    before = state()
    for pages, match in (
        ([sw[0], -1, sw[1]], "-1 .* before the first page id"),
        ([-1, sw[0], sw[0]], "duplicate"),
        ([-1, -1, 11], "free or owned"),
        ([-1, sw[0]], "expected 3 ids"),
    ):
        with pytest.raises(ValueError, match=match):
            cache.insert_host(k, host, 0, component_pages={"swa": pages})
        assert state() == before
    attached, leaf = cache.insert_host(k, host, 0, component_pages={"swa": [-1, sw[0], sw[1]]})
    assert attached == 3 and swa.state(leaf).host.tolist() == sw.tolist() and len(leaf) == 2
    cache.sanity_check(0, {"swa": 0})


def test_an_swa_component_on_the_full_engine_is_refused():
    from cache_harness import numpy_backend_factory, small_geom

    from hicache_jax.cache import HiCacheConfig, HiRadixCache

    full = numpy_backend_factory(small_geom(2), 8, 8)
    with pytest.raises(ValueError, match="its own pools"):
        HiRadixCache(
            HiCacheConfig(page_size=2),
            full.engine,
            full.device.allocator,
            components=[SWAComponent(full.engine, full.device.allocator, 4)],
        )


def test_insert_whose_frontier_lies_inside_a_node_that_keeps_its_swa_pages_frees_only_duplicates():
    """The caller's -1 entries (below its frontier) inside a node that has SWA device pages
    are no pages: only its ids are duplicates to free (found by the slow fuzz run)."""
    cache, drv, swa = setup(page_size=1, window=4, device_pages=40, swa_device_pages=30)
    k = key(np.arange(10))
    insert_with_swa(cache, drv, k)  # one node [0, 10) with SWA pages on every page
    insert_with_swa(cache, drv, key(np.arange(10), [77]))  # a sibling splits nothing above 10
    swa_free = swa.device_allocator.available
    insert_with_swa(cache, drv, k, frontier_page=3)  # -1 for [0, 3), 7 duplicate ids for [3, 10)
    assert swa.device_allocator.available == swa_free  # the 7 duplicates were freed, nothing else
    m = cache.match_prefix(k)
    assert m.device_hit_length == 10
    pages = swa.request_pages(m.last_device_node, 10)
    drv.sw.check_device(k, pages[pages >= 0], int(np.flatnonzero(pages >= 0)[0]))
    cache.sanity_check(0, {"swa": 0})


def test_a_backup_whose_swa_host_allocation_fails_twice_backs_up_the_full_pages_alone():
    """``on_backup``: the first SWA host allocation fails (after eviction), the retry for the
    deepest pages that fit fails too (an allocator that refuses: e.g. one rank's, in tests).
    The backup then goes on without SWA host copies (the window's host tombstone), never with
    a None page list."""
    cache, drv, swa = setup(page_size=2, window=6, device_pages=40, swa_device_pages=20)
    refused = []
    swa.host_allocator.alloc = lambda n: refused.append(n) and None  # every SWA host allocation fails
    k = key(np.arange(20))
    insert_with_swa(cache, drv, k, frontier_page=4)  # write_through: backs up at insert
    cache.flush()
    assert len(refused) >= 2  # the allocation and its retry
    assert [s[1:] for s in states(cache, swa, k)][1:] == [(True, False), (True, False)]  # SWA on device only
    m = cache.match_prefix(k)
    assert m.device_hit_length == 20
    cache.sanity_check(0, {"swa": 0})
