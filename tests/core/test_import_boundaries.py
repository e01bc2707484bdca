"""The cache manager imports with numpy alone: no JAX, no torch."""

import subprocess
import sys

import pytest


def test_import_hicache_jax_pulls_no_jax_or_torch():
    code = (
        "import sys, hicache_jax, hicache_jax.backends.numpy_backend; "
        "bad = [m for m in ('jax', 'jaxlib', 'torch', 'torch_npu') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_jax_backend_imports_no_pallas_kernel_backend():
    """Python 3.11's install (jax 0.10, no absl) cannot import Mosaic GPU: the JAX backend and
    an ``xla`` copier must not import it (nor the Triton / TPU Pallas backends)."""
    pytest.importorskip("jax")
    code = (
        "import sys, hicache_jax.backends.jax; from pallas_kernels.page_copy import PageCopier, PageCopyConfig; "
        "PageCopier(PageCopyConfig(impl='xla')); "
        "bad = [m for m in ('jax.experimental.pallas.mosaic_gpu', 'jax.experimental.mosaic.gpu', "
        "'jax.experimental.pallas.triton', 'jax.experimental.pallas.tpu', 'pallas_kernels.page_copy.gpu_mgpu', "
        "'pallas_kernels.page_copy.gpu', 'pallas_kernels.page_copy.tpu') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = _run(code)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_kernel_that_cannot_import_fails_at_construction_naming_the_extra():
    """Mosaic GPU made unimportable (as on Python 3.11 without absl): asking for ``mgpu``
    raises ImportError at construction naming the impl, the [jax] extra and the xla way out."""
    pytest.importorskip("jax")
    code = (
        "import sys; sys.modules['jax.experimental.pallas.mosaic_gpu'] = None; "  # importing it now raises
        "from pallas_kernels.page_copy import PageCopier, PageCopyConfig\n"
        "try:\n    PageCopier(PageCopyConfig(impl='mgpu'))\nexcept ImportError as e:\n    print('ERR', e)\n"
        "else:\n    print('no error')"
    )
    r = _run(code)
    out = r.stdout
    assert "ERR impl: the 'mgpu' page-copy kernels could not be imported" in out, out + r.stderr
    assert "hicache-jax[jax]" in out and "impl='xla'" in out, out
