"""Reference backend in plain numpy: a device pool that lives in host memory.

Used by the manager's tests (no JAX needed) and as the semantic oracle for real backends.

``NumpyTransferEngine(deferred=True)`` does not copy when a transfer is issued: the bytes
move only when the test calls ``complete(handle)`` / ``complete_all()``, in any order. A
manager bug that frees or overwrites pages while their transfer is still in flight then
shows up as wrong bytes, which a shadow model detects.

Threading: single-threaded; everything runs on the caller's thread.
"""

from __future__ import annotations

import numpy as np

from ..allocator import PageAllocator, check_page_ids
from ..host_layout import HostLayout
from ..host_pool import HostKVPool
from ..kv_geometry import KVGeometry
from ..transfer import KVTransferEngine, LoadHandle


class NumpyDevicePool:
    """Per component, one array ``(L, pages, page, heads, width)`` of raw KV bits."""

    def __init__(self, geom: KVGeometry, num_pages: int) -> None:
        self.geom = geom
        self.allocator = PageAllocator(num_pages, name="device")
        self.num_pages = num_pages
        shape = (geom.num_layers, num_pages) + geom.page_shape
        self.buffers = {c: np.zeros(shape, geom.container_dtype) for c in geom.components}

    def write(self, component: str, device_ids: object, pages: np.ndarray) -> None:
        """Write ``pages`` ``(L, n, page, heads, width)`` into the pool (what a model step does)."""
        ids = check_page_ids(device_ids, self.num_pages, "device_ids")
        self.buffers[component][:, ids] = pages

    def read(self, component: str, device_ids: object) -> np.ndarray:
        ids = check_page_ids(device_ids, self.num_pages, "device_ids", unique=False)
        return self.buffers[component][:, ids].copy()


class _DeferredHandle(LoadHandle):
    def __init__(self, engine: "NumpyTransferEngine", run, num_layers: int) -> None:
        self._engine, self._run, self.num_layers = engine, run, num_layers
        self.completed = False
        self.error: BaseException | None = None

    def complete(self) -> None:
        if not self.completed:
            self.completed = True
            self._run()

    def layer_done(self, layer: int) -> bool:
        return self.completed

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        # Deferred mode: waiting forces completion, like a blocking stream sync.
        self.complete()

    def done(self) -> bool:
        return self.completed


class NumpyTransferEngine(KVTransferEngine):
    """Copies between a NumpyDevicePool and a HostKVPool, immediately or on demand."""

    def __init__(self, device_pool: NumpyDevicePool, host_pool: HostKVPool, deferred: bool = False) -> None:
        if device_pool.geom != host_pool.geom:
            raise ValueError(f"host_pool: geometry {host_pool.geom} differs from the device pool's {device_pool.geom}")
        self.geom = device_pool.geom
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.device_num_pages = device_pool.num_pages
        self.deferred = deferred
        self.pending: list[_DeferredHandle] = []

    def _issue(self, run) -> _DeferredHandle:
        handle = _DeferredHandle(self, run, self.geom.num_layers)
        if self.deferred:
            self.pending.append(handle)
        else:
            handle.complete()
        return handle

    def backup(self, device_ids, host_ids) -> _DeferredHandle:
        d, h = self.validate(device_ids, host_ids)
        order = self.host_pool.layout.transfer_order

        def run() -> None:
            for c in self.geom.components:
                buf = self.device_pool.buffers[c][:, d]  # (L, n, page, H, D)
                if order == "nlp":
                    buf = buf.transpose(1, 0, 2, 3, 4)
                elif order == "npl":
                    buf = buf.transpose(1, 2, 0, 3, 4)
                self.host_pool.write_pages_unchecked(c, h, np.ascontiguousarray(buf))

        return self._issue(run)

    def load(self, host_ids, device_ids) -> _DeferredHandle:
        d, h = self.validate(device_ids, host_ids)

        def run() -> None:
            for c in self.geom.components:
                for layer in range(self.geom.num_layers):
                    self.device_pool.buffers[c][layer, d] = self.host_pool.read_layer_unchecked(c, h, layer)

        return self._issue(run)

    # ---- test control --------------------------------------------------------------------
    def complete(self, handle: _DeferredHandle) -> None:
        handle.complete()
        if handle in self.pending:
            self.pending.remove(handle)

    def complete_all(self) -> None:
        for handle in list(self.pending):
            self.complete(handle)


def make_numpy_backend(geom: KVGeometry, device_pages: int, host_pages: int,
                       layout: HostLayout | str = HostLayout.PAGE_FIRST, deferred: bool = False):
    """Convenience: (device pool, host pool, engine) for tests."""
    device = NumpyDevicePool(geom, device_pages)
    host = HostKVPool(geom, host_pages, layout)
    return device, host, NumpyTransferEngine(device, host, deferred=deferred)
