"""Write policies (write_through, write_through_selective, write_back) and eviction
policies (LRU, LFU), including the in-flight D2H lock and backup contiguity."""

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, node_path_pages, prefill_insert
from hicache_jax.cache import RadixKey


def seq(start, n, ns=None):
    return RadixKey(np.arange(start, start + n, dtype=np.int64), ns)


def evict_all_and_reload(cache, be, oracle, key):
    """Demote everything, load key back, and check the bytes that came back."""
    be.complete_all()
    cache.flush()
    cache.evict(10**9)
    m = cache.match_prefix(key)
    assert m.device_hit_length == 0
    lb = cache.load_back(m.last_host_node)
    assert lb is not None
    be.complete_all()
    cache.flush()
    oracle.check_device(key, lb.device_pages)
    return lb


# ---------------------------------------------------------------- write_through
def test_write_through_backs_up_at_insert_and_locks_until_ack(backend_factory):
    cache, be = make_cache(backend_factory, deferred=True)
    oracle = KVOracle(be)
    node = prefill_insert(cache, oracle, seq(0, 12)).last_node
    assert node.backuped and cache.in_flight == (1, 0)
    assert node.lock_ref == 1 and node.host_lock_ref == 1
    assert cache.evict(12) == 0  # locked until acknowledged
    assert cache.writing_check() == 0  # copy not done yet
    be.complete_all()
    assert cache.writing_check() == 1
    assert node.lock_ref == 0 and node.host_lock_ref == 0
    oracle.check_host(seq(0, 12), node.host_value)
    assert cache.evict(12) == 12 and node.evicted
    assert cache.metrics.backup_tokens == 12
    assert cache.metrics.backup_bytes == 12 * be.geom.bytes_per_page
    evict_all_and_reload(cache, be, oracle, seq(0, 12))
    cache.sanity_check(0)


def test_write_through_acks_are_fifo(backend_factory):
    cache, be = make_cache(backend_factory, deferred=True)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 4))
    prefill_insert(cache, oracle, seq(100, 4))
    first, second = list(be.pending)
    be.complete(second)
    assert cache.writing_check() == 0  # the head is not done
    be.complete(first)
    assert cache.writing_check() == 2
    cache.sanity_check(0)


def test_backup_done_when_issued_is_acknowledged_at_once_after_earlier_ones(backend_factory, monkeypatch):
    """A copy the engine finishes while issuing it is acknowledged inside the insert (no
    locks, nothing in flight), unless an earlier backup still waits: then it queues behind
    it (FIFO). Its host copy holds the right bytes either way."""
    cache, be = make_cache(backend_factory, deferred=True)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 8))  # deferred: in flight
    assert cache.in_flight == (1, 0)
    issue = cache.components.backup

    def synchronous(device_ids, host_ids):
        handle = issue(device_ids, host_ids)
        be.complete(handle)
        return handle

    monkeypatch.setattr(cache.components, "backup", synchronous)
    prefill_insert(cache, oracle, seq(100, 8))  # done at once, but the first one waits
    assert cache.in_flight == (2, 0)
    be.complete_all()
    assert cache.writing_check() == 2
    acked = cache.metrics.backup_tokens
    node = prefill_insert(cache, oracle, seq(200, 12)).last_node  # nothing waits: acknowledged now
    assert cache.in_flight == (0, 0) and cache.protected_tokens == 0
    assert node.backuped and node.lock_ref == 0 and node.host_lock_ref == 0
    assert cache.metrics.backup_tokens == acked + 12
    cache.sanity_check(0)
    oracle.check_host(seq(200, 12), node.host_value)
    evict_all_and_reload(cache, be, oracle, seq(200, 12))
    cache.sanity_check(0)


def test_write_through_backs_up_unbacked_ancestors_parent_first(backend_factory):
    cache, be = make_cache(backend_factory, write_policy="write_through_selective")
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 4))  # 1 hit: not backed up
    prefill_insert(cache, oracle, seq(0, 8))  # parent 2 hits, child 1 hit
    parent = cache.match_prefix(seq(0, 4)).last_device_node
    child = cache.match_prefix(seq(0, 8)).last_device_node
    assert parent.backuped and not child.backuped
    prefill_insert(cache, oracle, seq(0, 8))  # child reaches 2 hits
    assert child.backuped
    cache.flush()
    oracle.check_host(seq(0, 8), node_path_pages(cache, child, host=True))
    cache.sanity_check(0)


def test_write_through_host_full_leaves_nodes_unbacked(backend_factory):
    cache, be = make_cache(backend_factory, device_pages=32, host_pages=8, host_reclaim=False)
    oracle = KVOracle(be)
    a = prefill_insert(cache, oracle, seq(0, 6)).last_node
    b = prefill_insert(cache, oracle, seq(100, 6)).last_node  # host has 2 pages left
    assert a.backuped and not b.backuped
    assert cache.metrics.backup_failed_tokens == 6
    cache.flush()
    cache.sanity_check(0)


