"""Mooncake backend tests: a real ``mooncake_master`` (and metadata server) started by fixtures.

Everything here skips, with the reason, where no master can run: the ``mooncake`` extra is
not installed (the Python 3.11 torch env installs only ``dev``), the Debian libraries are
missing, or the master does not come up. No test mocks the store.
"""

from __future__ import annotations

import pytest

from mooncake_helpers import close_stores, start_master


@pytest.fixture(scope="session")
def master():
    """One master for the tests that do not hurt it."""
    m = start_master()
    yield m
    close_stores(m)  # their clients first
    m.stop()


@pytest.fixture
def own_master(request):
    """A master of the test's own (fault tests kill and restart it). Parametrise indirectly
    with a dict of ``MooncakeMaster`` keyword arguments to change its settings."""
    m = start_master(**getattr(request, "param", {}))
    yield m
    close_stores(m)  # their clients first
    m.stop()
