"""L3 with the SWA component across two thread ranks (a real barrier; one file store both
ranks share): the trailing pool's window pages are reserved through the agreed facade beside
the full pool's (one flag per prefetch), and the windows are read in a second phase at the
agreed end of the first, so every rank attaches the same pages with the same window. Every
byte served is checked against the oracles (``swa_harness``); the digests must be equal."""

from __future__ import annotations

import os

import numpy as np
from cache_harness import KVOracle, numpy_backend_factory, small_geom
from rank_threads import ThreadGroup, run_ranks
from replicated_engine import mark_replicated
from swa_harness import SWADriver, make_swa_cache

from hicache_jax.cache import NoExchangeAgreement, RadixKey
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig

P, W = 2, 6  # SWA context 5 tokens: 3 window pages


def rank_setup(agreement, path, draft=False, replicated_swa=False):
    sidecars = draft_be = None
    if draft:
        draft_be = numpy_backend_factory(small_geom(P, layers=1), 48, 64)
        sidecars = {"draft": draft_be.engine}
    cache, full, swa_be, swa = make_swa_cache(
        page_size=P,
        window=W,
        device_pages=48,
        host_pages=64,
        swa_device_pages=24,
        swa_host_pages=32,
        agreement=agreement,
        sidecars=sidecars,
    )
    if replicated_swa:  # as if the SWA layers had fewer KV heads than ranks: every rank holds all
        mark_replicated(swa_be.engine)
    ctl = StorageController(
        cache,
        StorageConfig(
            backend="file", path=str(path), prefetch_threshold_tokens=4, prefetch_policy="wait_complete", worker_nice=0
        ),
        model="m",
    )
    return cache, SWADriver(cache, full, swa_be, swa), swa, ctl, draft_be


def drop_everything(cache, ctl):
    cache.flush()
    assert ctl.flush(120)
    cache.evict(cache.evictable_tokens)
    cache.evict_host(cache.host_tokens)
    assert cache.host_tokens == 0


def count_window_reads(ctl, pool="swa") -> list[int]:
    """The pages of each of this rank's reads of ``pool`` (its window reads), in order; the
    returned list grows as reads happen."""
    reads: list[int] = []
    batch_get = ctl.storage.batch_get

    def counted_get(keys, ids, p=None):
        if p == pool:
            reads.append(len(keys))
        return batch_get(keys, ids, p)

    ctl.storage.batch_get = counted_get
    return reads


def short_reads(ctl, pool, pages):
    """This rank's reads of ``pool`` stop ``pages`` pages short of every request."""
    get_multi, batch_get = ctl.storage.get_multi, ctl.storage.batch_get

    def short_multi(transfers):
        if pool != "target":
            return get_multi(transfers)
        res = get_multi(transfers)
        n = len(transfers[0].keys)
        return type(res)(min(res.hit_pages, max(0, n - pages)), res.pool_hits)

    def short_get(keys, ids, p=None):
        flags = list(batch_get(keys, ids, p))
        if p == pool:
            flags[max(0, len(flags) - pages) :] = [False] * min(pages, len(flags))
        return flags

    ctl.storage.get_multi, ctl.storage.batch_get = short_multi, short_get


def failing_window_alloc(ctl):
    """This rank's SWA host allocations fail (a failing pinned allocation: the allocator said
    there was room)."""
    swa = ctl.cache.components.components["swa"]
    swa.host_allocator.alloc = lambda n: None


