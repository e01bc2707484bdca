"""What the README tells a new user to do, end to end: build the wheel, install it with the
``[jax,storage,metrics]`` extras into a fresh virtual environment of every Python the README
names (3.12 and 3.11; on 3.11 the extras resolve to jax 0.10 and no orbax), run
``examples/own_engine.py`` there (outside the repository, without PYTHONPATH) and check it
served device, host and storage hits from the installed package.

Cost: the wheel is built once for both; the 3.11 interpreter is found as ``scripts/_env.sh``
finds it (``python3.11`` or pyenv) and the case skips, saying so, where there is none. Each
case costs ~100 s on CI's 2 cores (a fresh venv, jax installed, the example compiled), so CI
runs the 3.11 case alone: it is the only place the package runs on 3.11 with JAX (the extras
resolve to jax 0.10 and no orbax there; the torch env has no JAX). The 3.12 case (orbax from the
installed wheel; the package itself is tested on 3.12 from source everywhere else) is marked
``slow``: ``pytest -m slow tests/jax_backend/test_wheel_example.py`` runs it (before a release).

The dependencies are those of ``locks/wheel-py3XX.txt`` (pip's constraints): what CI tested, not
whatever the index serves that day (``./scripts/test --latest`` watches the newest).

Offline-capable: packages come from a local wheelhouse (``$HICACHE_WHEELHOUSE``, default
``~/.cache/hicache_jax/wheelhouse``) that ``pip download`` fills while the registry is
reachable (pip's own cache makes that quick after the first time); the install itself runs
with ``--no-index``. With no registry and an incomplete wheelhouse the test skips and says so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import hicache_jax

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "core"))
from test_readme import install_extras  # noqa: E402  (the README's install line: what this test runs)

EXTRAS = install_extras()


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _find_python(version: str) -> str | None:
    """An interpreter of ``version`` (``major.minor``), found as ``scripts/_env.sh`` does."""
    if sys.version_info[:2] == tuple(map(int, version.split("."))):
        return getattr(sys, "_base_executable", sys.executable)
    r = subprocess.run(
        ["bash", "-c", f'source "{ROOT}/scripts/_env.sh" && _find_python {version}'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    path = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    return path or None


def _lock(python: str) -> Path:
    """The lock of the README's install on ``python``; its extras must be the README's."""
    name = f"wheel-py{python.replace('.', '')}"
    spec = re.search(rf"\[{name}\]=\"[0-9.]+\|([a-z,]+)\"", (ROOT / "scripts" / "_env.sh").read_text())
    assert spec and spec.group(1) == EXTRAS, f"scripts/_env.sh locks {name} for other extras than the README's {EXTRAS}"
    return ROOT / "locks" / f"{name}.txt"


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _wheelhouse() -> Path:
    house = Path(os.environ.get("HICACHE_WHEELHOUSE", Path.home() / ".cache" / "hicache_jax" / "wheelhouse"))
    house.mkdir(parents=True, exist_ok=True)
    return house


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built once from a copy of the repository (the build writes into its source
    tree) with an isolated build from the wheelhouse."""
    tmp = tmp_path_factory.mktemp("wheel")
    env, house = _clean_env(), _wheelhouse()
    pip = [sys.executable, "-m", "pip"]
    # The build backend into the wheelhouse (best effort: offline, the wheelhouse may have it).
    _run(pip + ["download", "-q", "-d", str(house), "setuptools>=77"], tmp, env, 600)
    src = tmp / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv*",
            "build",
            "dist",
            "*.egg-info",
            "hicache-results",
            ".test-reports",
            "__pycache__",
            ".hypothesis",
            ".pytest_cache",
        ),
    )
    dist = tmp / "dist"
    r = _run(
        pip + ["wheel", "-q", "--no-deps", "--no-index", "--find-links", str(house), "-w", str(dist), str(src)],
        tmp,
        env,
        600,
    )
    if r.returncode:
        pytest.skip(f"cannot build the wheel (no registry and no setuptools in {house}?): {r.stderr[-500:]}")
    (whl,) = dist.glob("hicache_jax-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "hicache_jax/py.typed" in names, "the wheel lacks py.typed (type checkers would ignore its hints)"
    assert whl.name.startswith(f"hicache_jax-{hicache_jax.__version__}-"), whl.name  # one version everywhere
    return whl


@pytest.mark.skipif(sys.version_info[:2] != (3, 12), reason="runs from the Python 3.12 (JAX) environment")
@pytest.mark.parametrize("python", [pytest.param("3.12", marks=pytest.mark.slow), "3.11"])
def test_wheel_installs_into_a_fresh_venv_and_the_example_hits_every_tier(tmp_path, wheel, python):
    env, house = _clean_env(), _wheelhouse()
    base = _find_python(python)
    if base is None:
        pytest.skip(
            f"no Python {python} found (python{python} or a pyenv {python}.x): the README's install "
            f"on {python} is not checked here"
        )
    # 1. A fresh venv of that Python; the dependencies into the wheelhouse (by its own pip, so the
    # wheels match its version), then installed from there alone.
    target = tmp_path / "venv"
    r = _run([base, "-m", "venv", str(target)], tmp_path, env, 300)
    assert r.returncode == 0, r.stderr
    py = str(target / "bin" / "python")
    spec = f"{wheel}[{EXTRAS}]"
    lock = ["-c", str(_lock(python))]
    # The project's own wheel is passed by path, never taken from the wheelhouse; pip download
    # also saves it there, and a build of the same version left from an earlier run would stand
    # in for this one ("already downloaded"), dependencies included: with a new dependency
    # (crc32c) the install then found nothing and the case skipped as offline.
    for stale in house.glob("hicache_jax-*.whl"):
        stale.unlink()
    _run(
        [py, "-m", "pip", "download", "-q", "-d", str(house), "--find-links", str(wheel.parent), *lock, spec],
        tmp_path,
        env,
        900,
    )
    r = _run(
        [py, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(house), *lock, spec], tmp_path, env, 900
    )
    if r.returncode:
        if "No matching distribution" in r.stderr or "Could not find a version" in r.stderr:
            pytest.skip(f"the wheelhouse {house} lacks dependencies and the registry is unreachable: {r.stderr[-500:]}")
        pytest.fail(f"pip install {spec} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    # The install must not have pulled the reference engine's dependencies.
    r = _run([py, "-c", "import importlib.util as u; print(u.find_spec('flax') is None)"], tmp_path, env, 120)
    assert r.stdout.strip() == "True", "the [jax,storage,metrics] extras pulled flax (only [engine] needs it)"
    # 2. The example, run from a directory outside the repository.
    run_dir = tmp_path / "user"
    run_dir.mkdir()
    out = run_dir / "result.json"
    r = _run([py, str(ROOT / "examples" / "own_engine.py"), "--out", str(out)], run_dir, env, 900)
    assert r.returncode == 0, f"example failed on Python {python}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    res = json.loads(out.read_text())
    assert str(target) in res["hicache_jax_file"], f"the example imported {res['hicache_jax_file']}, not the wheel"
    # [storage] brings orbax on 3.12 only (its version marker); 3.11 serves L3 from the file backend.
    assert res["storage_backend"] == ("orbax" if python == "3.12" else "file"), res["storage_backend"]
    cached = res["cached_tokens"]
    assert cached["device"] > 0 and cached["host"] > 0 and cached["storage"] > 0, cached
    assert res["prometheus_cached_tokens_after_restart"]["storage"] > 0
    assert res["kv_bytes_checked"]
    assert "device, host and storage hits: all seen" in r.stdout
