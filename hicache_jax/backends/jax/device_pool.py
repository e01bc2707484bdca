"""Device (L1) KV pool as JAX arrays: per component and layer one array ``(P, page, H, D)``.

One array per layer (not one stacked array) so that a layer-by-layer H2D load lets the
forward pass consume layer 0 while later layers still load: each layer's array depends
only on its own scatter.

Sharding: with a ``mesh`` the MHA pools are sharded over ``kv_axis`` on the KV-head axis
(``PartitionSpec(None, None, kv_axis, None)``). A pool is *replicated* (every device holds every
head: ``PartitionSpec()``) when it is an MLA latent pool (one head), or, with
``replicate_fewer_heads``, when it has fewer KV heads than the mesh axis has devices (a draft
model's KV next to a target with more heads). ``replicated`` says which; the L3 tier writes a
replicated pool from rank 0 only, under rank-independent keys.
The mesh may span several processes (``jax.distributed``): every process then holds only its
own heads of every page (``local_geom``: the geometry of that share, which is what its host
pool holds), and every computation on the pool runs on all processes in the same order.

Donation contract: a step that updates a layer (the model writing new KV, or a load)
consumes the old array and must store the returned one. Two helpers do that for the caller:

* ``apply(step, *args)``: calls ``step(buffers, *args) -> (result, new_buffers)`` (a jitted
  model step that donates ``buffers`` and writes KV wherever it likes) and installs every
  returned layer array before it returns ``result``;
* ``write_pages(page_ids, kv)``: writes whole pages of KV (device arrays ``(L, n, page, H,
  D)`` per component) with one jitted, donating scatter, and installs the result.

``set_layer`` remains for callers that manage donation themselves. A layer array that was
donated and never replaced is caught where it would be used (``layers``, hence every backup
and load, ``apply``, ``write_pages``, ``check``): ``StaleDevicePoolError`` names the layer and
the fix, instead of JAX's "Array has been deleted" from deep inside a later transfer.

Threading: only the owner thread touches ``buffers`` (the thread that runs the model steps
and calls the cache).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ...allocator import PageAllocator, check_page_ids
from ...kv_geometry import KVGeometry


class StaleDevicePoolError(RuntimeError):
    """A pool layer array was donated to a step and the step's output was never installed."""


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _scatter_pages(layers: list[jax.Array], ids: jax.Array, values: jax.Array) -> list[jax.Array]:
    # values: (L, n, page, H, D). Padded ids point past the pool: mode="drop" skips them.
    return [a.at[ids].set(values[l].astype(a.dtype), mode="drop") for l, a in enumerate(layers)]


_SCATTER = jax.jit(_scatter_pages, donate_argnums=(0,))


