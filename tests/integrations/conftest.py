"""Fixtures of the integration tests."""

from __future__ import annotations

import shutil
import tempfile

import pytest


@pytest.fixture
def l3_dir():
    """A fresh L3 directory, removed after the test."""
    d = tempfile.mkdtemp(prefix="esurge-l3-")
    yield d
    shutil.rmtree(d, ignore_errors=True)
