"""L3 with several ranks (threads exchanging through a real barrier; the process tests are in
``tests/distributed``): a page group sharded over the ranks becomes visible only once every
rank's shard is stored (rank 0's commit marker after the ranks agree); a replicated (MLA)
pool is written by rank 0 alone under keys every rank shares."""

from __future__ import annotations

import os
import time

import numpy as np
from cache_harness import KVOracle, numpy_backend_factory, prefill_insert, small_geom
from rank_threads import ThreadGroup, run_ranks
from replicated_engine import mark_replicated

from hicache_jax.cache import HiCacheConfig, HiRadixCache, NoExchangeAgreement, RadixKey
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig

P = 2


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


def rank_setup(agreement, path, kind="mha", **storage):
    be = numpy_backend_factory(small_geom(P, kind), 64, 64, "page_first", False)
    cache = HiRadixCache(
        HiCacheConfig(page_size=P, load_back_threshold=0), be.engine, be.device.allocator, agreement=agreement
    )
    # wait_complete by default: these tests are about which pages are visible, not about a
    # deadline (a 1 s prefetch timeout can pass on a loaded machine; the agreed hit is then 0)
    storage = {"prefetch_policy": "wait_complete", **storage}
    ctl = StorageController(
        cache, StorageConfig(backend="file", path=str(path), prefetch_threshold_tokens=P, **storage), model="ranks"
    )
    return cache, be, ctl


def files(path, pool):
    d = os.path.join(path, "pages-v1", pool)
    return sorted(f for _, _, fs in os.walk(d) for f in fs if f.endswith(".kv"))


def store_then_drop(cache, ctl, oracle, key):
    prefill_insert(cache, oracle, key)
    cache.flush()  # reserve -> agree -> commit, the copy, its ack: the L3 job is queued
    assert ctl.flush()  # agreed done on every rank; rank 0's markers written
    cache.evict(cache.evictable_tokens)
    cache.evict_host(cache.host_tokens)


def fetch(cache, ctl, key):
    op = ctl.prefetch(key)
    got = ctl.finish_prefetch(op)
    req, lb = cache.begin_request(key)
    cache.flush()
    cache.dec_lock_ref(req.last_node) if req.last_node is not None else None
    return got


def test_a_sharded_page_group_is_visible_only_once_every_rank_stored_its_shard(tmp_path):
    group = ThreadGroup(2, timeout=60)
    a, b = seq(0, 8), seq(100, 8)

    def rank(r):
        cache, be, ctl = rank_setup(group.agreement(r), tmp_path)
        assert ctl.markers and ctl.tp_rank == r
        oracle = KVOracle(be)
        fail = [r == 1]  # rank 1's shard of a's pages is not stored (a full disk, say)
        real = ctl.storage.batch_set
        ctl.storage.batch_set = lambda keys, ids, pool=None: (
            [False] * len(keys) if fail[0] and pool == "target" else real(keys, ids, pool)
        )
        store_then_drop(cache, ctl, oracle, a)
        fail[0] = False
        group.barrier.wait(30)
        after_a = (len(files(tmp_path, "commit")), len(files(tmp_path, "target")))
        store_then_drop(cache, ctl, oracle, b)
        after_b = len(files(tmp_path, "commit"))
        got = (fetch(cache, ctl, a), fetch(cache, ctl, b))
        cache.sanity_check(0)
        ctl.close()
        return after_a, after_b, got

    (after_a, after_b, got), other = run_ranks(group, rank)
    assert other[2] == got
    assert after_a == (0, 4)  # rank 0's 4 shard pages are stored, but no marker: invisible
    assert after_b == 4  # b's 4 pages: both shards stored, rank 0 marked them
    assert got == (0, 8)  # a misses on both ranks (no marker), b hits on both


