"""Two real processes, one cache state: ``jax.distributed`` on the CPU (gloo), no mocked
collective. Both ranks run the same trace (``tests/cache/rank_trace.py``) with rank 1's
divergences injected (a failing host allocation, copies finishing steps later, short and
missing storage reads; over a hybrid cache, with a draft sidecar too: failing SWA host
allocations and a window sliding a step late); every step's tree digests must be equal across
the ranks, and the served prefixes too. Every barrier is bounded (``KVStoreAgreement`` / ``DeviceAgreement``
timeouts) and the launcher kills both processes at its deadline, so a hang fails the test.
With the exchange switched off (``NoExchangeAgreement``) the same divergence must split the
trees: the digests can see what the agreement prevents.

Cost: each agreement-off control runs in the launch of its kv test (``kv+none``: the ranks run
the control after the kv trace, on a fresh cache), read through a module fixture; CI's
``--dist loadfile`` keeps the file on one worker, so each pair launches once.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from hicache_jax.distributed import RanksFailed, launch_local

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STEPS = 30


def run_pair(
    tmp_path, agreement: str, divergence: str = "all", timeout_s: float = 240, env=None, components: str = "full"
) -> list[dict]:
    """Both ranks' JSON (``agreement`` ``kv+none``: the kv run's; ``pair_json(tmp_path / "out" /
    "none")`` reads the control's)."""
    store, out = tmp_path / "l3", tmp_path / "out"
    store.mkdir()
    out.mkdir()
    launch_local(
        [
            sys.executable,
            str(HERE / "trace_rank.py"),
            agreement,
            divergence,
            str(store),
            str(out),
            str(STEPS),
            components,
        ],
        2,
        timeout_s=timeout_s,
        cwd=str(ROOT),
        env=env,
    )
    return pair_json(out)


def pair_json(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def kv_and_control(tmp_path_factory) -> Path:
    """The kv run under every divergence, then its agreement-off control, in one launch."""
    tmp = tmp_path_factory.mktemp("kv_and_control")
    run_pair(tmp, "kv+none", timeout_s=360)
    return tmp / "out"


@pytest.fixture(scope="module")
def swa_and_control(tmp_path_factory) -> Path:
    """The same over a hybrid cache (``components`` swa)."""
    tmp = tmp_path_factory.mktemp("swa_and_control")
    run_pair(tmp, "kv+none", timeout_s=360, components="swa")
    return tmp / "out"


@pytest.mark.parametrize("agreement", ["kv", "device"])
def test_two_processes_stay_identical_under_every_divergence(request, tmp_path, agreement):
    if agreement == "kv":
        r0, r1 = pair_json(request.getfixturevalue("kv_and_control"))
    else:
        r0, r1 = run_pair(tmp_path, agreement)
    assert len(r0["digests"]) == STEPS + 1
    assert r0["digests"] == r1["digests"]
    assert r0["served"] == r1["served"] and sum(r0["served"]) > 0
    assert r0["storage_tokens"] == r1["storage_tokens"] > 0
    assert all(v > 0 for v in r1["fired"].values()), r1["fired"]
    assert r0["exchanges"] == r1["exchanges"] >= STEPS


def test_two_processes_without_the_exchange_diverge(kv_and_control):
    """What this control shows, and what it does not: without the exchange the two ranks' trees
    differ, so the kv test's equal digests are not vacuous. It does not tie the split to rank
    1's injections: with L3 on, each rank's prefetch hits depend on when its own write-through
    reached the store, so a run without injections splits too (seen: steps 24 and 29 of a
    calm run differ). The SWA control below has no L3 and does fail without its injections."""
    r0, r1 = pair_json(kv_and_control / "none")
    assert r0["digests"] != r1["digests"]


@pytest.mark.parametrize("components", ["swa", "draft+swa"])
def test_two_processes_with_swa_stay_identical_under_every_divergence(request, tmp_path, components):
    """A hybrid cache (and a draft sidecar) across two processes: rank 1's full and SWA host
    allocations fail, its copies finish late and its window slides a step late; the digests
    (SWA state included) stay equal after every step, one exchange per step."""
    if components == "swa":
        r0, r1 = pair_json(request.getfixturevalue("swa_and_control"))
    else:
        r0, r1 = run_pair(tmp_path, "kv", components=components)
    assert len(r0["digests"]) == STEPS + 1
    assert r0["digests"] == r1["digests"]
    assert r0["served"] == r1["served"] and sum(r0["served"]) > 0
    assert set(r1["fired"]) == {"alloc_fail", "slow_d2h", "swa_alloc_fail", "late_slide"}
    assert all(v > 0 for v in r1["fired"].values()), r1["fired"]
    assert r0["exchanges"] == r1["exchanges"] == STEPS


def test_two_processes_with_swa_without_the_exchange_diverge(swa_and_control):
    r0, r1 = pair_json(swa_and_control / "none")
    assert r0["digests"] != r1["digests"]


@pytest.mark.parametrize("agreement", ["kv", "device"])
def test_a_rank_that_never_arrives_times_the_others_out_instead_of_hanging(tmp_path, agreement):
    t0 = time.monotonic()
    with pytest.raises(RanksFailed, match="a rank failed") as e:
        run_pair(tmp_path, agreement, "stall", env={**os.environ, "HICACHE_AGREEMENT_TIMEOUT": "3"})
    rank0 = e.value.results[0]
    assert rank0.returncode not in (0, None) and "AgreementError" in rank0.output and "within 3 s" in rank0.output
    assert e.value.results[1].returncode is not None  # killed, not left behind
    assert time.monotonic() - t0 < 120


def test_the_launcher_kills_every_rank_at_its_deadline(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RanksFailed, match="outlived 2 s"):
        launch_local([sys.executable, "-c", "import time; time.sleep(600)"], 2, timeout_s=2)
    assert time.monotonic() - t0 < 30


def test_both_agreements_give_the_min_clean_up_and_run_on_worker_threads():
    results = launch_local([sys.executable, str(HERE / "agreement_rank.py")], 2, timeout_s=240, cwd=str(ROOT))
    assert [r.output.strip().splitlines()[-1] for r in results] == ["ok 0", "ok 1"]
