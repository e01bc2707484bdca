"""Root pytest configuration, shared by tests/ and the kernel tests beside pallas_kernels/.

* Gives JAX 8 CPU devices (before JAX is imported) so sharded pools run on a real mesh.
* In an environment without JAX (the Python 3.11 torch env) the JAX-only test folders are
  not collected; everything else must pass there too. Without easydel (every env but
  .venv-easydel) the eSurge integration tests are not collected.
* Tests marked ``slow`` (long stress runs) are skipped, with the reason, unless selected with
  ``-m slow``; CI runs their bounded variants.
"""

import importlib.util
import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

HAVE_JAX = importlib.util.find_spec("jax") is not None
HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_EASYDEL = importlib.util.find_spec("easydel") is not None

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
