"""``hicache_jax.l3.rank_steps``: the L3 agreement participant driven by hand on one process
(rank 0 of 2): what it reports, and that it acts on the agreed values only -- a hit lowered by
another rank, a reservation, a backup job another rank failed, and the commit markers that
make a page group visible to queries."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert
from hicache_jax.cache import RadixKey
from hicache_jax.l3.backup import L3Backups
from hicache_jax.l3.node_keys import NEW, STORED, NodeDigests
from hicache_jax.l3.pools import COMMIT_POOL, L3Pools
from hicache_jax.l3.prefetch import Prefetcher
from hicache_jax.l3.rank_steps import OP_BUDGET, RankSteps
from hicache_jax.storage import StorageConfig, create_storage, page_keys

P = 2


class Rank0:
    def __init__(self, threshold_tokens: int = 4, max_inflight_fraction: float = 0.5):
        self.cache, self.be = make_cache(numpy_backend_factory, page_size=P)
        self.oracle = KVOracle(self.be)
        self.config = StorageConfig(
            backend="memory", prefetch_policy="best_effort", prefetch_threshold_tokens=threshold_tokens
        )
        self.pools = L3Pools(self.cache.components, model="m", weights_revision="", tp_size=2, tp_rank=0, salt="")
        self.digests = NodeDigests(lambda: self.cache.root, P, self.pools.namespaces)
        self.storage = create_storage(self.config, self.pools.pools, self.pools.specs)
        self.executors = [ThreadPoolExecutor(1) for _ in range(3)]
        self.backups = L3Backups(self.cache, self.pools, self.digests, self.storage, self.executors[0], agreed=True)
        self.pf = Prefetcher(
            self.cache,
            self.pools,
            self.digests,
            self.storage,
            self.config,
            owner=self,
            query=self.executors[1],
            io=self.executors[2],
            batch_pages=128,
            max_inflight_fraction=max_inflight_fraction,
            agreed=True,
        )
        self.steps = RankSteps(self.cache, self.pools, self.pf, self.backups, self.storage, self.config)

    def step(self, other=None):
        """One step; ``other``: the other rank's report (default: the same as this rank's)."""
        self.steps.prepare()
        out = []
        self.steps.report(out)
        agreed = np.minimum(out, out if other is None else other(out))
        self.steps.apply(agreed)
        return out

    def markers(self, key):
        keys = page_keys(self.pools.namespaces(key.namespace)[COMMIT_POOL], key.token_ids)
        return self.storage.batch_exists(keys, COMMIT_POOL)

    def backed_up(self, key):
        prefill_insert(self.cache, self.oracle, key)
        self.cache.writing_check(block=True)
        return self.cache.match_prefix(key).last_host_node

    def close(self):
        for ex in self.executors:
            ex.shutdown(wait=True)


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


@pytest.fixture
def r0():
    r = Rank0()
    yield r
    r.close()


def test_a_job_every_rank_stored_is_committed_with_markers(r0):
    a = seq(0, 8)
    node = r0.backed_up(a)
    job = r0.backups.queue(node)
    assert job.done.wait(10)
    assert r0.step() == [2]  # 2: stored here
    r0.executors[0].submit(lambda: None).result()  # the markers are queued on the backup thread
    assert r0.digests.get(node).state == STORED and len(r0.backups) == 0 and node.host_lock_ref == 0
    assert r0.markers(a) == 4


def test_a_job_another_rank_failed_is_not_committed(r0):
    a = seq(0, 8)
    node = r0.backed_up(a)
    job = r0.backups.queue(node)
    assert job.done.wait(10)
    r0.step(other=lambda out: [1])  # 1: failed on the other rank
    r0.executors[0].submit(lambda: None).result()
    assert r0.digests.get(node).state == NEW and len(r0.backups) == 0 and node.host_lock_ref == 0
    assert r0.markers(a) == 0  # never visible: the other rank's shard is missing


def test_a_running_job_stays_until_every_rank_is_done(r0):
    node = r0.backed_up(seq(0, 8))
    job = r0.backups.queue(node)
    assert job.done.wait(10)
    r0.step(other=lambda out: [0])  # still running on the other rank
    assert len(r0.backups) == 1 and node.host_lock_ref == 1


def _answered(r0, op):
    t = time.perf_counter() + 10
    while op.progress()[0] is None:
        assert time.perf_counter() < t
        time.sleep(0.002)


def _store_committed(r0, key):
    r0.backups.queue(r0.backed_up(key))
    r0.backups.jobs()[0].done.wait(10)
    r0.step()
    r0.executors[0].submit(lambda: None).result()
    r0.cache.evict(r0.cache.evictable_tokens)
    r0.cache.evict_host(r0.cache.host_tokens)


def test_query_hit_is_the_ranks_minimum_and_the_read_reserves_that_many(r0):
    a = seq(0, 16)
    _store_committed(r0, a)
    op = r0.pf.start(a)
    _answered(r0, op)
    assert op.progress()[0] == 8
    assert r0.step(other=lambda out: [5]) == [8]  # this rank saw 8 pages; the other only 5
    assert op.agreed.hit == 5 and op.status == "querying"  # nothing reserved before the next step
    free = r0.cache.host_allocator.available
    assert r0.step() == [1]  # reservation succeeded here
    assert op.status == "loading" and op.reserved_pages == 5 and r0.cache.host_allocator.available == free - 5
    t = time.perf_counter() + 10
    while not op.progress()[2]:
        assert time.perf_counter() < t
        time.sleep(0.002)
    r0.step(other=lambda out: [out[0], out[1], 0])
    assert op.agreed.done == 5 and op.agreed.finished
    assert r0.steps.finish(op) == 10 and op.status == "finished"


def test_a_query_without_commit_markers_hits_nothing(r0):
    a = seq(0, 16)
    r0.backups.queue(r0.backed_up(a))
    r0.backups.jobs()[0].done.wait(10)
    r0.step(other=lambda out: [1])  # the other rank's shard failed: no markers
    r0.cache.evict(r0.cache.evictable_tokens)
    r0.cache.evict_host(r0.cache.host_tokens)
    assert (
        r0.storage.batch_exists(page_keys(r0.pools.namespaces(a.namespace)["target"], a.token_ids), "target") == 8
    )  # this rank's shard is there
    op = r0.pf.start(a)
    _answered(r0, op)
    assert op.progress()[0] == 0


def test_an_agreed_hit_below_the_threshold_is_revoked(r0):
    a = seq(0, 16)
    _store_committed(r0, a)
    op = r0.pf.start(a)
    _answered(r0, op)
    r0.step(other=lambda out: [1])  # 1 page < threshold 4 tokens
    assert op.status == "revoked" and op.reason == "storage hit below the threshold"
    assert not r0.pf.in_flight(op)


def test_an_exchange_that_fails_gives_back_the_reservation_and_the_next_step_reserves_again(r0):
    """``prepare`` reserved host pages for an agreed hit, then the exchange failed
    (``AgreementError`` on every rank: ``abandon``). The pages go back at once (the allocator and
    ``sanity_check`` see no leak) and the next good step reserves and reads as before."""
    a = seq(0, 16)
    _store_committed(r0, a)
    op = r0.pf.start(a)
    _answered(r0, op)
    r0.step()
    assert op.agreed.hit == 8 and op.status == "querying"
    free = r0.cache.host_allocator.available
    r0.steps.prepare()  # reserves the 8 pages ...
    assert r0.cache.host_allocator.available == free - 8
    r0.steps.abandon()  # ... and the exchange failed
    assert r0.cache.host_allocator.available == free and op.agreed.reservation is None
    r0.cache.sanity_check(0)
    assert r0.step() == [1] and op.status == "loading" and op.reserved_pages == 8


def test_an_exchange_that_fails_before_a_hit_was_agreed_gives_back_nothing(r0):
    """``abandon`` of a step in which a querying prefetch reserved nothing (its hit is not agreed
    yet) settles no pages, and the prefetch goes on as if the step had not run."""
    a = seq(0, 16)
    _store_committed(r0, a)
    op = r0.pf.start(a)
    _answered(r0, op)
    free = r0.cache.host_allocator.available
    r0.steps.prepare()
    assert op.status == "querying" and op.agreed.reservation is None
    r0.steps.abandon()
    assert r0.cache.host_allocator.available == free and op.status == "querying"
    r0.cache.sanity_check(0)
    r0.step()
    assert op.agreed.hit == 8 and op.status == "querying"


def test_a_reservation_that_cannot_hold_the_threshold_reserves_nothing():
    """The fewest pages worth reading are the threshold's tokens rounded up to whole pages: with
    a 5-token threshold (pages of 2) and 2 host pages free, 8 agreed pages reserve nothing (2
    pages are 4 tokens, below the threshold) and the prefetch is revoked; 3 free pages are read."""
    for free_pages, status in ((2, "revoked"), (3, "loading")):
        r0 = Rank0(threshold_tokens=5)
        try:
            a = seq(0, 16)
            _store_committed(r0, a)
            op = r0.pf.start(a)
            _answered(r0, op)
            r0.step()
            assert op.agreed.hit == 8 and op.status == "querying"
            hold = r0.cache.host_allocator.alloc(r0.cache.host_allocator.available - free_pages)  # not evictable
            r0.step()
            assert op.status == status, (free_pages, op.status, op.reason)
            if status == "revoked":
                assert op.reason == "no host memory for the hit" and op.reserved_pages == 0
                assert r0.cache.host_allocator.available == free_pages  # nothing reserved, nothing leaked
            else:
                assert op.reserved_pages == 3 and r0.cache.metrics.prefetch_truncated == 1
                t = time.perf_counter() + 10
                while not op.progress()[2]:
                    assert time.perf_counter() < t
                    time.sleep(0.002)
                r0.step()
                r0.steps.finish(op)
            r0.cache.host_allocator.free(hold)
        finally:
            r0.close()


def test_at_most_op_budget_operations_report_in_a_step_and_the_rest_at_the_next():
    """The agreement vector has a fixed width: a step reports ``OP_BUDGET`` operations at most,
    in start order; the others wait for a later step (none is lost or reported twice)."""
    r0 = Rank0(max_inflight_fraction=1.0)  # 30 queries of 2 pages each fit the 64 host pages
    try:
        ops = [r0.pf.start(seq(1000 * i, 4)) for i in range(OP_BUDGET + 6)]
        assert all(op.status == "querying" for op in ops)
        for op in ops:
            _answered(r0, op)
        assert r0.step() == [0] * OP_BUDGET  # no storage hit anywhere
        assert [op.status for op in ops] == ["revoked"] * OP_BUDGET + ["querying"] * 6
        assert r0.step() == [0] * 6
        assert all(op.status == "revoked" and op.reason == "no storage hit" for op in ops)
    finally:
        r0.close()
