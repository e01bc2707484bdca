"""Agreed window slides (several ranks, ``component_steps``) across a request's end and ``flush``
(pure numpy; both environments).

* A request abandoned the documented raw way (its own pages freed, ``dec_lock_ref(req.last_node)``)
  leaves the slide tracking at once, as ``abort_request`` and ``cache_finished_req`` do: its
  noted slide is never applied to pages it no longer owns (which another request may hold by
  then), and it does not stay tracked.
* ``flush()`` returns only once every noted slide is agreed and applied, as it waits for
  every copy: after it, the pool holds what a single process's would.
"""

from __future__ import annotations

import numpy as np
from rank_threads import ThreadGroup, run_ranks
from swa_harness import SWADriver, make_swa_cache

from hicache_jax.cache import RadixKey


def key(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


def _agreed_swa_cache(group, r, **kw):
    return make_swa_cache(
        window=5, agreement=group.agreement(r), swa_host_pages=24, deferred=False, swa_device_pages=24, **kw
    )


def test_a_request_abandoned_by_dec_lock_ref_leaves_the_slide_tracking():
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, full, swa_be, swa = _agreed_swa_cache(group, r)
        drv = SWADriver(cache, full, swa_be, swa)
        assert drv.serve(key(0, 12)) is not None  # a cached prefix, so the next request holds a lock
        cache.check_events()
        req, _ = drv.admit(key(0, 13))
        assert req.last_node is not None and cache.debug_view().tracked_slides == 0
        assert drv.extend(req, key(0, 30))  # slide_window(req) inside: noted, not yet agreed
        assert cache.debug_view().tracked_slides == 1
        drv.abort(req)  # the raw abandon: own pages of both pools freed, dec_lock_ref(req.last_node)
        assert cache.debug_view().tracked_slides == 0
        # Another request takes the freed SWA pages; the abandoned request's slide must not free them.
        other, _ = drv.admit(key(100, 5))
        assert drv.extend(other, key(100, 16))
        cache.check_events()  # the agreed step: only ``other``'s slide is applied
        own = other.component_pages["swa"][other.cached_pages :]
        assert swa.device_allocator.is_allocated(own[own >= 0]).all()
        cache.cache_finished_req(other)
        cache.check_events()
        cache.sanity_check(0, {"swa": 0})
        assert cache.debug_view().tracked_slides == 0
        return cache.debug_view().digest()

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1


def test_two_requests_locked_at_one_node_one_abandoned_the_other_slides_on():
    """Locks on one node are interchangeable: abandoning one of two requests locked there
    forgets both; the live one is noted again by its next slide and slides as before."""
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, full, swa_be, swa = _agreed_swa_cache(group, r)
        drv = SWADriver(cache, full, swa_be, swa)
        assert drv.serve(key(0, 12)) is not None
        cache.check_events()
        live, _ = drv.admit(key(0, 13))
        gone, _ = drv.admit(key(0, 13))
        assert live.last_node is gone.last_node is not None
        assert drv.extend(live, key(0, 16)) and drv.extend(gone, RadixKey(np.r_[np.arange(12), 50, 51, 52, 53]))
        assert cache.debug_view().tracked_slides == 2
        drv.abort(gone)
        assert cache.debug_view().tracked_slides == 0
        cache.check_events()
        assert drv.extend(live, key(0, 28))  # noted again
        assert cache.debug_view().tracked_slides == 1
        freed = swa.metrics.freed_request_pages
        cache.check_events()
        assert swa.metrics.freed_request_pages > freed  # its window slid
        cache.cache_finished_req(live)
        cache.check_events()
        cache.sanity_check(0, {"swa": 0})
        return cache.debug_view().digest()

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1


def test_flush_applies_the_noted_slides():
    """After ``flush`` the request holds the SWA pages a single process's would (its noted
    slide agreed and applied), and a rank that has written less makes both slide to its
    length without ``flush`` waiting for it to catch up."""
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, full, swa_be, swa = _agreed_swa_cache(group, r)
        drv = SWADriver(cache, full, swa_be, swa)
        req, _ = drv.admit(key(0, 3))
        assert drv.extend(req, key(0, 20))  # noted: 20 tokens written on both ranks
        assert swa.metrics.freed_request_pages == 0
        cache.flush()
        own = drv.own_pages(req)[1]
        assert drv.extend(req, key(0, 30))
        if r == 1:
            cache.slide_window(req, written=24)  # rank 1 has written less so far
        cache.flush()  # returns: the agreed (shorter) slide is applied, rank 1 need not catch up
        lagged = drv.own_pages(req)[1]
        cache.cache_finished_req(req)
        cache.check_events()
        cache.sanity_check(0, {"swa": 0})
        return own, lagged, cache.debug_view().digest()

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1
    cache, full, swa_be, swa = make_swa_cache(window=5, deferred=False, swa_device_pages=24)
    drv = SWADriver(cache, full, swa_be, swa)
    req, _ = drv.admit(key(0, 3))
    assert drv.extend(req, key(0, 20))  # one process: the slide applies at once
    assert r0[0] == drv.own_pages(req)[1]
    assert drv.extend(req, key(0, 24))
    assert r0[1] == drv.own_pages(req)[1] + 3  # slid to 24, holding the pages of 24..30 too
