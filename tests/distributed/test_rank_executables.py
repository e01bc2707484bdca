"""Every rank runs the same executable of a collective program (``initialize_from_env``).

jaxlib seeds each execution's launch id (XLA's ``RunId``) from the executable's fingerprint,
and jaxlib >= 0.12 derives the gloo tags of a program's collectives from the ``RunId``: ranks
whose executables of one program have different fingerprints wait, for good, each on a tag
the other never sends on (on jaxlib 0.11 the tag was 0 and both cases below passed anyway).
Two ways the fingerprints came apart, each a test here (``same_executable_rank.py`` is the
rank; a hang fails at the launcher's deadline):

* the IR's locations held each op's full Python traceback, so a program that rank 1 first
  traced through one more frame (as the rank scripts' injected wrappers do) compiled to
  another fingerprint: the lowered IR, locations included, must be the same on both ranks;
* the persistent compilation cache (pytest's session cache reaches the ranks through
  ``JAX_COMPILATION_CACHE_DIR``): only process 0 writes it, under keys only process 0 reads,
  and an executable loaded from it has another fingerprint than the same program compiled,
  so a launch whose rank 0 loaded what an earlier launch's rank 0 wrote, while rank 1
  compiled, hung. The ranks must not use it: two launches over one cache directory both run,
  and leave it empty.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hicache_jax.distributed import launch_local

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# batch 4 x 16 heads x 64: rank 0's 8 heads hold 1.0, rank 1's 2.0 (identity weights)
EXPECTED = [f"ok {r} {4 * 8 * 64 * 3.0}" for r in range(2)]


def launch(env=None) -> list[list[str]]:
    results = launch_local(
        [sys.executable, str(HERE / "same_executable_rank.py")], 2, timeout_s=120, cwd=str(ROOT), env=env
    )
    return [r.output.strip().splitlines() for r in results]


def test_a_program_first_traced_through_different_call_stacks_runs_on_both_ranks():
    lines = launch()
    digests = [next(x for x in ls if x.startswith("digest ")) for ls in lines]
    assert digests[0] == digests[1], "the ranks lowered the program to different IR (locations included)"
    assert [ls[-1] for ls in lines] == EXPECTED


def test_ranks_neither_load_nor_write_the_persistent_compilation_cache(tmp_path):
    cache = tmp_path / "jax-cache"
    cache.mkdir()
    env = {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }
    for _ in range(2):  # the second launch's rank 0 would find the first's executables
        assert [ls[-1] for ls in launch(env)] == EXPECTED
    assert list(cache.iterdir()) == []
