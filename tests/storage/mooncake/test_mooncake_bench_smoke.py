"""The serving benchmarks on Mooncake: ``--storage-backend mooncake`` starts a local store
(master + store node) for the run, engines lend it no memory, and it is stopped at the end.

CI runs the store's lifecycle and a page through it with the benchmark's own settings; the
whole ``bench restart --storage-backend mooncake`` (two engine processes sharing the store,
~70 CPU-seconds) is ``slow``. ``test_mooncake_engines.py`` runs two engines in CI."""

from __future__ import annotations

import json
import os

import pytest

from hicache_jax import HostKVPool
from hicache_jax.storage import create_storage
from hicache_jax.storage.mooncake import unavailable_reason

from storage_helpers import GEOM, assert_pages_equal, fill_random, keys_for


def _need_store_and_jax() -> None:
    pytest.importorskip("jax")
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no Mooncake master here: {reason}")


def _children(names: tuple[str, ...]) -> list[str]:
    me, out = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                comm, rest = f.read().split("(", 1)[1].rsplit(")", 1)
        except OSError:
            continue
        state, ppid = rest.split()[:2]
        if ppid == me and comm in names and state != "Z":
            out.append(f"{comm}:{pid}")
    return out


def test_bench_starts_a_store_uses_it_and_stops_it(capsys):
    _need_store_and_jax()
    from hicache_jax import cli
    from hicache_jax.bench import serving

    names = ("mooncake_master", "mooncake_client")
    before = _children(names)
    args = cli.parser().parse_args(
        ["bench", "ttft", "--storage-backend", "mooncake", "--mooncake-node-bytes", str(64 << 20)]
    )
    src = HostKVPool(GEOM, 4, "page_first")
    fill_random(src, 31)
    keys = keys_for(2, seed=31)
    with serving._StorageDir(args):
        assert len(_children(names)) == len(before) + 2  # a master and a store node
        cfg = serving.storage_config(args)
        assert (cfg.backend, cfg.mooncake_master, cfg.mooncake_global_segment_bytes) == (
            "mooncake",
            args.mooncake_master,
            0,
        )
        st = create_storage(cfg, {"target": src})
        try:
            assert st.batch_set(keys, [2, 3]) == [True, True]
            dst = HostKVPool(GEOM, 4, "page_first")
            st.codecs["target"].pool = dst
            assert st.batch_get(keys, [0, 1]) == [True, True]
            assert_pages_equal(src, [2, 3], dst, [0, 1])
        finally:
            st.close()
    assert _children(names) == before
    assert args.mooncake_master is None
    assert "local Mooncake Store" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_restart_on_mooncake(tmp_path, capsys):
    _need_store_and_jax()
    from hicache_jax import cli

    names = ("mooncake_master", "mooncake_client")
    before = _children(names)
    out = tmp_path / "r.json"
    argv = [
        "bench",
        "restart",
        "--model",
        "tiny",
        "--num-prompts",
        "2",
        "--prompt-len",
        "40",
        "--page-size",
        "4",
        "--device-pages",
        "64",
        "--storage-backend",
        "mooncake",
        "--mooncake-node-bytes",
        str(64 << 20),
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["same_tokens"] and payload["write"]["pid"] != payload["read"]["pid"]
    assert payload["read"]["cached"]["storage"] == 2 * 36  # each prompt's 39 tokens, page-aligned
    assert payload["write"]["cached"]["storage"] == 0
    assert payload["config"]["storage_backend"] == "mooncake"
    assert "local Mooncake Store" in capsys.readouterr().out
    assert _children(names) == before  # the store it started is stopped


@pytest.mark.parametrize("placement", ["node", "local"])
def test_bench_l3_mooncake_quick(tmp_path, placement):
    import subprocess
    import sys

    from storage_helpers import REPO, child_env

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no Mooncake master here: {reason}")
    out = tmp_path / "l3.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_l3",
            "--backend",
            "mooncake",
            "--quick",
            "--mooncake-placement",
            placement,
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert list(data["configs"]) == [placement] and data["runs"] == 1
    run = data["configs"][placement]["runs"][0]
    assert run["config"]["placement"] == placement
    for k in (
        "write_mooncake",
        "write_raw",
        "write_rawm",
        "read_mooncake",
        "read_raw",
        "read_rawm",
        "read1_mooncake",
        "read1_raw",
        "read1_rawm",
    ):
        assert run["gbps"][k] > 0
    m = run["backend_metrics"]
    assert m["corrupt"] == 0 and m["hits"] > 0 and m["hits"] == m["verified"]
    # the goal ratio is against the faster raw call, paired per round; the summary is over runs
    for op, s in data["configs"][placement]["summary"].items():
        ratio = run["ratios"][op]["paired"]
        assert s["runs"] == [ratio] and s["median"] == s["min"] == s["max"] == ratio
        assert s["met_every_run"] == (ratio >= s["goal"])
    assert {op: s["goal"] for op, s in data["configs"][placement]["summary"].items()} == {
        "write, one batch": 0.9,
        "read, one batch": 0.9,
        "read, one page per call": 0.8,
    }
    secs = run["seconds"]
    w = [min(b, c) / a for a, b, c in zip(secs["write_mooncake"], secs["write_raw"], secs["write_rawm"])]
    assert run["ratios"]["write, one batch"]["paired"] == sorted(w)[len(w) // 2]  # one round: its own ratio
    assert "n/a (--quick sizes: not comparable)" in r.stdout and "NOT met" not in r.stdout  # no verdict at --quick
