"""A hybrid (sliding-window) model served by the reference engine as two real processes WITH
L3 storage (file): tensor-parallel ranks over ``jax.distributed`` on the CPU, each holding its
KV heads of the full and the SWA pool, one file store both write, against the same workload in
one process (``hybrid_l3_engine_rank.py``).

Rounds are served from the device (L1), the host (L2) and storage (L3, windows included).
Rank 1 alone fails SWA host allocations, finishes its D2H copies late, reads a full-pool page
short, reads an SWA window page short and sees a storage page missing. The ranks must produce
the single process's tokens, their trees' digests (SWA state included) must be equal after
every agreement step, every injection must have fired, and the L3 round must attach and load
the same pages (and windows) on both ranks. With the exchange switched off
(``NoExchangeAgreement``) the SWA allocation failures alone must leave the ranks' settled trees
different, while without them they settle equal: the digests can see what the agreement
prevents. The launcher kills both ranks at its deadline, so a hang fails the test.

Cost: one launch of the ranks serves the CI case and the control (``launched``: the controls
run in the rank processes after the agreed run), instead of three; CI's ``--dist loadfile``
keeps both tests on one worker, so it launches once.
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
SCRIPT = str(HERE / "hybrid_l3_engine_rank.py")
CLIENTS = 4  # hybrid_l3_engine_rank.FIRSTS: requests per round
CONTROLS = ("swa", "calm")  # the agreement-off control's runs: rank 1's failing SWA allocations, none


def launch(out: Path, agreement: str, diverge: str, base: dict, controls: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """The rank script as two ranks over a fresh store under ``out``: rank 0's and rank 1's JSON.
    ``controls``: the agreement-off controls the ranks also run after theirs (the script's
    CONTROLS; results in ``out / control``)."""
    out.mkdir()
    (out / "l3").mkdir()
    launch_local(
        [
            sys.executable,
            SCRIPT,
            str(out),
            str(out / "l3"),
            agreement,
            diverge,
            *([",".join(controls)] if controls else []),
        ],
        2,
        timeout_s=300 + 120 * len(controls),
        cwd=str(ROOT),
        env=base,
    )
    return ranks_json(out)


def ranks_json(out: Path) -> tuple[dict, dict]:
    return tuple(json.loads((out / f"rank{r}.json").read_text()) for r in range(2))


def run_ranks_and_single(
    tmp_path, kv_heads: int | None = None, controls: tuple[str, ...] = ()
) -> tuple[dict, dict, dict]:
    """Two ranks under every divergence (then ``controls``: see ``launch``) and, alongside, one
    process: (single, rank 0, rank 1). ``kv_heads``: the model's KV heads if not the tiny
    hybrid's two."""
    base = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree's hicache_jax, not an installed one
    if kv_heads is not None:
        base["HYBRID_RANK_KV_HEADS"] = str(kv_heads)
    env = rank_env(0, 1, "", base)
    for k in ("HICACHE_RANK", "HICACHE_NUM_PROCESSES", "HICACHE_COORDINATOR"):
        env.pop(k)
    one_dir = tmp_path / "single"
    (one_dir / "l3").mkdir(parents=True)
    single = subprocess.Popen(
        [sys.executable, SCRIPT, str(one_dir), str(one_dir / "l3"), "single", "-"],
        cwd=str(ROOT),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        r0, r1 = launch(tmp_path / "ranks", "kv", "all", base, controls)
        out, _ = single.communicate(timeout=300)
    finally:
        if single.poll() is None:
            single.kill()
            single.wait()
    assert single.returncode == 0, out[-3000:]
    return json.loads((one_dir / "single.json").read_text()), r0, r1


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, tuple[dict, dict, dict]]:
    """The CI case's launch (the tiny hybrid's two KV heads), with the controls, once."""
    out = tmp_path_factory.mktemp("hybrid_l3")
    return out, run_ranks_and_single(out, None, CONTROLS)


