"""Several ranks (threads, a real MIN exchange, one file store): the agreed end of an L3 read
lands where storage holds no window; the ranks agree on a shorter stop that has one.

Two turns are stored (full pages 0..23; SWA windows 9..11 and 21..23 only, the pages between
out of the window when backed up). Rank 1 reads 4 target pages short, so the agreed end of the
full read is page 20, whose window was never stored: each rank finds the end of turn 1
(page 12) as the longest shorter stop with its window, the ranks agree on it and every rank
attaches those 12 pages with that window. (Before, the window read at 20 failed and nothing
was attached on either rank: the hybrid + spec L3 rank test's request that got 0 tokens.)
Checked per rank: tokens attached and served by tier, the bytes of both pools served, equal
digests, the window reads each rank made.
"""

from __future__ import annotations

import numpy as np
from rank_threads import ThreadGroup, run_ranks
from swa_harness import insert_with_frontier
from test_swa_ranks import count_window_reads, drop_everything, rank_setup, short_reads

from hicache_jax.cache import RadixKey

P = 2


def test_an_agreed_end_without_a_stored_window_falls_back_to_a_stop_with_one_on_every_rank(tmp_path):
    group = ThreadGroup(2, timeout=60)

    def rank(r):
        cache, drv, swa, ctl, _draft = rank_setup(group.agreement(r), tmp_path)
        turn2 = RadixKey(np.arange(300, 348))  # 24 pages
        insert_with_frontier(cache, drv, RadixKey(turn2.token_ids[:24]), 9)  # SWA pages 9..11
        cache.flush()
        insert_with_frontier(cache, drv, turn2, 21)  # SWA pages 21..23
        drop_everything(cache, ctl)
        if r == 1:
            short_reads(ctl, "target", 4)
        windows = count_window_reads(ctl)  # the pages of each window read of the swa pool
        key = RadixKey(np.r_[turn2.token_ids, 7])
        op = ctl.prefetch(key)
        got = ctl.finish_prefetch(op)
        cache.sanity_check(0, {"swa": 0})
        req, _lb = drv.admit(key)
        drv.check_prefix(req)  # full pages and the window's SWA pages, byte-exact
        tiers = dict(req.hit_tokens)
        drv.abort(req)
        cache.flush()
        digest = cache.debug_view().digest()
        cache.sanity_check(0, {"swa": 0})
        ctl.close()
        return got, tiers, digest, op.hit_tokens, windows

    (got0, t0, d0, h0, w0), (got1, t1, d1, h1, w1) = run_ranks(group, rank)
    assert h0 == h1 == 48  # storage had all of it on both ranks
    assert got0 == got1 == 24, (got0, got1)  # turn 1 with its window, on every rank
    assert t0 == t1 == {"device": 0, "host": 0, "storage": 24}
    assert d0 == d1
    # Each rank: the window at 20 (not stored), its own fallback to 12, then 12 again as agreed.
    assert w0 == w1 == [3, 3, 3]
