"""Speculative decoding served by the reference engine as two real processes WITH L3 storage
(file): tensor-parallel ranks over ``jax.distributed`` on the CPU, each holding its KV heads of
the target's and the draft's pool, one file store both write, against the same workload in one
process (``spec_l3_engine_rank.py``).

Rounds are served from the device (L1), the host (L2) and storage (L3), draft pages read from
storage with the target's. Rank 1 alone fails host allocations, finishes its D2H copies late,
reads a page short of every storage read, sees a storage page missing and starts every round
late. The ranks must produce the single process's tokens, their trees' digests must be equal
after every agreement step (and at every exchange: ``check_digest``), every injection must have
fired, the L3 round must attach the same pages on both ranks, and every page it serves must
hold, on each rank, the bytes (that rank's heads of the target's and the draft's KV) computed
for its prefix. With the exchange switched off (``NoExchangeAgreement``) the allocation failures
alone must leave the ranks' settled trees different, while without them they settle equal: the
digests can see what the agreement prevents. The launcher kills both ranks at its deadline, so
a hang fails the test.

Cost: one launch of the ranks serves both tests (``launched``: the controls run in the rank
processes after the agreed run), instead of three; CI's ``--dist loadfile`` keeps both tests
on one worker, so it launches once.
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
SCRIPT = str(HERE / "spec_l3_engine_rank.py")
CLIENTS, PAGE = 3, 4  # spec_l3_engine_rank: requests per round, tokens per page


def launch(
    out: Path, agreement: str, diverge: str, base: dict, script: str = SCRIPT, controls: tuple[str, ...] = ()
) -> tuple[dict, dict]:
    """``script`` as two ranks over a fresh store under ``out``: rank 0's and rank 1's JSON.
    ``controls``: the agreement-off controls the ranks also run after theirs (``script``'s
    CONTROLS; results in ``out / control``)."""
    out.mkdir()
    (out / "l3").mkdir()
    launch_local(
        [
            sys.executable,
            script,
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


def run_ranks_and_single(tmp_path, script: str = SCRIPT, controls: tuple[str, ...] = ()) -> tuple[dict, dict, dict]:
    """``script`` as two ranks under every divergence (then ``controls``: see ``launch``) and,
    alongside, as one process: (single, rank 0, rank 1)."""
    base = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree's hicache_jax, not an installed one
    env = rank_env(0, 1, "", base)
    for k in ("HICACHE_RANK", "HICACHE_NUM_PROCESSES", "HICACHE_COORDINATOR"):
        env.pop(k)
    one_dir = tmp_path / "single"
    (one_dir / "l3").mkdir(parents=True)
    single = subprocess.Popen(
        [sys.executable, script, str(one_dir), str(one_dir / "l3"), "single", "-"],
        cwd=str(ROOT),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        r0, r1 = launch(tmp_path / "ranks", "kv", "all", base, script, controls)
        out, _ = single.communicate(timeout=300)
    finally:
        if single.poll() is None:
            single.kill()
            single.wait()
    assert single.returncode == 0, out[-3000:]
    return json.loads((one_dir / "single.json").read_text()), r0, r1


CONTROLS = ("alloc", "calm")  # the agreement-off control's runs: rank 1's failing allocations, none


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, tuple[dict, dict, dict]]:
    """The ranks (every divergence, then the controls) and the single process, once for the
    module (one launch for both tests: each launch costs the ranks' start-up and compiles)."""
    out = tmp_path_factory.mktemp("spec_l3")
    return out, run_ranks_and_single(out, controls=CONTROLS)


def test_two_ranks_decode_speculatively_from_l1_l2_and_l3_with_the_single_process_tokens(launched):
    tmp_path, (one, r0, r1) = launched
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
    # The same pages attached and loaded from L3 on both ranks; rank 1's short reads and missing
    # pages made the L3 round serve less than one process does (agreed, not wrong).
    assert r0["metrics"]["prefetch_attached_tokens"] == r1["metrics"]["prefetch_attached_tokens"] > 0
    assert r0["metrics"]["loaded_storage_tokens"] == r1["metrics"]["loaded_storage_tokens"] > 0
    alone = one["tiers"][3 * CLIENTS :]
    assert sum(t["storage"] for t in rounds[3]) < sum(t["storage"] for t in alone), (rounds[3], alone)
    # A prefix whose backup failed (agreed: rank 1's host allocation) never reached L3: its
    # prefetch is skipped alike on both ranks.
    assert r0["metrics"]["prefetch_skipped_by_reason"] == r1["metrics"]["prefetch_skipped_by_reason"]
    # Draft pages came from storage with the target's, on both ranks, page for page; rank 1
    # read short, and both attached no more than it read.
    for r in (one, r0, r1):
        assert r["reads"]["draft_read_pages"] == r["reads"]["target_read_pages"] > 0, r["reads"]
    assert r0["reads"]["target_read_pages"] > r1["reads"]["target_read_pages"]
    assert r0["metrics"]["prefetch_attached_tokens"] <= PAGE * r1["reads"]["target_read_pages"]
    assert r0["stats"]["exchanges"] == r1["stats"]["exchanges"] > 0
    # The bytes each rank was served in the L3 round (its heads of the target's and the
    # draft's KV of every served page) are those it computed for the page's prefix.
    for r in (one, r0, r1):
        assert r["bytes_remembered"] > 0 and r["bytes_checked"] > 0 and r["bytes_unknown"] == 0, r
        assert r["bytes_mismatched"] == {"target": 0, "draft": 0}, r["bytes_mismatched"]
    assert r0["bytes_checked"] == r1["bytes_checked"]
    assert r0["bytes_checked"] * PAGE == sum(t["storage"] for t in rounds[3])  # every page served from L3
    assert os.listdir(tmp_path / "ranks" / "l3" / "pages-v1" / "commit")  # rank 0 marked what both stored
    assert os.listdir(tmp_path / "ranks" / "l3" / "pages-v1" / "draft")  # the draft pages went to storage


def test_without_the_exchange_a_host_allocation_failing_on_one_rank_splits_the_speculative_trees(launched):
    """The agreement-off control: the same protocol with ``NoExchangeAgreement``. Rank 1's failing
    host allocations (its backups of target and draft pages) alone leave the settled trees
    different; without them the settled trees are equal. Run by the ranks of the test above,
    after theirs (``launched``), each control on a fresh engine and store."""
    ranks_dir = launched[0] / "ranks"
    r0, r1 = ranks_json(ranks_dir / "alloc")
    assert r1["fired"]["alloc_fail"] > 0
    assert r0["tokens"] == r1["tokens"]  # the divergence is in what the trees keep, not in the steps
    assert r0["digests"][-1] != r1["digests"][-1]
    c0, c1 = ranks_json(ranks_dir / "calm")
    assert not any(c1["fired"].values())
    assert c0["digests"][-1] == c1["digests"][-1]
