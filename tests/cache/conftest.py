"""Fixtures for the cache tests: parametrised over backend factories (numpy now).

A new backend joins every backend-neutral cache test by adding its factory to
``BACKEND_FACTORIES`` (or by overriding the ``backend_factory`` fixture in its own conftest).
"""

import pytest

from cache_harness import numpy_backend_factory

BACKEND_FACTORIES = {"numpy": numpy_backend_factory}


@pytest.fixture(params=sorted(BACKEND_FACTORIES))
def backend_factory(request):
    return BACKEND_FACTORIES[request.param]
