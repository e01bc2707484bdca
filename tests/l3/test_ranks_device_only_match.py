"""Several ranks: an L3 prefetch whose match ends on device-only nodes (their host copy
reclaimed, or not made yet) reads the rest as one process does (``test_l3_device_only_match``).

Two ranks as threads exchanging through a real barrier (``rank_threads``), a file store both
write their shards to, the tree's digests compared at every step (``check_digest``). Storage
holds the whole prompt; each rank holds its head on the device only (write_through: its host
copy reclaimed; write_back: never made; a hybrid SWA cache too). Checked per rank: the
prefetch is not skipped and starts where the backed-up prefix ends, the tokens attached, the
store's reads, the head's host copy against the oracle, the tiers and bytes served,
``sanity_check``; across ranks: the same results and digests.

Then the head's backup in the ranks' agreement:
* wanted but not yet agreed when the prefetch starts, committed by the steps the prefetch runs:
  the read's pages for the head are freed (the backup's copy stays the only one), the rest
  attaches after it;
* reserved for the step's agreement while an attach runs inside that step (a participant after
  the cache's own): the attach gives the head nothing (its copy is promised to the backup) and
  frees every page; the backup then commits, or, when a rank's allocation failed, rolls back
  and a later prefetch gives the head its copy from storage; the same inside write_back's
  agreement within an eviction. No node ever holds two copies (without the rule,
  ``sanity_check`` finds the double-owned host pages).
"""

from __future__ import annotations

import numpy as np
import pytest
from cache_harness import (
    KVOracle,
    device_only_path,
    fail_next_allocs,
    node_path_pages,
    numpy_backend_factory,
    prefill_insert,
    serve_checked,
    small_geom,
)
from rank_threads import ThreadGroup, run_ranks

from hicache_jax.cache import HiCacheConfig, HiRadixCache, RadixKey
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig

P = 2


def seq(*runs):
    return RadixKey(np.concatenate([np.arange(a, a + n) for a, n in runs]).astype(np.int64))


def rank_rig(agreement, path, policy="write_through", deferred=False):
    """``deferred``: the engine's copies finish only when waited for (or ``complete``d)."""
    be = numpy_backend_factory(small_geom(P, "mha"), 32, 64, "page_first", deferred)
    cache = HiRadixCache(
        HiCacheConfig(page_size=P, load_back_threshold=0, write_policy=policy),
        be.engine,
        be.device.allocator,
        agreement=agreement,
    )
    cache.step_agreement.check_digest = True  # every step: the ranks' trees are identical
    ctl = StorageController(
        cache,
        StorageConfig(
            backend="file", path=str(path), prefetch_threshold_tokens=4, prefetch_policy="wait_complete", worker_nice=0
        ),
        model="ranks",
    )
    return cache, KVOracle(be), ctl


def to_storage_only(cache, oracle, ctl, key):
    prefill_insert(cache, oracle, key)
    cache.flush()  # reserve -> agree -> commit, copy, ack: the L3 job is queued
    cache.evict(cache.evictable_tokens)  # write_back: the backup (agreed inside the eviction) is made here
    assert ctl.flush()  # every rank's shard stored, rank 0's markers written
    cache.evict_host(cache.host_tokens)
    assert cache.host_tokens == 0 and cache.evictable_tokens == 0


def check_head_host_copy(cache, oracle, head):
    node = cache.match_prefix(head).last_device_node
    assert node.host_value is not None
    oracle.check_host(head, node_path_pages(cache, node, host=True))


