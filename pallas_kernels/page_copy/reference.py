"""Pure-JAX reference for page gather/scatter. Also the ``direct`` io backend (plain XLA).

Same signatures as the Pallas kernels (see ``common``): the kernels are tested bit-exact
against these functions.

``scatter_layer_pages`` is the same scatter written as a loop of per-page
``dynamic_update_slice``: XLA:CPU lowers a scatter to an element-wise loop nest, while each
``dynamic_update_slice`` into the donated pool is one contiguous page copy, about 3x faster on
a CPU (8 layers x 1024 pages x 16 x 8 x 128 bf16: 0.65x -> 2.0x a plain device copy of the same
bytes). On a GPU a loop is one kernel launch per page, so there the scatter stays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .common import check_order


_LAYER_AXIS = {"nlp": 1, "npl": 2, "lnp": 0}
_PAGE_AXIS = {"nlp": 0, "npl": 0, "lnp": 1}


def gather_layers(
    pools: tuple[jax.Array, ...],
    ids: jax.Array,
    n: jax.Array,
    out: jax.Array | None,
    order: str,
    branch_full: bool = False,
) -> jax.Array:
    """Gather pages ``ids[:n]`` from every pool layer into a transfer buffer in ``order``.

    With ``out``, positions >= n keep its bytes (donate it to update in place); without, the
    padding positions hold whatever pages the padding ids name. ``branch_full`` (the CPU form):
    a full bucket (n = bucket) skips reading ``out``, a third of the bytes moved; not on a GPU,
    where a conditional's predicate is read back on the host before the branch runs.
    """
    check_order(order)

    def gathered(pools):
        pages = [jnp.take(p, ids, axis=0, mode="clip") for p in pools]  # each (nb, page, H, D)
        return jnp.stack(pages, axis=_LAYER_AXIS[order])

    if out is None:
        return gathered(pools)
    nb = ids.shape[0]

    def keep_padding(pools, out):
        new = gathered(pools)
        live_shape = [1] * new.ndim
        live_shape[_PAGE_AXIS[order]] = nb
        live = (jnp.arange(nb) < n[0]).reshape(live_shape)
        return jnp.where(live, new, out)

    if not branch_full:
        return keep_padding(pools, out)
    # A full bucket keeps nothing of ``out``: skip reading it.
    return jax.lax.cond(n[0] >= nb, lambda pools, out: gathered(pools), keep_padding, pools, out)


def select_layer(buf: jax.Array, layer: jax.Array, order: str) -> jax.Array:
    """(nb, page, H, D) slab of one layer from a transfer buffer (dynamic layer index)."""
    return jax.lax.dynamic_index_in_dim(buf, layer, axis=_LAYER_AXIS[check_order(order)], keepdims=False)


def scatter_layer(
    pool: jax.Array, ids: jax.Array, n: jax.Array, buf: jax.Array, layer: jax.Array, order: str
) -> jax.Array:
    """Write layer ``layer`` of ``buf`` into pool pages ``ids[:n]``; padding is dropped.

    Donate ``pool`` so XLA updates it in place.
    """
    src = select_layer(buf, layer[0], order)
    nb = ids.shape[0]
    live = jnp.arange(nb) < n[0]
    # Padding gets distinct out-of-bounds ids, so they are dropped and indices stay unique.
    dest = jnp.where(live, ids, pool.shape[0] + jnp.arange(nb, dtype=ids.dtype))
    return pool.at[dest].set(src, mode="drop", unique_indices=True)


def scatter_layer_pages(
    pool: jax.Array, ids: jax.Array, n: jax.Array, buf: jax.Array, layer: jax.Array, order: str
) -> jax.Array:
    """``scatter_layer`` as ``n`` per-page ``dynamic_update_slice`` s (see the module note: the
    CPU form). Positions >= n are never touched; ids must be in range (the copier checks)."""
    check_order(order)
    page_axis, layer_axis = _PAGE_AXIS[order], _LAYER_AXIS[order]
    size = tuple(1 if a in (page_axis, layer_axis) else d for a, d in enumerate(buf.shape))
    zero = jnp.zeros((), jnp.int32)

    def body(i, p):
        start = tuple(i if a == page_axis else layer[0] if a == layer_axis else zero for a in range(buf.ndim))
        page = jax.lax.dynamic_slice(buf, start, size).reshape((1,) + p.shape[1:])  # drop the unit layer axis
        return jax.lax.dynamic_update_slice(p, page, (ids[i],) + (zero,) * (p.ndim - 1))

    return jax.lax.fori_loop(0, n[0], body, pool)
