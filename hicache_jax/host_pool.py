"""Host (L2) KV pool: numpy arrays in one of the upstream host layouts, plus a page allocator.

Pure numpy; imports no JAX or torch. Backends (JAX, torch) read and write it through
``write_pages`` / ``read_pages`` / ``read_layer`` with integer host page ids and contiguous
buffers in the layout's transfer order (see ``host_layout``).

Memory: by default a plain numpy array. A backend may hand in the ``buffer`` instead, e.g.
pinned host memory: ``hicache_jax.backends.jax.memory.pinned_host_pool`` allocates it as a
JAX ``pinned_host`` array and passes a writable view (``buffer_owner`` keeps it alive); the
torch backend (npu_bridge) can pass a pinned torch tensor's numpy view the same way.

Threading: ``write_pages``/``read_pages`` on *disjoint* page ids may run concurrently from
transfer worker threads (numpy releases the GIL on copies); the allocator and everything
else belong to the owner thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._checks import check_int, physical_memory_bytes
from .allocator import MAX_PAGES, PageAllocator, check_page_ids
from .host_layout import HostLayout, host_array_shape, page_major_shape
from .kv_geometry import KVGeometry


@dataclass(frozen=True)
class HostPoolConfig:
    """How big the host pool is and how it is laid out.

    ``size_bytes`` (if > 0) wins over ``ratio``; the ratio is host tokens / device tokens.
    A host pool smaller than the device pool (ratio < 1) is allowed (upstream only warns).
    """

    layout: HostLayout | str = HostLayout.PAGE_FIRST
    ratio: float = 2.0
    size_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", HostLayout.parse(self.layout))
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
            raise TypeError(f"ratio: expected a number, got {type(self.ratio).__name__}")
        if not (self.ratio > 0 and math.isfinite(self.ratio)):
            raise ValueError(f"ratio: expected a finite number > 0, got {self.ratio}")
        if isinstance(self.size_bytes, bool) or not isinstance(self.size_bytes, int):
            raise TypeError(f"size_bytes: expected an int, got {type(self.size_bytes).__name__}")
        if self.size_bytes < 0:
            raise ValueError(f"size_bytes: expected >= 0, got {self.size_bytes}")

    def num_pages(self, geom: KVGeometry, device_pages: int) -> int:
        """Host pages for a device pool of ``device_pages`` pages."""
        if self.size_bytes:
            pages = self.size_bytes // geom.bytes_per_page
        else:
            pages = int(device_pages * self.ratio)
        if pages < 1:
            raise ValueError(
                f"host pool: {self} gives {pages} pages for {geom} "
                f"({geom.bytes_per_page} bytes per page); need at least 1"
            )
        return pages


class HostKVPool:
    """Numpy host pool. Holds raw KV bits in ``geom.container_dtype``."""

    def __init__(
        self,
        geom: KVGeometry,
        num_pages: int,
        layout: HostLayout | str = HostLayout.PAGE_FIRST,
        buffer: np.ndarray | None = None,
        buffer_owner: object = None,
    ) -> None:
        if not isinstance(geom, KVGeometry):
            raise TypeError(f"geom: expected KVGeometry, got {type(geom).__name__}")
        check_int("num_pages", num_pages, 0, MAX_PAGES)
        ram = physical_memory_bytes()
        if buffer is None and ram is not None and num_pages * geom.bytes_per_page > ram:
            raise ValueError(
                f"num_pages: expected a pool that fits this machine's {ram / 2**30:.1f} GiB of memory, "
                f"got {num_pages} pages of {geom.bytes_per_page} bytes "
                f"({num_pages * geom.bytes_per_page / 2**30:.1f} GiB)"
            )
        self.geom = geom
        self.layout = HostLayout.parse(layout)
        self.allocator = PageAllocator(num_pages, name="host")
        self.num_pages = self.allocator.num_pages
        shape = host_array_shape(geom, self.layout, num_pages)
        if buffer is None:
            buffer = np.zeros(shape, dtype=geom.container_dtype)
        elif not isinstance(buffer, np.ndarray):
            raise TypeError(f"buffer: expected a numpy array, got {type(buffer).__name__}")
        elif (
            buffer.shape != shape
            or buffer.dtype != geom.container_dtype
            or not buffer.flags.c_contiguous
            or not buffer.flags.writeable
        ):
            raise ValueError(
                f"buffer: expected a writable C-contiguous {geom.container_dtype} array of shape "
                f"{shape}, got {buffer.dtype} {buffer.shape} (writeable={buffer.flags.writeable})"
            )
        self.array = buffer
        self._buffer_owner = buffer_owner  # keeps externally allocated (e.g. pinned) memory alive
        # Where the bytes live: "numpy" (pageable), or the owner's kind ("pinned_host").
        self.memory_kind = getattr(buffer_owner, "memory_kind", "numpy")
        views = self.array if geom.kind == "mha" else self.array[None]
        shape = page_major_shape(geom, self.layout, num_pages)
        # Page-major views share memory with self.array (reshape of contiguous data never copies).
        self._views = {c: views[i].reshape(shape) for i, c in enumerate(geom.components)}
        for v in self._views.values():
            assert np.shares_memory(v, self.array)

    @classmethod
    def from_config(cls, geom: KVGeometry, config: HostPoolConfig, device_pages: int) -> "HostKVPool":
        return cls(geom, config.num_pages(geom, device_pages), config.layout)

    @property
    def buffer_owner(self) -> object:
        """What allocated ``array`` when it was handed in (a backend's arena, a pinned tensor), or None.

        A backend that recognises its own owner may move pages through it instead of through
        the numpy view (the JAX backend streams pinned pages inside XLA executables)."""
        return self._buffer_owner

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def component_view(self, component: str) -> np.ndarray:
        """The page-major view of one component (shares memory with the pool)."""
        try:
            return self._views[component]
        except KeyError:
            raise ValueError(f"component: expected one of {self.geom.components}, got {component!r}") from None

    def _check_ids(self, host_ids: object, unique: bool) -> np.ndarray:
        # Writes must name distinct pages; reads may repeat one (e.g. bucket padding).
        return check_page_ids(host_ids, self.num_pages, "host_ids", unique=unique)

    def write_pages(self, component: str, host_ids: object, buf: np.ndarray) -> None:
        """Store ``buf`` (transfer order, n = len(host_ids)) into the given host pages."""
        self.write_pages_unchecked(component, self._check_ids(host_ids, unique=True), buf)

    def write_pages_unchecked(self, component: str, ids: np.ndarray, buf: np.ndarray) -> None:
        """``write_pages`` for ids an engine already validated (``KVTransferEngine.validate``)."""
        view = self.component_view(component)
        expected = page_major_shape(self.geom, self.layout, ids.size)
        buf = np.asarray(buf)
        if buf.shape != expected:
            raise ValueError(
                f"buf: expected shape {expected} for {ids.size} pages in {self.layout.value} order, got {buf.shape}"
            )
        if buf.dtype.itemsize != self.geom.itemsize:
            raise TypeError(f"buf: expected {self.geom.itemsize}-byte elements ({self.geom.dtype}), got {buf.dtype}")
        buf = buf.view(self.geom.container_dtype)
        if self.layout is HostLayout.LAYER_FIRST:
            view[:, ids] = buf
        else:
            view[ids] = buf

    def read_pages(self, component: str, host_ids: object, out: np.ndarray | None = None) -> np.ndarray:
        """Gather host pages into a contiguous buffer in transfer order (a copy, never a view)."""
        view = self.component_view(component)
        ids = self._check_ids(host_ids, unique=False)
        axis = 1 if self.layout is HostLayout.LAYER_FIRST else 0
        return np.take(view, ids, axis=axis, out=out)

    def read_layer(self, component: str, host_ids: object, layer: int) -> np.ndarray:
        """Gather one layer of host pages: ``(n, page, heads, width)`` contiguous."""
        return self.read_layer_unchecked(component, self._check_ids(host_ids, unique=False), layer)

    def read_layer_unchecked(self, component: str, ids: np.ndarray, layer: int) -> np.ndarray:
        """``read_layer`` for ids an engine already validated."""
        view = self.component_view(component)
        if not 0 <= layer < self.geom.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.geom.num_layers}, got {layer}")
        if self.layout is HostLayout.LAYER_FIRST:
            return view[layer][ids]
        if self.layout is HostLayout.PAGE_FIRST:
            return np.ascontiguousarray(view[ids, :, layer])
        return np.ascontiguousarray(view[ids, layer])
