"""SWA (and draft sidecar) state in the agreed rank protocol (pure numpy; both environments).

What is checked here: the digest covers the SWA component's state (per node and its counters)
while a full-only cache digests byte for byte as before; SWA host reservations go reserve ->
agree -> commit (a full part and a component part per backup); window slides go to the
agreed (MIN) length; the L3 facade's component reservations; one exchange per step.
The serving traces over several ranks are in ``test_swa_fuzz_ranks.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from rank_threads import ThreadGroup, run_ranks
from rank_trace import rank_cache, run_trace
from swa_harness import SWADriver, make_swa_cache

from hicache_jax.cache import RadixKey
from hicache_jax.cache.rank_digest import state_digest

# ``run_trace(rank_cache(None), steps=12)``'s digests (sha256 of their concatenation) and its
# final digest with page ids, recorded before components took part in the digest: a full-only
# cache must keep digesting exactly as it did (ranks of different versions compare digests).
FULL_ONLY_TRACE = "46a8773474934f2226466a7163ae3f305fe6915f017e4cb4d4dde649ca87c6cf"
FULL_ONLY_PAGES = "f49b2629f10fb0a5d9220c38fd9019081403b56deb2df45e48e6ea877c20ff78"


def key(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


# ---------------------------------------------------------------------------------------------- digest
def test_a_full_only_digest_is_byte_identical_to_before():
    import hashlib

    cache, be, _ = rank_cache(None)
    out = run_trace(cache, be, steps=12)
    assert hashlib.sha256("".join(out["digests"]).encode()).hexdigest() == FULL_ONLY_TRACE
    assert cache.debug_view().digest(pages=True) == FULL_ONLY_PAGES


def _full_part(cache):
    v = cache.debug_view()
    return state_digest(v.root, v.clock, v.counters, v.pending())


def test_the_digest_sees_swa_state_the_full_tree_does_not(monkeypatch):
    cache, full, swa_be, swa = make_swa_cache(window=5, swa_device_pages=16)
    drv = SWADriver(cache, full, swa_be, swa)
    assert drv.serve(key(0, 20), chunk=4) is not None
    cache.sanity_check(0, {"swa": 0})
    d0, f0 = cache.debug_view().digest(), _full_part(cache)
    assert d0 != f0  # the SWA state is in it
    m = cache.match_prefix(key(0, 20))
    receipt = cache.inc_lock_ref(m.last_device_node)
    monkeypatch.setattr(swa, "digest_state", lambda: {})  # the per-node part alone must see it
    f1, d1 = _full_part(cache), cache.debug_view().digest()
    # Tombstone an out-of-window node: only SWA state changes.
    assert swa.evict(1) >= 1 and swa.metrics.tombstoned_tokens > 0
    assert _full_part(cache) == f1 and cache.debug_view().digest() != d1
    monkeypatch.undo()
    cache.dec_lock_ref(receipt)
    cache.sanity_check(0, {"swa": 0})


def test_the_digest_sees_swa_holds_and_counters():
    cache, full, swa_be, swa = make_swa_cache(window=5)
    drv = SWADriver(cache, full, swa_be, swa)
    drv.serve(key(0, 12))
    m = cache.match_prefix(key(0, 12))
    d0, f0 = cache.debug_view().digest(), _full_part(cache)
    r = cache.inc_lock_ref(m.last_device_node)  # a window hold: full locks change too
    d1 = cache.debug_view().digest()
    assert d1 != d0
    # the window hold released early leaves the full lock: only SWA state differs
    f1 = _full_part(cache)
    assert swa.release_window(m.last_device_node)
    assert _full_part(cache) == f1 and cache.debug_view().digest() != d1
    cache.dec_lock_ref(r)
    assert cache.debug_view().digest() == d0 and _full_part(cache) == f0


# ---------------------------------------------------------------------------------------------- backups
def _failing(alloc, fails: list):
    """``alloc`` that returns None while ``fails[0]`` > 0 (counting down): a rank's failed allocation."""

    def f(n):
        if n and fails[0]:
            fails[0] -= 1
            return None
        return alloc(n)

    return f


