"""Fixtures of the real-model tests: the Gemma 3 270M GGUF from its package (skips, naming the
extra, where the package is not installed)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def gguf() -> Path:
    from hicache_jax.models.gemma3 import model_file

    try:
        return model_file("gemma3-270m")
    except ModuleNotFoundError as e:
        pytest.skip(str(e))
