"""Fixtures for the L3 controller tests (``hicache_jax.l3``): they drive a real cache, so they
share the cache tests' harness (``tests/cache/cache_harness.py``) and backend factories."""

import sys
from pathlib import Path

_CACHE_TESTS = str(Path(__file__).resolve().parents[1] / "cache")
if _CACHE_TESTS not in sys.path:
    sys.path.insert(0, _CACHE_TESTS)

import pytest  # noqa: E402
from cache_harness import numpy_backend_factory  # noqa: E402

BACKEND_FACTORIES = {"numpy": numpy_backend_factory}


@pytest.fixture(params=sorted(BACKEND_FACTORIES))
def backend_factory(request):
    return BACKEND_FACTORIES[request.param]
