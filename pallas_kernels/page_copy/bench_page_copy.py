"""Benchmark pieces for the page-copy kernels (driven by ``benchmarks/bench_transfer.py``).

Each measurement is paired with a raw device-to-device copy of the same number of bytes
measured in the same process, so the reported ratio is hardware-independent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .dispatch import PageCopier

_raw_copy = jax.jit(lambda x: x + jnp.zeros((), x.dtype))  # forces a read and a write of every byte


def raw_device_copy_seconds(nbytes: int, reps: int, median_seconds) -> float:
    """Median time of a plain device copy of ``nbytes`` (contiguous, uint8)."""
    x = jnp.asarray(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
    return median_seconds(lambda: _raw_copy(x).block_until_ready(), reps)


def gather_scatter_seconds(copier: PageCopier, pools: list[jax.Array], ids: np.ndarray, dest: np.ndarray,
                           order: str, reps: int, median_seconds) -> tuple[float, float]:
    """(gather, scatter) median seconds: all layers gathered once; each layer scattered back."""
    buf, _ = copier.gather(pools, ids, order)
    jax.block_until_ready(buf)

    def gather():
        jax.block_until_ready(copier.gather(pools, ids, order)[0])

    state = {"pools": [jnp.copy(p) for p in pools]}

    def scatter():
        new = [copier.scatter(p, dest, buf, l, order) for l, p in enumerate(state["pools"])]
        jax.block_until_ready(new)
        state["pools"] = new  # donated: keep the replacements

    return median_seconds(gather, reps), median_seconds(scatter, reps)
