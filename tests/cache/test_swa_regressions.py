"""One regression test per upstream SWA + HiCache crash (sglang PR #23391's thread) and per SWA
leak family (sglang #27586 / #27789 / #36135; #24972 / #36350 / #36848), each replayed on our
tree, and each run once more against a deliberately broken variant of the component (a
subclass in this file, named for the bug it puts back) to show the test sees that bug.

* crash 1, ``cache_protected_len <= len(new_indices) + page_size - 1`` after chunked prefill:
  upstream re-matched the request's prefix after a chunk's insert and found it shorter (the
  chunk's window was not usable). Ours: after each chunked ``cache_unfinished_req`` the
  request's whole prefix is device-usable with its window's SWA pages held. Broken variant:
  an insert that does not recover tombstones (``NoRecovery``).
* crash 2, a node in both the SWA device and host LRU (INV-2 / INV-5): the lists drifted
  when a window came back to the device. Ours recomputes both memberships from the node's
  state on every change. Broken variant: incremental list upkeep that forgets the host list
  on load-back (``IncrementalLists``).
* crash 3, ``cd.lock_ref == 0`` during decode allocation (``alloc`` -> SWA eviction ->
  cascade): SWA eviction picked a leaf whose other component was locked. Ours evicts a leaf
  whole only when its full KV is unlocked, else tombstones it. Broken variant: whole-leaf
  eviction of any SWA-unlocked leaf (``LeafIgnoresFullLock``).
* leak family 1, a stale full -> SWA mapping on a tombstone frees a live slot (#27586). Ours
  frees SWA pages from the node that holds them and keeps no mapping. Broken variant: a
  full -> SWA mapping kept per node, not cleared when the node is tombstoned, and freed
  through on full eviction (``StaleMapping``).
* leak family 2, releasing an SWA lock never taken after a tombstone is restored (#36350):
  ours records exactly what each hold incremented, and revived window nodes join the holds.
  Broken variants: holds that ignore revived nodes, so the holds on one node differ and a
  release can take another caller's (``NoJoin``); upstream's shape before its receipts, a
  release that walks the window again and decrements what has SWA pages there now
  (``ReleaseByWalk``).
"""

from __future__ import annotations

import numpy as np
import pytest
from swa_harness import SWADriver, make_swa_cache
from swa_harness import insert_with_frontier as insert_with_swa_pages

from hicache_jax.cache import CacheInvariantError, RadixKey
from hicache_jax.cache.components import SWAComponent


def build(cls=SWAComponent, **kw):
    cache, full, swa_be, swa = make_swa_cache(**kw)
    if cls is not SWAComponent:  # the same pools, the broken component
        from hicache_jax.cache import HiCacheConfig, HiRadixCache

        swa_be.device.allocator.reset()
        swa = cls(swa_be.engine, swa_be.device.allocator, swa.window)
        full.device.allocator.reset()
        full.host.allocator.reset()
        cache = HiRadixCache(
            HiCacheConfig(page_size=cache.page_size, write_policy=cache.write_policy, load_back_threshold=0),
            full.engine,
            full.device.allocator,
            components=[swa],
        )
    return cache, SWADriver(cache, full, swa_be, swa), swa


def insert_with_frontier(cache, drv, k, frontier_page):
    """``swa_harness.insert_with_frontier``, returning the insert's last node."""
    return insert_with_swa_pages(cache, drv, k, frontier_page).last_node


# ---------------------------------------------------------------- crash 1
class NoRecovery(SWAComponent):
    """Broken: an insert frees the caller's SWA pages where the tree has a tombstone."""

    def on_insert_span(self, last, span, pages):
        if pages is not None:
            node, acc, nodes = last, 0, []
            while acc < span:
                nodes.append(node)
                acc += node.size
                node = node.parent
            j, out = 0, pages.copy()
            p = self.page_size
            for n in reversed(nodes):
                k = n.size // p
                st = self.state(n)
                if (st is None or st.dev is None) and n.dev_children:  # an existing tombstone: not recovered
                    c = out[j : j + k]
                    if (c >= 0).any():
                        self.device_allocator.free(c[c >= 0])
                    out[j : j + k] = -1
                j += k
            pages = out
        super().on_insert_span(last, span, pages)