def test_the_query_needs_the_marker_not_only_the_shards(tmp_path):
    group = ThreadGroup(2, timeout=60)
    a = seq(0, 8)

    def rank(r):
        cache, be, ctl = rank_setup(group.agreement(r), tmp_path)
        store_then_drop(cache, ctl, KVOracle(be), a)
        group.barrier.wait(30)
        if r == 0:  # the markers vanish; both ranks' shards stay
            for root, _, fs in os.walk(os.path.join(tmp_path, "pages-v1", "commit")):
                for f in fs:
                    os.remove(os.path.join(root, f))
        group.barrier.wait(30)
        got = fetch(cache, ctl, a)
        ctl.close()
        return got

    assert run_ranks(group, rank) == [0, 0]
    assert len(files(tmp_path, "target")) == 8  # 4 pages x 2 shards


def test_a_replicated_mla_pool_is_written_by_rank_0_only_and_read_by_every_rank(tmp_path):
    group = ThreadGroup(2, timeout=60)
    a = seq(0, 8)

    def rank(r):
        cache, be, ctl = rank_setup(group.agreement(r), tmp_path, kind="mla")
        assert ctl.replicated == {"target"} and not ctl.markers
        sets = []
        real = ctl.storage.batch_set
        ctl.storage.batch_set = lambda keys, ids, pool=None: sets.append(len(keys)) or real(keys, ids, pool)
        store_then_drop(cache, ctl, KVOracle(be), a)
        group.barrier.wait(30)
        got = fetch(cache, ctl, a)
        oracle = KVOracle(be)
        m = cache.match_prefix(a)
        oracle.check_device(a, m.device_indices)  # rank 1 reads the bytes rank 0 wrote
        ctl.close()
        return got, sets

    (got0, sets0), (got1, sets1) = run_ranks(group, rank)
    assert got0 == got1 == 8
    assert sets0 == [4] and sets1 == []  # rank 1 never writes the shared pages
    assert len(files(tmp_path, "target")) == 4 and not files(tmp_path, "commit")


def test_a_page_missing_on_one_rank_sizes_every_ranks_host_eviction_alike(tmp_path):
    """The hit is agreed (MIN) before host pages are reserved for it: rank 1 sees only 3 of a
    prefix's 8 stored pages, so both ranks reserve 3 and evict the same host leaves for them
    (a rank reserving for its own hit would evict more, and the trees would differ)."""
    group = ThreadGroup(2, timeout=60)
    a = seq(0, 16)  # 8 pages

    def rank(r):
        cache, be, ctl = rank_setup(group.agreement(r), tmp_path)
        oracle = KVOracle(be)
        store_then_drop(cache, ctl, oracle, a)
        for i in range(16):  # fill the host with 16 host-only leaves of 4 pages each
            prefill_insert(cache, oracle, seq(1000 + 100 * i, 8))
            cache.flush()
            cache.evict(cache.evictable_tokens)
        assert ctl.flush()
        assert cache.host_allocator.available == 0
        if r == 1:
            exists_multi = ctl.storage.exists_multi

            def missing(transfers):
                res = exists_multi(transfers)
                return type(res)(min(res.hit_pages, 3), {k: min(v, 3) for k, v in res.pool_hits.items()})

            ctl.storage.exists_multi = missing
        before = cache.metrics.evicted_host_tokens
        got = ctl.finish_prefetch(ctl.prefetch(a))
        evicted = cache.metrics.evicted_host_tokens - before
        digest = cache.debug_view().digest()
        cache.sanity_check(0)
        ctl.close()
        return got, evicted, digest

    (got0, ev0, d0), (got1, ev1, d1) = run_ranks(group, rank)
    assert got0 == got1 == 3 * P
    assert ev0 == ev1 == 4 * P  # one 4-page leaf made room for the 3 agreed pages, on both ranks
    assert d0 == d1


def _deadline_on_one_rank(tmp_path, make_agreement):
    """Both ranks prefetch a stored 8-page prefix under the ``timeout`` policy; rank 1's
    deadline has already passed (its timeout is 0 s, as if its clock ran ahead) and its reads
    are slow, while rank 0 has 60 s and reads at once."""
    group = ThreadGroup(2, timeout=60)
    a = seq(0, 16)

    def rank(r):
        late = (
            {"prefetch_timeout_base_s": 0.0, "prefetch_timeout_per_ki_token_s": 0.0}
            if r == 1
            else {"prefetch_timeout_base_s": 60.0}
        )
        cache, be, ctl = rank_setup(make_agreement(group, r), tmp_path, prefetch_policy="timeout", **late)
        store_then_drop(cache, ctl, KVOracle(be), a)
        if r == 1:
            get_multi = ctl.storage.get_multi

            def slow(transfers):
                time.sleep(0.3)
                return get_multi(transfers)

            ctl.storage.get_multi = slow
        got = ctl.finish_prefetch(ctl.prefetch(a))
        cache.flush()
        ctl.flush()
        timeouts = cache.metrics.prefetch_timeouts
        digest = cache.debug_view().digest()
        cache.sanity_check(0)
        ctl.close()
        return got, timeouts, digest

    return run_ranks(group, rank)


