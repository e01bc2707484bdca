"""Tier 1 (CPU): torch, torch_npu and the kernel package load only when needed, with clear errors."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def run(code: str):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_import_npu_bridge_pulls_no_torch():
    r = run(
        "import sys, npu_bridge, npu_bridge.kv_split_pool; "
        "bad = [m for m in ('torch', 'torch_npu', 'sgl_kernel_npu') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_missing_torch_error_names_it():
    # hide torch from this subprocess: a None entry makes `import torch` raise ImportError
    r = run(
        "import sys; sys.modules['torch'] = None\n"
        "import npu_bridge\n"
        "try:\n    npu_bridge.make_torch_backend\nexcept npu_bridge.MissingDependencyError as e:\n"
        "    print('ERR', e); sys.exit(0)\nsys.exit(1)"
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "needs torch" in r.stdout and "torch==2.13.0" in r.stdout


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_missing_torch_npu_error_names_it():
    from npu_bridge import MissingDependencyError, make_torch_backend
    from hicache_jax import KVGeometry

    with pytest.raises(MissingDependencyError, match="torch_npu"):
        make_torch_backend(KVGeometry.mha(1, 1, 1, 2, "float16"), 2, 2, "page_first_direct", device="npu")