def crash1_chunked_prefill_keeps_the_prefix_usable(cls):
    cache, drv, swa = build(
        cls, page_size=2, window=5, device_pages=60, host_pages=60, swa_device_pages=30, swa_host_pages=30
    )
    first = drv.serve(RadixKey(np.arange(1, 17)), out=list(range(100, 112)))  # [16, 24) becomes a tombstone
    assert first is not None
    # A request that diverges inside the tombstone: its match ends before it, so it recomputes
    # the tombstone's span in chunks; each chunk's insert must leave its prefix usable.
    toks = np.r_[first.token_ids[:20], np.arange(300, 310)]
    req, _ = drv.admit(RadixKey(toks))
    assert req.cached_pages == 8  # [16, 20) is a tombstone: the device-usable prefix ends at 16
    pos = 16
    while pos < len(toks):
        end = min(len(toks), pos + 3)
        assert drv.extend(req, RadixKey(toks[:end]))
        cache.cache_unfinished_req(req, chunked=True)
        protected = req.cached_pages * 2
        assert cache.peek_prefix(RadixKey(toks[:protected]))[0] == protected, "the prefix shrank"
        drv.check_prefix(req)
        full_own, swa_own = SWADriver.own_pages(req)
        cache.sanity_check(full_own, {"swa": swa_own})
        pos = end
    cache.cache_finished_req(req)
    cache.sanity_check(0, {"swa": 0})


def test_crash1_chunked_prefill_keeps_the_requests_prefix_usable():
    crash1_chunked_prefill_keeps_the_prefix_usable(SWAComponent)


def test_crash1_is_seen_without_tombstone_recovery():
    with pytest.raises(AssertionError, match="the prefix shrank|window page .* missing"):
        crash1_chunked_prefill_keeps_the_prefix_usable(NoRecovery)


# ---------------------------------------------------------------- crash 2
class IncrementalLists(SWAComponent):
    """Broken: the SWA host list is kept incrementally (joined when the device pages go,
    left when the host pages go), as upstream's LRUs were: a window loaded back stays in it."""

    def _refresh(self, st):
        dev = st.dev is not None and not st.holders
        if dev != (st in self.device_index.members):
            self.device_index.set_member(st, dev)
        if st.host is None and st in self.host_index.members:
            self.host_index.set_member(st, False)
        elif st.host is not None and st.dev is None and st not in self.host_index.members:
            self.host_index.set_member(st, True)


def crash2_no_node_in_both_lists(cls):
    cache, drv, swa = build(
        cls,
        page_size=2,
        window=5,
        device_pages=40,
        host_pages=40,
        swa_device_pages=8,
        swa_host_pages=20,
        write_policy="write_through_selective",
    )
    base = np.arange(1, 13)
    for _ in range(2):  # selective: the second insert-hit backs the path up
        assert drv.serve(RadixKey(base), chunk=4) is not None
    cache.flush()
    cache.sanity_check(0, {"swa": 0})
    child = insert_with_frontier(cache, drv, RadixKey(np.r_[base, 50, 51, 52, 53]), 6)
    receipt = cache.inc_lock_ref(child)  # keeps base's full KV on the device, not its SWA
    got = cache.alloc_component("swa", swa.device_allocator.available + 6)  # SWA pressure: base's SWA goes
    swa.device_allocator.free(got)
    cache.dec_lock_ref(receipt)
    cache.sanity_check(0, {"swa": 0})
    # base's window is on the host only (the host list); the next request brings it back.
    req, lb = drv.admit(RadixKey(np.r_[base, 9]))
    assert lb is not None and req.cached_pages == 6
    drv.check_prefix(req)
    cache.flush()
    cache.sanity_check(*SWADriver.own_pages(req)[:1], {"swa": SWADriver.own_pages(req)[1]})
    drv.abort(req)
    cache.sanity_check(0, {"swa": 0})


def test_crash2_a_window_loaded_back_is_in_one_list_only():
    crash2_no_node_in_both_lists(SWAComponent)


def test_crash2_is_seen_with_incremental_lists():
    with pytest.raises(CacheInvariantError, match="swa_host: stale members|in both the SWA device and host"):
        crash2_no_node_in_both_lists(IncrementalLists)


# ---------------------------------------------------------------- crash 3
class LeafIgnoresFullLock(SWAComponent):
    """Broken: SWA eviction evicts any SWA-unlocked device leaf whole, locked full KV or not."""

    def evict(self, num_pages):
        freed = 0
        while freed < num_pages:
            st = self.device_index.pop()
            if st is None:
                break
            k = st.dev.shape[0]
            if st.node.dev_children == 0:
                self.evictor.evict_leaf(st.node)
            else:
                self._free_dev(self._take_dev(st))
            freed += k
        return freed


