"""Smoke test of ``python -m npu_bridge.bench_transfer_torch`` (tiny sweep, CPU)."""

import json
import subprocess
import sys
from pathlib import Path

from npu_bridge import bench_transfer_torch

ROOT = Path(__file__).parents[2]
COLUMNS = {
    "page_size",
    "pages",
    "layout",
    "d2h_gbps",
    "raw_d2h_gbps",
    "host_memcpy_gbps",
    "h2d_gbps",
    "raw_h2d_gbps",
    "d2h_vs_raw",
    "d2h_vs_memcpy",
    "h2d_vs_raw",
    "gather_gbps",
    "scatter_gbps",
}


def test_bench_quick_cli_writes_table_and_json(tmp_path):
    out = tmp_path / "t.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "npu_bridge.bench_transfer_torch",
            "--quick",
            "--device",
            "cpu",
            "--page-counts",
            "4",
            "--reps",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "x raw D2H" in r.stdout and "N/A" in r.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "transfer" and data["backend"] == "torch" and data["host_pool_memory"] == "pageable"
    assert {(x["page_size"], x["layout"]) for x in data["results"]} == {
        (p, l) for p in (1, 16) for l in ("layer_first", "page_first", "page_first_direct")
    }
    for x in data["results"]:
        assert COLUMNS <= x.keys() and x["gather_gbps"] is None
        assert x["d2h_gbps"] > 0 and x["h2d_gbps"] > 0 and x["raw_d2h_gbps"] > 0


def test_bench_mla_kv_split_through_the_op_reference(tmp_path):
    out = tmp_path / "m.json"
    assert (
        bench_transfer_torch.main(
            [
                "--quick",
                "--device",
                "cpu",
                "--kind",
                "mla",
                "--impl",
                "reference",
                "--layouts",
                "page_first_kv_split",
                "--page-sizes",
                "4",
                "--page-counts",
                "4",
                "--reps",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    (row,) = json.loads(out.read_text())["results"]
    assert row["layout"] == "page_first_kv_split" and row["transfer_impl"] == "reference" and row["h2d_gbps"] > 0
