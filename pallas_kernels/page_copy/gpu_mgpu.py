"""GPU page-copy kernels on Mosaic GPU (``plgpu.kernel``): TMA copies staged through shared memory.

The successor of the Triton kernels in ``gpu`` (the Pallas Triton backend is deprecated since
jax 0.11). Same operations and signatures as ``gpu`` / ``tpu`` / ``reference``:

* ``gather_layers``: pages ``ids[:n]`` of every pool layer into a transfer buffer in one of the
  three orders of ``common`` (``nlp``, ``npl``, ``lnp``);
* ``scatter_layer``: layer ``layer`` of a transfer buffer into pool pages ``ids[:n]``, in place.

How a copy runs. Every page of one layer is viewed as ``(page, W)`` 32-bit words (``W`` = bytes
per token / 4) and cut into tiles ``(tr, tc)`` that divide it exactly, with ``tc <= 256`` and
``tr <= 256`` (the TMA box limit) and ``tr * tc * 4 <= tile_bytes``: a page larger than the
shared-memory budget (64 tokens x 8 heads x 128 x bf16 is 128 KiB per layer) moves as several
tiles. Grid: ``(page blocks, tiles)``; a block handles ``G`` consecutive page positions (several
pages per block when tiles are small) and, for a gather, every layer. Its work items (page,
layer) run through ``S`` shared-memory slots: a TMA load (GMEM -> SMEM, completion on the slot's
barrier) is issued up to ``S`` items ahead of the TMA store (SMEM -> GMEM) that drains it, and a
slot is reloaded only after the store reading it has finished reading
(``wait_smem_to_gmem(0, wait_read_only=True)``). Page ids, the live count ``n`` and the layer
are int32 arrays in global memory, read by the block (Mosaic GPU has no scalar prefetch).
Padding positions (>= n) issue nothing: live positions are a prefix, so a block's live items
are a prefix of its item list too.

Requirements: bytes per token (``H * D * itemsize``) a multiple of 16 (TMA's alignment);
``supported`` says so and the entry points raise ``ValueError`` otherwise.

Donation and ownership: ``scatter_layer`` writes into the pool in place through a mutable ref
(``jax.new_ref`` / ``jax.freeze``; ``plgpu.kernel`` has no ``input_output_aliases``): call it
under ``jit`` with the pool donated, and the lowered module aliases the pool argument to the
result (a test checks it). The caller's pool array is invalid afterwards; unnamed pages keep
their bytes. ``gather_layers(out=...)`` writes into the donated ``out`` the same way and leaves
its padding positions as they were; without ``out`` the padding positions are undefined.
Duplicate destination ids would race: the dispatcher rejects them before launch.

Kernels copy bits (unsigned containers uint8/16/32, as ``dispatch`` passes them, then viewed as
uint32 words here): NaN payloads and -0.0 pass unchanged.

Testing without a GPU: ``interpret=True`` runs the kernels in Mosaic GPU's interpreter
(``plgpu.InterpretGPUParams``) on the CPU; ``jax.jit(f).trace(...).lower(
lowering_platforms=("cuda",))`` lowers them to the ``mosaic_gpu_v2`` custom call. Threading: none
of its own; JAX dispatch rules apply.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .common import buffer_shape, buffer_tile, check_order

TILE_BYTES = 32 * 1024  # bytes per shared-memory slot (one TMA box)
MAX_SLOTS = 4  # shared-memory slots per block: loads in flight per block
BLOCK_BYTES = 64 * 1024  # several small pages per block until a block moves about this much
MAX_ITEMS = 32  # work items per block (statically unrolled: compile time grows with it)
_BOX = 256  # TMA box limit per dimension (elements)


def supported(page_shape: tuple[int, ...], itemsize: int) -> bool:
    """Whether pages of ``page_shape`` = (page, H, D) and ``itemsize`` can be copied (16-byte rows)."""
    return (math.prod(page_shape[1:]) * itemsize) % 16 == 0


def _check(page_shape, itemsize) -> None:
    if not supported(page_shape, itemsize):
        raise ValueError(
            f"mgpu page copy: bytes per token ({math.prod(page_shape[1:])} x {itemsize}) must be a "
            f"multiple of 16 for TMA; use impl 'xla' for this geometry"
        )


def tiles(page: int, words: int, tile_bytes: int = TILE_BYTES) -> tuple[int, int]:
    """(rows, cols) of the tile a (page, words) uint32 page is cut into (both divide exactly)."""
    col_cap = max(4, min(_BOX, tile_bytes // 4))
    tc = max(c for c in range(4, min(words, col_cap) + 1, 4) if words % c == 0)
    row_cap = max(1, min(_BOX, tile_bytes // (4 * tc)))
    tr = max(r for r in range(1, min(page, row_cap) + 1) if page % r == 0)
    return tr, tc


def _plan(nb: int, page: int, words: int, per_page_items: int, tile_bytes: int, pages_per_block: int | None):
    """(tr, tc, tiles per page, pages per block G, slots S)."""
    tr, tc = tiles(page, words, tile_bytes)
    n_tiles = (page // tr) * (words // tc)
    tb = tr * tc * 4
    if pages_per_block is None:  # several pages per block only while one page is a single small tile
        g = 1 if n_tiles > 1 else -(-BLOCK_BYTES // (per_page_items * tb))
        pages_per_block = max(1, min(g, MAX_ITEMS // per_page_items, nb))
    g = max(1, min(pages_per_block, nb))
    s = max(1, min(g * per_page_items, MAX_SLOTS, (4 * TILE_BYTES) // tb))
    return tr, tc, n_tiles, g, s


def _to_words(x: jax.Array) -> jax.Array:
    """(..., page, H, D) unsigned container -> (..., page, W) uint32 (same bits, no copy under jit)."""
    *lead, page, h, d = x.shape
    k = 4 // x.dtype.itemsize
    w = h * d // k
    if k == 1:
        return jax.lax.bitcast_convert_type(x.reshape(*lead, page, w), jnp.uint32)
    return jax.lax.bitcast_convert_type(x.reshape(*lead, page, w, k), jnp.uint32)


def _from_words(x: jax.Array, shape, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype).reshape(shape)


def _kernel_kw(interpret, name: str) -> dict:
    """``interpret`` (True or a ``plgpu.InterpretGPUParams``, e.g. with ``detect_races``) and the
    kernel's name where this jax takes one."""
    kw = {}
    if interpret:
        kw["interpret"] = interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()
    if "kernel_name" in getattr(plgpu.Mesh, "__dataclass_fields__", {}):
        kw["kernel_name"] = name
    return kw