def test_a_deadline_passed_on_one_rank_stops_the_prefetch_on_every_rank(tmp_path):
    """ "A prefetch that may terminate" is agreed (a MAX): rank 1's deadline stops rank 0's
    prefetch at the same step, with the same pages attached."""
    (got0, t0, d0), (got1, t1, d1) = _deadline_on_one_rank(tmp_path, lambda g, r: g.agreement(r))
    assert t0 == t1 == 1
    assert got0 == got1 < 8 * P
    assert d0 == d1


def test_without_the_exchange_only_the_late_rank_stops(tmp_path):
    (got0, t0, d0), (got1, t1, d1) = _deadline_on_one_rank(tmp_path, lambda g, r: NoExchangeAgreement(r, 2))
    assert (t0, t1) == (0, 1) and got0 == 8 * P > got1
    assert d0 != d1


def test_a_replicated_draft_pool_is_written_by_rank_0_only_and_read_by_every_rank(tmp_path):
    """A draft sidecar whose engine is ``replicated`` (fewer KV heads than ranks: every rank
    holds all of them) is stored like an MLA pool: rank 0 alone writes it, under keys every
    rank shares; the target stays sharded (both ranks write, rank 0 marks). Both ranks read
    the draft pages back byte for byte."""
    group = ThreadGroup(2, timeout=60)
    a = seq(0, 8)

    def rank(r):
        be = numpy_backend_factory(small_geom(P), 64, 64, "page_first", False)
        side = numpy_backend_factory(small_geom(P, layers=1), 64, 64, "page_first", False)
        mark_replicated(side.engine)
        cache = HiRadixCache(
            HiCacheConfig(page_size=P, load_back_threshold=0),
            be.engine,
            be.device.allocator,
            {"draft": side.engine},
            agreement=group.agreement(r),
        )
        ctl = StorageController(
            cache,
            StorageConfig(
                backend="file", path=str(tmp_path), prefetch_threshold_tokens=P, prefetch_policy="wait_complete"
            ),
            model="ranks",
        )
        assert ctl.replicated == {"draft"} and ctl.markers
        sets = []
        real = ctl.storage.batch_set
        ctl.storage.batch_set = lambda keys, ids, pool=None: sets.append((pool, len(keys))) or real(keys, ids, pool)
        oracles = [KVOracle(be), KVOracle(side, salt=0x5A5A5A5A)]
        prefill_insert(cache, oracles[0], a)
        oracles[1].write(a, cache.match_prefix(a).device_indices)
        cache.flush()
        assert ctl.flush()
        cache.evict(cache.evictable_tokens)
        cache.evict_host(cache.host_tokens)
        group.barrier.wait(30)
        got = fetch(cache, ctl, a)
        m = cache.match_prefix(a)
        for oracle in oracles:  # rank 1's draft bytes are the ones rank 0 wrote
            oracle.check_device(a, m.device_indices)
        digest = cache.debug_view().digest()
        ctl.close()
        return got, sets, digest

    (got0, sets0, d0), (got1, sets1, d1) = run_ranks(group, rank)
    assert got0 == got1 == 8 and d0 == d1
    assert sorted(sets0) == [("commit", 4), ("draft", 4), ("target", 4)]
    assert sets1 == [("target", 4)]  # rank 1 writes its target shard, never the shared draft pages
    assert len(files(tmp_path, "draft")) == 4  # one key per page: the same on both ranks
    assert len(files(tmp_path, "target")) == 8 and len(files(tmp_path, "commit")) == 4
