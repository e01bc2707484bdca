"""The cache manager imports with numpy alone: no JAX, no torch."""

import subprocess
import sys


def test_import_hicache_jax_pulls_no_jax_or_torch():
    code = ("import sys, hicache_jax, hicache_jax.backends.numpy_backend; "
            "bad = [m for m in ('jax', 'jaxlib', 'torch', 'torch_npu') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
