"""Speculative decoding of a hybrid (sliding-window) target served by the reference engine as two
real processes (``jax.distributed`` on the CPU; full, SWA and draft pools sharded on the KV
heads), against the same workload in one process; no L3.

The target is the trained toy pair with a sliding-window layer, so its verify steps accept
every proposal and move the window by ``k + 1 = 5`` tokens, more than a page: the SWA pool,
sized exactly (``Engine.swa_pages_needed`` with ``spec`` and ranks), must hold the slides'
agreed lag of a verify step. Rank 1 alone fails every other SWA host allocation and reports
every window slide of a decode round one step late (``hybrid_spec_engine_rank.py``). The ranks
must produce the single process's tokens, which are plain greedy decoding's; their digests
(SWA and draft state included) must be equal after every agreement step and at every exchange
(``check_digest``); both injections must have fired; and the rounds must be served from the
device (L1) and, after a device eviction, from the host (L2) alike on both ranks. The same
served from L3 too, with rank 1's storage faults: ``test_engine_ranks_hybrid_spec_l3``.

The agreement-off control runs one round with the exchange switched off
(``NoExchangeAgreement``): rank 1's two injections must leave the ranks' settled trees
different, and without them the settled trees must be equal, so the digests can see what the
agreement prevents. Settled: each rank flushes (all its copies acknowledged, backups and
slides settled) before the last digest. Mid-run digests are not compared there: without the
exchange each rank acknowledges its own D2H copies as they finish, so the copies in flight
(and the locks they hold), which the digest covers, differ step by step with timing alone.

Cost: one launch of the ranks serves both tests (the ``launched`` fixture; the controls run
in the rank processes after the agreed run, each on a fresh engine), instead of three; CI's
``--dist loadfile`` keeps both tests on one worker, so it launches once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_engine_ranks_hybrid import run_ranks_and_single

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "hybrid_spec_engine_rank.py")
CLIENTS, K = 3, 4  # hybrid_spec_engine_rank: requests per round, draft tokens per verify
CONTROLS = ("swa", "calm")  # the agreement-off control's runs: rank 1's injections, none


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Path:
    """The ranks (DIVERGE swa, then the controls) and the single process, once for the module."""
    out = tmp_path_factory.mktemp("hybrid_spec")
    run_ranks_and_single(out, SCRIPT, "swa", *CONTROLS)
    return out


def results(out: Path, names=("single", "rank0", "rank1")) -> tuple[dict, ...]:
    return tuple(json.loads((out / f"{n}.json").read_text()) for n in names)


def test_two_ranks_decode_a_hybrid_target_speculatively_with_the_single_process_tokens_under_swa_divergence(launched):
    one, r0, r1 = results(launched)
    assert one["tokens"] == one["plain_tokens"]  # exact: speculation serves plain greedy decoding's tokens
    assert r0["tokens"] == r1["tokens"] == one["tokens"]
    assert r0["accept_lengths"] == r1["accept_lengths"]
    assert max(max(a) for a in r0["accept_lengths"]) == K + 1  # verify steps moved the window by k + 1
    assert len(r0["digests"]) == len(r1["digests"]) > 5 and r0["digests"] == r1["digests"]
    assert r1["fired"]["swa_host_alloc_fail"] > 0 and r1["fired"]["late_slide"] > 0, r1["fired"]
    assert r0["slides"] == r1["slides"] > 0  # window slides went through the agreement
    assert r0["swa_allocs_after_agreed_slides"] == r1["swa_allocs_after_agreed_slides"]
    # The SWA sizing: with ranks a decoding request held SWA pages only because its agreed
    # slide lagged a verify step (k + 1 = 5 tokens) behind: two pages, more than the one page
    # a plain decode step's lag needs, and what ``swa_pages_needed`` adds per decoding request.
    assert one["verify_lag_pages"] == 0
    assert r0["verify_lag_pages"] == r1["verify_lag_pages"] == 2
    assert r0["verify_lag_pages"] <= r0["lag_granted_per_decoding_request"]
    assert r0["tiers"] == r1["tiers"]
    second, last = r0["tiers"][CLIENTS : 2 * CLIENTS], r0["tiers"][2 * CLIENTS :]
    assert all(t["device"] > 0 for t in second), second  # L1
    assert all(t["device"] == 0 for t in last) and any(t["host"] > 0 for t in last), last  # L2
    # The windows whose SWA backup failed on rank 1 are host tombstones on both ranks: their
    # prefixes are served shorter from the host than in the single process (agreed, not wrong).
    assert sum(t["host"] for t in last) < sum(t["host"] for t in one["tiers"][2 * CLIENTS :])


def test_without_the_exchange_rank_1s_swa_divergence_splits_the_settled_hybrid_speculative_trees(launched):
    """The agreement-off control (module docstring): the injections of the test above, one
    round, ``NoExchangeAgreement``; then the same without the injections."""
    r0, r1 = results(launched / "swa", ("rank0", "rank1"))
    c0, c1 = results(launched / "calm", ("rank0", "rank1"))
    assert r1["fired"]["swa_host_alloc_fail"] > 0 and r1["fired"]["late_slide"] > 0, r1["fired"]
    assert not any(r0["fired"].values()) and not any(c0["fired"].values()) and not any(c1["fired"].values())
    assert r0["tokens"] == r1["tokens"] == c0["tokens"]  # the divergence is in what the trees keep
    # Without the injections the ranks settle equal; with them rank 1 alone leaves that state
    # (rank 0 injects nothing and, without the exchange, takes none of rank 1's values: it
    # settles as in the calm run), so the difference is the injections', not timing's.
    assert c0["digests"][-1] == c1["digests"][-1], (c0["settled_swa"], c1["settled_swa"])
    assert r0["digests"][-1] == c0["digests"][-1]
    assert r1["digests"][-1] != r0["digests"][-1]
    # ... in the SWA component's state, which both injections act on: rank 1's failed SWA
    # backups are host tombstones on rank 1 only, and its late slides keep window pages longer.
    assert r1["settled_swa"] != r0["settled_swa"] == c1["settled_swa"]
