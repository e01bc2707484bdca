"""The README Quickstart's benchmark command, run as written: ``./scripts/bench --quick`` (plus
``--out`` into a temporary directory) must finish, serve the same tokens with and without the
cache, and say that its quick sizes are not comparable to the GPU goals.

It runs only from the project's own ``.venv`` (as CI does after ``./scripts/test`` built it):
anywhere else the script would build a virtual environment first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
    reason="runs from the project's own .venv (./scripts/bench would build one first)",
)
def test_quickstart_bench_quick_runs_as_written(tmp_path):
    out = tmp_path / "multiturn.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    r = subprocess.run(
        [str(ROOT / "scripts" / "bench"), "--quick", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "multiturn"
    assert payload["token_divergence"]["same"], payload["token_divergence"]
    assert payload["verdict"]["text"].startswith("not comparable at these sizes"), payload["verdict"]
    assert "verdict: not comparable at these sizes" in r.stdout
    assert out.with_suffix(".png").stat().st_size > 1000
