"""A hybrid (sliding-window) model served by the reference engine as two real processes
(tensor-parallel ranks over ``jax.distributed`` on the CPU, each holding its KV heads of the
full and the SWA pool), against the same workload in one process; no L3 (the L3's SWA window
reads are not agreed across ranks yet, and the engine refuses that combination).

Rank 1 alone fails every other SWA host allocation (``hybrid_engine_rank.py``); the SWA pool
is sized exactly (``Engine.swa_pages_needed`` with ranks) and one prompt is long enough that
its prefill outruns its agreed (lagging) window slides. The ranks must
produce the same tokens as the single process, their trees' digests (SWA component included)
must be equal after every agreement step, the injection must have fired, window slides must have been agreed, and
the rounds must be served from the device (L1) and, after a device eviction, from the host
(L2) alike on both ranks. The launcher kills both ranks at its deadline, so a hang fails the
test rather than CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hicache_jax.distributed import launch_local
from hicache_jax.distributed.launch import rank_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CLIENTS = 3  # hybrid_engine_rank.CLIENTS: requests per round


def run_ranks_and_single(tmp_path, script: str, diverge: str, *controls: str) -> tuple[dict, dict, dict]:
    """``script`` as two ranks (DIVERGE ``diverge``) and, alongside, as one process: the
    single run's, rank 0's and rank 1's JSON. ``controls``: the agreement-off controls the
    ranks also run after theirs (``script``'s CONTROLS; results in ``tmp_path / control``)."""
    base = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree's hicache_jax, not an installed one
    env = rank_env(0, 1, "", base)
    for k in ("HICACHE_RANK", "HICACHE_NUM_PROCESSES", "HICACHE_COORDINATOR"):
        env.pop(k)
    single = subprocess.Popen(
        [sys.executable, script, str(tmp_path), "single", "-"],
        cwd=str(ROOT),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        launch_local(
            [sys.executable, script, str(tmp_path), "kv", diverge, *([",".join(controls)] if controls else [])],
            2,
            timeout_s=300 + 120 * len(controls),
            cwd=str(ROOT),
            env=base,
        )
        out, _ = single.communicate(timeout=300)
    finally:
        if single.poll() is None:
            single.kill()
            single.wait()
    assert single.returncode == 0, out[-3000:]
    return tuple(json.loads((tmp_path / f"{n}.json").read_text()) for n in ("single", "rank0", "rank1"))


def test_two_ranks_serve_a_hybrid_model_with_the_single_process_tokens_under_swa_divergence(tmp_path):
    one, r0, r1 = run_ranks_and_single(tmp_path, str(HERE / "hybrid_engine_rank.py"), "swa")
    assert r0["tokens"] == r1["tokens"] == one["tokens"]
    assert len(r0["digests"]) == len(r1["digests"]) > 5 and r0["digests"] == r1["digests"]
    assert r1["fired"]["swa_host_alloc_fail"] > 0, r1["fired"]
    assert r0["slides"] == r1["slides"] > 0  # window slides went through the agreement
    # The long prefill outran its agreed slides: an SWA allocation ran short and succeeded
    # after an agreement step, at the same point on both ranks.
    assert r0["swa_allocs_after_agreed_slides"] == r1["swa_allocs_after_agreed_slides"] > 0
    assert r0["tiers"] == r1["tiers"]
    second, last = r0["tiers"][CLIENTS : 2 * CLIENTS], r0["tiers"][2 * CLIENTS :]
    assert all(t["device"] > 0 for t in second), second  # L1
    assert all(t["device"] == 0 for t in last) and any(t["host"] > 0 for t in last), last  # L2
    # The windows whose SWA backup failed on rank 1 are host tombstones on both ranks: their
    # prefixes are served shorter from the host than in the single process (agreed, not wrong).
    assert sum(t["host"] for t in last) < sum(t["host"] for t in one["tiers"][2 * CLIENTS :])
