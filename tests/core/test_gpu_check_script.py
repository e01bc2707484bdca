"""``scripts/gpu_check.sh``: it parses, its dry run keeps the issue's budget (at most 8 result
files, step timeouts that fit in 8 minutes, the GPU preset with the file L3), a step past its
timeout is killed and the later steps still run, and a step with too little time left is
skipped. The CPU-sized run of every step (``QUICK=1``) is the ``slow`` test at the end."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
MANDATORY = ("versions", "pytest", "transfer", "ttft", "multiturn")

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and coreutils timeout"
)


def _run(tmp_path, timeout=120, **env) -> subprocess.CompletedProcess:
    full = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
        "TMPDIR": str(tmp_path),
        **{k: str(v) for k, v in env.items()},
    }
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=timeout)


def _files(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


def test_script_parses():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_dry_run_keeps_the_budget(tmp_path):
    r = _run(tmp_path, DRY_RUN=1)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    steps = dict(re.findall(r"^\[(\w+)\] timeout (\d+)s: ", out, re.M))
    assert set(steps) == {*MANDATORY, "gemma", "determ", "noreuse", "streamvar", "d2hprobe", "hlo", "kernels"}, out
    budget = int(re.search(r"^BUDGET_S=\$\{BUDGET_S:-(\d+)\}", SCRIPT.read_text(), re.M).group(1))
    assert budget <= 480  # the whole script within 8 minutes
    assert sum(int(steps[s]) for s in MANDATORY) < budget  # the later steps get what is left
    kept = re.search(r"^files kept in \$OUT: (.*)$", out, re.M).group(1).split()
    assert len(kept) == len(set(kept)) <= 8, kept
    assert {"gpu_check.log", "summary.txt", "ttft.json", "multiturn.json", "transfer.json"} <= set(kept)
    lines = {name: next(l for l in out.splitlines() if l.startswith(f"[{name}]")) for name in steps}
    assert "-m pytest tests -m gpu" in lines["pytest"] and "-m pytest pallas_kernels -m gpu" in lines["kernels"]
    assert "bench transfer --page-sizes 16 64 --page-counts 1024 " in lines["transfer"]
    assert "--prompt-len 2048" in lines["ttft"]
    for name in ("ttft", "multiturn", "determ", "noreuse"):
        assert "--model llama3-8b-shape" in lines[name] and "--storage-backend file" in lines[name], lines[name]
        assert "--quick" not in lines[name]
    assert "--deterministic" in lines["determ"] and "--no-reuse" in lines["noreuse"]
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_quick_dry_run_passes_quick_everywhere(tmp_path):
    r = _run(tmp_path, DRY_RUN=1, QUICK=1, LAYERS=2)
    assert r.returncode == 0, r.stderr
    for name in ("transfer", "ttft", "multiturn", "determ"):
        line = next(l for l in r.stdout.splitlines() if l.startswith(f"[{name}]"))
        assert "--quick" in line and "--page-sizes" not in line and "--prompt-len" not in line, line
        if name != "transfer":
            assert "--layers 2" in line


def test_a_step_past_its_timeout_is_killed_and_the_next_one_runs(tmp_path):
    """A stand-in interpreter that hangs (but runs the summary): both steps time out after
    their 10 s cap, each rc is printed, the script finishes and keeps only its two logs."""
    fake = tmp_path / "python"
    # (pip too: a checkout with wheels in .whl/ installs them first, untimed)
    fake.write_text(f'#!/bin/sh\nif [ "$1" = - ] || [ "$2" = pip ]; then exec {sys.executable} "$@"; fi\nsleep 60\n')
    fake.chmod(0o755)
    r = _run(tmp_path, PYTHON=fake, STEPS="pytest transfer", CAP_PYTEST=10, CAP_TRANSFER=10)
    assert r.returncode == 0, r.stderr
    assert "===== pytest: rc=124 (TIMED OUT after 10s)" in r.stdout, r.stdout
    assert "===== transfer: rc=124 (TIMED OUT after 10s)" in r.stdout
    assert "step pytest: rc=124" in r.stdout and "transfer.json: no result" in r.stdout
    assert "pytest -m gpu (tests): no tally; -v lines so far: 0 passed, 0 failed, 0 skipped" in r.stdout
    assert _files(tmp_path / "out") == ["gpu_check.log", "summary.txt"]


def test_a_step_without_enough_time_left_is_skipped(tmp_path):
    r = _run(tmp_path, STEPS="versions transfer", BUDGET_S=12)
    assert r.returncode == 0, r.stderr
    assert "[versions] SKIPPED: " in r.stdout and "[transfer] SKIPPED: " in r.stdout
    assert "step transfer: rc=skipped" in r.stdout


@pytest.mark.slow
def test_quick_run_on_the_cpu_finishes_with_at_most_8_files(tmp_path):
    """Every step at --quick sizes (about 2 minutes on 2 CPUs): each rc 0, the goals' verdicts
    in the summary, at most 8 files."""
    r = _run(tmp_path, timeout=600, QUICK=1)
    assert r.returncode == 0, r.stderr
    for name in MANDATORY:
        assert f"step {name}: rc=0" in r.stdout, r.stdout
    assert r.stdout.count("verdict: not comparable at these sizes") >= 2
    files = _files(tmp_path / "out")
    assert len(files) <= 8 and {"ttft.json", "ttft.png", "multiturn.json", "summary.txt"} <= set(files), files


def test_test_module_names_are_unique_across_the_tree():
    """``scripts/gpu_check.sh`` collects ``tests`` and ``pallas_kernels`` in one pytest session
    (CI runs each environment's folders apart): test folders are not packages, so two test
    modules with one basename fail collection there ("import file mismatch"), as one did on the
    first H200 run."""
    seen: dict[str, Path] = {}
    for path in sorted([*(ROOT / "tests").rglob("test_*.py"), *(ROOT / "pallas_kernels").rglob("test_*.py")]):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a module name"
        seen[path.name] = path
    assert len(seen) > 50  # the walk found the suite
