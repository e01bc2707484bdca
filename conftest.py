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
* The files whose tests take longest (``LONGEST_FIRST``, from CI's ``--durations``) are moved,
  whole and in that order, to the front of the collection: the xdist workers take files in
  collection order (``scripts/test``: ``--dist loadfile --no-loadscope-reorder``), and a
  long file taken last leaves the other worker idle that long at the end of the run. Only the
  order changes (every worker collects the same order).
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
    collect_ignore_glob += [
        "pallas_kernels/*",
        "tests/jax_backend/*",
        "tests/distributed/*",
        "benchmarks/*",
        "tests/integrations/*",
        "tests/models/*",
    ]
if not HAVE_EASYDEL:  # the eSurge tests run in .venv-easydel (scripts/test, step 3)
    collect_ignore_glob += ["tests/integrations/test_easydel_*"]


# The files that take longest in all (worker-seconds per file, s15's measurements at load 4-5
# and CI's --durations, 2026-11), longest first.
LONGEST_FIRST = (
    "tests/jax_backend/test_serving_bench_smoke.py",  # ~370 s: seven bench runs of 38-91 s
    "tests/jax_backend/test_engine.py",  # ~360 s, 28 tests
    "tests/jax_backend/test_wheel_example.py",  # ~100-290 s: the wheel, a fresh venv, the example
    "tests/jax_backend/test_engine_spec_hybrid.py",  # ~240 s
    "tests/jax_backend/test_engine_spec.py",  # ~210 s
    "tests/jax_backend/test_engine_deterministic.py",  # ~210 s
    "tests/distributed/",  # launches of three JAX processes, 40-90 s each, 50-150 s per file
    "pallas_kernels/page_copy/test_page_copy_mgpu.py",  # a 60-90 s interpreter case and more
    "tests/models/test_gemma_oracle.py",  # the transformers oracle (~80 s) and the JAX model
    "tests/jax_backend/test_reference_model.py",  # ~140 s
    "tests/jax_backend/test_reference_model_swa.py",  # ~120 s
    "tests/jax_backend/test_host_stream.py",  # ~100 s
    "tests/jax_backend/test_engine_swa.py",
    "tests/jax_backend/test_routed_bench_smoke.py",
    "tests/jax_backend/test_draft_model.py",
    "tests/jax_backend/test_engine_l3_after_split.py",
    "tests/jax_backend/test_quickstart_bench.py",
    "tests/jax_backend/test_transfer_engine.py",
    "tests/cache/test_cache_fuzz.py",
    "tests/npu_bridge/test_cache_suite_torch.py",  # the torch env's longest after the fuzz (~75 s)
    "tests/cache/test_bench_tree_differential.py",
    "tests/cache/test_swa_fuzz.py",
    "tests/cache/test_swa_fuzz_ranks.py",
)


def _longest_first_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    for i, prefix in enumerate(LONGEST_FIRST):
        if path.startswith(prefix):
            return i
    return len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_longest_first_rank)  # stable: within a file (and among the rest) the order stays
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="long stress run: select with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
