"""The SWA + draft serving trace with L3 on two thread ranks over one file store
(``swa_l3_trace``): with a short L3 read and a missing storage page on rank 1, the ranks'
trees stay equal after every step and every byte served is right; with each rank deciding
alone they differ."""

from __future__ import annotations

import pytest
from rank_threads import ThreadGroup, run_ranks
from swa_l3_trace import run_swa_l3_trace, swa_l3_rank

from hicache_jax.cache import NoExchangeAgreement


def trace(tmp_path, divergence, agreed=True, steps=30):
    group = ThreadGroup(2, timeout=60)

    def rank(r):
        agreement = group.agreement(r) if agreed else NoExchangeAgreement(r, 2)
        cache, be, ctl = swa_l3_rank(agreement, tmp_path)
        try:
            return run_swa_l3_trace(cache, be, ctl, divergence=divergence if r == 1 else (), steps=steps)
        finally:
            ctl.close()

    return run_ranks(group, rank, timeout=150)


@pytest.mark.parametrize("divergence", [(), ("short_read",), ("missing_page",), ("alloc_fail", "swa_alloc_fail")])
def test_swa_and_draft_l3_trace_on_two_ranks(tmp_path, divergence):
    a, b = trace(tmp_path, divergence)
    first = next((i for i, (x, y) in enumerate(zip(a["digests"], b["digests"])) if x != y), None)
    assert first is None, f"the ranks' trees differ from step {first}"
    assert a["served"] == b["served"] and a["from_l3"] == b["from_l3"]
    assert a["from_l3"] > 0 and a["swa_loaded"] > 0, (a["from_l3"], a["swa_loaded"])
    assert a["device_only_reads"] == b["device_only_reads"] > 0  # not skipped as not_backed_up
    for d in divergence:
        assert b["fired"][d] > 0, b["fired"]


def test_without_the_exchange_the_l3_divergences_split_the_trees(tmp_path):
    a, b = trace(tmp_path, ("short_read", "missing_page"), agreed=False)
    assert a["digests"] != b["digests"]
