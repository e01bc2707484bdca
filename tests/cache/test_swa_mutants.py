"""SWA host-tier rules that only a targeted scenario can see (issue 28 point 2's surviving
mutants): host eviction of SWA pages respects host locks (a pinned host-only leaf is not
dropped, a pinned internal node keeps its SWA host pages), and a backup that finds the SWA
host pool short keeps the deepest pages (the window a match needs), not the shallowest.

Each test was seen failing with its mutant applied (see the issue-28 report)."""

from __future__ import annotations

import numpy as np
from swa_harness import SWADriver, make_swa_cache

from hicache_jax.cache import RadixKey


def key(*parts):
    return RadixKey(np.concatenate([np.asarray(p, np.int64) for p in parts]))


def insert_with_swa(cache, drv, k):
    """Raw insert of ``k``'s whole pages, with full and SWA pages for every page."""
    n = len(k) // cache.page_size
    full = cache.alloc_device(n)
    sw = cache.alloc_component("swa", n)
    drv.full.write(k, full)
    for i in range(n):
        drv.sw.write(k, sw[i : i + 1], i)
    return cache.insert(k, full, component_pages={"swa": sw.astype(np.int32)})


def host_only_tree():
    """Window 3, page 1: nodes [0, 2) and [2, 4) (the insert caps the window leaf), and a leaf
    [4, 6) under them; everything backed up, then evicted from the device: the SWA host pool
    (6 pages) is full."""
    cache, full, swa_be, swa = make_swa_cache(
        page_size=1, window=3, device_pages=40, host_pages=40, swa_device_pages=20, swa_host_pages=6
    )
    drv = SWADriver(cache, full, swa_be, swa)
    insert_with_swa(cache, drv, key(np.arange(4)))
    leaf = insert_with_swa(cache, drv, key(np.arange(4), [10, 11])).last_node
    cache.flush()
    cache.evict(100)
    assert swa.host_allocator.available == 0 and cache.evictable_tokens == 0
    return cache, swa, leaf


def swa_host_nodes(cache, swa):
    """Nodes holding SWA host pages, by (depth, size)."""
    out, stack = [], [(cache.root, 0)]
    while stack:
        n, depth = stack.pop()
        for c in n.children.values():
            st = swa.state(c)
            if st is not None and st.host is not None:
                out.append((depth, len(c)))
            stack.append((c, depth + len(c)))
    return sorted(out)


def test_swa_host_eviction_skips_a_pinned_host_only_leaf():
    cache, swa, leaf = host_only_tree()
    before = swa_host_nodes(cache, swa)
    receipt = cache.pin_host(leaf)  # the leaf and its ancestors: every SWA host page is pinned
    assert cache.reserve_component_host_pages("swa", 2) is None  # nothing may go
    assert swa_host_nodes(cache, swa) == before and not leaf.deleted
    assert swa.metrics.host_leaf_evictions == 0 and swa.metrics.host_tombstoned_tokens == 0
    cache.sanity_check(0, {"swa": 0})
    cache.unpin_host(receipt)
    got = cache.reserve_component_host_pages("swa", 2)  # unpinned: the leaf goes first (LRU)
    assert got is not None and got.size == 2
    swa.host_allocator.free(got)
    cache.sanity_check(0, {"swa": 0})


def test_swa_host_eviction_keeps_a_pinned_internal_nodes_pages():
    cache, swa, leaf = host_only_tree()
    window_top = leaf.parent  # [2, 4): pinned with [0, 2); the leaf is not
    receipt = cache.pin_host(window_top)
    # Only the unpinned leaf's 2 pages can be freed: 6 are not there.
    assert cache.reserve_component_host_pages("swa", 6) is None
    assert swa_host_nodes(cache, swa) == [(0, 2), (2, 2)]  # the pinned nodes lost nothing
    assert swa.metrics.host_tombstoned_tokens == 0
    assert cache.peek_prefix(key(np.arange(4), [99])) == (0, 4)  # still usable from the host
    cache.sanity_check(0, {"swa": 0})
    cache.unpin_host(receipt)
    cache.sanity_check(0, {"swa": 0})


def test_a_short_swa_host_pool_backs_up_the_window_not_the_shallowest_pages():
    # Page 2, window 5 (context 4 tokens: 2 window pages). A 12-token insert is two nodes,
    # [0, 8) and the capped window leaf [8, 12): 6 SWA pages; the SWA host pool has 4.
    cache, full, swa_be, swa = make_swa_cache(
        page_size=2, window=5, device_pages=24, host_pages=48, swa_device_pages=12, swa_host_pages=4
    )
    drv = SWADriver(cache, full, swa_be, swa)
    k = key(np.arange(100, 112))
    insert_with_swa(cache, drv, k)
    cache.flush()
    cache.evict(cache.evictable_tokens)  # host only now
    # The window before the end (tokens [8, 12)) is on the host: the whole prefix is usable
    # from the host (backing up [0, 8) instead would make only 8 tokens usable).
    assert cache.peek_prefix(key(k.token_ids, [7])) == (0, 12)
    assert swa.metrics.backup_failed_tokens == 8  # [0, 8) did not fit (4 pages of 6)
    req, _lb = drv.admit(key(k.token_ids, [7]))
    drv.check_prefix(req)
    assert req.cached_pages * 2 == 12
    drv.abort(req)
    cache.flush()
    cache.sanity_check(0, {"swa": 0})
