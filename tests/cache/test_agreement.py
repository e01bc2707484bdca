"""Agreement across ranks (pure numpy; both environments): ranks are threads exchanging
through a real barrier (``rank_threads``); the same protocol runs over ``jax.distributed`` in
real processes in ``tests/distributed``.

What is checked: one process keeps its direct paths (no exchange); with several ranks every
step exchanges once, even with nothing to report; per-rank divergence (a failed host
allocation, late copies, short or missing storage reads) leaves every rank's tree identical
after every step, and the served prefixes equal; with the exchange switched off the same
divergence makes the trees differ (so the digest comparison can see what the exchange
prevents); ranks that build different vectors, or whose trees differ, raise instead of
misreading each other.
"""

from __future__ import annotations

import numpy as np
import pytest
from cache_harness import KVOracle, fail_next_allocs, numpy_backend_factory, prefill_insert, small_geom
from rank_threads import ThreadGroup, run_ranks
from rank_trace import P, divergences, rank_cache, run_trace

from hicache_jax.cache import (
    CacheFailedError,
    HiCacheConfig,
    HiRadixCache,
    NoExchangeAgreement,
    RadixKey,
    RankDivergenceError,
    SingleProcessAgreement,
)


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


# ---------------------------------------------------------------------------------------------- one process
def test_one_process_is_the_identity_and_exchanges_nothing():
    assert SingleProcessAgreement().agree_min(np.arange(3)).tolist() == [0, 1, 2]
    cache, be, _ = rank_cache(None, deferred=False)
    assert not cache.agreed and isinstance(cache.agreement, SingleProcessAgreement)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 8))
    cache.check_events()
    cache.flush()
    assert cache.step_agreement.exchanges == 0
    assert cache.match_prefix(seq(0, 8)).host_hit_length == 0 and cache.host_tokens == 8  # backed up at insert


def test_agreement_must_be_an_agreement():
    be = numpy_backend_factory(small_geom(1), 8, 16)
    with pytest.raises(TypeError, match="agreement"):
        HiRadixCache(HiCacheConfig(), be.engine, be.device.allocator, agreement=lambda values: values)


# ---------------------------------------------------------------------------------------------- the protocol
def test_every_step_exchanges_once_even_with_nothing_to_report():
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, be, _ = rank_cache(group.agreement(r))
        for _ in range(5):
            cache.check_events()  # nothing in flight, nothing reserved
        return cache.step_agreement.steps, group.calls[r]

    assert run_ranks(group, rank) == [(5, 5), (5, 5)]