def crash3_decode_allocation_never_cascades_into_a_locked_node(cls):
    cache, drv, swa = build(
        cls, page_size=2, window=5, device_pages=60, host_pages=60, swa_device_pages=4, swa_host_pages=20
    )
    assert drv.serve(RadixKey(np.arange(1, 9))) is not None  # the tree: [0, 4) a tombstone, [4, 8) 2 SWA pages
    req, _ = drv.admit(RadixKey(np.r_[np.arange(1, 9), 40]))
    leaf = req.last_node
    for t in range(41, 60):  # decode past the window: the request's hold on the leaf goes early
        if not drv.extend(req, RadixKey(np.r_[req.key.token_ids, t])):
            raise AssertionError("decode allocation failed")
        full_own, swa_own = SWADriver.own_pages(req)
        cache.sanity_check(full_own, {"swa": swa_own})
    assert swa.lock_count(leaf) == 0 and leaf.lock_ref == 1 and leaf.value is not None
    assert swa.metrics.tombstoned_tokens > 0  # the decode's SWA allocation tombstoned the locked leaf
    cache.cache_finished_req(req)
    cache.sanity_check(0, {"swa": 0})


def test_crash3_decode_allocation_tombstones_a_full_locked_leaf():
    crash3_decode_allocation_never_cascades_into_a_locked_node(SWAComponent)


def test_crash3_is_seen_when_leaves_ignore_the_full_lock():
    with pytest.raises(ValueError, match="not an unlocked device leaf"):
        crash3_decode_allocation_never_cascades_into_a_locked_node(LeafIgnoresFullLock)


