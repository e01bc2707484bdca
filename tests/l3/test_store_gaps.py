"""A store that refuses page k of n, and the gap it leaves across ``batch_pages``.

The first backup of a 12-page prompt has its page k refused by the store (once): the job is
partly failed, so its nodes stay unstored and the next backup below them writes them again
(``l3.backup``: a partly failed job is never marked stored). Until then the store has a gap:
a prefetch counts consecutive hits batch by batch and stops at the first short batch, so it
reports and serves exactly the k pages before the gap, never the pages after it
(``l3.prefetch``'s query).
"""

from __future__ import annotations

import numpy as np
from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert

from hicache_jax.cache import RadixKey
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig

P = 2
PAGES = 12
K = 2  # the refused page: inside the first batch of 4
BATCH = 4


def config(path):
    return StorageConfig(backend="file", path=str(path), prefetch_threshold_tokens=P, prefetch_policy="wait_complete")


def refuse_page_once(storage, k):
    """The store refuses the k-th page of the first target-pool write it gets, once."""
    orig = storage._write_from_host
    state = {"armed": True}

    def write(pool, keys, ids):
        if pool != "target" or not state["armed"] or len(keys) <= k:
            return orig(pool, keys, ids)
        state["armed"] = False
        keep = [i for i in range(len(keys)) if i != k]
        ok = orig(pool, [keys[i] for i in keep], ids[keep])
        out = [False] * len(keys)
        for i, o in zip(keep, ok):
            out[i] = o
        return out

    storage._write_from_host = write


def fresh_storage_hit(path, key):
    """A fresh cache on the store: (tokens served from storage, the prefetch's hit), bytes checked."""
    cache, be = make_cache(numpy_backend_factory, page_size=P, device_pages=64, host_pages=64, load_back_threshold=0)
    with StorageController(cache, config(path), model="m", batch_pages=BATCH) as ctl:
        op = ctl.prefetch(key)
        got = ctl.finish_prefetch(op)
        if got:
            req, _ = cache.begin_request(key)
            cache.flush()
            assert req.cached_pages * P == got
            KVOracle(be).check_device(RadixKey(key.token_ids[:got]), req.device_pages[: got // P])
            cache.dec_lock_ref(req.last_node)
        cache.sanity_check(0)
    return got, op.hit_tokens


def serve(path, keys):
    cache, be = make_cache(numpy_backend_factory, page_size=P, device_pages=64, host_pages=64)
    ctl = StorageController(cache, config(path), model="m")
    refuse_page_once(ctl.storage, K)
    oracle = KVOracle(be)
    for key in keys:
        prefill_insert(cache, oracle, key)
        cache.flush()
        assert ctl.flush(60)
    failed = cache.metrics.storage_backup_failed_tokens
    ctl.close()
    return failed


A = RadixKey(np.arange(PAGES * P, dtype=np.int64))
B = RadixKey(np.arange((PAGES + 4) * P, dtype=np.int64))  # A, then 4 more pages


def test_a_gap_across_batches_stops_the_hit_at_the_gap(tmp_path):
    assert serve(tmp_path, [A]) == P  # the refused page counted as a failed backup
    got, hit = fresh_storage_hit(tmp_path, RadixKey(np.r_[A.token_ids, 99]))
    assert (got, hit) == (K * P, K * P), "a hit counted past the gap (a short batch, then full ones)"


def test_a_partly_failed_backup_is_written_again_with_the_next_backup_below_it(tmp_path):
    assert serve(tmp_path, [A, B]) == P
    got, hit = fresh_storage_hit(tmp_path, RadixKey(np.r_[B.token_ids, 99]))
    assert got == len(B), "the refused page was never written again: its job was marked stored"
