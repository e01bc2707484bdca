"""Reference backend in plain numpy: a device pool that lives in host memory.

Used by the manager's tests (no JAX needed) and as the semantic oracle for real backends.

``NumpyTransferEngine()`` copies when a transfer is issued and returns the engine's one
``CompletedHandle`` (the cache then acknowledges a backup at once, without locks).
``NumpyTransferEngine(deferred=True)`` does not copy when a transfer is issued: the bytes
move only when the test calls ``complete(handle)`` / ``complete_all()``, in any order. A
manager bug that frees or overwrites pages while their transfer is still in flight then
shows up as wrong bytes, which a shadow model detects.

``inject_failures(n, kind)`` makes the next ``n`` backups / loads fail the way a broken copy
would: they write random bytes into their destination pages, and waiting on them raises
``TransferError``. A manager that served those pages would return wrong bytes.

Threading: single-threaded; everything runs on the caller's thread.
"""

from __future__ import annotations

import time

import numpy as np

from ..allocator import PageAllocator, check_page_ids
from ..host_layout import HostLayout
from ..host_pool import HostKVPool
from ..kv_geometry import KVGeometry
from ..transfer import CompletedHandle, KVTransferEngine, LoadHandle, TransferError


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


def _as_rows(a2: np.ndarray, base: np.ndarray) -> np.ndarray | None:
    """``a2`` (pages, elements per page) as a 1-D view of opaque page rows into ``base``, or
    None when that needs a copy (``a2`` itself a copy, or a page's elements not contiguous)."""
    if not np.shares_memory(a2, base) or a2.strides[1] != a2.itemsize:
        return None
    return a2.view(np.dtype((np.void, a2.shape[1] * a2.itemsize))).reshape(-1)