def _pipeline(items, live, src, dst, slots, bar):
    """Copy work items through shared-memory ``slots``: item j's TMA load runs S items ahead of its store.

    ``live(j)``: traced bool (a prefix of the items is live); ``src(j)`` / ``dst(j)``: GMEM refs
    (read only under ``live(j)``, so padding ids are never dereferenced).
    """
    S = len(slots)

    def load(j):
        @pl.when(live(j))
        def _():
            if j >= S:  # slot j % S was last read by item j - S's store: let it finish reading
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.copy_gmem_to_smem(src(j), slots[j % S], bar.at[j % S])

    for j in range(min(S, items)):
        load(j)
    for j in range(items):

        @pl.when(live(j))
        def _():
            plgpu.barrier_wait(bar.at[j % S])
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(slots[j % S], dst(j))

        if j + S < items:
            load(j + S)
    plgpu.wait_smem_to_gmem(0)  # every store has landed before the block exits


def _tile_slices(t, tr, tc, words):
    per_row = words // tc
    return pl.ds((t // per_row) * tr, tr), pl.ds((t % per_row) * tc, tc)


@functools.partial(
    jax.jit, static_argnames=("order", "interpret", "tile_bytes", "pages_per_block"), donate_argnums=(3,)
)
def gather_layers(
    pools: tuple[jax.Array, ...],
    ids: jax.Array,
    n: jax.Array,
    out: jax.Array | None,
    order: str,
    interpret: bool = False,
    tile_bytes: int = TILE_BYTES,
    pages_per_block: int | None = None,
) -> jax.Array:
    """Gather pages ``ids[:n]`` of every pool layer into a transfer buffer in ``order``.

    With ``out`` (donated) the pages land in it in place and positions >= n keep its bytes;
    without, a fresh buffer is returned whose padding positions are undefined.
    """
    check_order(order)
    nb, L = ids.shape[0], len(pools)
    P, page, h, d = pools[0].shape
    dtype = pools[0].dtype
    _check((page, h, d), dtype.itemsize)
    shape = buffer_shape(order, nb, L, (page, h, d))
    if out is not None and out.shape != shape:
        raise ValueError(f"out: expected shape {shape}, got {out.shape}")
    words = h * d * dtype.itemsize // 4
    tr, tc, n_tiles, G, S = _plan(nb, page, words, L, tile_bytes, pages_per_block)
    wpools = [_to_words(p) for p in pools]
    wshape = shape[:3] + (words,)
    out_ref = None if out is None else jax.new_ref(_to_words(out), memory_space=plgpu.GMEM)

    def body(n_g, ids_g, *refs):
        srcs = refs[:L]
        dst_ref = out_ref if out_ref is not None else refs[L]
        slots, bar = refs[-S - 1 : -1], refs[-1]
        base = jax.lax.axis_index("b") * G
        rows, cols = _tile_slices(jax.lax.axis_index("t"), tr, tc, words)
        item = lambda j: (base + j // L, j % L)  # noqa: E731  (page position, layer), page-major
        _pipeline(
            G * L,
            lambda j: item(j)[0] < n_g[0],
            lambda j: srcs[j % L].at[ids_g[item(j)[0]], rows, cols],
            lambda j: buffer_tile(dst_ref, order, item(j)[0], j % L, rows, cols),
            slots,
            bar,
        )

    kernel = plgpu.kernel(
        body,
        out_type=() if out_ref is not None else jax.ShapeDtypeStruct(wshape, jnp.uint32),
        grid=(pl.cdiv(nb, G), n_tiles),
        grid_names=("b", "t"),
        scratch_types=[plgpu.SMEM((tr, tc), jnp.uint32) for _ in range(S)] + [plgpu.Barrier(num_barriers=S)],
        **_kernel_kw(interpret, f"hicache_mgpu_gather_{order}"),
    )
    res = kernel(n, ids, *wpools)
    if out_ref is not None:
        res = jax.freeze(out_ref)
    return _from_words(res, shape, dtype)


@functools.partial(
    jax.jit, static_argnames=("order", "interpret", "tile_bytes", "pages_per_block"), donate_argnums=(0,)
)
def scatter_layer(
    pool: jax.Array,
    ids: jax.Array,
    n: jax.Array,
    buf: jax.Array,
    layer: jax.Array,
    order: str,
    interpret: bool = False,
    tile_bytes: int = TILE_BYTES,
    pages_per_block: int | None = None,
) -> jax.Array:
    """Write layer ``layer`` of ``buf`` into pool pages ``ids[:n]`` in place; the pool is donated."""
    check_order(order)
    nb = ids.shape[0]
    P, page, h, d = pool.shape
    _check((page, h, d), pool.dtype.itemsize)
    words = h * d * pool.dtype.itemsize // 4
    tr, tc, n_tiles, G, S = _plan(nb, page, words, 1, tile_bytes, pages_per_block)
    pool_ref = jax.new_ref(_to_words(pool), memory_space=plgpu.GMEM)

    def body(n_g, ids_g, layer_g, buf_g, *refs):
        slots, bar = refs[:-1], refs[-1]
        base = jax.lax.axis_index("b") * G
        rows, cols = _tile_slices(jax.lax.axis_index("t"), tr, tc, words)
        _pipeline(
            G,
            lambda j: base + j < n_g[0],
            lambda j: buffer_tile(buf_g, order, base + j, layer_g[0], rows, cols),
            lambda j: pool_ref.at[ids_g[base + j], rows, cols],
            slots,
            bar,
        )

    plgpu.kernel(
        body,
        out_type=(),
        grid=(pl.cdiv(nb, G), n_tiles),
        grid_names=("b", "t"),
        scratch_types=[plgpu.SMEM((tr, tc), jnp.uint32) for _ in range(S)] + [plgpu.Barrier(num_barriers=S)],
        **_kernel_kw(interpret, f"hicache_mgpu_scatter_{order}"),
    )(n, ids, layer, _to_words(buf))
    return _from_words(jax.freeze(pool_ref), pool.shape, pool.dtype)
