"""What the README tells a new user to do, end to end: build the wheel, install it with the
``[jax,storage,metrics]`` extras into a fresh Python 3.12 virtual environment, run
``examples/own_engine.py`` there (outside the repository, without PYTHONPATH) and check it
served device, host and storage hits from the installed package.

Offline-capable: packages come from a local wheelhouse (``$HICACHE_WHEELHOUSE``, default
``~/.cache/hicache_jax/wheelhouse``) that ``pip download`` fills while the registry is
reachable (pip's own cache makes that quick after the first time); the install itself runs
with ``--no-index``. With no registry and an incomplete wheelhouse the test skips and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = "jax,storage,metrics"


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.mark.skipif(sys.version_info[:2] != (3, 12), reason="the README's install path is Python 3.12")
def test_wheel_installs_into_a_fresh_venv_and_the_example_hits_every_tier(tmp_path):
    env = _clean_env()
    house = Path(os.environ.get("HICACHE_WHEELHOUSE", Path.home() / ".cache" / "hicache_jax" / "wheelhouse"))
    house.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    # 1. The build backend into the wheelhouse (best effort: offline, the wheelhouse may have it).
    _run(pip + ["download", "-q", "-d", str(house), "setuptools>=77"], tmp_path, env, 600)
    # 2. The wheel, built from a copy of the repository (the build writes into its source tree)
    # with an isolated build from the wheelhouse.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "hicache-results", ".test-reports", "__pycache__",
        ".hypothesis", ".pytest_cache"))
    dist = tmp_path / "dist"
    r = _run(pip + ["wheel", "-q", "--no-deps", "--no-index", "--find-links", str(house), "-w", str(dist),
                    str(src)], tmp_path, env, 600)
    if r.returncode:
        pytest.skip(f"cannot build the wheel (no registry and no setuptools in {house}?): {r.stderr[-500:]}")
    (wheel,) = dist.glob("hicache_jax-*.whl")
    # 3. A fresh venv from this interpreter's base Python 3.12; the dependencies into the wheelhouse.
    target = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(target)
    py = str(target / "bin" / "python")
    spec = f"{wheel}[{EXTRAS}]"
    _run(pip + ["download", "-q", "-d", str(house), "--find-links", str(dist), spec], tmp_path, env, 900)
    r = _run([py, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(house), spec], tmp_path, env, 900)
    if r.returncode:
        if "No matching distribution" in r.stderr or "Could not find a version" in r.stderr:
            pytest.skip(f"the wheelhouse {house} lacks dependencies and the registry is unreachable: "
                        f"{r.stderr[-500:]}")
        pytest.fail(f"pip install {spec} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    # The install must not have pulled the reference engine's dependencies.
    r = _run([py, "-c", "import importlib.util as u; print(u.find_spec('flax') is None)"], tmp_path, env, 120)
    assert r.stdout.strip() == "True", "the [jax,storage,metrics] extras pulled flax (only [engine] needs it)"
    # 4. The example, run from a directory outside the repository.
    run_dir = tmp_path / "user"
    run_dir.mkdir()
    out = run_dir / "result.json"
    r = _run([py, str(ROOT / "examples" / "own_engine.py"), "--out", str(out)], run_dir, env, 900)
    assert r.returncode == 0, f"example failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    res = json.loads(out.read_text())
    assert str(target) in res["hicache_jax_file"], f"the example imported {res['hicache_jax_file']}, not the wheel"
    cached = res["cached_tokens"]
    assert cached["device"] > 0 and cached["host"] > 0 and cached["storage"] > 0, cached
    assert res["prometheus_cached_tokens_after_restart"]["storage"] > 0
    assert res["kv_bytes_checked"]
    assert "device, host and storage hits: all seen" in r.stdout
