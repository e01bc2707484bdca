"""The D2H interference probe (``benchmarks/probe_backup_interference.py``) runs every copy
path it names on this platform and reports each with its step ratio and copy rate (timings
mean something on a GPU only; ``scripts/gpu_check.sh`` runs it there)."""

from __future__ import annotations

import json

from benchmarks import probe_backup_interference as probe


def test_probe_runs_every_available_path_and_reports_it(tmp_path):
    out = tmp_path / "bi.json"
    assert probe.main(["--quick", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    methods = payload["methods"]
    # The CPU has a pinned_host memory kind in JAX >= 0.11, so every path is measured here.
    assert set(methods) == set(probe.METHODS), sorted(methods)
    for name, m in methods.items():
        assert m["copies"] >= 1 and m["copy_gbps_during"] > 0, (name, m)
        assert m["step_ms_idle"] > 0 and m["step_ratio"] > 0, (name, m)
    assert methods["engine-stream"]["path"] == "xla_stream" and methods["engine-numpy"]["path"] == "numpy"