class JaxDevicePool:
    """The device tier (L1): per KV component (``k``/``v``, or MLA's latent) and layer one JAX
    array of shape ``(num_pages, page_size, heads, head_dim)``, and the ``allocator`` of its
    page ids (shared by the scheduler and the cache: ``HiRadixCache(config, engine,
    pool.allocator)``).

    ``geom``: the KV geometry (``KVGeometry.mha`` / ``.mla``). ``mesh`` + ``kv_axis``: shard
    every array over that mesh axis by KV head (MLA pools are replicated, and so are pools with
    fewer KV heads than the axis has devices when ``replicate_fewer_heads``; otherwise the heads
    must split evenly); ``device``: the one device otherwise (the first by default). The arrays
    start zeroed.

    Your model reads and writes ``buffers[component][layer]`` (``layers(component)``) by page
    id. A jitted step that donates them must have its outputs installed: run it as
    ``apply(step, *args)`` (``step(buffers, *args) -> (result, new_buffers)``), or install one
    with ``set_layer``; write whole pages with ``write_pages``. A donated array never replaced
    raises ``StaleDevicePoolError`` naming the fix at its next use (``check()`` tests it).
    ``read_pages_host`` / ``write_pages_host`` move pages to / from numpy (tests, debugging).

    Ownership and threads: the pool's arrays belong to the thread that runs the model steps
    (the cache's owner thread too); the ``JaxTransferEngine`` built on it replaces arrays it
    donates to its copies on that thread. Not thread-safe.
    """

    def __init__(
        self,
        geom: KVGeometry,
        num_pages: int,
        mesh: Mesh | None = None,
        kv_axis: str = "tp",
        device: jax.Device | None = None,
        replicate_fewer_heads: bool = False,
    ) -> None:
        if not isinstance(geom, KVGeometry):
            raise TypeError(f"geom: expected KVGeometry, got {type(geom).__name__}")
        self.geom = geom
        self.allocator = PageAllocator(num_pages, name="device")
        self.num_pages = self.allocator.num_pages
        self.mesh = mesh
        self.kv_axis = kv_axis if mesh is not None else None
        if not isinstance(replicate_fewer_heads, bool):
            raise TypeError(f"replicate_fewer_heads: expected a bool, got {type(replicate_fewer_heads).__name__}")
        # Every device holds every head: MLA's one latent head, or (opted in) fewer heads than devices.
        self.replicated = geom.kind != "mha"
        if mesh is not None:
            if kv_axis not in mesh.axis_names:
                raise ValueError(f"kv_axis: {kv_axis!r} is not an axis of the mesh {mesh.axis_names}")
            tp = mesh.shape[kv_axis]
            if geom.kind == "mha" and replicate_fewer_heads and geom.num_kv_heads < tp:
                self.replicated = True
            elif geom.kind == "mha" and geom.num_kv_heads % tp:
                fewer = (
                    " (replicate_fewer_heads=True replicates a pool with fewer heads than devices)"
                    if geom.num_kv_heads < tp
                    else ""
                )
                raise ValueError(
                    f"mesh: {geom.num_kv_heads} KV heads do not split over {tp} devices on {kv_axis!r}{fewer}"
                )
            spec = PartitionSpec() if self.replicated else PartitionSpec(None, None, kv_axis, None)
            self.sharding = NamedSharding(mesh, spec)
        else:
            self.sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
        self.dtype = jnp.dtype(geom.numpy_dtype())
        shape = (self.num_pages,) + geom.page_shape
        zeros = jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=self.sharding)
        self.buffers: dict[str, list[jax.Array]] = {
            c: [zeros() for _ in range(geom.num_layers)] for c in geom.components
        }

    @property
    def multiprocess(self) -> bool:
        """Whether the pool spans devices of other processes (a mesh over ``jax.distributed``)."""
        return not self.sharding.is_fully_addressable

    @property
    def local_geom(self) -> KVGeometry:
        """The geometry of this process's share of every page: all of it in one process (or
        for a ``replicated`` pool); its KV heads when the mesh spans processes."""
        if not self.multiprocess or self.replicated:
            return self.geom
        shape = (self.num_pages,) + self.geom.page_shape
        spans = sorted(
            {
                (sl[2].start or 0, self.geom.num_kv_heads if sl[2].stop is None else sl[2].stop)
                for sl in self.sharding.addressable_devices_indices_map(shape).values()
            }
        )
        if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
            raise ValueError(f"mesh: this process's KV heads {spans} are not one contiguous range")
        return replace(self.geom, num_kv_heads=spans[-1][1] - spans[0][0])

    @property
    def local_device(self) -> jax.Device:
        """One device of this process that holds the pool."""
        return next(d for d in self.sharding.device_set if d.process_index == jax.process_index())

    @property
    def copier_sharding(self) -> tuple[Mesh | None, str | None]:
        """(mesh, kv_axis) to give a PageCopier: kv_axis None means ``replicated`` or no mesh."""
        if self.mesh is None:
            return None, None
        return self.mesh, (None if self.replicated else self.kv_axis)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layers in self.buffers.values() for a in layers)

    def layers(self, component: str) -> list[jax.Array]:
        """The component's layer arrays (checked: none of them donated and left stale)."""
        try:
            layers = self.buffers[component]
        except KeyError:
            raise ValueError(f"component: expected one of {self.geom.components}, got {component!r}") from None
        for layer, a in enumerate(layers):
            if a.is_deleted():
                raise self._stale(component, layer)
        return layers

    @staticmethod
    def _stale(component: str, layer: int) -> StaleDevicePoolError:
        return StaleDevicePoolError(
            f"device pool: layer {layer} of component {component!r} was donated to a jitted step and the "
            f"step's output was never installed, so the pool holds a deleted array. Run KV-writing steps "
            f"through JaxDevicePool.apply(step, ...) (or write_pages), which install the outputs, or call "
            f"set_layer(component, layer, new_array) for every layer the step returned"
        )

    def check(self) -> None:
        """Raise ``StaleDevicePoolError`` if any layer array was donated and not replaced."""
        for c in self.buffers:
            self.layers(c)

    def set_layer(self, component: str, layer: int, array: jax.Array) -> None:
        """Install the array that replaced a donated layer."""
        try:
            old = self.buffers[component][layer]
        except KeyError:
            raise ValueError(f"component: expected one of {self.geom.components}, got {component!r}") from None
        except (IndexError, TypeError):
            raise ValueError(f"layer: expected an int in [0, {self.geom.num_layers}), got {layer!r}") from None
        if not isinstance(array, jax.Array):
            raise TypeError(f"array: expected a jax.Array, got {type(array).__name__}")
        if array.shape != old.shape or array.dtype != old.dtype:
            raise ValueError(f"array: expected {old.shape} {old.dtype}, got {array.shape} {array.dtype}")
        if array.is_deleted():
            raise ValueError(
                f"array: already deleted (donated to another step); install the output of the "
                f"step that consumed layer {layer} of {component!r} instead"
            )
        self.buffers[component][layer] = self._committed(array)

    def _committed(self, array: jax.Array) -> jax.Array:
        # jit keys its cache on committedness: an uncommitted layer (a page-copy scatter can
        # return one) would make the next model step compile again for that mix of inputs.
        return array if array.committed else jax.device_put(array, self.sharding)

    def apply(self, step: Callable[..., tuple[Any, Mapping[str, list[jax.Array]]]], *args: Any, **kwargs: Any) -> Any:
        """Run ``step(buffers, *args, **kwargs) -> (result, new_buffers)`` and install ``new_buffers``.

        ``step`` is typically a ``jax.jit`` with ``donate_argnums`` on ``buffers`` (a dict
        component -> list of layer arrays, as ``buffers``); it must return, for every
        component and layer, the array that replaces the one it was given. Returns ``result``.
        The new arrays are checked (same components, layer count, shape and dtype) before
        any is installed; if ``step`` raises, or returns something else after it consumed
        the pool, the pool is left stale and every later use raises ``StaleDevicePoolError``.
        """
        self.check()
        out = step(self.buffers, *args, **kwargs)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"step: expected it to return (result, new_buffers), got {type(out).__name__}")
        result, new = out
        self._install(new, "step")
        return result

    def _install(self, new: object, what: str) -> None:
        if not isinstance(new, Mapping) or set(new) != set(self.buffers):
            got = sorted(new) if isinstance(new, Mapping) else type(new).__name__
            raise ValueError(f"{what}: expected new buffers for components {sorted(self.buffers)}, got {got}")
        for c, layers in new.items():
            if len(layers) != self.geom.num_layers:
                raise ValueError(f"{what}: expected {self.geom.num_layers} layers for {c!r}, got {len(layers)}")
            for l, a in enumerate(layers):
                old = self.buffers[c][l]
                if not isinstance(a, jax.Array) or a.shape != old.shape or a.dtype != old.dtype:
                    raise ValueError(
                        f"{what}: layer {l} of {c!r}: expected {old.shape} {old.dtype}, got "
                        f"{getattr(a, 'shape', type(a).__name__)} {getattr(a, 'dtype', '')}"
                    )
        for c, layers in new.items():
            self.buffers[c] = [self._committed(a) for a in layers]

    def write_pages(self, page_ids: object, kv: Mapping[str, Any]) -> None:
        """Write whole pages: ``kv[component]`` is ``(L, n, page, H, D)`` (a device or host array
        of any float dtype; cast to the pool's) for the ``n`` pages ``page_ids``.

        One jitted scatter over every layer of a component, donating the old arrays and
        installing the new ones. The page count is padded to a power of two (the padding is
        dropped), so a few compiled shapes serve every call.
        """
        ids = check_page_ids(page_ids, self.num_pages, "page_ids")
        if not isinstance(kv, Mapping) or set(kv) != set(self.geom.components):
            got = sorted(kv) if isinstance(kv, Mapping) else type(kv).__name__
            raise ValueError(f"kv: expected arrays for components {list(self.geom.components)}, got {got}")
        want = (self.geom.num_layers, ids.size) + self.geom.page_shape
        for c, v in kv.items():
            if tuple(getattr(v, "shape", ())) != want:
                raise ValueError(
                    f"kv[{c!r}]: expected shape {want} (layers, pages, page, heads, dim), "
                    f"got {getattr(v, 'shape', type(v).__name__)}"
                )
        self.check()
        if not ids.size:
            return
        nb = _bucket(ids.size)
        padded = np.full(nb, self.num_pages, np.int32)  # out of range: dropped
        padded[: ids.size] = ids
        for c, v in kv.items():
            v = jnp.asarray(v)
            if nb != ids.size:
                v = jnp.pad(v, [(0, 0), (0, nb - ids.size)] + [(0, 0)] * (v.ndim - 2))
            self.buffers[c] = list(_SCATTER(self.buffers[c], padded, v))

    # ---- host-side helpers (tests, debugging, the reference engine) -----------------------
    def write_pages_host(self, component: str, device_ids: object, pages: np.ndarray) -> None:
        """Write raw bits ``pages`` ``(L, n, page, H, D)`` (any dtype of the KV's width, viewed
        as the pool's) into pages ``device_ids``."""
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