class _DeferredHandle(LoadHandle):
    def __init__(self, engine: "NumpyTransferEngine", run, num_layers: int) -> None:
        self._engine, self._run, self.num_layers = engine, run, num_layers
        self.completed = False
        self.error: BaseException | None = None
        self._t_done: float | None = None

    @property
    def completed_at(self) -> float | None:
        return self._t_done

    def complete(self) -> None:
        if not self.completed:
            self.completed = True
            self._run()
            self._t_done = time.perf_counter()

    def layer_done(self, layer: int) -> bool:
        return self.completed

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        # Deferred mode: waiting forces completion, like a blocking stream sync.
        self.complete()
        if self.error is not None:
            raise TransferError(f"transfer failed: {self.error!r}")

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
        # Direct copies between the two pools' arrays: a host component's page-major view and
        # the device buffer share dtype and per-page shape, so one gather + one scatter per
        # component moves a transfer (transposed per layout: device order is (L, n, page, H, D)).
        order = host_pool.layout.transfer_order
        self._perm = {"lnp": None, "npl": (1, 2, 0, 3, 4), "nlp": (1, 0, 2, 3, 4)}[order]
        self._inv = None if self._perm is None else tuple(int(i) for i in np.argsort(self._perm))
        self._pairs = tuple((device_pool.buffers[c], host_pool.component_view(c)) for c in self.geom.components)
        for dev, host in self._pairs:
            if dev.dtype != host.dtype or dev.ndim != 5 or host.ndim != 5:
                raise ValueError(
                    f"host_pool: component views {host.dtype} {host.shape} do not match the device "
                    f"buffers {dev.dtype} {dev.shape}"
                )
        # Per component and layer, a page is one contiguous row in the device buffer and, for
        # every layout with page size 1 (and for layer_first / page_first_direct at any page
        # size), one contiguous run of bytes in the host pool too. Each side is then viewed as
        # a 1-D array of opaque rows and a transfer is one row gather + scatter per (component,
        # layer): numpy copies whole rows instead of walking the 5-D index space element-wise
        # (~7x faster for small rows). ``None`` when a view would need a copy (the 5-D path).
        self._rows = self._row_views(order)
        self.pending: list[_DeferredHandle] = []
        self._completed = CompletedHandle(self.geom.num_layers)  # what an immediate copy returns
        self._failures = {"backup": 0, "load": 0}
        self._garbage = np.random.default_rng(0xBAD)

    def _row_views(self, order: str) -> tuple | None:
        rows = []
        for dev, host in self._pairs:
            for layer in range(dev.shape[0]):
                d2 = dev[layer].reshape(dev.shape[1], -1)
                h = host[layer] if order == "lnp" else host[:, :, layer] if order == "npl" else host[:, layer]
                h2 = h.reshape(h.shape[0], -1)
                d_rows, h_rows = _as_rows(d2, dev), _as_rows(h2, host)
                if d_rows is None or h_rows is None or d_rows.dtype != h_rows.dtype:
                    return None
                rows.append((d_rows, h_rows))
        return tuple(rows)

    def inject_failures(self, count: int, kind: str = "backup") -> None:
        """The next ``count`` copies of ``kind`` ("backup" or "load") fail (test control)."""
        if kind not in self._failures:
            raise ValueError(f"kind: expected 'backup' or 'load', got {kind!r}")
        self._failures[kind] = int(count)

    def _issue(self, run, kind: str, dst: np.ndarray) -> _DeferredHandle:
        fail = self._failures[kind] > 0
        if fail:
            self._failures[kind] -= 1
            run = self._scramble_fn(kind, dst)
        handle = _DeferredHandle(self, run, self.geom.num_layers)
        if fail:
            handle.error = RuntimeError(f"injected {kind} failure")
        if self.deferred:
            self.pending.append(handle)
        else:
            handle.complete()
        return handle

    def _scramble_fn(self, kind: str, ids: np.ndarray):
        """A failed copy: random bytes land in the destination pages."""

        def run() -> None:
            for dev, host in self._pairs:
                if kind == "load":
                    dev[:, ids] = self._random_like(dev[:, ids])
                elif self._perm is None:
                    host[:, ids] = self._random_like(host[:, ids])
                else:
                    host[ids] = self._random_like(host[ids])

        return run

    def _random_like(self, a: np.ndarray) -> np.ndarray:
        return self._garbage.integers(0, 256, a.nbytes, dtype=np.uint8).view(a.dtype).reshape(a.shape)

    def backup(self, device_ids, host_ids) -> LoadHandle:
        d, h = self.validate(device_ids, host_ids)
        return self._transfer("backup", d, h)

    def load(self, host_ids, device_ids) -> LoadHandle:
        d, h = self.validate(device_ids, host_ids)
        return self._transfer("load", d, h)

    def backup_owned(self, device_ids: np.ndarray, host_ids: np.ndarray) -> LoadHandle:
        # The cache's own ids (KVTransferEngine.backup_owned): no validate.
        return self._transfer("backup", device_ids, host_ids)

    def load_owned(self, host_ids: np.ndarray, device_ids: np.ndarray) -> LoadHandle:
        return self._transfer("load", device_ids, host_ids)

    def _transfer(self, kind: str, d: np.ndarray, h: np.ndarray) -> LoadHandle:
        """Copy device pages ``d`` to host pages ``h`` ("backup") or back ("load")."""
        d, h = d.astype(np.intp), h.astype(np.intp)  # private copies; numpy indexes by intp natively
        copy = self._copy_d2h if kind == "backup" else self._copy_h2d
        if self.deferred or self._failures[kind]:
            return self._issue(lambda: copy(d, h), kind, h if kind == "backup" else d)
        copy(d, h)  # immediate mode, nothing to fail: copy now, no per-copy handle
        return self._completed

    def _copy_d2h(self, d: np.ndarray, h: np.ndarray) -> None:
        if self._rows is not None:
            for dev, host in self._rows:
                host[h] = dev[d]
            return
        perm = self._perm
        for dev, host in self._pairs:
            buf = dev[:, d]  # (L, n, page, H, D)
            if perm is None:
                host[:, h] = buf
            else:
                host[h] = buf.transpose(perm)

    def _copy_h2d(self, d: np.ndarray, h: np.ndarray) -> None:
        # All layers at once: the handle reports them done together anyway.
        if self._rows is not None:
            for dev, host in self._rows:
                dev[d] = host[h]
            return
        inv = self._inv
        for dev, host in self._pairs:
            dev[:, d] = host[:, h] if inv is None else host[h].transpose(inv)

    # ---- test control --------------------------------------------------------------------
    def complete(self, handle: _DeferredHandle) -> None:
        """Run ``handle``'s copy now (a failed one does not raise here; its wait does)."""
        handle.complete()
        if handle in self.pending:
            self.pending.remove(handle)

    def complete_all(self) -> None:
        for handle in list(self.pending):
            self.complete(handle)


def make_numpy_backend(
    geom: KVGeometry,
    device_pages: int,
    host_pages: int,
    layout: HostLayout | str = HostLayout.PAGE_FIRST,
    deferred: bool = False,
):
    """Convenience: (device pool, host pool, engine) for tests."""
    device = NumpyDevicePool(geom, device_pages)
    host = HostKVPool(geom, host_pages, layout)
    return device, host, NumpyTransferEngine(device, host, deferred=deferred)