def round_trip(tmp_path, diverge=None, make_agreement=None, draft=False, replicated_swa=False, sets=None):
    """Serve a request, store it, drop both tiers, prefetch it back and admit it on two ranks.
    ``sets``: a dict to fill with each rank's storage writes, rank -> [(pool, pages)]."""
    group = ThreadGroup(2, timeout=60)
    make_agreement = make_agreement or (lambda r: group.agreement(r))

    def rank(r):
        cache, drv, swa, ctl, draft_be = rank_setup(make_agreement(r), tmp_path, draft, replicated_swa)
        draft_oracle = KVOracle(draft_be, salt=0xD2AF7) if draft else None
        if sets is not None:
            mine = sets.setdefault(r, [])
            batch_set = ctl.storage.batch_set
            ctl.storage.batch_set = lambda keys, ids, pool=None: (
                mine.append((pool, len(keys))) or batch_set(keys, ids, pool)
            )
        key = RadixKey(np.arange(1, 25))
        final = drv.serve(key, chunk=6, out=list(range(100, 110)))
        assert final is not None
        if draft:  # not written by the driver: the test writes the draft KV of the whole key
            m = cache.match_prefix(final)
            draft_oracle.write(final, m.device_indices)
        drop_everything(cache, ctl)
        if r == 1 and diverge is not None:
            diverge(ctl)
        free = (cache.host_allocator.available, swa.host_allocator.available)
        window_reads = count_window_reads(ctl)  # one window read per prefetch, at the agreed end
        key = RadixKey(np.r_[final.token_ids, 7])
        op = ctl.prefetch(key)
        got = ctl.finish_prefetch(op)
        cache.sanity_check(0, {"swa": 0})
        if not got:  # nothing attached: every page reserved for the prefetch is free again
            assert (cache.host_allocator.available, swa.host_allocator.available) == free
        loaded = swa.metrics.loaded_tokens
        req, _lb = drv.admit(key)
        drv.check_prefix(req)  # the full pages and the SWA window, byte for byte
        if draft:
            draft_oracle.check_device(key, req.device_pages[: req.cached_pages])
        window = swa.metrics.loaded_tokens - loaded
        drv.abort(req)
        cache.flush()
        digest = cache.debug_view().digest()
        cache.sanity_check(0, {"swa": 0})
        ctl.close()
        return got, window, digest, window_reads

    return run_ranks(group, rank)


def test_swa_windows_come_back_from_l3_on_every_rank(tmp_path):
    (got0, win0, d0, r0), (got1, win1, d1, r1) = round_trip(tmp_path)
    assert got0 == got1 == 34
    assert win0 == win1 == 3 * P  # the window came back from the host (read from L3) on both ranks
    assert r0 == r1 == [3]
    assert d0 == d1


def test_a_short_full_read_on_one_rank_moves_every_ranks_window(tmp_path):
    """Rank 1 reads 2 pages fewer of the target pool: the agreed end is 2 pages earlier, and
    both ranks read the window before that end (not before their own)."""
    (got0, win0, d0, r0), (got1, win1, d1, r1) = round_trip(tmp_path, lambda ctl: short_reads(ctl, "target", 2))
    assert got0 == got1 == 34 - 2 * P
    assert win0 == win1 == 3 * P
    assert r0 == r1 == [3]  # each rank read one window, the one before the agreed end
    assert d0 == d1


def test_a_short_window_read_on_one_rank_attaches_nothing_on_every_rank(tmp_path):
    (got0, _w0, d0, _r0), (got1, _w1, d1, _r1) = round_trip(tmp_path, lambda ctl: short_reads(ctl, "swa", 1))
    assert got0 == got1 == 0
    assert d0 == d1


def test_a_window_allocation_failing_on_one_rank_revokes_the_prefetch_on_every_rank(tmp_path):
    (got0, _w0, d0, _r0), (got1, _w1, d1, _r1) = round_trip(tmp_path, failing_window_alloc)
    assert got0 == got1 == 0
    assert d0 == d1


def test_without_the_exchange_a_short_window_read_diverges(tmp_path):
    (got0, _w0, d0, _r0), (got1, _w1, d1, _r1) = round_trip(
        tmp_path, lambda ctl: short_reads(ctl, "swa", 1), make_agreement=lambda r: NoExchangeAgreement(r, 2)
    )
    assert (got0, got1) == (34, 0)
    assert d0 != d1


def test_a_draft_sidecar_beside_the_swa_pool_round_trips_on_every_rank(tmp_path):
    (got0, win0, d0, r0), (got1, win1, d1, r1) = round_trip(tmp_path, draft=True)
    assert got0 == got1 == 34 and win0 == win1 == 3 * P and d0 == d1


def test_a_replicated_swa_pool_is_written_by_rank_0_only_and_its_window_read_by_every_rank(tmp_path):
    sets = {}
    (got0, win0, d0, r0), (got1, win1, d1, r1) = round_trip(tmp_path, replicated_swa=True, sets=sets)
    assert {pool for pool, _n in sets[0]} == {"target", "swa", "commit"}
    assert {pool for pool, _n in sets[1]} == {"target"}  # rank 1 never writes the shared window pages
    assert got0 == got1 == 34 and win0 == win1 == 3 * P and d0 == d1  # rank 1's window bytes: rank 0's
    assert stored(tmp_path, "swa") == 17  # one key per page, the same on both ranks
    assert stored(tmp_path, "target") == 34  # the full pool stays sharded


def stored(path, pool):
    return sum(len(fs) for _, _, fs in os.walk(os.path.join(path, "pages-v1", pool)))
