"""The backend-neutral cache-manager suite (tests/cache), run again on the torch backend (CPU).

Every test of tests/cache/test_cache_api.py and test_cache_policies.py that takes the
``backend_factory`` fixture is re-collected here with the fixture bound to
``make_torch_backend`` (device='cpu'); the stateful fuzz runs with its machine's factory
swapped. Non-deferred transfers are really asynchronous here (worker threads), unlike numpy's,
except in the fuzz, which finishes them before they return (see ``_fuzz_backend_factory``).
"""

import functools
import inspect
import sys
from pathlib import Path

import pytest

CACHE_TESTS = Path(__file__).parents[1] / "cache"
if not (CACHE_TESTS / "cache_harness.py").is_file():
    pytest.skip("tests/cache (the manager suite) is not present", allow_module_level=True)
pytest.importorskip("hicache_jax.cache")
if str(CACHE_TESTS) not in sys.path:
    sys.path.insert(0, str(CACHE_TESTS))

import cache_harness  # noqa: E402
import test_cache_api  # noqa: E402
import test_cache_fuzz  # noqa: E402
import test_cache_policies  # noqa: E402

from npu_bridge import make_torch_backend  # noqa: E402


def torch_backend_factory(geom, device_pages, host_pages, layout="page_first", deferred=False):
    return cache_harness.Backend(geom, *make_torch_backend(geom, device_pages, host_pages, layout, deferred=deferred))


@pytest.fixture
def backend_factory():
    return torch_backend_factory


def _is_fixture(obj) -> bool:
    return type(obj).__name__ == "FixtureFunctionDefinition" or hasattr(obj, "_pytestfixturefunction")


def _reexport(module, prefix):
    n = 0
    for name, obj in list(vars(module).items()):
        if _is_fixture(obj) and name != "backend_factory":  # module fixtures the tests use (e.g. page_size)
            if name in globals() and globals()[name] is not obj:
                raise RuntimeError(f"fixture {name!r} defined by two cache test modules")
            globals()[name] = obj
        elif name.startswith("test_") and callable(obj) and "backend_factory" in inspect.signature(obj).parameters:
            globals()[f"test_{prefix}__{name[5:]}"] = obj
            n += 1
    return n


assert _reexport(test_cache_api, "api") > 0 and _reexport(test_cache_policies, "policies") > 0


def _finished(issue, *page_ids):
    handle = issue(*page_ids)
    handle.wait()
    return handle


def _fuzz_backend_factory(geom, device_pages, host_pages, layout="page_first", deferred=False):
    """The torch backend with every non-deferred copy finished before it returns. Hypothesis
    replays test cases and needs the same draws each time; with copies on worker threads,
    which requests got device room depended on their timing (FlakyStrategyDefinition).
    Deferred copies, completed by the machine in random order, still cover out-of-order
    completion; the asynchronous path has its own tests (test_torch_backend_cpu.py)."""
    be = torch_backend_factory(geom, device_pages, host_pages, layout, deferred)
    if not deferred:
        for name in ("backup_owned", "load_owned"):
            setattr(be.engine, name, functools.partial(_finished, getattr(be.engine, name)))
    return be


def test_fuzz_torch_ci(monkeypatch):
    monkeypatch.setattr(test_cache_fuzz.CacheMachine, "backend_factory", staticmethod(_fuzz_backend_factory))
    # The torch engine cannot inject copy failures (the numpy run covers them).
    test_cache_fuzz._run(**test_cache_fuzz.CI_RUN, failures=False)
