"""SWA (and draft + SWA) caches across two thread-ranks (pure numpy; both environments).

The rank-trace pair over the hybrid caches (``rank_trace.run_swa_trace``): with the
agreement, every rank's digest (tree, residency, SWA state) is equal after every step under
each divergence injected on rank 1 (a failed full or SWA host allocation, late copies, a
window that slides a step late), each asserted to have fired, with one exchange per step;
with the exchange switched off the same divergence splits the digests (the test can see).
Then the SWA fuzz (``test_swa_fuzz``'s random operations) with an agreement across two
thread-ranks: bounded here, larger under ``-m slow``.
"""

from __future__ import annotations

import pytest
from rank_threads import ThreadGroup, run_ranks
from rank_trace import divergences, rank_cache, run_swa_trace

from hicache_jax.cache import NoExchangeAgreement

SWA_KINDS = divergences("swa", l3=False)
CASES = [(c, d) for c in ("swa", "draft+swa") for d in SWA_KINDS + ("all",)]


def _pair(make_agreement, components, divergence, steps=30):
    group = ThreadGroup(2, timeout=60)

    def rank(r):
        cache, be, _ = rank_cache(make_agreement(group, r), components=components)
        div = (set(SWA_KINDS) if divergence == "all" else {divergence}) if r == 1 else set()
        out = run_swa_trace(cache, be, divergence=div, steps=steps)
        out["agreement_steps"] = cache.step_agreement.steps
        return out

    return run_ranks(group, rank, timeout=300)


@pytest.mark.parametrize("components,divergence", CASES)
def test_swa_ranks_stay_identical_under_divergence(components, divergence):
    r0, r1 = _pair(lambda g, r: g.agreement(r), components, divergence)
    assert r0["digests"] == r1["digests"]  # after every step
    assert r0["served"] == r1["served"] and sum(r0["served"]) > 0
    kinds = SWA_KINDS if divergence == "all" else (divergence,)
    for k in kinds:
        assert r1["fired"][k] > 0, f"{k} never fired: the trace does not exercise it"
    assert r0["exchanges"] == r1["exchanges"] == r0["steps"]  # one exchange per step, no more
    assert r0["swa"]["backup_tokens"] > 0


@pytest.mark.parametrize("components,divergence", CASES)
def test_without_the_exchange_the_same_divergence_splits_the_swa_trees(components, divergence):
    r0, r1 = _pair(lambda g, r: NoExchangeAgreement(r, 2), components, divergence)
    first = next((i for i, (a, b) in enumerate(zip(r0["digests"], r1["digests"])) if a != b), None)
    assert first is not None, "the divergence left no trace in the digests"
