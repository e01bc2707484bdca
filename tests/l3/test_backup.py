"""``hicache_jax.l3.backup``: write-through jobs driven directly (no controller): which pages a
job writes, the host lock it holds until the storage copied them, what settling marks, and
the inline fallback once the backup executor is shut down."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert
from hicache_jax.cache import RadixKey
from hicache_jax.l3.backup import L3Backups
from hicache_jax.l3.node_keys import INFLIGHT, NEW, STORED, NodeDigests
from hicache_jax.l3.pools import TARGET_POOL, L3Pools
from hicache_jax.storage import StorageConfig, create_storage, page_keys

P = 2


class Rig:
    def __init__(self, agreed=False):
        self.cache, self.be = make_cache(numpy_backend_factory, page_size=P)
        self.oracle = KVOracle(self.be)
        self.pools = L3Pools(self.cache.components, model="m", weights_revision="", tp_size=1, tp_rank=0, salt="")
        self.digests = NodeDigests(lambda: self.cache.root, P, self.pools.namespaces)
        self.storage = create_storage(StorageConfig(backend="memory"), self.pools.pools, self.pools.specs)
        self.executor = ThreadPoolExecutor(1)
        self.backups = L3Backups(self.cache, self.pools, self.digests, self.storage, self.executor, agreed=agreed)

    def backed_up(self, key):
        prefill_insert(self.cache, self.oracle, key)
        self.cache.writing_check(block=True)
        return self.cache.match_prefix(key).last_host_node

    def stored(self, key):
        keys = page_keys(self.pools.namespaces(key.namespace)[TARGET_POOL], key.token_ids)
        return self.storage.batch_exists(keys, TARGET_POOL)

    def close(self):
        self.executor.shutdown(wait=True)
        self.storage.close()


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def test_a_job_writes_the_chain_once_and_holds_the_host_pages_until_settled(rig):
    a = seq(0, 12)
    node = rig.backed_up(a)
    job = rig.backups.queue(node)
    assert job is not None and job.pages == 6 and rig.backups.pending_pages() == 6
    assert node.host_lock_ref == 1  # the storage may still be copying the pages
    assert rig.digests.get(node).state == INFLIGHT
    assert rig.backups.queue(node) is None  # in flight: not queued twice
    assert rig.backups.wait(10)
    assert node.host_lock_ref == 0 and len(rig.backups) == 0 and rig.digests.get(node).state == STORED
    assert rig.stored(a) == 6
    # The pages in storage hold the KV the model wrote (read into free host pages).
    spare = list(range(50, 56))
    got = rig.storage.batch_get(
        page_keys(rig.pools.namespaces(a.namespace)[TARGET_POOL], a.token_ids), spare, TARGET_POOL
    )
    assert all(got)
    rig.oracle.check_host(a, np.asarray(spare))
    m = rig.cache.metrics
    assert m.storage_backup_tokens == 12 and m.storage_backup_failed_tokens == 0
    # A child of a stored node: only its own pages.
    b = RadixKey(np.concatenate([a.token_ids, np.arange(100, 104)]))
    job = rig.backups.queue(rig.backed_up(b))
    assert job.pages == 2 and rig.backups.wait(10) and rig.stored(b) == 8


def test_a_failed_write_leaves_the_nodes_new_and_is_retried_below(rig):
    a = seq(0, 8)
    node = rig.backed_up(a)
    real = rig.storage.batch_set
    rig.storage.batch_set = lambda keys, ids, pool: [False] * len(keys)
    rig.backups.queue(node)
    assert rig.backups.wait(10)
    assert rig.digests.get(node).state == NEW and node.host_lock_ref == 0
    assert rig.cache.metrics.storage_backup_failed_tokens == 8 and rig.stored(a) == 0
    rig.storage.batch_set = real
    b = RadixKey(np.concatenate([a.token_ids, np.arange(100, 104)]))
    job = rig.backups.queue(rig.backed_up(b))
    assert job.pages == 6  # a's pages again, with b's
    assert rig.backups.wait(10) and rig.stored(b) == 6


def test_a_job_runs_inline_once_the_executor_is_shut_down(rig):
    """The exit path: ``concurrent.futures`` refuses new work at interpreter exit."""
    rig.executor.shutdown(wait=True)
    a = seq(0, 8)
    job = rig.backups.queue(rig.backed_up(a))
    assert job.done.is_set()  # written on this thread, before queue returned
    rig.backups.reap()
    assert rig.stored(a) == 4 and len(rig.backups) == 0


def test_several_ranks_settle_only_by_the_agreed_outcome():
    rig = Rig(agreed=True)
    try:
        node = rig.backed_up(seq(0, 8))
        job = rig.backups.queue(node)
        job.done.wait(10)
        assert len(rig.backups) == 1  # done here, but nothing settles without a step or a wait
        rig.backups.settle(job, False)  # another rank failed it
        assert rig.digests.get(node).state == NEW and node.host_lock_ref == 0 and len(rig.backups) == 0
    finally:
        rig.close()
