"""Root pytest configuration, shared by tests/ and the kernel tests beside pallas_kernels/.

* Gives JAX 8 CPU devices (before JAX is imported) so sharded pools run on a real mesh.
* Turns on JAX's persistent compilation cache for the session (before JAX is imported), in a
  fresh temporary directory that the pytest-xdist workers and every subprocess a test starts
  inherit through the environment, and that is removed at exit. Much of the JAX env's time is
  XLA compiling, and much of that compiled the same executables again: every Engine precompiles
  its transfer buckets with executables of its own, each xdist worker and each subprocess (bench
  children, ranks, examples) compiles for itself. A hit returns the executable that the
  same computation compiled to, so no test sees anything else; JAX still records the compile
  event on a hit (test_reference_model_swa counts those). The entries are written without a lock
  (no filelock here); they are compressed, so one read while another worker writes it fails to
  decompress, and JAX warns and compiles. Set JAX_COMPILATION_CACHE_DIR yourself
  to keep a cache across runs, or to "" to turn it off. Not in .venv-easydel: its tests keep
  their own persistent cache (hicache_jax.integrations.easydel.testing).
* In an environment without JAX (the Python 3.11 torch env) the JAX-only test folders are
  not collected; everything else must pass there too. Without easydel (every env but
  .venv-easydel) the eSurge integration tests are not collected.
* Tests marked ``slow`` (long stress runs) are skipped, with the reason, unless selected with
  ``-m slow``; CI runs their bounded variants.
"""

import atexit
import importlib.util
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

HAVE_JAX = importlib.util.find_spec("jax") is not None
HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_EASYDEL = importlib.util.find_spec("easydel") is not None


def _share_compiled_executables() -> None:
    """Point JAX's persistent compilation cache at a directory made for this session (the
    xdist controller makes it; its workers inherit the variable and so share it)."""
    if not HAVE_JAX or HAVE_EASYDEL or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    path = tempfile.mkdtemp(prefix="hicache-jax-test-compile-cache-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    # every executable, however small or quick to compile: the tiny test models compile in
    # well under JAX's 1 s default, and there are thousands of them
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


_share_compiled_executables()

collect_ignore_glob = []
if not HAVE_JAX:
    collect_ignore_glob += ["pallas_kernels/*", "tests/jax_backend/*", "tests/distributed/*", "benchmarks/*",
                            "tests/integrations/*"]
if not HAVE_EASYDEL:  # the eSurge tests run in .venv-easydel (scripts/test, step 3)
    collect_ignore_glob += ["tests/integrations/test_easydel_*"]


def pytest_collection_modifyitems(config, items):
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="long stress run: select with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
