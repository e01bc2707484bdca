"""hicache_jax.storage and its numpy backends import without JAX, orbax or tensorstore."""

import subprocess
import sys

from storage_helpers import REPO, child_env


def test_storage_imports_pull_no_jax_orbax_tensorstore():
    code = (
        "import sys, hicache_jax.storage, hicache_jax.storage.file, hicache_jax.storage.memory; "
        "bad = [m for m in ('jax', 'orbax', 'tensorstore', 'torch') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=child_env())
    assert r.returncode == 0, r.stdout + r.stderr