# ---------------------------------------------------------------- leak family 1
class StaleMapping(SWAComponent):
    """Broken (#27586's shape): a full -> SWA page mapping (full page id -> SWA page id),
    written when a node gets SWA pages, not cleared when SWA eviction tombstones the node,
    and used to free the SWA pages on the node's full eviction (``free_swa(full_idx)``)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.mapping = {}

    def _set_dev(self, st, ids):
        super()._set_dev(st, ids)
        self.mapping.update(zip(st.node.value.tolist(), ids.tolist()))

    def on_evict(self, node, tier):
        if tier == "device":
            st = self.state(node)
            if st is not None and st.dev is not None:
                self._take_dev(st)  # the node's own pages go through the mapping below
            mapped = [self.mapping.pop(f) for f in node.value.tolist() if f in self.mapping]
            if mapped:
                self._free_dev(np.array(mapped, np.int32))
            return
        super().on_evict(node, tier)


def leak1_a_tombstone_never_frees_a_live_page(cls):
    cache, drv, swa = build(
        cls, page_size=1, window=5, device_pages=40, host_pages=40, swa_device_pages=12, swa_host_pages=20
    )
    x = insert_with_frontier(cache, drv, RadixKey([1, 2, 3, 4]), 0)
    leaf = insert_with_frontier(
        cache, drv, RadixKey(np.arange(1, 11)), 4
    )  # x is internal; the leaf's window is its own
    receipt = cache.inc_lock_ref(leaf)  # x's full KV stays on the device; its SWA is not held
    assert swa.lock_count(x) == 0
    old = swa.node_device_pages(x)
    got = cache.alloc_component("swa", swa.device_allocator.available + 4)  # x is tombstoned...
    assert swa.node_device_pages(x) is None and x.value is not None
    swa.device_allocator.free(got)
    cache.dec_lock_ref(receipt)
    # ...and its former pages now serve another prefix, y.
    drained = swa.device_allocator.alloc(swa.device_allocator.available)
    swa.device_allocator.free(old)  # only x's old pages are free now
    y = insert_with_frontier(cache, drv, RadixKey([7, 8, 9, 10]), 0)
    swa.device_allocator.free(np.setdiff1d(drained, old))
    live = swa.node_device_pages(y)
    assert sorted(live.tolist()) == sorted(old.tolist())
    cache.evict(cache.evictable_tokens - len(y))  # x's full KV leaves the device (y is the newest)
    assert x.value is None and y.value is not None
    assert swa.node_device_pages(y) is not None and swa.device_allocator.is_allocated(live).all(), (
        "a live page was freed"
    )
    drv.sw.check_device(RadixKey([7, 8, 9, 10]), live)
    cache.sanity_check(0, {"swa": 0})


def test_leak1_a_tombstone_never_frees_a_live_page():
    leak1_a_tombstone_never_frees_a_live_page(SWAComponent)


def test_leak1_is_seen_with_a_stale_mapping():
    with pytest.raises(AssertionError, match="a live page was freed"):
        leak1_a_tombstone_never_frees_a_live_page(StaleMapping)


# ---------------------------------------------------------------- leak family 2
class NoJoin(SWAComponent):
    """Broken: revived window nodes do not join the live window holds (the holds on one node
    then differ, and a release may take the one another caller needs)."""

    def _join_window_holds(self, revived):
        pass


class ReleaseByWalk(NoJoin):
    """Broken the way upstream was before its lock receipts (#24972 / #36350 / #36848): the
    acquire skips tombstones, and a release walks the window again and drops one hold from
    every node with SWA pages there now, so it also decrements a revived node it never locked."""

    def on_release(self, receipt):
        if receipt.host is not None or receipt.device is None:
            return
        entry = self._win.get(receipt.device)
        if entry is None:
            return
        if entry[1]:
            entry[1] -= 1
        else:
            hold = entry[0].pop()
            for n in self._window(receipt.device):
                st = self.state(n)
                if st is None or st.dev is None or not st.holders:
                    continue
                h = hold if hold in st.holders else next(iter(st.holders))  # "lock_ref -= 1"
                st.holders.discard(h)
                h.states.remove(st)
                if not st.holders:
                    self.protected_tokens -= st.node.size
                    self.evictable_tokens += st.node.size
                self._refresh(st)
        if not entry[0] and not entry[1]:
            del self._win[receipt.device]


def leak2_a_release_never_takes_a_lock_it_did_not_take(cls, mid_check=True):
    cache, drv, swa = build(
        cls, page_size=1, window=4, device_pages=40, host_pages=40, swa_device_pages=12, swa_host_pages=20
    )
    k = RadixKey([1, 2, 3, 4, 5, 6])
    b = insert_with_frontier(cache, drv, k, 4)  # [0, 4) a tombstone, b = [4, 6)
    tomb = b.parent
    a = cache.inc_lock_ref(b)  # acquired while the window's [3, 4) is a tombstone: holds b only
    assert swa.lock_count(b) == 1 and swa.lock_count(tomb) == 0
    insert_with_frontier(cache, drv, k, 1)  # revives [1, 4) (split at the frontier)
    revived = b.parent
    assert swa.node_device_pages(revived) is not None
    c = cache.inc_lock_ref(b)  # holds b and the revived node
    if mid_check:  # (off: see the symptom itself, not the invariant that a hold covers its window)
        cache.sanity_check(0, {"swa": 0})
    cache.dec_lock_ref(a)  # a's release must leave c's protection whole
    assert swa.lock_count(revived) == 1 and swa.lock_count(b) == 1, "c's window lost its hold"
    got = cache.alloc_component("swa", swa.device_allocator.available + 8)  # SWA pressure
    if got is not None:
        swa.device_allocator.free(got)
    assert swa.node_device_pages(revived) is not None, "c's window lost a page"
    pages = swa.request_pages(b, 6)
    drv.sw.check_device(k, pages[3:], 3)
    cache.dec_lock_ref(c)
    cache.sanity_check(0, {"swa": 0})


def test_leak2_a_release_never_takes_a_lock_it_did_not_take():
    leak2_a_release_never_takes_a_lock_it_did_not_take(SWAComponent)


def test_leak2_is_seen_when_revived_nodes_do_not_join_the_holds():
    with pytest.raises((AssertionError, CacheInvariantError), match="c's window lost|misses SWA pages of its window"):
        leak2_a_release_never_takes_a_lock_it_did_not_take(NoJoin)


def test_leak2_is_seen_when_a_release_walks_the_window_again():
    with pytest.raises(CacheInvariantError, match="misses SWA pages of its window"):
        leak2_a_release_never_takes_a_lock_it_did_not_take(ReleaseByWalk)
    with pytest.raises(AssertionError, match="c's window lost its hold"):  # the symptom itself
        leak2_a_release_never_takes_a_lock_it_did_not_take(ReleaseByWalk, mid_check=False)
