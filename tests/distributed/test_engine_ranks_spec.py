"""Speculative decoding served by the reference engine as two real processes (the draft pool
sharded as the target's, draft pages moving with the target pages), against the same workload
in one process; no L3. Rank 1 alone fails every third host allocation
(``spec_engine_rank.py``). The ranks must produce the single process's tokens, their digests
must be equal at every exchange (``check_digest``) and after every step, the injection must
have fired, and the rounds must be served from the device (L1) and, after a device eviction,
from the host (L2) alike on both ranks. The same served from L3 too, with rank 1's storage
faults and the agreement-off control: ``test_engine_ranks_spec_l3``.
"""

from __future__ import annotations

from pathlib import Path

from test_engine_ranks_hybrid import run_ranks_and_single

HERE = Path(__file__).resolve().parent
CLIENTS = 3  # spec_engine_rank.CLIENTS: requests per round


def test_two_ranks_serve_speculative_decoding_with_the_single_process_tokens_under_divergence(tmp_path):
    one, r0, r1 = run_ranks_and_single(tmp_path, str(HERE / "spec_engine_rank.py"), "alloc")
    assert r0["tokens"] == r1["tokens"] == one["tokens"]
    assert len(r0["digests"]) == len(r1["digests"]) > 5 and r0["digests"] == r1["digests"]
    assert r1["fired"]["alloc_fail"] > 0, r1["fired"]
    assert r0["tiers"] == r1["tiers"]
    second, last = r0["tiers"][CLIENTS : 2 * CLIENTS], r0["tiers"][2 * CLIENTS :]
    assert all(t["device"] > 0 for t in second), second  # L1
    assert all(t["device"] == 0 for t in last) and any(t["host"] > 0 for t in last), last  # L2
