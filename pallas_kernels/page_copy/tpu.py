"""TPU page-copy kernels: scalar-prefetched page ids and DMAs between HBM refs.

The page ids and the live count ``n`` are scalar-prefetched into SMEM; pools and buffers
stay in HBM (``pl.ANY``) and every page moves as one async DMA (strided on the buffer side
for the ``npl`` order). One grid step per page: start the page's DMAs (one per layer), then
wait on them. Padding steps (>= n) issue nothing.

On CPU these run with ``interpret=True`` (the HLO interpreter), which is how CI checks them.
Duplicate destination ids would race; the dispatcher rejects them before launch.

Buffer donation: ``gather_layers`` writes into a donated ``out`` buffer and ``scatter_layer``
into a donated pool (``input_output_aliases``); the caller's array is invalid afterwards and
the returned one replaces it. Pages not named (and padding positions) keep their bytes.

Kernels copy unsigned containers (uint8/16/32); ``dispatch`` bitcasts KV dtypes to them, since
interpreted masked float copies may flush subnormals or canonicalise NaNs.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .common import buffer_shape, check_order


def _buf_at(buf_ref, order: str, i, layer):
    """The (page, H, D) slot of page i, layer ``layer`` inside a transfer buffer ref."""
    if order == "nlp":
        return buf_ref.at[i, layer]
    if order == "npl":
        return buf_ref.at[i, :, layer]
    return buf_ref.at[layer, i]


def _gather_kernel(order: str, num_layers: int, n_ref, ids_ref, *refs):
    # refs: pools..., [out_in (aliased)], out, sem
    pools, out_ref, sem = refs[:num_layers], refs[-2], refs[-1]
    i = pl.program_id(0)

    @pl.when(i < n_ref[0])
    def _():
        copies = [
            pltpu.make_async_copy(p.at[ids_ref[i]], _buf_at(out_ref, order, i, l), sem) for l, p in enumerate(pools)
        ]
        for c in copies:
            c.start()
        for c in copies:
            c.wait()


@functools.partial(jax.jit, static_argnames=("order", "interpret"), donate_argnums=(3,))
def gather_layers(
    pools: tuple[jax.Array, ...],
    ids: jax.Array,
    n: jax.Array,
    out: jax.Array | None,
    order: str,
    interpret: bool = False,
) -> jax.Array:
    """Gather pages ``ids[:n]`` of every pool layer into a transfer buffer in ``order``.

    With ``out`` (donated) the pages land in it in place and positions >= n keep its bytes;
    without, a fresh buffer is returned whose padding positions are undefined.
    """
    check_order(order)
    nb, L = ids.shape[0], len(pools)
    shape = buffer_shape(order, nb, L, pools[0].shape[1:])
    extra = () if out is None else (out,)
    if out is not None and out.shape != shape:
        raise ValueError(f"out: expected shape {shape}, got {out.shape}")
    return pl.pallas_call(
        functools.partial(_gather_kernel, order, L),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(nb,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * (L + len(extra)),
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct(shape, pools[0].dtype),
        input_output_aliases={2 + L: 0} if extra else {},  # operands: (n, ids, *pools, [out])
        interpret=interpret,
        name=f"hicache_gather_{order}",
    )(n, ids, *pools, *extra)


def _scatter_kernel(order: str, n_ref, ids_ref, layer_ref, pool_in, buf_ref, pool_out, sem):
    del pool_in  # aliased to pool_out
    i = pl.program_id(0)

    @pl.when(i < n_ref[0])
    def _():
        c = pltpu.make_async_copy(_buf_at(buf_ref, order, i, layer_ref[0]), pool_out.at[ids_ref[i]], sem)
        c.start()
        c.wait()


@functools.partial(jax.jit, static_argnames=("order", "interpret"), donate_argnums=(0,))
def scatter_layer(
    pool: jax.Array, ids: jax.Array, n: jax.Array, buf: jax.Array, layer: jax.Array, order: str, interpret: bool = False
) -> jax.Array:
    check_order(order)
    nb = ids.shape[0]
    return pl.pallas_call(
        functools.partial(_scatter_kernel, order),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(nb,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        # Operand indices count the scalar-prefetch operands: (n, ids, layer, pool, buf).
        input_output_aliases={3: 0},
        interpret=interpret,
        name=f"hicache_scatter_{order}",
    )(n, ids, layer, pool, buf)
