"""JAX transfer engine: D2H backups and H2D loads between a JaxDevicePool and a HostKVPool.

Backup (D2H), never blocking the caller:
  owner thread: one all-layer gather per component into a transfer buffer already in the
  host layout's order (``page_copy`` fuses the layout conversion), then ``device_put`` to
  the host memory kind (pinned where the platform has it); both are async dispatches.
  D2H worker: waits for the bytes (``np.asarray``) and copies the first ``n`` pages into
  the host pool with one fancy-index copy. The handle is that job's future.

Load (H2D), layer by layer:
  owner thread: one numpy gather of the host pages into a contiguous staging buffer per
  component (transfer order, bucket-padded; pinned and reused through a ``StagingRing`` on a
  single-device pool where the platform has pinned memory), one ``device_put`` of it, then
  one scatter per layer from that buffer into the layer's pool array (donated, in place). Each layer's new
  array is installed in the pool at once, so later model steps are ordered after it by
  dataflow; ``LoadHandle.layer_done(l)`` reports whether layer l's arrays have landed.

Several processes (a pool whose mesh spans ``jax.distributed`` processes): the host pool
holds this process's KV heads only (``JaxDevicePool.local_geom``). A backup's worker copies
this process's shards of the transfer buffer (``local_numpy``); a load builds the global
staging buffer from every process's own host pages
(``jax.make_array_from_process_local_data``). Every process must issue the same copies in the
same order (the cache's agreed protocol does).

Threading: ``backup``/``load`` are called from the owner thread (the one that donates the
pool arrays to model steps; multi-host JAX also needs every ``device_put`` issued there).
The D2H worker only converts finished host buffers to numpy and writes host pages the
manager has reserved for this backup; it runs ``worker_nice`` above the owner's priority
(``hicache_jax.workers``), so its memcpy never takes a core the model step wants.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from pallas_kernels.page_copy.dispatch import PageCopier, PageCopyConfig

from ...host_layout import HostLayout
from ...host_pool import HostKVPool
from ...transfer import CompletedHandle, FutureHandle, KVTransferEngine, LoadHandle, SerialWorker
from ...workers import DEFAULT_WORKER_NICE, check_nice
from .device_pool import JaxDevicePool
from .memory import StagingRing, host_memory_kind

_PAGE_AXIS = {"nlp": 0, "npl": 0, "lnp": 1}
_HEAD_AXIS = 3  # of a transfer buffer, in every order: (n | L, L | n, page, heads, width)


def local_numpy(arr: jax.Array) -> np.ndarray:
    """``arr`` as numpy, or, when it spans other processes, this process's part of it: its
    shards along the head axis (replicated copies once), in head order."""
    if arr.is_fully_addressable:
        return np.asarray(arr)
    parts = {}
    for sh in arr.addressable_shards:
        parts.setdefault(sh.index[_HEAD_AXIS].start or 0, sh.data)
    if len(parts) == 1:
        return np.asarray(next(iter(parts.values())))
    return np.concatenate([np.asarray(parts[k]) for k in sorted(parts)], axis=_HEAD_AXIS)


class JaxLoadHandle(LoadHandle):
    """Per-layer readiness of an H2D load: layer l is done when its pool arrays are ready.

    ``completed_at`` is stamped by the first ``wait_layer`` / ``layer_done`` / ``done`` that
    finds the last layer landed (JAX offers no completion callback): exact when the caller
    waits for the load before its step reads it, as the reference engine does."""

    def __init__(self, per_layer: list[list[jax.Array]]) -> None:
        self._per_layer = per_layer
        self.num_layers = len(per_layer)
        self._t_done: float | None = None

    @property
    def completed_at(self) -> float | None:
        return self._t_done

    @staticmethod
    def _ready(a: jax.Array) -> bool:
        # A consumed (donated) array was used by a later step, which ran after the load.
        return a.is_deleted() or a.is_ready()

    def layer_done(self, layer: int) -> bool:
        ok = all(self._ready(a) for a in self._per_layer[layer])
        if ok and self._t_done is None and layer == self.num_layers - 1 and \
                all(self._ready(a) for arrays in self._per_layer for a in arrays):
            self._t_done = time.perf_counter()
        return ok

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        for a in self._per_layer[layer]:
            if not a.is_deleted():
                a.block_until_ready()
        if self._t_done is None and layer == self.num_layers - 1:
            self.layer_done(layer)  # stamps completed_at once every layer has landed

    def done(self) -> bool:
        return all(self.layer_done(l) for l in range(self.num_layers))


class JaxTransferEngine(KVTransferEngine):
    def __init__(self, device_pool: JaxDevicePool, host_pool: HostKVPool, copier: PageCopier | None = None,
                 copy_config: PageCopyConfig | None = None, use_host_memory_kind: bool = True,
                 worker_nice: int = DEFAULT_WORKER_NICE) -> None:
        if device_pool.local_geom != host_pool.geom:
            raise ValueError(f"host_pool: geometry {host_pool.geom} differs from this process's share of the device "
                             f"pool {device_pool.local_geom}")
        self.multiprocess = device_pool.multiprocess
        self.geom = host_pool.geom
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.device_num_pages = device_pool.num_pages
        if copier is None:
            mesh, axis = device_pool.copier_sharding
            copier = PageCopier(copy_config or PageCopyConfig(max_pages=device_pool.num_pages), mesh=mesh,
                                kv_axis=axis)
        self.copier = copier
        self.order = host_pool.layout.transfer_order
        # Memory kind D2H buffers land in (pinned where the platform has it); None: plain copies.
        self.host_memory_kind = host_memory_kind(device_pool.local_device) if use_host_memory_kind else None
        # Pinned H2D staging for single-device pools (sharded pools take numpy -> device_put).
        self._ring = None
        if self.host_memory_kind == "pinned_host" and device_pool.mesh is None:
            self._ring = StagingRing(next(iter(device_pool.sharding.device_set)), "pinned_host")
        self._d2h = SerialWorker("hicache-d2h", check_nice(worker_nice))

    def precompile(self, max_pages: int | None = None) -> int:
        """Compile every bucket's gather and scatter now, so serving never compiles."""
        shape = (self.device_num_pages,) + self.device_pool.geom.page_shape
        return self.copier.precompile(shape, self.device_pool.dtype, self.geom.num_layers, (self.order,),
                                      max_pages=max_pages)

    # ---- D2H ---------------------------------------------------------------------------
    def backup(self, device_ids, host_ids) -> FutureHandle | CompletedHandle:
        d, h = self.validate(device_ids, host_ids)
        if not d.size:
            return CompletedHandle(self.geom.num_layers)
        staged = []
        for c in self.geom.components:
            buf, n = self.copier.gather(self.device_pool.layers(c), d, self.order)
            if self.host_memory_kind is not None:
                buf = jax.device_put(buf, buf.sharding.with_memory_kind(self.host_memory_kind))
            staged.append((c, buf))
        axis, host, view_dtype = _PAGE_AXIS[self.order], self.host_pool, self.geom.container_dtype

        def finish() -> None:
            for c, buf in staged:
                arr = local_numpy(buf).view(view_dtype)
                arr = arr[:, :n] if axis == 1 else arr[:n]
                host.write_pages_unchecked(c, h, arr)

        return FutureHandle(self._d2h.submit(finish))

    # ---- H2D ---------------------------------------------------------------------------
    def load(self, host_ids, device_ids) -> JaxLoadHandle | CompletedHandle:
        d, h = self.validate(device_ids, host_ids)
        if not d.size:
            return CompletedHandle(self.geom.num_layers)
        nb = self.copier.bucket_for(h.size)
        padded = np.zeros(nb, np.int32)
        padded[:h.size] = h  # padding reads host page 0; the scatter skips those positions
        per_layer: list[list[jax.Array]] = [[] for _ in range(self.geom.num_layers)]
        for c in self.geom.components:
            layers = self.device_pool.layers(c)  # checked once (StaleDevicePoolError); updated in place below
            dev_buf = self._stage_h2d(c, padded)
            for layer in range(self.geom.num_layers):
                new = self.copier.scatter(layers[layer], d, dev_buf, layer, self.order)
                self.device_pool.set_layer(c, layer, new)
                per_layer[layer].append(layers[layer])  # the installed (committed) array
        return JaxLoadHandle(per_layer)

    def _stage_h2d(self, component: str, padded_ids: np.ndarray) -> jax.Array:
        """Host pages -> contiguous staging buffer -> device transfer buffer (async)."""
        if self._ring is None:
            staging = self.host_pool.read_pages(component, padded_ids).view(self.device_pool.dtype)
            sharding = self.copier.buffer_sharding() or self.device_pool.sharding
            if self.multiprocess:  # every process contributes its own heads
                shape = list(staging.shape)
                shape[_HEAD_AXIS] = self.device_pool.geom.heads
                return jax.make_array_from_process_local_data(sharding, staging, tuple(shape))
            return jax.device_put(staging, sharding)
        shape = self.host_pool.component_view(component).shape
        shape = (shape[0], padded_ids.size) + shape[2:] if self.order == "lnp" else (padded_ids.size,) + shape[1:]
        view, owner = buf = self._ring.acquire(shape, self.device_pool.dtype)
        self.host_pool.read_pages(component, padded_ids, out=view.view(self.geom.container_dtype))
        dev_buf = jax.device_put(owner, self.device_pool.sharding)
        self._ring.release(buf, dev_buf)
        return dev_buf

    def close(self) -> None:
        self._d2h.shutdown()