def _agreed_swa_cache(group, r, **kw):
    kw.setdefault("swa_host_pages", 24)
    kw.setdefault("deferred", True)
    kw.setdefault("swa_deferred", kw["deferred"])
    return make_swa_cache(window=5, agreement=group.agreement(r), **kw)


def _settle(cache, full, swa_be):
    for _ in range(4):
        full.engine.complete_all()
        swa_be.engine.complete_all()
        cache.check_events()
    cache.flush()


def test_an_swa_host_allocation_failing_on_one_rank_leaves_swa_host_tombstones_on_every_rank():
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, full, swa_be, swa = _agreed_swa_cache(group, r)
        drv = SWADriver(cache, full, swa_be, swa)
        fails = [1 if r == 1 else 0]
        swa.host_allocator.alloc = _failing(swa.host_allocator.alloc, fails)
        drv.serve(key(0, 12))
        cache.check_events()  # full part agreed (both got it), SWA part failed on rank 1
        assert fails == [0]
        a = cache.match_prefix(key(0, 12)).last_device_node
        first = [a.host_value is not None, swa.node_host_pages(a) is None, swa.host_allocator.used, swa.phantom_pages]
        drv.serve(key(100, 12))
        cache.check_events()  # both parts everywhere
        _settle(cache, full, swa_be)
        b = cache.match_prefix(key(100, 12)).last_device_node
        second = [b.host_value is not None, swa.node_host_pages(b) is not None]
        cache.sanity_check(0, {"swa": 0})
        # the SWA bytes that come back from the host are the ones that went out
        cache.evict(cache.evictable_tokens)
        assert cache.match_prefix(key(100, 12)).device_indices.size == 0
        req, lb = drv.admit(key(100, 13))
        assert lb is not None
        full.engine.complete_all()
        swa_be.engine.complete_all()
        drv.check_prefix(req)
        assert req.cached_pages == 6
        drv.abort(req)
        _settle(cache, full, swa_be)
        cache.sanity_check(0, {"swa": 0})
        return first, second, swa.metrics.backup_failed_tokens, cache.debug_view().digest()

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1
    assert r0[0] == [True, True, 0, 0]  # full backed up, SWA a host tombstone, nothing held
    assert r0[1] == [True, True] and r0[2] > 0


def test_a_full_host_allocation_failing_on_one_rank_rolls_back_the_swa_part_too():
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, full, swa_be, swa = _agreed_swa_cache(group, r)
        drv = SWADriver(cache, full, swa_be, swa)
        fails = [1 if r == 1 else 0]
        cache.host_allocator.alloc = _failing(cache.host_allocator.alloc, fails)
        drv.serve(key(0, 12))
        cache.check_events()
        a = cache.match_prefix(key(0, 12)).last_device_node
        out = [
            a.host_value is None,
            swa.node_host_pages(a) is None,
            swa.host_allocator.used,
            cache.host_allocator.used,
            swa.phantom_pages,
            cache.stats()["agreement"]["rolled_back_backups"],
        ]
        cache.sanity_check(0, {"swa": 0})
        return out, cache.debug_view().digest()

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1 and r0[0] == [True, True, 0, 0, 0, 1]


def test_write_back_agrees_on_both_parts_inside_an_eviction():
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, full, swa_be, swa = _agreed_swa_cache(
            group, r, write_policy="write_back", deferred=False, swa_deferred=False
        )
        drv = SWADriver(cache, full, swa_be, swa)
        swa.host_allocator.alloc = _failing(swa.host_allocator.alloc, [1 if r == 1 else 0])
        drv.serve(key(0, 12))
        drv.serve(key(100, 12))
        before = group.calls[r]
        cache.evict(cache.evictable_tokens)  # each leaf: backed up (both parts agreed) first
        exchanges = group.calls[r] - before
        host_swa = [swa.node_host_pages(n) is not None for n in cache.all_nodes() if n.host_value is not None]
        cache.sanity_check(0, {"swa": 0})
        return exchanges, host_swa, cache.debug_view().digest()

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1 and r0[0] > 0
    assert False in r0[1] and True in r0[1]  # the first SWA part failed on rank 1: a tombstone everywhere


