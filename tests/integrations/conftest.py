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


@pytest.fixture(scope="module")
def tokenizer_dir():
    """The tiny word-level tokenizer eSurge's workers load by path (``testing.build_tokenizer``),
    one per test module."""
    from hicache_jax.integrations.easydel import testing

    d = tempfile.mkdtemp(prefix="esurge-tok-")
    testing.build_tokenizer(d)
    yield d
    shutil.rmtree(d, ignore_errors=True)
