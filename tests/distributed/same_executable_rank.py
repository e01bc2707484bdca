"""One rank of ``test_rank_executables``: the same collective program, first traced through
different Python call stacks on the two ranks, must run (started by ``launch_local``).

The program all-gathers a head-sharded array (each rank holds its half) for a replicated
matmul. Rank 1 traces it (and lowers it, with debug info) through one extra Python frame,
as a rank-specific wrapper would (a test's injection, any caller only one rank has); rank 0
calls it directly. Prints ``digest <sha256 of the lowered IR with its locations>`` and
``ok <rank> <sum of the result>``. Under a persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``
from the launcher) a second launch would find rank 0's executables there: what
``initialize_from_env`` must keep the ranks from loading.
"""

from __future__ import annotations

import hashlib

import numpy as np

from hicache_jax.distributed import initialize_from_env, run_rank

HEADS, BATCH, DIM = 16, 4, 64


def extra_frame(fn, *args):
    """The only difference between the ranks: one more frame on the stack while tracing."""
    return fn(*args)


def main() -> None:
    rank, n = initialize_from_env()
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))), ("tp",))
    heads = NamedSharding(mesh, PartitionSpec(None, "tp", None))
    replicated = NamedSharding(mesh, PartitionSpec())

    @jax.jit
    def step(x, w):
        x = jax.lax.with_sharding_constraint(x, replicated)  # the all-gather
        return jnp.einsum("bhd,de->bhe", x, w)

    local = np.full((BATCH, HEADS // n, DIM), rank + 1, np.float32)
    x = jax.make_array_from_process_local_data(heads, local, (BATCH, HEADS, DIM))
    w = jax.device_put(np.eye(DIM, dtype=np.float32), replicated)

    def first_use():
        text = step.trace(x, w).lower().as_text(debug_info=True)
        return text, step(x, w)

    text, out = extra_frame(first_use) if rank == 1 else first_use()
    print("digest", hashlib.sha256(text.encode()).hexdigest(), flush=True)
    for _ in range(3):
        out = step(x, w)
    total = jax.jit(jnp.sum, out_shardings=replicated)(out)
    print("ok", rank, float(total), flush=True)


if __name__ == "__main__":
    run_rank(main)