def test_a_failed_backup_copy_is_retried_with_its_swa_part():
    """Rank 1's SWA copy fails (random bytes land in its host pages): the retry must issue the
    SWA part again, or the window that comes back from the host is garbage."""
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, full, swa_be, swa = _agreed_swa_cache(group, r)
        drv = SWADriver(cache, full, swa_be, swa)
        if r == 1:
            swa_be.engine.inject_failures(1, "backup")
        drv.serve(key(0, 12))
        cache.check_events()  # committed everywhere: the copies are issued
        _settle(cache, full, swa_be)
        retries = cache.metrics.transfer_retries
        cache.evict(cache.evictable_tokens)
        req, lb = drv.admit(key(0, 13))
        full.engine.complete_all()
        swa_be.engine.complete_all()
        drv.check_prefix(req)  # the SWA window from the host holds the bytes that went out
        assert req.cached_pages == 6 and lb is not None
        drv.abort(req)
        _settle(cache, full, swa_be)
        cache.sanity_check(0, {"swa": 0})
        return retries, cache.debug_view().digest()

    r0, r1 = run_ranks(group, rank)
    assert r0[1] == r1[1] and (r0[0], r1[0]) == (0, 1)


# ---------------------------------------------------------------------------------------------- window slides
def test_a_window_slides_to_the_length_every_rank_wrote():
    """Rank 1's forward pass lags one step (``written``): each step both ranks slide to the
    shorter length, so their trees stay equal; a single process slides at once."""
    group = ThreadGroup(2, timeout=30)
    toks = np.arange(40, dtype=np.int64)

    def rank(r):
        cache, full, swa_be, swa = _agreed_swa_cache(group, r, deferred=False, swa_device_pages=24)
        drv = SWADriver(cache, full, swa_be, swa)
        req, _ = drv.admit(RadixKey(toks[:3]))
        prev = 0
        own, freed = [], []
        for end in range(4, 30, 2):  # decode: 2 tokens a step
            assert drv.extend(req, RadixKey(toks[:end]))  # slide_window(req) inside: recorded
            if r == 1:  # rank 1 has written only the previous step's tokens
                cache.slide_window(req, written=prev)
            prev = end
            cache.check_events()
            own.append(drv.own_pages(req)[1])
            freed.append(swa.metrics.freed_request_pages)
        cache.cache_finished_req(req)
        cache.check_events()
        cache.sanity_check(0, {"swa": 0})
        st = cache.stats()["agreement"]
        return own, freed, cache.debug_view().digest(), st["steps"], st["exchanges"], group.calls[r]

    r0, r1 = run_ranks(group, rank)
    assert r0[:3] == r1[:3]
    own, freed = r0[0], r0[1]
    assert freed[-1] > 0 and max(own) < 13  # it slid (13 pages would be the whole request)
    assert r0[3] == r0[4] == r0[5] == 14  # one exchange per step, nothing else

    # the same sequence in one process slides one step earlier: more pages freed by each step
    cache, full, swa_be, swa = make_swa_cache(window=5, deferred=False, swa_device_pages=24)
    drv = SWADriver(cache, full, swa_be, swa)
    req, _ = drv.admit(RadixKey(toks[:3]))
    one = []
    for end in range(4, 30, 2):
        drv.extend(req, RadixKey(toks[:end]))
        one.append(swa.metrics.freed_request_pages)
    assert one[-1] >= freed[-1] and any(a > b for a, b in zip(one, freed))


