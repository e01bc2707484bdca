"""Speculative decoding of a hybrid (sliding-window) target served by the reference engine as two
real processes WITH L3 storage (file; full, SWA and draft pools sharded on the KV heads), against
the same workload in one process (``hybrid_spec_l3_engine_rank.py``).

Rounds are served from the device (L1), the host (L2) and storage (L3: full pages, windows and
draft pages). Rank 1 alone fails host and SWA host allocations (before the L3 round), finishes its D2H copies late,
reads a page short of every storage read, sees a storage page missing and reports its window
slides a step late. The ranks must produce the single process's tokens, which are plain greedy
decoding's, with the same accept lengths; their digests (SWA and draft state included) must be
equal after every agreement step and at every exchange (``check_digest``); every injection must
have fired; the L3 round must attach the same pages and load the same windows on both ranks,
read draft pages with the target's, and serve on each rank the bytes (its heads of the full and
the draft pages) computed for each page's prefix.
"""

from __future__ import annotations

from test_engine_ranks_spec_l3 import HERE, run_ranks_and_single

CLIENTS, K = 3, 4  # hybrid_spec_engine_rank: requests per round, draft tokens per verify


def test_two_ranks_decode_a_hybrid_target_speculatively_from_l1_l2_and_l3_with_the_single_process_tokens(tmp_path):
    one, r0, r1 = run_ranks_and_single(tmp_path, str(HERE / "hybrid_spec_l3_engine_rank.py"))
    assert one["tokens"] == one["plain_tokens"]  # exact: speculation serves plain greedy decoding's tokens
    assert r0["tokens"] == r1["tokens"] == one["tokens"]
    assert r0["accept_lengths"] == r1["accept_lengths"]
    assert max(max(a) for a in r0["accept_lengths"]) == K + 1
    assert len(r0["digests"]) == len(r1["digests"]) > 20 and r0["digests"] == r1["digests"]
    assert all(v > 0 for v in r1["fired"].values()), r1["fired"]
    assert not any(r0["fired"].values()), r0["fired"]
    assert r0["tiers"] == r1["tiers"]
    rounds = [r0["tiers"][i : i + CLIENTS] for i in range(0, len(r0["tiers"]), CLIENTS)]
    assert len(rounds) == 4
    assert all(t["device"] > 0 for t in rounds[1]), rounds[1]  # L1
    assert all(t["device"] == 0 for t in rounds[2]) and any(t["host"] > 0 for t in rounds[2]), rounds[2]  # L2
    assert all(t["device"] == t["host"] == 0 for t in rounds[3]) and any(t["storage"] > 0 for t in rounds[3])  # L3
    assert r0["metrics"]["prefetch_attached_tokens"] == r1["metrics"]["prefetch_attached_tokens"] > 0
    assert r0["metrics"]["loaded_storage_tokens"] == r1["metrics"]["loaded_storage_tokens"] > 0
    assert r0["swa_loaded_tokens"] == r1["swa_loaded_tokens"] > 0
    # Rank 1's faults made the L3 round serve less than one process does (agreed, not wrong).
    alone = one["tiers"][3 * CLIENTS :]
    assert all(t["storage"] > 0 for t in alone), alone
    assert sum(t["storage"] for t in rounds[3]) < sum(t["storage"] for t in alone)
    assert r0["metrics"]["prefetch_skipped_by_reason"] == r1["metrics"]["prefetch_skipped_by_reason"]
    for r in (one, r0, r1):  # draft pages read from storage with the target's, page for page
        assert r["reads"]["draft_read_pages"] == r["reads"]["target_read_pages"] > 0, r["reads"]
        assert r["bytes_remembered"] > 0 and r["bytes_checked"] > 0 and r["bytes_unknown"] == 0, r
        assert r["bytes_mismatched"] == {"target": 0, "draft": 0}, r["bytes_mismatched"]
    assert r0["bytes_checked"] == r1["bytes_checked"]
