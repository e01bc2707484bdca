"""The L3 benchmark runs end to end in --quick mode and writes its JSON (needs orbax)."""

import json
import os
import subprocess
import sys

from storage_helpers import REPO, child_env


def test_bench_l3_quick(tmp_path):
    out = tmp_path / "l3.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_l3", "--quick", "--out", str(out),
                        "--dir", str(tmp_path / "store")], cwd=REPO, env=child_env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    for k in ("write_orbax", "write_raw", "write_raw_seg", "read1_orbax", "read1_raw", "read1_raw_split",
              "read16_orbax", "read16_raw"):
        assert data["gbps"][k] > 0
    assert set(data["goal_ratios"]) >= {"write / orbax segments", "cold read, 1 at a time / orbax + CRC",
                                        "cold read, 16 in flight / orbax + CRC"}
    # the goal ratio is against the faster raw baseline of the op
    assert data["goal_ratios"]["write / orbax segments"] == min(
        data["ratios"]["write / orbax segments / raw file per page"],
        data["ratios"]["write / orbax segments / raw file per segment"])
    assert data["crc32c"]["gbps"] > 0 and "machine" in data
    assert not os.listdir(tmp_path / "store")  # rounds cleaned up