def test_without_the_exchange_a_late_slide_splits_the_trees():
    from hicache_jax.cache import NoExchangeAgreement

    def rank(r):
        cache, full, swa_be, swa = make_swa_cache(
            window=5, deferred=False, swa_device_pages=24, agreement=NoExchangeAgreement(r, 2)
        )
        drv = SWADriver(cache, full, swa_be, swa)
        toks = np.arange(40, dtype=np.int64)
        req, _ = drv.admit(RadixKey(toks[:3]))
        prev, digests = 0, []
        for end in range(4, 30, 2):
            drv.extend(req, RadixKey(toks[:end]))
            if r == 1:
                cache.slide_window(req, written=prev)
            prev = end
            cache.check_events()
            digests.append(cache.debug_view().digest())
        return digests

    assert rank(0) != rank(1)


def test_a_finished_request_is_forgotten_and_written_is_checked():
    group = ThreadGroup(1, timeout=30)

    def rank(r):
        cache, full, swa_be, swa = _agreed_swa_cache(group, r, deferred=False)
        drv = SWADriver(cache, full, swa_be, swa)
        req, _ = drv.admit(key(0, 5))
        drv.extend(req, key(0, 12))
        for bad, exc in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
            with pytest.raises(exc, match="written"):
                cache.slide_window(req, written=bad)
        assert cache.debug_view().tracked_slides == 1
        cache.cache_finished_req(req)
        assert cache.debug_view().tracked_slides == 0
        req, _ = drv.admit(key(50, 5))
        drv.extend(req, key(50, 12))
        assert cache.debug_view().tracked_slides == 1
        cache.abort_request(req)
        assert cache.debug_view().tracked_slides == 0
        cache.check_events()
        cache.sanity_check(0, {"swa": 0})

    run_ranks(group, rank)


def test_a_request_stays_reported_until_every_rank_noted_the_same_length():
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, full, swa_be, swa = _agreed_swa_cache(group, r, deferred=False, swa_device_pages=24)
        drv = SWADriver(cache, full, swa_be, swa)
        req, _ = drv.admit(key(0, 3))
        drv.extend(req, key(0, 20))  # slide_window(req): 20 tokens written
        if r == 1:
            cache.slide_window(req, written=10)  # rank 1 has written 10 so far
        cache.check_events()
        after_lag = swa.metrics.freed_request_pages
        if r == 1:
            cache.slide_window(req)  # rank 1 catches up; rank 0 has nothing new to say
        cache.check_events()
        caught_up = swa.metrics.freed_request_pages
        cache.check_events()  # clean: nothing reported
        cache.cache_finished_req(req)
        cache.sanity_check(0, {"swa": 0})
        return after_lag, caught_up, cache.debug_view().digest()

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1 and 0 < r0[0] < r0[1]


# ---------------------------------------------------------------------------------------------- L3 facade
def test_component_host_pages_reserved_agreed_then_kept_or_freed():
    cache, full, swa_be, swa = make_swa_cache(window=5, swa_host_pages=8)
    alloc = swa.host_allocator
    ids = cache.reserve_component_host_pages_agreed("swa", 3)
    assert ids is not None and ids.shape == (3,) and alloc.used == 3 and swa.phantom_pages == 0
    cache.settle_component_host_pages("swa", 3, ids, True)  # kept: the caller's
    assert alloc.used == 3 and alloc.is_allocated(ids).all()
    alloc.free(ids)
    ids = cache.reserve_component_host_pages_agreed("swa", 3)
    cache.settle_component_host_pages("swa", 3, ids, False)  # another rank failed: freed
    assert alloc.used == 0
    # this rank's allocation fails: counted as taken until settled, so a second reservation
    # in the same step sees the free count every rank sees
    real = alloc.alloc
    alloc.alloc = _failing(real, [1])
    a = cache.reserve_component_host_pages_agreed("swa", 5)
    assert a is None and swa.phantom_pages == 5 and swa.host_available == 3
    b = cache.reserve_component_host_pages_agreed("swa", 4)  # 3 left as every rank counts them
    assert b is None and swa.phantom_pages == 9 and alloc.used == 0
    with pytest.raises(Exception, match="invariant"):
        cache.sanity_check(0, {"swa": 0})  # phantom pages outlive no step
    cache.settle_component_host_pages("swa", 4, b, False)
    cache.settle_component_host_pages("swa", 5, a, False)
    assert swa.phantom_pages == 0 and alloc.used == 0
    cache.sanity_check(0, {"swa": 0})


