"""The root conftest's session compilation cache: JAX in this test process writes every
executable it compiles to the directory named by ``JAX_COMPILATION_CACHE_DIR`` (set by the
conftest, inherited by the xdist workers and by subprocesses), so a second process asking for
the same computation loads it instead of compiling it."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import jax
import jax.numpy as jnp
import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("JAX_COMPILATION_CACHE_DIR") == "",
    reason="the persistent compilation cache was turned off (JAX_COMPILATION_CACHE_DIR='')",
)

# A computation no other test compiles: the constant is new in every session.
_SALT = float(uuid.uuid4().int % 10_000) + 0.5
_PROGRAM = f"""
import jax, jax.numpy as jnp
hits = []
jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e.endswith("cache_hits") else None)
print(float(jax.jit(lambda x: x * {_SALT} + 1.0)(jnp.ones(3))[0]), len(hits))
"""


def _entries(path: str) -> set[str]:
    return {name for name in os.listdir(path) if name.endswith("-cache")}


def test_this_process_writes_what_it_compiles_to_the_session_directory():
    path = os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert jax.config.jax_compilation_cache_dir == path and os.path.isdir(path)
    before = _entries(path)
    assert float(jax.jit(lambda x: x * _SALT - 1.0)(jnp.ones(2))[0]) == _SALT - 1.0
    assert _entries(path) - before, "a fresh compile wrote no cache entry (min compile time or entry size?)"


def test_a_subprocess_loads_what_an_earlier_one_compiled():
    """The first child compiles and writes; the second, with the same environment, hits."""
    runs = [
        subprocess.run(
            [sys.executable, "-c", _PROGRAM], env=dict(os.environ), capture_output=True, text=True, timeout=300
        )
        for _ in range(2)
    ]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    (first_value, first_hits), (second_value, second_hits) = (r.stdout.split() for r in runs)
    assert first_value == second_value == str(_SALT + 1.0)
    assert int(second_hits) > int(first_hits)