def test_chunked_insert_counts_no_hit_and_backs_up_nothing(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    node = prefill_insert(cache, oracle, seq(0, 8), chunked=True).last_node
    assert node.hit_count == 0 and not node.backuped
    cache.sanity_check(0)


# ---------------------------------------------------------------- write_through_selective
def test_selective_backs_up_prompts_at_finish_outputs_when_reused(backend_factory):
    cache, be = make_cache(backend_factory, write_policy="write_through_selective", device_pages=64, host_pages=128)
    oracle = KVOracle(be)
    prompt, full = seq(0, 12), seq(0, 16)
    req, _ = cache.begin_request(prompt)
    req.extend(prompt, cache.alloc_device(12))
    oracle.write(prompt, req.device_pages)
    cache.cache_unfinished_req(req)  # prompt: 1 hit
    assert not cache.match_prefix(prompt).last_device_node.backuped
    req.extend(full, cache.alloc_device(4))
    oracle.write(full, req.device_pages[12:], 12)
    cache.cache_finished_req(req)  # prompt: 2 hits -> backed up; output: 1 hit
    cache.flush()
    prompt_node = cache.match_prefix(prompt).last_device_node
    out_node = cache.match_prefix(full).last_device_node
    assert prompt_node.backuped and not out_node.backuped
    prefill_insert(cache, oracle, full)  # output reused
    assert out_node.backuped
    evict_all_and_reload(cache, be, oracle, full)
    cache.sanity_check(0)


def test_selective_custom_threshold(backend_factory):
    cache, be = make_cache(backend_factory, write_policy="write_through_selective", write_through_threshold=3)
    oracle = KVOracle(be)
    for i in range(3):
        node = prefill_insert(cache, oracle, seq(0, 4)).last_node
        assert node.backuped == (i == 2)


# ---------------------------------------------------------------- write_back
def test_write_back_copies_only_at_eviction(backend_factory):
    cache, be = make_cache(backend_factory, write_policy="write_back", deferred=True)
    oracle = KVOracle(be)
    node = prefill_insert(cache, oracle, seq(0, 12)).last_node
    assert not node.backuped and cache.in_flight == (0, 0)
    assert cache.evict(12) == 12  # blocks on the copy (forces the deferred engine)
    assert node.evicted and node.backuped
    assert cache.metrics.backup_tokens == 12
    evict_all_and_reload(cache, be, oracle, seq(0, 12))
    cache.sanity_check(0)


def test_write_back_backs_up_unbacked_ancestors(backend_factory):
    cache, be = make_cache(backend_factory, write_policy="write_back")
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 6))
    leaf = prefill_insert(cache, oracle, seq(0, 12)).last_node
    parent = leaf.parent
    cache.inc_lock_ref(parent)
    assert cache.evict(6) == 6
    assert leaf.evicted and leaf.backuped and parent.backuped and not parent.evicted
    cache.dec_lock_ref(parent)
    cache.sanity_check(0)
    evict_all_and_reload(cache, be, oracle, seq(0, 12))


def test_write_back_host_full_drops_subtree(backend_factory):
    cache, be = make_cache(backend_factory, write_policy="write_back", device_pages=32, host_pages=4)
    oracle = KVOracle(be)
    node = prefill_insert(cache, oracle, seq(0, 12)).last_node
    assert cache.evict(12) == 12
    assert node.deleted
    assert cache.metrics.dropped_tokens == 12
    assert cache.match_prefix(seq(0, 12)).host_hit_length == 0
    assert be.host.allocator.available == 4
    cache.sanity_check(0)


def test_write_back_makes_host_room_by_evicting_host_leaves(backend_factory):
    cache, be = make_cache(backend_factory, write_policy="write_back", device_pages=32, host_pages=12)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 12))
    cache.evict(12)  # host full of seq(0)
    b = prefill_insert(cache, oracle, seq(100, 12)).last_node
    cache.evict(12)  # host eviction drops seq(0) to take seq(100)
    assert b.backuped and b.evicted
    assert cache.match_prefix(seq(0, 12)).host_hit_length == 0
    evict_all_and_reload(cache, be, oracle, seq(100, 12))
    cache.sanity_check(0)


# ---------------------------------------------------------------- eviction policies
def _three_leaves(cache, oracle):
    a = prefill_insert(cache, oracle, seq(0, 4)).last_node
    b = prefill_insert(cache, oracle, seq(100, 4)).last_node
    c = prefill_insert(cache, oracle, seq(200, 4)).last_node
    return a, b, c


def test_lru_evicts_least_recently_used(backend_factory):
    cache, be = make_cache(backend_factory, write_policy="write_back", eviction_policy="lru")
    oracle = KVOracle(be)
    a, b, c = _three_leaves(cache, oracle)
    prefill_insert(cache, oracle, seq(0, 4))  # a: 2 hits, most recent
    cache.match_prefix(seq(100, 4))  # b: recent (match refreshes time, no hit)
    cache.evict(4)
    assert c.evicted and not a.evicted and not b.evicted


def test_lfu_evicts_least_frequently_hit(backend_factory):
    # write_through: under write_back no hits are counted, so LFU orders by access time
    # (test_tree_decisions)
    cache, be = make_cache(backend_factory, eviction_policy="lfu")
    oracle = KVOracle(be)
    a, b, c = _three_leaves(cache, oracle)
    prefill_insert(cache, oracle, seq(200, 4))  # c: 2 hits
    prefill_insert(cache, oracle, seq(0, 4))  # a: 2 hits
    cache.match_prefix(seq(100, 4))  # b: most recent but 1 hit
    cache.flush()  # an asynchronous backend's write-through backups hold the nodes until acknowledged
    cache.evict(4)
    assert b.evicted and not a.evicted and not c.evicted
    cache.evict(4)  # ties on hits: least recent first (c was touched before a)
    assert c.evicted and not a.evicted


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_host_eviction_follows_policy(backend_factory, policy):
    cache, be = make_cache(backend_factory, eviction_policy=policy)
    oracle = KVOracle(be)
    a, b, c = _three_leaves(cache, oracle)
    prefill_insert(cache, oracle, seq(0, 4))  # a: 2 hits and most recent
    cache.flush()
    cache.evict(12)
    cache.evict_host(4)
    assert b.deleted and not a.deleted and not c.deleted
    cache.sanity_check(0)
