"""The reference engine as two real processes (tensor-parallel ranks over ``jax.distributed``
on the CPU, each holding its KV heads), against the same workload in one process.

Rank 1 alone fails every third host allocation, finishes its D2H copies steps late, reads
short and sees a storage page missing (``engine_rank.py``). The ranks must produce the same
tokens as the single process, their trees' digests must be equal at every agreement step
(recorded, and compared by every exchange: ``check_digest``), every divergence must have
fired, and the last round must still be served from L3 on both ranks. The launcher kills
both ranks at its deadline, so a hang fails the test rather than CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_jax.distributed import launch_local
from hicache_jax.distributed.launch import rank_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.mark.parametrize(
    "model", ["mha", pytest.param("one_kv_head", marks=pytest.mark.slow), pytest.param("mla", marks=pytest.mark.slow)]
)
def test_two_ranks_serve_the_single_process_tokens_under_divergence(tmp_path, model):
    """``model`` (``engine_rank.MODELS``): ``mha`` shards the two KV heads over the ranks;
    ``one_kv_head`` (fewer KV heads than ranks) and ``mla`` replicate every pool on both ranks,
    whose L3 pages rank 0 alone writes under keys without a rank (no commit markers)."""
    (tmp_path / "l3").mkdir()
    (tmp_path / "l3-single").mkdir()
    script = str(HERE / "engine_rank.py")
    env = rank_env(0, 1, "")
    for k in ("HICACHE_RANK", "HICACHE_NUM_PROCESSES", "HICACHE_COORDINATOR"):
        env.pop(k)
    single = subprocess.Popen(
        [sys.executable, script, str(tmp_path), str(tmp_path / "l3-single"), "single", "-", model],
        cwd=str(ROOT),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        launch_local(
            [sys.executable, script, str(tmp_path), str(tmp_path / "l3"), "kv", "all", model],
            2,
            timeout_s=400,
            cwd=str(ROOT),
        )
        out, _ = single.communicate(timeout=400)
    finally:
        if single.poll() is None:
            single.kill()
            single.wait()
    assert single.returncode == 0, out[-3000:]
    one = json.loads((tmp_path / "single.json").read_text())
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["tokens"] == r1["tokens"] == one["tokens"]
    assert len(r0["digests"]) == len(r1["digests"]) > 20 and r0["digests"] == r1["digests"]
    assert all(v > 0 for v in r1["fired"].values()), r1["fired"]
    assert r0["tiers"] == r1["tiers"]
    assert r0["metrics"]["prefetch_attached_tokens"] == r1["metrics"]["prefetch_attached_tokens"] > 0
    pages, alone = tmp_path / "l3" / "pages-v1", tmp_path / "l3-single" / "pages-v1"
    stored = {p.relative_to(pages) for p in pages.rglob("*.kv") if p.parent.parent.name == "target"}
    stored_alone = {p.relative_to(alone) for p in alone.rglob("*.kv") if p.parent.parent.name == "target"}
    assert stored and stored_alone
    if model == "mha":  # each rank its half of every page, under keys with the rank
        assert os.listdir(pages / "commit")  # rank 0 marked what both stored
        assert not stored & stored_alone
        assert r0["metrics"]["storage_written_pages"] > 0 and r1["metrics"]["storage_written_pages"] > 0
    else:  # one copy of every page, written by rank 0 under the single process's keys, with its bytes
        assert not (pages / "commit").exists()
        assert r1["metrics"]["storage_written_pages"] == 0 < r0["metrics"]["storage_written_pages"]
        assert stored <= stored_alone, sorted(map(str, stored - stored_alone))[:3]
        assert all((pages / p).read_bytes() == (alone / p).read_bytes() for p in stored)


def test_each_rank_moves_exactly_its_own_heads_of_every_page():
    results = launch_local([sys.executable, str(HERE / "transfer_rank.py")], 2, timeout_s=300, cwd=str(ROOT))
    assert [r.output.strip().splitlines()[-1] for r in results] == ["ok 0", "ok 1"]


@pytest.mark.slow  # ~2 min of CPU (two ranks, then one process, each compile and run the benchmark)
def test_bench_multiturn_runs_as_two_processes_with_the_single_process_tokens(tmp_path):
    """``hicache-jax bench multiturn --num-processes 2``: both ranks serve (rank 0 reports, its
    output echoed live), every rank's tokens equal rank 0's and the no-cache run's, and they
    equal what the same command serves in one process (compared by the payloads' token digests)."""
    cmd = [
        sys.executable,
        "-m",
        "hicache_jax.cli",
        "bench",
        "multiturn",
        "--model",
        "tiny",
        "--clients",
        "2",
        "--rounds",
        "2",
        "--first-len",
        "40",
        "--turn-len",
        "12",
        "--answer-len",
        "3",
        "--device-pages",
        "24",
        "--page-size",
        "4",
        "--host-ratio",
        "1",
        "--storage-backend",
        "file",
        "--rank-timeout",
        "500",
    ]
    out = tmp_path / "results" / "mt.json"
    r = subprocess.run(
        [*cmd, "--num-processes", "2", "--out", str(out)], cwd=str(ROOT), capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["ranks"]["num_processes"] == 2 and payload["ranks"]["same_tokens_as_rank0"] == [True, True]
    assert payload["same_tokens"] and payload["hicache"]["cache_hit_rate"] > 0
    steps = payload["ranks"]["agreement_steps"]
    assert steps[0]["exchanges"] == steps[1]["exchanges"] > 0
    assert "tokens identical on every rank: True" in r.stdout
    assert "round 1 hicache" in r.stdout + r.stderr  # rank 0's progress came through
    one = tmp_path / "results" / "one.json"
    r1 = subprocess.run([*cmd, "--out", str(one)], cwd=str(ROOT), capture_output=True, text=True, timeout=600)
    assert r1.returncode == 0, r1.stdout[-3000:] + r1.stderr[-3000:]
    single = json.loads(one.read_text())
    assert "ranks" not in single and "agreement" not in single["cache_stats"]
    assert payload["tokens_sha256"] == single["tokens_sha256"]