@pytest.mark.parametrize("nodes,policy", [(1, "write_through"), (2, "write_through"), (2, "write_back")])
def test_two_ranks_read_the_continuation_after_a_device_only_match(nodes, policy, tmp_path):
    """write_through: the head's host copy reclaimed; write_back: never made."""
    group = ThreadGroup(2, timeout=60)
    whole, head = seq((0, 16)), seq((0, 8))

    def rank(r):
        cache, oracle, ctl = rank_rig(group.agreement(r), tmp_path, policy)
        try:
            to_storage_only(cache, oracle, ctl, whole)
            if nodes == 2:
                prefill_insert(cache, oracle, seq((0, 4)))  # the head as two nodes: 4 + 4 tokens
            prefill_insert(cache, oracle, head)
            cache.flush()
            assert ctl.flush()
            cache.evict_host(cache.host_tokens)  # the head's host copy is reclaimed on every rank
            assert cache.host_tokens == 0
            assert device_only_path(cache, whole) == [True] * nodes
            cache.sanity_check(0)
            reads0 = ctl.storage.metrics.hits

            op = ctl.prefetch(whole)
            assert op.reason_code == "" and op.status == "querying", (op.reason_code, op.reason)
            assert (op.start, op.tree_end) == (0, 8)  # read from the backed-up end (the root)
            attached = ctl.finish_prefetch(op)
            assert op.status == "finished", (op.status, op.reason)
            reads = ctl.storage.metrics.hits - reads0
            cache.sanity_check(0)
            assert device_only_path(cache, head) == [False] * nodes  # host copies from the pages read
            check_head_host_copy(cache, oracle, head)
            hits = serve_checked(cache, oracle, whole)
            cache.sanity_check(0)
            return attached, reads, hits, cache.metrics.prefetched_tokens, cache.debug_view().digest()
        finally:
            ctl.close()

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1  # the same tokens attached, reads, tiers and tree on both ranks
    attached, reads, hits, prefetched, _digest = r0
    assert attached == 16 and prefetched == 16 and reads == 16 // P
    assert hits == {"device": 8, "host": 0, "storage": 8}


@pytest.mark.parametrize("in_flight", [False, True])
def test_a_head_backed_up_by_the_agreement_during_the_read_keeps_one_host_copy(in_flight, tmp_path):
    """The head is inserted (write_through: its backup wanted, agreed at the next step) and the
    prefetch starts before any step, from the root. The steps ``finish_prefetch`` runs commit
    the head's backup; the attach then frees the read's pages for the head and attaches the 8
    tokens after it. ``in_flight``: the backup's copy is still unacknowledged at the attach
    (a deferred engine)."""
    group = ThreadGroup(2, timeout=60)
    whole, head = seq((0, 16)), seq((0, 8))

    def rank(r):
        cache, oracle, ctl = rank_rig(group.agreement(r), tmp_path, deferred=in_flight)
        try:
            to_storage_only(cache, oracle, ctl, whole)
            prefill_insert(cache, oracle, head)  # its backup is deferred to the next step
            assert device_only_path(cache, head) == [True]
            op = ctl.prefetch(whole)
            assert (op.status, op.start, op.tree_end) == ("querying", 0, 8), (op.status, op.reason)
            attached = ctl.finish_prefetch(op)
            assert op.status == "finished", (op.status, op.reason)
            assert cache.in_flight[0] == (1 if in_flight else 0)  # the head's copy, unacknowledged
            cache.flush()
            cache.sanity_check(0)
            check_head_host_copy(cache, oracle, head)  # the backup's copy (device bytes)
            hits = serve_checked(cache, oracle, whole)
            cache.sanity_check(0)
            return (
                attached,
                cache.metrics.prefetched_tokens,
                cache.metrics.backup_tokens,
                hits,
                cache.host_tokens,
                cache.debug_view().digest(),
            )
        finally:
            ctl.close()

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1
    attached, prefetched, backed_up, hits, host_tokens, _digest = r0
    assert prefetched == 16  # every page was read ...
    assert attached == 8  # ... but the head's were freed: the backup had given it its copy
    assert backed_up == 16 + 8  # the whole key's first backup, then the head's
    assert host_tokens == 16  # the head once, the 8 tokens after it
    assert hits == {"device": 8, "host": 0, "storage": 8}


class AttachInStep:
    """A step participant registered after the cache's own (and the controller's): its
    ``prepare`` runs while the step's backup reservations wait for their agreement, and attaches
    ``ids`` (host pages for ``key`` from its start, as a read from storage) there, once."""

    def __init__(self, cache, key, ids) -> None:
        self.cache, self.key, self.ids = cache, key, ids
        self.result = None
        self.reserved_then = None

    def prepare(self) -> None:
        if self.ids is not None:
            self.reserved_then = self.cache.debug_view().reserved_backup_nodes
            self.result = self.cache.insert_host(self.key, self.ids, 0)
            self.ids = None

    def report(self, out) -> None:
        pass

    def apply(self, agreed) -> None:
        pass


