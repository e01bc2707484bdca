"""GPU page-copy kernels: Triton-lowered ``pallas_call`` with masked block loads/stores.

GPU Pallas has no scalar prefetch, so page ids, the live count and the layer index are plain
int32 inputs read inside the kernel. Pages are viewed as ``(page, H*D)`` tiles and copied in
power-of-two blocks ``(TB, CB)`` (Triton needs power-of-two block shapes) with masks for the
ragged edges, so any page size (1, 16, 33, ...) works. Grid: (pages, token blocks, column
blocks); programs whose page position is padding (>= n) store nothing.

On CPU these run with ``interpret=True``; CI checks them that way against the reference.

Buffer donation: as in ``tpu``: ``out`` of a gather and ``pool`` of a scatter are aliased to
the output and donated.

Kernels copy unsigned containers (uint8/16/32); ``dispatch`` bitcasts KV dtypes to them, since
interpreted masked float copies may flush subnormals or canonicalise NaNs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .common import buffer_shape, buffer_tile, check_order

_MAX_BLOCK_ELEMS = 4096  # elements per program per layer: enough bytes in flight, few registers


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _blocks(page: int, cols: int) -> tuple[int, int]:
    cb = min(_pow2_at_least(cols), _MAX_BLOCK_ELEMS)
    tb = max(1, min(_pow2_at_least(page), _MAX_BLOCK_ELEMS // cb))
    return tb, cb


def _mask(tb: int, cb: int, page: int, cols_total: int, live):
    rows = pl.program_id(1) * tb + jnp.arange(tb)
    cols = pl.program_id(2) * cb + jnp.arange(cb)
    return (rows < page)[:, None] & (cols < cols_total)[None, :] & live


def _gather_kernel(order, num_layers, tb, cb, page, hd, n_ref, ids_ref, *refs):
    pools, out_ref = refs[:num_layers], refs[-1]  # refs: pools..., [out_in (aliased)], out
    i = pl.program_id(0)
    mask = _mask(tb, cb, page, hd, i < n_ref[0])
    rows, cols = pl.ds(pl.program_id(1) * tb, tb), pl.ds(pl.program_id(2) * cb, cb)
    src = ids_ref[i]
    for l, p in enumerate(pools):
        v = plt.load(p.at[src, rows, cols], mask=mask)
        plt.store(buffer_tile(out_ref, order, i, jnp.int32(l), rows, cols), v, mask=mask)


@functools.partial(jax.jit, static_argnames=("order", "interpret"), donate_argnums=(3,))
def gather_layers(
    pools: tuple[jax.Array, ...],
    ids: jax.Array,
    n: jax.Array,
    out: jax.Array | None,
    order: str,
    interpret: bool = False,
) -> jax.Array:
    """Gather pages ``ids[:n]`` of every pool layer into a transfer buffer (see ``tpu.gather_layers``)."""
    check_order(order)
    nb, L = ids.shape[0], len(pools)
    _, page, h, d = pools[0].shape
    shape = buffer_shape(order, nb, L, pools[0].shape[1:])
    if out is not None and out.shape != shape:
        raise ValueError(f"out: expected shape {shape}, got {out.shape}")
    tb, cb = _blocks(page, h * d)
    flat_pools = [p.reshape(p.shape[0], page, h * d) for p in pools]
    flat_shape = shape[:3] + (h * d,)
    extra = () if out is None else (out.reshape(flat_shape),)
    res = pl.pallas_call(
        functools.partial(_gather_kernel, order, L, tb, cb, page, h * d),
        grid=(nb, pl.cdiv(page, tb), pl.cdiv(h * d, cb)),
        out_shape=jax.ShapeDtypeStruct(flat_shape, pools[0].dtype),
        input_output_aliases={2 + L: 0} if extra else {},  # operands: (n, ids, *pools, [out])
        interpret=interpret,
        name=f"hicache_gather_{order}",
    )(n, ids, *flat_pools, *extra)
    return res.reshape(shape)


def _scatter_kernel(order, tb, cb, page, hd, n_ref, ids_ref, layer_ref, pool_in, buf_ref, pool_out):
    del pool_in  # aliased to pool_out
    i = pl.program_id(0)
    mask = _mask(tb, cb, page, hd, i < n_ref[0])
    rows, cols = pl.ds(pl.program_id(1) * tb, tb), pl.ds(pl.program_id(2) * cb, cb)
    v = plt.load(buffer_tile(buf_ref, order, i, layer_ref[0], rows, cols), mask=mask)
    plt.store(pool_out.at[ids_ref[i], rows, cols], v, mask=mask)


@functools.partial(jax.jit, static_argnames=("order", "interpret"), donate_argnums=(0,))
def scatter_layer(
    pool: jax.Array, ids: jax.Array, n: jax.Array, buf: jax.Array, layer: jax.Array, order: str, interpret: bool = False
) -> jax.Array:
    """Write layer ``layer`` of ``buf`` into pool pages ``ids[:n]``; the pool is donated."""
    check_order(order)
    nb = ids.shape[0]
    P, page, h, d = pool.shape
    tb, cb = _blocks(page, h * d)
    res = pl.pallas_call(
        functools.partial(_scatter_kernel, order, tb, cb, page, h * d),
        grid=(nb, pl.cdiv(page, tb), pl.cdiv(h * d, cb)),
        out_shape=jax.ShapeDtypeStruct((P, page, h * d), pool.dtype),
        input_output_aliases={3: 0},  # operands: (n, ids, layer, pool, buf)
        interpret=interpret,
        name=f"hicache_scatter_{order}",
    )(n, ids, layer, pool.reshape(P, page, h * d), buf.reshape(buf.shape[:3] + (h * d,)))
    return res.reshape(pool.shape)
