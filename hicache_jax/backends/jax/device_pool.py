"""Device (L1) KV pool as JAX arrays: per component and layer one array ``(P, page, H, D)``.

One array per layer (not one stacked array) so that a layer-by-layer H2D load lets the
forward pass consume layer 0 while later layers still load: each layer's array depends
only on its own scatter.

Sharding: with a ``mesh`` the MHA pools are sharded over ``kv_axis`` on the KV-head axis
(``PartitionSpec(None, None, kv_axis, None)``); MLA latent pools (one head) are replicated.
The mesh may span several processes (``jax.distributed``): every process then holds only its
own heads of every page (``local_geom``: the geometry of that share, which is what its host
pool holds), and every computation on the pool runs on all processes in the same order.

Donation contract: a step that updates a layer (the model writing new KV, or a load)
consumes the old array and must store the returned one with ``set_layer``. Only the owner
thread touches ``buffers``.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ...allocator import PageAllocator, check_page_ids
from ...kv_geometry import KVGeometry


class JaxDevicePool:
    def __init__(self, geom: KVGeometry, num_pages: int, mesh: Mesh | None = None, kv_axis: str = "tp",
                 device: jax.Device | None = None) -> None:
        if not isinstance(geom, KVGeometry):
            raise TypeError(f"geom: expected KVGeometry, got {type(geom).__name__}")
        self.geom = geom
        self.allocator = PageAllocator(num_pages, name="device")
        self.num_pages = self.allocator.num_pages
        self.mesh = mesh
        self.kv_axis = kv_axis if mesh is not None else None
        if mesh is not None:
            if kv_axis not in mesh.axis_names:
                raise ValueError(f"kv_axis: {kv_axis!r} is not an axis of the mesh {mesh.axis_names}")
            tp = mesh.shape[kv_axis]
            if geom.kind == "mha" and geom.num_kv_heads % tp:
                raise ValueError(f"mesh: {geom.num_kv_heads} KV heads do not split over {tp} devices on {kv_axis!r}")
            spec = PartitionSpec(None, None, kv_axis, None) if geom.kind == "mha" else PartitionSpec()
            self.sharding = NamedSharding(mesh, spec)
        else:
            self.sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
        self.dtype = jnp.dtype(geom.numpy_dtype())
        shape = (self.num_pages,) + geom.page_shape
        zeros = jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=self.sharding)
        self.buffers: dict[str, list[jax.Array]] = {
            c: [zeros() for _ in range(geom.num_layers)] for c in geom.components}

    @property
    def multiprocess(self) -> bool:
        """Whether the pool spans devices of other processes (a mesh over ``jax.distributed``)."""
        return not self.sharding.is_fully_addressable

    @property
    def local_geom(self) -> KVGeometry:
        """The geometry of this process's share of every page: all of it in one process (or
        for a replicated MLA pool); its KV heads when the mesh spans processes."""
        if not self.multiprocess or self.geom.kind != "mha":
            return self.geom
        shape = (self.num_pages,) + self.geom.page_shape
        spans = sorted({(sl[2].start or 0, self.geom.num_kv_heads if sl[2].stop is None else sl[2].stop)
                        for sl in self.sharding.addressable_devices_indices_map(shape).values()})
        if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
            raise ValueError(f"mesh: this process's KV heads {spans} are not one contiguous range")
        return replace(self.geom, num_kv_heads=spans[-1][1] - spans[0][0])

    @property
    def local_device(self) -> jax.Device:
        """One device of this process that holds the pool."""
        return next(d for d in self.sharding.device_set if d.process_index == jax.process_index())

    @property
    def copier_sharding(self) -> tuple[Mesh | None, str | None]:
        """(mesh, kv_axis) to give a PageCopier: kv_axis None means replicated (MLA) or no mesh."""
        if self.mesh is None:
            return None, None
        return self.mesh, (self.kv_axis if self.geom.kind == "mha" else None)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layers in self.buffers.values() for a in layers)

    def layers(self, component: str) -> list[jax.Array]:
        try:
            return self.buffers[component]
        except KeyError:
            raise ValueError(f"component: expected one of {self.geom.components}, got {component!r}") from None

    def set_layer(self, component: str, layer: int, array: jax.Array) -> None:
        """Install the array that replaced a donated layer."""
        old = self.layers(component)[layer]
        if array.shape != old.shape or array.dtype != old.dtype:
            raise ValueError(f"array: expected {old.shape} {old.dtype}, got {array.shape} {array.dtype}")
        self.buffers[component][layer] = array

    # ---- host-side helpers (tests, debugging, the reference engine) -----------------------
    def write_pages_host(self, component: str, device_ids: object, pages: np.ndarray) -> None:
        """Write ``pages`` ``(L, n, page, H, D)`` (any dtype of the KV's width) into pages ``device_ids``."""
        ids = check_page_ids(device_ids, self.num_pages, "device_ids")
        pages = np.asarray(pages).view(self.dtype)
        for l, arr in enumerate(self.layers(component)):
            new = arr.at[ids].set(jax.device_put(pages[l], self.sharding))
            self.buffers[component][l] = new

    def read_pages_host(self, component: str, device_ids: object) -> np.ndarray:
        """Pages ``(L, n, page, H, D)`` as raw bits (the geometry's container dtype)."""
        ids = check_page_ids(device_ids, self.num_pages, "device_ids", unique=False)
        out = np.stack([np.asarray(arr[ids]) for arr in self.layers(component)])
        return out.view(self.geom.container_dtype)