def test_component_host_reservation_input_is_checked():
    cache, full, swa_be, swa = make_swa_cache(window=5, swa_host_pages=8)
    for args, exc in ((("full", 2), ValueError), (("swa", -1), ValueError), (("swa", 1.0), TypeError)):
        with pytest.raises(exc):
            cache.reserve_component_host_pages_agreed(*args)
    assert swa.host_allocator.used == 0
    ids = cache.reserve_component_host_pages_agreed("swa", 2)
    with pytest.raises(ValueError, match="ids"):
        cache.settle_component_host_pages("swa", 3, ids, True)
    with pytest.raises(TypeError, match="keep"):
        cache.settle_component_host_pages("swa", 2, ids, 1)
    assert swa.host_allocator.used == 2
    cache.settle_component_host_pages("swa", 2, ids, False)
    assert swa.host_allocator.used == 0


def test_component_host_reservations_agree_across_ranks():
    """The L3 shape of the protocol on two thread ranks: a participant reserves in
    ``prepare``, reports ``ids is not None``, keeps or frees in ``apply``."""
    group = ThreadGroup(2, timeout=30)

    class Window:
        def __init__(self, cache):
            self.cache, self.r, self.kept = cache, None, []

        def prepare(self):
            self.r = self.cache.reserve_component_host_pages_agreed("swa", 2)

        def report(self, out):
            out.append(0 if self.r is None else 1)

        def apply(self, agreed):
            self.cache.settle_component_host_pages("swa", 2, self.r, bool(agreed[0]))
            self.kept.append(bool(agreed[0]))
            if agreed[0]:
                self.cache.components.components["swa"].host_allocator.free(self.r)

    def rank(r):
        cache, full, swa_be, swa = _agreed_swa_cache(group, r)
        if r == 1:
            swa.host_allocator.alloc = _failing(swa.host_allocator.alloc, [1])
        w = Window(cache)
        cache.step_agreement.add(w)
        cache.check_events()
        cache.check_events()
        cache.sanity_check(0, {"swa": 0})
        return w.kept, swa.host_allocator.used

    assert run_ranks(group, rank) == [([False, True], 0)] * 2


def test_slides_report_within_their_budget_and_the_rest_wait_a_step():
    """20 requests slide at once: 16 (the budget, 32 of the vector's slots) report in the first
    step, the other 4 in the next; the vector never outgrows its fixed width."""
    from hicache_jax.cache.component_steps import BUDGET

    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, full, swa_be, swa = _agreed_swa_cache(group, r, deferred=False, device_pages=200, swa_device_pages=200)
        drv = SWADriver(cache, full, swa_be, swa)
        reqs = []
        for i in range(20):
            req, _ = drv.admit(key(1000 * i, 3))
            assert drv.extend(req, key(1000 * i, 14))  # slide_window: noted, dirty
            reqs.append(req)
        cache.check_events()
        first = cache.stats()["agreement"]["agreed_slides"]
        cache.check_events()
        second = cache.stats()["agreement"]["agreed_slides"]
        for req in reqs:
            cache.cache_finished_req(req)
        cache.check_events()
        cache.sanity_check(0, {"swa": 0})
        return first, second, cache.stats()["agreement"]["exchanges"]

    assert run_ranks(group, rank) == [(BUDGET, 20, 3)] * 2
