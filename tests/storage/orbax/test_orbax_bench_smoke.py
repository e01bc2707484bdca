"""The L3 benchmark runs end to end in --quick mode and writes its JSON (needs orbax)."""

import json
import os
import subprocess
import sys

from storage_helpers import REPO, child_env


def test_bench_l3_quick(tmp_path):
    out = tmp_path / "l3.json"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_l3", "--quick", "--out", str(out), "--dir", str(tmp_path / "store")],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    top = json.loads(out.read_text())
    assert list(top["configs"]) == ["orbax"] and top["runs"] == 1
    data = top["configs"]["orbax"]["runs"][0]
    for k in (
        "write_orbax",
        "write_raw",
        "write_raw_seg",
        "write_raw_seg_pipe",
        "read1_orbax",
        "read1_raw",
        "read1_raw_split",
        "read16_orbax",
        "read16_raw",
    ):
        assert data["gbps"][k] > 0
    assert set(data["goal_ratios"]) >= {
        "write / orbax segments",
        "cold read, 1 at a time / orbax + CRC",
        "cold read, 16 in flight / orbax + CRC",
    }
    # the goal ratio is against the fastest raw baseline of the op
    assert data["goal_ratios"]["write / orbax segments"] == min(
        data["ratios"]["write / orbax segments / raw file per page"],
        data["ratios"]["write / orbax segments / raw file per segment"],
        data["ratios"]["write / orbax segments / raw file per segment, pipelined"],
    )
    # each goal with its own threshold (issue 25: write 0.9, cold reads 0.95) and a verdict
    goals = data["goals"]
    assert {k: g["goal"] for k, g in goals.items()} == {
        "write / orbax segments": 0.9,
        "cold read, 1 at a time / orbax + CRC": 0.95,
        "cold read, 16 in flight / orbax + CRC": 0.95,
    }
    for k, g in goals.items():
        assert g["ratio"] == data["goal_ratios"][k] and g["met"] == (g["ratio"] >= g["goal"])
    assert "goal >= 0.95: " in r.stdout and "goal >= 0.9: " in r.stdout
    assert data["crc32c"]["gbps"] > 0 and "machine" in data
    summary = top["configs"]["orbax"]["summary"]  # over runs (one here): median, range, verdict
    for k, g in goals.items():
        assert summary[k]["runs"] == [g["ratio"]] and summary[k]["goal"] == g["goal"]
        assert summary[k]["met_every_run"] == g["met"]
    assert not os.listdir(tmp_path / "store")  # rounds cleaned up


def test_raw_pipelined_segment_writer_same_bytes_every_file_synced_two_in_flight(tmp_path, monkeypatch):
    """The pipelined raw baseline writes the serial one's files byte for byte, fsyncs every one
    of them before it returns, and never has more than two files in flight (one written, one
    syncing): a fair baseline, not one that skips durability."""
    import threading
    import time

    import numpy as np

    from benchmarks.bench_l3 import raw_write_segments, raw_write_segments_pipelined

    pages = np.random.default_rng(0).integers(0, 256, (10, 4096), dtype=np.uint8)
    raw_write_segments(str(tmp_path / "serial"), pages, 3)
    real_fsync = os.fsync
    synced, max_unsynced = [], [0]
    lock = threading.Lock()

    def unsynced() -> None:
        with lock:  # files opened so far that are not yet synced (this one included)
            opened = len(os.listdir(tmp_path / "pipe"))
            max_unsynced[0] = max(max_unsynced[0], opened - len(synced))

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        unsynced()
        time.sleep(0.05)  # a slow disk: the writer thread runs ahead if it may
        # counted again after the sleep: right at the call the writer may not have opened the
        # next file yet (a race this test once lost on a loaded machine: max 1)
        unsynced()
        real_fsync(fd)
        with lock:
            synced.append(path)

    monkeypatch.setattr(os, "fsync", fsync)
    raw_write_segments_pipelined(str(tmp_path / "pipe"), pages, 3)
    names = sorted(os.listdir(tmp_path / "serial"))
    assert names == sorted(os.listdir(tmp_path / "pipe")) and len(names) == 4
    for n in names:
        assert (tmp_path / "pipe" / n).read_bytes() == (tmp_path / "serial" / n).read_bytes()
    assert sorted(os.path.basename(p) for p in synced) == names  # each synced once, all before the return
    assert max_unsynced[0] == 2  # overlapped, but never more than two files in flight
