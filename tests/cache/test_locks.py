"""Lock receipts: a lock names exactly what it incremented, a release decrements exactly that,
once; callers can only release locks they took; the L3 pins are receipts too."""

from __future__ import annotations

import numpy as np
import pytest
from cache_harness import KVOracle, make_cache, prefill_insert

from hicache_jax.cache import LockReceipt, RadixKey


def seq(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


def counts(cache):
    return [(n.id, n.lock_ref, n.host_lock_ref) for n in cache.all_nodes()], (
        cache.evictable_tokens,
        cache.protected_tokens,
        cache.host_tokens,
    )


def test_dec_lock_ref_never_releases_a_transfers_lock(backend_factory):
    """A deferred backup holds device and host path locks on its node until acknowledged; a
    caller's dec_lock_ref on that node must not take them (it would let eviction free pages a
    copy is still reading)."""
    cache, be = make_cache(backend_factory, deferred=True)
    oracle = KVOracle(be)
    leaf = prefill_insert(cache, oracle, seq(0, 6)).last_node
    assert leaf.lock_ref == 1 and leaf.host_lock_ref == 1  # the backup's
    before = counts(cache)
    with pytest.raises(ValueError, match="unlock below zero"):
        cache.dec_lock_ref(leaf)
    assert counts(cache) == before
    be.complete_all()
    cache.flush()
    assert leaf.lock_ref == 0 and leaf.host_lock_ref == 0
    cache.sanity_check(0)


def test_dec_lock_ref_releases_only_a_lock_taken_on_that_node(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 4))
    leaf = prefill_insert(cache, oracle, seq(0, 8)).last_node
    cache.flush()
    parent = leaf.parent
    cache.inc_lock_ref(leaf)  # the path lock counts on the parent too
    assert parent.lock_ref == 1
    before = counts(cache)
    with pytest.raises(ValueError, match="unlock below zero"):
        cache.dec_lock_ref(parent)  # nobody locked the parent itself
    assert counts(cache) == before
    cache.inc_lock_ref(leaf)
    cache.dec_lock_ref(leaf)
    cache.dec_lock_ref(leaf)
    assert (leaf.lock_ref, parent.lock_ref) == (0, 0)
    assert cache.protected_tokens == 0 and cache.evictable_tokens == 8
    cache.sanity_check(0)


def test_a_lock_survives_a_split_of_its_node(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    leaf = prefill_insert(cache, oracle, seq(0, 8)).last_node
    cache.flush()
    cache.inc_lock_ref(leaf)
    cache.match_prefix(seq(0, 3))  # splits the locked node: a new upper part takes its count
    upper = leaf.parent
    assert len(upper) == 3 and upper.lock_ref == 1 and cache.protected_tokens == 8
    cache.dec_lock_ref(leaf)
    assert upper.lock_ref == 0 and leaf.lock_ref == 0 and cache.protected_tokens == 0
    cache.sanity_check(0)


def test_pin_receipts_release_exactly_once(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    leaf = prefill_insert(cache, oracle, seq(0, 6)).last_node
    cache.flush()
    pin = cache.pin_host(leaf)
    assert isinstance(pin, LockReceipt) and pin.live and pin.node is leaf
    assert leaf.host_lock_ref == 1
    cache.evict(100)  # demoted, not deleted: the host copy is pinned
    assert cache.evict_host(100) == 0 and not leaf.deleted
    cache.unpin_host(pin)
    assert leaf.host_lock_ref == 0 and not pin.live
    before = counts(cache)
    with pytest.raises(ValueError, match="already released"):
        cache.unpin_host(pin)
    assert counts(cache) == before
    assert cache.evict_host(100) == 6 and leaf.deleted
    cache.sanity_check(0)


def test_pin_host_rejects_bad_nodes_and_receipts(backend_factory):
    cache, be = make_cache(backend_factory, write_policy="write_back")
    oracle = KVOracle(be)
    leaf = prefill_insert(cache, oracle, seq(0, 6)).last_node  # write_back: not backed up
    with pytest.raises(ValueError, match="not backed up"):
        cache.pin_host(leaf)
    with pytest.raises(TypeError, match="node"):
        cache.pin_host("leaf")
    with pytest.raises(TypeError, match="receipt"):
        cache.unpin_host(object())
    root_pin = cache.pin_host(cache.root)  # nothing to pin: a receipt that does nothing
    cache.unpin_host(root_pin)
    cache.sanity_check(0)


def test_receipts_of_a_reset_tree_release_as_no_ops(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    leaf = prefill_insert(cache, oracle, seq(0, 6)).last_node
    cache.flush()
    pin = cache.pin_host(leaf)
    cache.reset()  # the L3 controller's on_reset would release first; a stray pin is harmless
    assert leaf.deleted
    cache.unpin_host(pin)
    assert not pin.live
    cache.sanity_check(0)


def test_a_request_whose_lock_was_released_is_refused_before_any_change(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, seq(0, 4))
    cache.flush()
    key = seq(0, 8)
    req, _ = cache.begin_request(key)
    new = cache.alloc_device(4)
    oracle.write(key, new, 4)
    req.extend(key, new)
    cache.dec_lock_ref(req.last_node)  # abandoned by the caller...
    before = counts(cache)
    free = be.device.allocator.available
    with pytest.raises(ValueError, match="released"):
        cache.cache_finished_req(req)  # ...then finished anyway
    assert counts(cache) == before and be.device.allocator.available == free
    be.device.allocator.free(new)
    cache.sanity_check(0)


def test_sanity_check_sees_a_caller_lock_without_its_path_count(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    leaf = prefill_insert(cache, oracle, seq(0, 6)).last_node
    cache.flush()
    cache.inc_lock_ref(leaf)
    leaf.lock_ref = 0  # corrupt: the count the caller's lock made is gone
    with pytest.raises(Exception, match="caller locks"):
        cache.sanity_check()


def test_inc_lock_ref_returns_a_receipt_that_releases_exactly_once(backend_factory):
    cache, be = make_cache(backend_factory)
    oracle = KVOracle(be)
    leaf = prefill_insert(cache, oracle, seq(0, 6)).last_node
    cache.flush()
    a = cache.inc_lock_ref(leaf)
    b = cache.inc_lock_ref(leaf)
    assert isinstance(a, LockReceipt) and a is not b and leaf.lock_ref == 2
    cache.dec_lock_ref(a)
    assert leaf.lock_ref == 1 and not a.live and b.live
    before = counts(cache)
    with pytest.raises(ValueError, match="not a live caller lock"):
        cache.dec_lock_ref(a)
    assert counts(cache) == before
    cache.dec_lock_ref(b)
    assert leaf.lock_ref == 0 and cache.protected_tokens == 0
    assert cache.inc_lock_ref(cache.root) is None
    cache.sanity_check(0)
