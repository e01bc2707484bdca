"""``hicache_jax.l3.prefetch``: prefetch operations driven directly (no controller): what a
start skips and why, the bytes that attach, pages that stay reserved while a read may still
write them, and what a short arrival does."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, node_path_pages, numpy_backend_factory, prefill_insert
from hicache_jax.cache import RadixKey
from hicache_jax.l3.backup import L3Backups
from hicache_jax.l3.node_keys import NodeDigests
from hicache_jax.l3.pools import L3Pools
from hicache_jax.l3.prefetch import Prefetcher
from hicache_jax.storage import StorageConfig
from hicache_jax.storage.memory import MemoryStorage

P = 2
GATE_S = 20.0


class ReadGate(MemoryStorage):
    """Page reads wait for a permit each (one per batch); every wait gives up after GATE_S."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.reads = threading.Semaphore(1000)
        self.reads_started = threading.Event()

    def hold(self):
        self.reads = threading.Semaphore(0)

    def _read(self, pool, keys):
        self.reads_started.set()
        self.reads.acquire(timeout=GATE_S)
        return super()._read(pool, keys)


class Rig:
    def __init__(self, policy="wait_complete", threshold=4, batch_pages=2):
        self.cache, self.be = make_cache(numpy_backend_factory, page_size=P)
        self.oracle = KVOracle(self.be)
        self.config = StorageConfig(backend="memory", prefetch_policy=policy, prefetch_threshold_tokens=threshold)
        self.pools = L3Pools(self.cache.components, model="m", weights_revision="", tp_size=1, tp_rank=0, salt="")
        self.digests = NodeDigests(lambda: self.cache.root, P, self.pools.namespaces)
        self.storage = ReadGate(self.config, self.pools.pools, self.pools.specs)
        self.executors = [ThreadPoolExecutor(1) for _ in range(3)]
        self.backups = L3Backups(self.cache, self.pools, self.digests, self.storage, self.executors[0], agreed=False)
        self.pf = Prefetcher(
            self.cache,
            self.pools,
            self.digests,
            self.storage,
            self.config,
            owner=self,
            query=self.executors[1],
            io=self.executors[2],
            batch_pages=batch_pages,
            max_inflight_fraction=0.5,
            agreed=False,
        )

    def store(self, key):
        """Write ``key``'s KV to storage, then drop it from both tiers."""
        prefill_insert(self.cache, self.oracle, key)
        self.cache.writing_check(block=True)
        self.backups.queue(self.cache.match_prefix(key).last_host_node)
        assert self.backups.wait(10)
        self.cache.evict(self.cache.evictable_tokens)
        self.cache.evict_host(self.cache.host_tokens)
        assert self.cache.host_tokens == 0

    def close(self):
        for ex in self.executors:
            ex.shutdown(wait=True)


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


def wait_for(cond, timeout=10.0):
    t = time.perf_counter() + timeout
    while not cond():
        assert time.perf_counter() < t, "timed out"
        time.sleep(0.002)


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def test_a_stored_continuation_attaches_with_the_bytes_that_were_written(rig):
    a = seq(0, 12)
    rig.store(a)
    op = rig.pf.start(a)
    assert op.status == "querying" and len(rig.pf) == 1
    assert rig.pf.finish(op) == 12 and op.status == "finished" and op.storage_tokens == 12
    node = rig.cache.match_prefix(a).last_host_node
    rig.oracle.check_host(a, node_path_pages(rig.cache, node, host=True))
    assert len(rig.pf) == 0 and rig.pf.reserved_host_pages().size == 0
    rig.cache.sanity_check()


@pytest.mark.parametrize("case", ["below_threshold", "closed", "not_stored"])
def test_what_never_reads(rig, case):
    if case == "below_threshold":
        op = rig.pf.start(seq(0, 3))  # 2 tokens after the page cut, threshold 4
        assert op.status == "skipped" and op.reason_code == "below_threshold" and "< 4" in op.reason
    elif case == "closed":
        op = rig.pf.start(seq(0, 12), closed=True)
        assert op.status == "closed" and op.reason_code == "closed"
    else:
        op = rig.pf.start(seq(0, 12))
        assert rig.pf.finish(op) == 0 and op.status == "revoked" and op.reason == "no storage hit"
    assert len(rig.pf) == 0 and rig.pf.reserved_host_pages().size == 0
    assert rig.cache.metrics.prefetch_skipped_by_reason.get(case, 0) == (case != "not_stored")


def test_cancel_of_a_loading_read_keeps_its_pages_until_the_read_lets_go(rig):
    a = seq(0, 12)
    rig.store(a)
    rig.storage.hold()
    op = rig.pf.start(a)
    wait_for(lambda: op.progress()[0] is not None)
    rig.pf.advance(op)
    assert op.status == "loading"
    reserved = rig.pf.reserved_host_pages().copy()
    assert reserved.size == 6
    wait_for(rig.storage.reads_started.is_set)
    rig.pf.cancel(op)
    assert op.status == "revoked" and op.reason == "cancelled"
    # The IO thread may still write these pages: they stay reserved, not free.
    assert np.array_equal(np.sort(rig.pf.reserved_host_pages()), np.sort(reserved))
    assert rig.pf.draining() == [op]
    assert rig.cache.host_allocator.available == 64 - 6  # not back in the allocator
    rig.storage.reads.release(1000)
    wait_for(lambda: op.progress()[2])
    rig.pf.poll()
    assert rig.pf.draining() == [] and rig.pf.reserved_host_pages().size == 0
    rig.cache.sanity_check(0)


def test_a_read_cut_short_attaches_what_arrived_and_parks_the_rest():
    rig = Rig(policy="best_effort")
    try:
        a = seq(0, 12)
        rig.store(a)
        rig.storage.hold()
        op = rig.pf.start(a)
        wait_for(lambda: op.progress()[0] is not None)
        rig.pf.advance(op)
        rig.storage.reads.release(1)  # the first batch (2 pages) only
        wait_for(lambda: op.progress()[1] == 2)
        assert rig.pf.finish(op) == 4  # best_effort: what has arrived
        assert rig.pf.reserved_host_pages().size == 4  # the rest, still under the read
        node = rig.cache.match_prefix(seq(0, 4)).last_host_node
        rig.oracle.check_host(seq(0, 4), node_path_pages(rig.cache, node, host=True))
        rig.storage.reads.release(1000)
        wait_for(lambda: op.progress()[2])
        rig.pf.poll()
        assert rig.pf.reserved_host_pages().size == 0
        rig.cache.sanity_check(0)
    finally:
        rig.close()


def test_an_arrival_below_the_threshold_is_revoked_and_freed():
    rig = Rig(policy="best_effort", threshold=6, batch_pages=2)
    try:
        a = seq(0, 12)
        rig.store(a)
        rig.storage.hold()
        op = rig.pf.start(a)
        wait_for(lambda: op.progress()[0] is not None)
        rig.pf.advance(op)
        rig.storage.reads.release(1)
        wait_for(lambda: op.progress()[1] == 2)
        free = rig.cache.host_allocator.available
        assert rig.pf.finish(op) == 0 and op.status == "revoked" and op.reason == "arrived below the threshold"
        assert rig.cache.host_allocator.available == free + 2  # the 2 pages that arrived, freed
        rig.storage.reads.release(1000)
        wait_for(lambda: op.progress()[2])
        rig.pf.poll()
        rig.cache.sanity_check(0)
    finally:
        rig.close()
