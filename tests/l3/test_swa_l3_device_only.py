"""An L3 prefetch on a hybrid (SWA) cache whose match ends on device-only nodes.

Storage holds a whole prompt (full pages and SWA pages); the tree holds its head on the
device only (recomputed, host copy reclaimed), with SWA device pages for the head's window
only. The read starts where the backed-up prefix ends (here the root): the head's nodes get
full host copies from it, the continuation attaches as host-only nodes, and the SWA window
read before the hit's end goes to the nodes its pages belong to (the continuation, and the
head's last nodes when the continuation is shorter than the window). Checked: the store's
read counter, the tokens served per tier, the bytes served on both pools (the model's
window rule, ``swa_harness``) and the head's host copies, ``sanity_check`` of both pools.
"""

from __future__ import annotations

import numpy as np
import pytest
from swa_harness import SWADriver, insert_with_frontier, make_swa_cache

from cache_harness import node_path_pages
from hicache_jax.cache import RadixKey
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig

P, W = 2, 6  # SWA context W - 1 = 5 tokens: 3 window pages


def make():
    cache, full, swa_be, swa = make_swa_cache(
        page_size=P, window=W, device_pages=48, host_pages=64, swa_device_pages=24, swa_host_pages=32
    )
    cfg = StorageConfig(backend="memory", prefetch_threshold_tokens=4, prefetch_policy="wait_complete", worker_nice=0)
    return cache, SWADriver(cache, full, swa_be, swa), swa, StorageController(cache, cfg, model="m")


def path_nodes(cache, key):
    node = cache.match_prefix(key).last_host_node  # the deepest usable end, any tier
    out = []
    while node is not cache.root:
        out.append(node)
        node = node.parent
    return out[::-1]


@pytest.mark.parametrize("head_pages", [8, 10])  # continuation of 4 pages (> the window), of 2 (< it)
def test_a_hybrid_cache_reads_the_continuation_after_a_device_only_match(head_pages):
    cache, drv, swa, ctl = make()
    try:
        k = RadixKey(np.arange(100, 124))  # 12 pages, SWA on every page
        insert_with_frontier(cache, drv, k, 0)
        cache.flush()
        assert ctl.flush(30)
        cache.evict(cache.evictable_tokens)
        cache.evict_host(cache.host_tokens)
        assert cache.host_tokens == 0 and cache.evictable_tokens == 0
        head = RadixKey(k.token_ids[: head_pages * P])
        insert_with_frontier(cache, drv, head, head_pages - 3)  # SWA for the head's window only
        cache.flush()
        assert ctl.flush(30)
        cache.evict_host(cache.host_tokens)
        assert cache.host_tokens == 0 and all(n.host_value is None for n in path_nodes(cache, head))
        cache.sanity_check(0, {"swa": 0})
        reads0 = ctl.storage.metrics.hits

        key = RadixKey(np.r_[k.token_ids, 7])
        op = ctl.prefetch(key)
        assert op.status == "querying", (op, op.reason)
        assert ctl.finish_prefetch(op) == 24 and op.status == "finished", (op, op.reason)
        # Every full page from the root and the window's 3 SWA pages.
        assert ctl.storage.metrics.hits - reads0 == 12 + 3
        cache.sanity_check(0, {"swa": 0})
        # The head's nodes have host copies now, byte for byte the oracle's.
        nodes = path_nodes(cache, head)
        assert all(n.host_value is not None for n in nodes)
        drv.full.check_host(head, node_path_pages(cache, nodes[-1], host=True))
        # The window's SWA host pages sit on the nodes of pages 9..11, bytes as written.
        off = got = 0
        for node in path_nodes(cache, k):
            sw_host = swa.node_host_pages(node)
            if sw_host is not None:
                assert off // P >= 9, (node, off)
                drv.sw.check_host(k, sw_host, off // P)
                got += sw_host.shape[0]
            off += node.size
        assert got == 3
        req, _lb = drv.admit(key)
        assert dict(req.hit_tokens) == {"device": head_pages * P, "host": 0, "storage": 24 - head_pages * P}
        assert req.cached_pages == 12
        drv.check_prefix(req)  # full pages and the window's SWA pages, byte-exact
        drv.abort(req)
        cache.flush()
        cache.sanity_check(0, {"swa": 0})
    finally:
        ctl.close()
