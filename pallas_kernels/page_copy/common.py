"""Shapes and orders shared by every page-copy implementation.

Arrays seen by the kernels:

* a *pool layer*: ``(P, page, H, D)``, one layer of one KV component (K, V or MLA latent),
  raw bits in an unsigned container dtype (the dispatcher bitcasts);
* a *transfer buffer* of ``nb`` pages over ``L`` layers in one of three orders, matching the
  host layouts of the cache that drives these kernels (its names in brackets):

  - ``nlp``: ``(nb, L, page, H, D)``  (page_first_direct)
  - ``npl``: ``(nb, page, L, H, D)``  (page_first)
  - ``lnp``: ``(L, nb, page, H, D)``  (layer_first)

Page counts are bucketed: ``ids`` has a bucket size ``nb`` >= the true count ``n`` (passed as
an int32 array of shape (1,) so it is data, not a compile-time constant). Entries at
positions >= n are padding: gathers leave those output pages undefined, scatters skip them.
"""

from __future__ import annotations

import numpy as np

ORDERS = ("nlp", "npl", "lnp")


def check_order(order: str) -> str:
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
    return order


def buffer_shape(order: str, nb: int, num_layers: int, page_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of an ``nb``-page transfer buffer over ``num_layers`` layers in ``order``."""
    page, *rest = page_shape
    return {
        "nlp": (nb, num_layers, page, *rest),
        "npl": (nb, page, num_layers, *rest),
        "lnp": (num_layers, nb, page, *rest),
    }[check_order(order)]


def buffer_tile(ref, order: str, i, layer, rows, cols):
    """The (rows, cols) tile of page position i / layer ``layer`` in a transfer-buffer ref viewed
    with its per-token axes flattened: ``(.., page, cols)`` in ``order``."""
    if order == "nlp":
        return ref.at[i, layer, rows, cols]
    if order == "npl":
        return ref.at[i, rows, layer, cols]
    return ref.at[layer, i, rows, cols]


def default_buckets(max_pages: int) -> tuple[int, ...]:
    """Page-count buckets up to ``max_pages``: 1, 2, 4, 8, 16, then p and 1.5p per power of two.

    Padding waste stays under 34% while a pool of 4096 pages needs only ~20 compiled shapes.
    """
    if max_pages < 1:
        raise ValueError(f"max_pages: expected >= 1, got {max_pages}")
    out = [1, 2, 4, 8, 16]
    p = 16
    while out[-1] < max_pages:
        out += [p + p // 2, 2 * p]
        p *= 2
    out = sorted(set(b for b in out if b < max_pages)) + [max_pages]
    return tuple(out)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"n: {n} pages exceed the largest precompiled bucket {buckets[-1]}")


def check_page_ids(ids: object, num_pages: int, name: str = "ids", unique: bool = True) -> np.ndarray:
    """``ids`` as an int32 copy after host-side checks, so no kernel sees a bad id.

    Raises ``TypeError`` for non-integer ids (floats, bools, objects) and ``ValueError`` for
    a rank other than 1, ids outside ``[0, num_pages)`` and, with ``unique`` (scatter
    destinations: duplicates would race), repeated ids. The messages name the offending ids.
    The package validates on its own: kernels never depend on the cache that drives them.
    """
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, np.int32)
    if arr.dtype.kind not in "iu":  # bool is kind 'b', floats 'f', objects 'O'
        raise TypeError(f"{name}: expected integer page ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of page ids, got shape {arr.shape}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= num_pages:
        bad = arr[(arr < 0) | (arr >= num_pages)]
        raise ValueError(f"{name}: ids out of range [0, {num_pages}): {bad[:8].tolist()}")
    out = arr.astype(np.int32)  # in range, so it fits
    if unique and out.size > 1:
        s = np.sort(out)
        if (s[1:] == s[:-1]).any():
            uniq, counts = np.unique(out, return_counts=True)
            raise ValueError(f"{name}: duplicate ids {uniq[counts > 1][:8].tolist()}")
    return out
