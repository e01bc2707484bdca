"""The project's virtual environments hold exactly what their lock in ``locks/`` names.

``scripts/_env.sh`` builds each venv from its lock (``uv pip sync``, then the project with the
lock as constraints), so this fails when a venv drifted from its lock: a dependency added to
pyproject.toml but not locked (``./scripts/lock`` refreshes the locks), a package installed by
hand, a venv built before the lock changed. Which lock: ``$HICACHE_LOCK`` (a path, or ``none``
to skip, as ``./scripts/test --latest`` does), else the one of the project venv this runs in;
outside the project's venvs (a user's own environment) it skips and says so.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_LOCKS = {".venv": "jax-py312", ".venv-torch": "torch-py311", ".venv-easydel": "easydel-py312"}
PROJECT = "hicache-jax"
sys.path.insert(0, str(ROOT / "scripts"))
from lock_diff import norm, parse_lock  # noqa: E402  (scripts/lock reads the locks with the same parser)


def drift(locked: dict[str, str], installed: dict[str, str]) -> list[str]:
    """What differs between a lock and the installed distributions (the project itself aside)."""
    out = []
    for name in sorted(locked.keys() | installed.keys()):
        if name == PROJECT:
            continue
        want, have = locked.get(name), installed.get(name)
        if want is None:
            out.append(f"{name}=={have} is installed but not locked")
        elif have is None:
            out.append(f"{name}=={want} is locked but not installed")
        elif have != want:
            out.append(f"{name}: locked {want}, installed {have}")
    return out


def _lock_path() -> Path | None:
    env = os.environ.get("HICACHE_LOCK")
    if env:
        return None if env == "none" else Path(env)
    name = VENV_LOCKS.get(Path(sys.prefix).name)
    if name is None or Path(sys.prefix).parent != ROOT:
        return None
    return ROOT / "locks" / f"{name}.txt"


def test_the_venv_holds_exactly_its_locked_versions():
    lock = _lock_path()
    if lock is None:
        pytest.skip(
            f"not one of the project's locked venvs ({sys.prefix}; HICACHE_LOCK={os.environ.get('HICACHE_LOCK')})"
        )
    locked = parse_lock(lock.read_text())
    # The venv's own site-packages only: a package may put a vendored copy's metadata on sys.path
    # at import (ray adds ray/thirdparty_files, which holds colorama's, in the easydel venv).
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {norm(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=site)}
    problems = drift(locked, installed)
    assert not problems, (
        f"{sys.prefix} differs from {lock.relative_to(ROOT)} (./scripts/lock refreshes the "
        f"locks; ./scripts/test rebuilds the venv from them):\n  " + "\n  ".join(problems)
    )


def test_drift_names_every_kind_of_difference():
    locked = parse_lock("jax==0.12.1\n    # via x\nnumpy==2.5.5 ; python_version >= '3.12'\npip==26.3\n")
    assert locked == {"jax": "0.12.1", "numpy": "2.5.5", "pip": "26.3"}
    installed = {"jax": "0.12.2", "numpy": "2.5.5", "rich": "14.0", PROJECT: "0.1.0"}
    assert drift(locked, installed) == [
        "jax: locked 0.12.1, installed 0.12.2",
        "pip==26.3 is locked but not installed",
        "rich==14.0 is installed but not locked",
    ]
    assert drift(locked, {**locked, PROJECT: "0.1.0"}) == []
    with pytest.raises(ValueError, match="expected name==version"):
        parse_lock("jax>=0.11\n")


@pytest.mark.parametrize("name", ["jax-py312", "torch-py311", "easydel-py312", "wheel-py311", "wheel-py312"])
def test_every_lock_pins_every_package_exactly(name):
    pins = parse_lock((ROOT / "locks" / f"{name}.txt").read_text())
    assert "pip" in pins and len(pins) > 3, pins
