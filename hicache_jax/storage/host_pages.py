"""Where a host page's bytes lie: its contiguous runs in the host pool's memory, in page-byte order.

A stored page is, per component of the pool's geometry, its slab in the host layout's transfer
order (``base.PageCodec``). In the host pool that is one contiguous run per component for the
page-first layouts (``page_first``, ``page_first_direct``) and one per component and layer for
``layer_first`` (the layers of a page are ``num_pages`` pages apart). ``PageRuns`` computes those
runs once per pool from the array's strides, so a backend reads or writes a page straight into
or out of the pool (``os.preadv`` / ``os.pwritev`` into ``views``, a transfer engine's pointers,
a CRC over ``runs``) with no gather or scatter copy and no page-sized staging array.

Threading: immutable after construction; share freely. The views and addresses point into the
pool's array, which ``PageRuns`` keeps alive; the caller must own the host pages it touches
(the storage contract: a reader owns the host ids of its call).
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..host_layout import HostLayout
from ..host_pool import HostKVPool

# memmove that keeps the GIL (``PYFUNCTYPE``; ``ctypes.memmove`` drops it): ``copy_out`` makes a
# call per run, and a thread that drops the GIL per call can wait up to a switch interval (5 ms)
# to get it back from a Python-heavy thread (orbax's writer) each time.
_memmove_keep_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes.cast(ctypes.memmove, ctypes.c_void_p).value
)


class PageRuns:
    """The runs of every page of one ``HostKVPool``."""

    def __init__(self, pool: HostKVPool) -> None:
        if not isinstance(pool, HostKVPool):
            raise TypeError(f"pool: expected HostKVPool, got {type(pool).__name__}")
        arr = pool.array
        if not arr.flags.c_contiguous:
            raise ValueError("pool: expected a C-contiguous host array")
        self.pool = pool
        self.num_pages = pool.num_pages
        self._flat = arr.reshape(-1).view(np.uint8)  # keeps the pool's memory alive with us
        self._mv = memoryview(self._flat)
        self.base = self._flat.ctypes.data
        comps = [pool.component_view(c) for c in pool.geom.components]
        v = comps[0]
        offs = [c.ctypes.data - self.base for c in comps]
        if pool.layout is HostLayout.LAYER_FIRST:  # (L, pages, ...): one run per component and layer
            self.page_stride = v.strides[1]
            size = v[0, 0].nbytes
            self.rel = [(o + layer * v.strides[0], size) for o in offs for layer in range(v.shape[0])]
        else:  # (pages, ...): the page is contiguous per component
            self.page_stride = v.strides[0]
            self.rel = [(o, v[0].nbytes) for o in offs]
        self.sizes = [s for _, s in self.rel]
        self.page_bytes = sum(self.sizes)
        self.contiguous = len(self.rel) == 1

    def _check(self, host_id: int) -> int:
        h = int(host_id)
        if not 0 <= h < self.num_pages:
            raise ValueError(f"host_id: expected 0 <= id < {self.num_pages}, got {host_id}")
        return h

    def offsets(self, host_id: int) -> list[tuple[int, int]]:
        """``(byte offset into the pool's array, nbytes)`` of each run of page ``host_id``."""
        b = self._check(host_id) * self.page_stride
        return [(b + o, s) for o, s in self.rel]

    def runs(self, host_id: int) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of each run (transfer engines, ``integrity.checksum_at``)."""
        b = self.base + self._check(host_id) * self.page_stride
        return [(b + o, s) for o, s in self.rel]

    def ptrs(self, host_id: int) -> list[int]:
        return [a for a, _ in self.runs(host_id)]

    def views(self, host_id: int) -> list[memoryview]:
        """Writable memoryviews of the runs (``os.preadv`` / ``os.pwritev`` buffers)."""
        return [self._mv[a : a + s] for a, s in self.offsets(host_id)]

    def arrays(self, host_id: int) -> list[np.ndarray]:
        """The runs as 1-D uint8 numpy views of the pool."""
        return [self._flat[a : a + s] for a, s in self.offsets(host_id)]

    def copy_out(self, host_ids, out: np.ndarray) -> None:
        """Copy pages ``host_ids`` into the rows of ``out`` (``uint8[n, page_bytes]`` with
        contiguous rows), run by run: one copy of each byte, no temporary. ValueError for a bad
        id or an ``out`` of another shape, dtype or layout (before anything is copied)."""
        ids = [self._check(h) for h in host_ids]
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != np.uint8
            or out.shape != (len(ids), self.page_bytes)
            or (len(ids) and out.strides[1] != 1)
            or not out.flags.writeable
        ):
            raise ValueError(
                f"out: expected a writable uint8[{len(ids)}, {self.page_bytes}] array with contiguous rows"
            )
        dst, row = out.ctypes.data, out.strides[0] if len(ids) else 0
        for r, h in enumerate(ids):
            src = self.base + h * self.page_stride
            d = dst + r * row
            for o, size in self.rel:
                _memmove_keep_gil(d, src + o, size)
                d += size

    def zero(self, host_id: int) -> None:
        """Zero-fill page ``host_id`` (a read that failed after bytes landed in it)."""
        for a, s in self.runs(host_id):
            ctypes.memset(a, 0, s)