def test_a_backup_is_reserved_agreed_then_committed_or_rolled_back_on_every_rank():
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, be, _ = rank_cache(group.agreement(r))
        oracle = KVOracle(be)
        if r == 1:  # rank 1's first host allocation fails
            fail_next_allocs(cache.host_allocator)
        a = prefill_insert(cache, oracle, seq(0, 8)).last_node
        assert a.host_value is None and cache.in_flight == (0, 0)  # deferred to the step
        cache.check_events()  # reserve (fails on rank 1) -> agree -> roll back everywhere
        out = [a.host_value is None, cache.host_allocator.used, cache.metrics.backup_failed_tokens]
        prefill_insert(cache, oracle, seq(100, 8))
        cache.check_events()  # this one succeeds everywhere: committed, copy issued
        be.engine.complete_all()
        cache.flush()
        out += [cache.host_tokens, cache.host_allocator.used, cache.debug_view().digest()]
        cache.sanity_check(0)
        return out

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1
    assert r0[:3] == [True, 0, 8] and r0[3:5] == [8, 8 // P]


def test_a_failed_reservation_counts_as_taken_for_the_rest_of_its_step():
    """Two backups reserved in one step with the host nearly full: rank 1's first allocation
    fails, so its allocator shows more free pages than rank 0's; the second reservation must
    still evict exactly what rank 0's evicts (its shortfall counts the failed pages)."""
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, be, _ = rank_cache(group.agreement(r), host_pages=12, deferred=False)
        oracle = KVOracle(be)
        prefill_insert(cache, oracle, seq(0, 16))  # 8 pages
        cache.flush()
        cache.evict(16)  # host-only now: 8 of the 12 host pages, an eviction candidate
        if r == 1:
            fail_next_allocs(cache.host_allocator)
        prefill_insert(cache, oracle, seq(100, 8))  # 4 pages: fit in the 4 free ones
        prefill_insert(cache, oracle, seq(200, 8))  # 4 more: the host-only node must go
        cache.check_events()
        cache.flush()
        cache.sanity_check(0)
        return (
            cache.debug_view().digest(),
            cache.host_tokens,
            cache.metrics.evicted_host_tokens,
            cache.metrics.backup_failed_tokens,
        )

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1 and r0[1:] == (8, 16, 8)  # the first backup rolled back, the second committed


def test_acknowledgements_wait_for_the_slowest_rank():
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, be, _ = rank_cache(group.agreement(r))
        oracle = KVOracle(be)
        node = prefill_insert(cache, oracle, seq(0, 8)).last_node
        cache.check_events()  # committed: the copy is in flight on both ranks
        seen = []
        for step in range(3):
            if r == 0 or step == 2:
                be.engine.complete_all()  # rank 1's copy finishes two steps later
            cache.check_events()
            seen.append((cache.in_flight[0], node.lock_ref))
        return seen

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1 == [(1, 1), (1, 1), (0, 0)]


def test_a_copy_failing_on_one_rank_latches_every_rank_at_the_same_step():
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, be, _ = rank_cache(group.agreement(r), retries=1)
        oracle = KVOracle(be)
        prefill_insert(cache, oracle, seq(0, 8))
        if r == 1:
            be.engine.inject_failures(2)  # the copy and its one retry fail
        cache.check_events()  # committed: the copy is issued (and fails on rank 1)
        be.engine.complete_all()
        try:
            cache.check_events()
        except CacheFailedError as e:
            msg = str(e)
        else:
            msg = None
        cache.reset()
        cache.sanity_check(0)
        return msg

    m0, m1 = run_ranks(group, rank)
    assert m0 is not None and "another rank" in m0
    assert m1 is not None and "on this rank" in m1


def test_write_back_agrees_on_the_backup_inside_an_eviction():
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, be, _ = rank_cache(group.agreement(r), policy="write_back", deferred=False)
        oracle = KVOracle(be)
        if r == 1:
            real = cache.host_allocator.alloc
            cache.host_allocator.alloc = lambda n: None if n == 3 else real(n)  # the 6-token node's
        prefill_insert(cache, oracle, seq(0, 6))
        prefill_insert(cache, oracle, seq(100, 8))
        freed = cache.evict(14)
        cache.sanity_check(0)
        return freed, cache.host_tokens, cache.metrics.dropped_tokens, cache.debug_view().digest()

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1 and r0[:3] == (14, 8, 6)  # the 6-token node is dropped on both ranks


def test_ranks_that_build_different_vectors_raise_instead_of_misreading():
    group = ThreadGroup(2, timeout=30)

    class Extra:
        def prepare(self):
            pass

        def report(self, out):
            out.append(5)

        def apply(self, agreed):
            pass

    def rank(r):
        cache, _, _ = rank_cache(group.agreement(r))
        if r == 1:
            cache.step_agreement.add(Extra())
        with pytest.raises(RankDivergenceError, match="different agreement vectors"):
            cache.check_events()

    run_ranks(group, rank)


def test_the_digest_check_sees_trees_that_differ():
    group = ThreadGroup(2, timeout=30)

    def rank(r):
        cache, be, _ = rank_cache(group.agreement(r))
        cache.step_agreement.check_digest = True
        prefill_insert(cache, KVOracle(be), seq(0, 4))
        cache.check_events()  # equal trees pass
        if r == 1:  # a mutation only rank 1 makes (a match refreshes access times)
            cache.match_prefix(seq(0, 4))
        with pytest.raises(RankDivergenceError, match="digests differ"):
            cache.check_events()

    run_ranks(group, rank)


# ---------------------------------------------------------------------------------------------- the trace
FULL_DIVERGENCES = divergences("full")
CASES = list(FULL_DIVERGENCES) + ["all"]


def _trace_on_threads(tmp_path, make_agreement, divergence, steps=30):
    group = ThreadGroup(2, timeout=60)

    def rank(r):
        cache, be, ctl = rank_cache(make_agreement(group, r), storage_dir=tmp_path)
        div = (set(FULL_DIVERGENCES) if divergence == "all" else {divergence}) if r == 1 else set()
        try:
            return run_trace(cache, be, ctl, divergence=div, steps=steps)
        finally:
            ctl.close()

    return run_ranks(group, rank, timeout=300)


@pytest.mark.parametrize("divergence", CASES)
def test_ranks_stay_identical_under_divergence(tmp_path, divergence):
    r0, r1 = _trace_on_threads(tmp_path, lambda g, r: g.agreement(r), divergence)
    assert r0["digests"] == r1["digests"]  # after every step
    assert r0["served"] == r1["served"]
    kinds = FULL_DIVERGENCES if divergence == "all" else (divergence,)
    for k in kinds:
        assert r1["fired"][k] > 0, f"{k} never fired: the trace does not exercise it"
    assert sum(r0["served"]) > 0 and r0["storage_tokens"] == r1["storage_tokens"] > 0  # L3 hits too
    assert r0["device_only_reads"] == r1["device_only_reads"]  # reads from before device-only nodes


@pytest.mark.parametrize("divergence", CASES)
def test_without_the_exchange_the_same_divergence_splits_the_trees(tmp_path, divergence):
    r0, r1 = _trace_on_threads(tmp_path, lambda g, r: NoExchangeAgreement(r, 2), divergence)
    first = next((i for i, (a, b) in enumerate(zip(r0["digests"], r1["digests"])) if a != b), None)
    assert first is not None, "the divergence left no trace in the digests"


@pytest.mark.parametrize(
    "rank,num_processes,err",
    [
        (5, 2, ValueError),
        (3, 2, ValueError),
        (-1, 2, ValueError),
        (0, 0, ValueError),
        (0, -2, ValueError),
        (0.5, 2, TypeError),
        (True, 2, TypeError),
        (0, "2", TypeError),
    ],
)
def test_ranks_outside_the_process_count_are_refused(rank, num_processes, err):
    from hicache_jax.cache.agreement import NoExchangeAgreement

    with pytest.raises(err, match="rank|num_processes"):
        NoExchangeAgreement(rank=rank, num_processes=num_processes)
    try:
        from hicache_jax.distributed.agreements import KVStoreAgreement
    except ImportError:  # the torch env has no JAX
        return
    with pytest.raises(err, match="rank|num_processes"):
        KVStoreAgreement("t", client=object(), rank=rank, num_processes=num_processes)