@pytest.mark.parametrize("kv_heads", [None, pytest.param(1, marks=pytest.mark.slow)])
def test_two_ranks_serve_a_hybrid_model_from_l1_l2_and_l3_with_the_single_process_tokens(request, tmp_path, kv_heads):
    """``kv_heads=1``: fewer KV heads than ranks, so the full and the SWA pool are replicated on
    both ranks and rank 0 alone writes their L3 pages (no commit markers)."""
    if kv_heads is None:
        tmp_path, (one, r0, r1) = request.getfixturevalue("launched")
    else:
        one, r0, r1 = run_ranks_and_single(tmp_path, kv_heads)
    assert r0["tokens"] == r1["tokens"] == one["tokens"]
    assert len(r0["digests"]) == len(r1["digests"]) > 20 and r0["digests"] == r1["digests"]
    assert all(v > 0 for v in r1["fired"].values()), r1["fired"]
    assert not any(r0["fired"].values()), r0["fired"]
    assert r0["tiers"] == r1["tiers"]
    rounds = [r0["tiers"][i : i + CLIENTS] for i in range(0, len(r0["tiers"]), CLIENTS)]
    assert len(rounds) == 4
    assert all(t["device"] > 0 for t in rounds[1]), rounds[1]  # L1
    assert all(t["device"] == 0 for t in rounds[2]) and any(t["host"] > 0 for t in rounds[2]), rounds[2]  # L2
    assert all(t["device"] == t["host"] == 0 for t in rounds[3]) and any(t["storage"] > 0 for t in rounds[3])  # L3
    # The same pages attached from L3, and the same SWA window pages loaded, on both ranks.
    assert r0["metrics"]["prefetch_attached_tokens"] == r1["metrics"]["prefetch_attached_tokens"] > 0
    assert r0["metrics"]["loaded_storage_tokens"] == r1["metrics"]["loaded_storage_tokens"] > 0
    assert r0["swa_loaded_tokens"] == r1["swa_loaded_tokens"] > 0
    # Rank 1's faults made the L3 round serve less than one process does, the same on both
    # ranks (agreed, not wrong: the tokens are the same): a request cut short (a missing page,
    # then a short read), one whose window read came up short (nothing attached), and whole ones.
    alone = one["tiers"][3 * CLIENTS :]
    assert all(t["storage"] > 0 for t in alone), alone
    assert any(0 < t["storage"] < u["storage"] for t, u in zip(rounds[3], alone)), rounds[3]
    assert any(t["storage"] == 0 for t in rounds[3]), rounds[3]
    assert any(t["storage"] == u["storage"] for t, u in zip(rounds[3], alone)), rounds[3]
    assert r0["stats"]["exchanges"] == r1["stats"]["exchanges"] == r0["stats"]["steps"]  # one per step
    # The bytes each rank was served in the L3 round (its heads of the full pages and of the
    # window's SWA pages) are those it computed (remembered from the tree before the tiers
    # were dropped), for every request whose whole stored prefix came back.
    for r in (one, r0, r1):
        assert r["bytes_remembered"] == CLIENTS and r["bytes_checked"] >= 1 and not r["bytes_mismatched"], {
            k: r[k] for k in ("bytes_remembered", "bytes_checked", "bytes_mismatched")
        }
    assert r0["bytes_checked"] == r1["bytes_checked"]
    if kv_heads is None:
        assert os.listdir(tmp_path / "ranks" / "l3" / "pages-v1" / "commit")  # rank 0 marked what both stored
    else:
        assert not (tmp_path / "ranks" / "l3" / "pages-v1" / "commit").exists()
    assert os.listdir(tmp_path / "ranks" / "l3" / "pages-v1" / "swa")  # the windows went to storage


def test_without_the_exchange_an_swa_allocation_failing_on_one_rank_splits_the_trees(launched):
    """The agreement-off control: the same protocol with ``NoExchangeAgreement``. Rank 1's failing
    SWA host allocations alone leave the settled trees different; without them the settled
    trees are equal (the mid-run digests may differ either way: copies land at each rank's pace).
    Run by the ranks of the CI case above, after theirs (``launched``), each on a fresh engine
    and store."""
    ranks_dir = launched[0] / "ranks"
    r0, r1 = ranks_json(ranks_dir / "swa")
    assert r1["fired"]["swa_host_alloc_fail"] > 0
    assert r0["tokens"] == r1["tokens"]  # the divergence is in what the trees keep, not in the steps
    assert r0["digests"][-1] != r1["digests"][-1]
    c0, c1 = ranks_json(ranks_dir / "calm")
    assert not any(c1["fired"].values())
    assert c0["digests"][-1] == c1["digests"][-1]