@pytest.mark.parametrize("rollback", [False, True])
def test_an_attach_inside_a_step_gives_a_node_reserved_for_backup_no_copy(rollback, tmp_path):
    group = ThreadGroup(2, timeout=60)
    whole, head = seq((0, 16)), seq((0, 8))

    def rank(r):
        cache, oracle, ctl = rank_rig(group.agreement(r), tmp_path)
        try:
            to_storage_only(cache, oracle, ctl, whole)
            prefill_insert(cache, oracle, head)  # its backup is wanted: reserved at the next step
            ids = cache.reserve_host_pages(16 // P)
            free0 = cache.host_allocator.available
            part = AttachInStep(cache, whole, ids)
            cache.step_agreement.add(part)
            if rollback and r == 1:  # rank 1's host allocation for the head's backup fails
                fail_next_allocs(cache.host_allocator)
            cache.check_events()  # reserve the head's chain -> the attach -> agree -> commit / roll back
            cache.step_agreement.remove(part)
            attached, leaf = part.result
            assert part.reserved_then == 1 and leaf is None  # the head was reserved: nothing attached
            cache.flush()
            cache.sanity_check(0)
            out = [attached, free0 - cache.host_allocator.available, device_only_path(cache, head)]
            if not rollback:
                check_head_host_copy(cache, oracle, head)  # the backup's copy, the only one
            # Outside the step: the head's copy comes from the backup, or, rolled back, from the read.
            op = ctl.prefetch(whole)
            out.append(ctl.finish_prefetch(op))
            cache.flush()
            cache.sanity_check(0)
            check_head_host_copy(cache, oracle, head)
            out += [serve_checked(cache, oracle, whole), cache.host_tokens, cache.debug_view().digest()]
            cache.sanity_check(0)
            return out
        finally:
            ctl.close()

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1
    attached, taken, head_device_only, later, hits, host_tokens, _digest = r0
    assert attached == 0
    # The attach's 8 pages all went back; the committed backup took the head's 4.
    assert taken == (-16 // P if rollback else 8 // P - 16 // P)
    assert head_device_only == [rollback]
    assert later == (16 if rollback else 8)  # rolled back: the head's copy comes from storage
    assert hits == {"device": 8, "host": 0, "storage": 8} and host_tokens == 16


@pytest.mark.parametrize("head_pages", [8, 10])  # a continuation longer than the window, shorter
def test_two_hybrid_ranks_read_the_continuation_after_a_device_only_match(head_pages, tmp_path):
    """``test_swa_l3_device_only`` over two ranks: the SWA component places its pages on
    device-only nodes (``device_only_host_copies``), so a hybrid cache reads from the root too;
    the window is reserved and read in the agreed second phase, and both ranks attach alike."""
    from swa_harness import SWADriver, insert_with_frontier, make_swa_cache

    W = 6  # SWA context 5 tokens: 3 window pages
    group = ThreadGroup(2, timeout=60)
    k = RadixKey(np.arange(100, 124))  # 12 pages
    key = RadixKey(np.r_[k.token_ids, 7])
    head = RadixKey(k.token_ids[: head_pages * P])

    def path_nodes(cache, key):
        node = cache.match_prefix(key).last_host_node
        out = []
        while node is not cache.root:
            out.append(node)
            node = node.parent
        return out[::-1]

    def rank(r):
        cache, full, swa_be, swa = make_swa_cache(
            page_size=P,
            window=W,
            device_pages=48,
            host_pages=64,
            swa_device_pages=24,
            swa_host_pages=32,
            agreement=group.agreement(r),
        )
        cache.step_agreement.check_digest = True
        drv = SWADriver(cache, full, swa_be, swa)
        ctl = StorageController(
            cache,
            StorageConfig(
                backend="file",
                path=str(tmp_path),
                prefetch_threshold_tokens=4,
                prefetch_policy="wait_complete",
                worker_nice=0,
            ),
            model="m",
        )
        try:
            insert_with_frontier(cache, drv, k, 0)
            cache.flush()
            assert ctl.flush(60)
            cache.evict(cache.evictable_tokens)
            cache.evict_host(cache.host_tokens)
            assert cache.host_tokens == 0 and cache.evictable_tokens == 0
            insert_with_frontier(cache, drv, head, head_pages - 3)  # SWA for the head's window only
            cache.flush()
            assert ctl.flush(60)
            cache.evict_host(cache.host_tokens)
            assert cache.host_tokens == 0 and all(n.host_value is None for n in path_nodes(cache, head))
            cache.sanity_check(0, {"swa": 0})
            reads0 = ctl.storage.metrics.hits
            op = ctl.prefetch(key)
            assert (op.status, op.start) == ("querying", 0), (op, op.reason)
            attached = ctl.finish_prefetch(op)
            assert op.status == "finished", (op, op.reason)
            reads = ctl.storage.metrics.hits - reads0
            cache.sanity_check(0, {"swa": 0})
            nodes = path_nodes(cache, head)
            assert all(n.host_value is not None for n in nodes)
            drv.full.check_host(head, node_path_pages(cache, nodes[-1], host=True))
            req, _lb = drv.admit(key)
            hits = dict(req.hit_tokens)
            assert req.cached_pages == 12
            drv.check_prefix(req)  # full pages and the window's SWA pages, byte-exact
            drv.abort(req)
            cache.flush()
            cache.sanity_check(0, {"swa": 0})
            return attached, reads, hits, cache.debug_view().digest()
        finally:
            ctl.close()

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1
    attached, reads, hits, _digest = r0
    assert attached == 24 and reads == 12 + 3  # every full page from the root, the window's SWA pages
    assert hits == {"device": head_pages * P, "host": 0, "storage": 24 - head_pages * P}


def test_an_attach_during_write_backs_agreement_inside_an_eviction_gives_the_evicted_node_no_copy(tmp_path):
    """write_back: evicting the device-only head reserves its backup and agrees on it inside
    the eviction (``StepAgreement.exchange``). An attach there (the exchange wrapped, as a
    callback the agreement might run) finds the head reserved and frees every page; the backup
    commits, the head leaves the device with that one copy, and a later prefetch attaches only
    the 8 tokens after it."""
    group = ThreadGroup(2, timeout=60)
    whole, head = seq((0, 16)), seq((0, 8))

    def rank(r):
        cache, oracle, ctl = rank_rig(group.agreement(r), tmp_path, "write_back")
        try:
            to_storage_only(cache, oracle, ctl, whole)
            prefill_insert(cache, oracle, head)  # write_back: on the device only
            ids = cache.reserve_host_pages(16 // P)
            steps, seen = cache.step_agreement, []
            real_exchange = steps.exchange

            def exchange(values):
                if not seen:
                    seen.append((cache.debug_view().reserved_backup_nodes, cache.insert_host(whole, ids, 0)))
                return real_exchange(values)

            steps.exchange = exchange
            assert cache.evict(8) == 8  # the head: backed up (agreed inside), then off the device
            steps.exchange = real_exchange
            ((reserved, (attached, leaf)),) = seen
            assert reserved == 1 and attached == 0 and leaf is None
            cache.flush()
            cache.sanity_check(0)
            node = cache.match_prefix(head).last_host_node
            assert node.value is None and node.host_value is not None  # host-only: the backup's copy
            oracle.check_host(head, node_path_pages(cache, node, host=True))
            op = ctl.prefetch(whole)
            later = ctl.finish_prefetch(op)
            hits = serve_checked(cache, oracle, whole)
            cache.sanity_check(0)
            return later, hits, cache.host_tokens, cache.debug_view().digest()
        finally:
            ctl.close()

    r0, r1 = run_ranks(group, rank)
    assert r0 == r1
    later, hits, host_tokens, _digest = r0
    assert later == 8 and host_tokens == 16
    assert hits == {"device": 0, "host": 8, "storage": 8}
