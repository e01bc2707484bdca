"""Benchmarks as two tensor-parallel ranks (``--num-processes 2``, ``hicache_jax.bench.ranks``):
``bench spec`` (speculative decoding, draft KV from each tier) and ``bench multiturn --model
hybrid`` (a sliding-window model). Each runs the real command line: the parent launches two
ranks (``jax.distributed`` on the CPU), rank 0 reports, and the parent checks that every rank
served rank 0's tokens. ``test_engine_ranks`` covers ``bench multiturn`` with a full-attention model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench(tmp_path, *argv: str) -> tuple[dict, str]:
    out = tmp_path / "results" / "bench.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hicache_jax.cli",
            "bench",
            *argv,
            "--num-processes",
            "2",
            "--rank-timeout",
            "500",
            "--out",
            str(out),
        ],
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout


def _same_on_both_ranks(payload: dict, stdout: str) -> None:
    ranks = payload["ranks"]
    assert ranks["num_processes"] == 2 and ranks["same_tokens_as_rank0"] == [True, True]
    steps = ranks["agreement_steps"]
    assert steps[0]["exchanges"] == steps[1]["exchanges"] > 0
    assert steps[0]["caches"] == steps[1]["caches"] >= 1
    assert "tokens identical on every rank: True" in stdout


@pytest.mark.slow  # ~3 min on a loaded 2-vCPU VM (two ranks compile the pair's programs)
def test_bench_spec_runs_as_two_processes_with_the_same_tokens_on_both_ranks(tmp_path):
    """``bench spec --quick --num-processes 2``: the four cases (cold, L1, L3 with and without
    draft backing) on both ranks, on a shared file L3; the draft KV comes back from L3 over
    ranks (restored accept length = the L1 hit's), and without draft backing it does not."""
    payload, stdout = _bench(tmp_path, "spec", "--quick")
    _same_on_both_ranks(payload, stdout)
    # the counts cover every engine of the rank: cold + L1, then the two restarts on L3
    assert payload["ranks"]["agreement_steps"][0]["caches"] == 3
    cases = payload["cases"]
    assert all(c["same_tokens_as_cold"] for c in cases.values()), {
        k: c["same_tokens_as_cold"] for k, c in cases.items()
    }
    assert cases["L1"]["cached_tokens"]["device"] > 0
    assert cases["L3 + draft"]["cached_tokens"]["storage"] > 0 and cases["L3, no draft"]["cached_tokens"]["storage"] > 0
    assert payload["ratios"]["restored_over_l1"] == 1.0
    assert payload["ratios"]["no_draft_over_l1"] < 0.9


@pytest.mark.slow  # ~3 min on a loaded 2-vCPU VM
def test_bench_multiturn_of_a_hybrid_model_runs_as_two_processes_with_the_same_tokens_on_both_ranks(tmp_path):
    """``bench multiturn --model hybrid --quick --num-processes 2`` (the tiny hybrid preset):
    both ranks serve rank 0's tokens, equal to the no-cache run's, with prefix hits, on the
    shared file L3 the parent sets up for ranks."""
    payload, stdout = _bench(tmp_path, "multiturn", "--quick", "--model", "hybrid")
    _same_on_both_ranks(payload, stdout)
    assert payload["same_tokens"] and payload["hicache"]["cache_hit_rate"] > 0
