"""Host pages <-> device without a CPU pass: XLA streams pinned-host pages inside one executable.

The host pool's memory is a ``PinnedHostArena``: one ``pinned_host`` ``jax.Array`` that XLA can
address, holding every component's pages in page-major order, plus a numpy view of the very
same bytes (what the cache, the L3 store and the numpy paths read and write). The two copy
executables built here take that array as a parameter, so the bytes move as host<->device
copies that XLA issues itself (on a GPU: copy-engine DMA from pinned memory, made asynchronous
by XLA's host-offloading passes), and no host thread touches a KV byte:

* ``H2D`` (load): for each page ``i < n``: a ``dynamic_slice`` of host page ``ids[i]`` (one
  layer group of it), ``device_put`` to device memory, written at position ``i`` of a device
  staging buffer in the transfer order the page-copy scatter reads. One executable per layer
  group, so group g is loaded (and its layers scattered into the pool) before group g+1.
* ``D2H`` (backup): the pool's all-layer gather leaves a device transfer buffer; for each page
  ``i < n`` its slice is ``device_put`` to host memory and written into host page ``ids[i]``
  with a ``dynamic_update_slice`` of the *donated* arena array. XLA aliases the donated
  parameter to its output, so the arena keeps its address and the numpy view stays valid:
  ``PinnedHostArena.install`` checks the address of every new array (``HostArenaMovedError``),
  and ``verify_in_place`` probes it once at start-up (callers then fall back to numpy copies).

Page loops (``StreamPlan.loop``): ``dynamic`` runs a ``fori_loop`` over the live count (data,
not a compile-time constant); ``static`` runs all ``nb`` positions of the bucket (a known trip
count, optionally unrolled: on a GPU a while loop with a data-dependent bound reads its
predicate back every iteration). Static padding is harmless by construction: an H2D padding
position reads host page ``ids[0]`` into a staging slot the scatter drops; a D2H padding
position repeats the last live page (the caller pads both id lists with their last id), so it
rewrites that host page with the same bytes. One executable per page-count bucket either way,
compiled in well under a second. ``default_stream_loop`` picks per platform: on one H200
(jax 0.11.2, 1024 pages of 16 tokens, 256 MiB per component) the static loop unrolled 8 times
moved D2H at 39.9 GB/s and H2D at 25.8 GB/s where the dynamic loop moved 17.1 and 13.2 (pinned
``device_put`` of the same bytes: ~52 GB/s), so GPUs get ``static`` x8; the CPU keeps
``dynamic`` (its loop has no predicate read-back, and padding would copy pages for nothing).

Ownership and threading: the arena array is owned by the transfer engine's owner thread, the
only one that dispatches these executables; every D2H donates the arena and installs the array
it returns (same address). Other threads (L3 I/O) may read and write *other* pages through the
numpy view while an executable runs: the executables touch only the pages they are given, and
no executable ever copies the arena as a whole (tests check the compiled HLO).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...host_layout import HostLayout, host_array_shape, page_major_shape
from ...kv_geometry import KVGeometry


STREAM_LOOPS = ("dynamic", "static")
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def default_stream_loop(platform: str) -> tuple[str, int]:
    """``(stream_loop, stream_unroll)`` measured best on ``platform`` (module docstring)."""
    return ("static", 8) if platform in _GPU_PLATFORMS else ("dynamic", 1)


class HostArenaMovedError(RuntimeError):
    """XLA returned the donated host arena at another address: the numpy view is no longer the pool."""


def numpy_view(address: int, nbytes: int, dtype, shape: tuple[int, ...], keep_alive: object) -> np.ndarray:
    """A writable numpy array over ``nbytes`` at ``address`` (a JAX buffer's), keeping
    ``keep_alive`` (what owns the buffer) referenced for as long as the view lives."""
    raw = (ctypes.c_char * max(nbytes, 1)).from_address(address)
    raw.owner = keep_alive  # the view's base is `raw`
    return np.frombuffer(raw, dtype=dtype, count=int(np.prod(shape))).reshape(shape)


def _space(kind: str):
    """The memory space a ``device_put`` inside ``jit`` moves to (jax >= 0.7: ``jax.memory.Space``)."""
    space = getattr(getattr(jax, "memory", None), "Space", None)
    if space is not None:
        return space.Device if kind == "device" else space.Host
    from jax._src.sharding_impls import TransferToMemoryKind  # older jax

    return TransferToMemoryKind(kind)


class PinnedHostArena:
    """A host pool's bytes as one ``pinned_host`` jax.Array plus a writable numpy view of them.

    ``array`` has shape ``(C,) + page_major_shape`` (C = number of KV components) in the KV
    dtype; ``view`` has the upstream host-pool shape (``host_array_shape``) in the geometry's
    container dtype, over the same address. The view keeps the arena alive.
    """

    def __init__(self, geom: KVGeometry, layout: HostLayout | str, num_pages: int, device: jax.Device) -> None:
        self.geom = geom
        self.layout = HostLayout.parse(layout)
        self.num_pages = num_pages
        self.device = device
        self.sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        self.shape = (len(geom.components),) + page_major_shape(geom, self.layout, num_pages)
        self.dtype = jnp.dtype(geom.numpy_dtype())
        shape, dtype = self.shape, self.dtype
        # Zeros moved to the host space inside jit: the array's type then carries the host
        # memory space, which executables taking it as a parameter need, and XLA owns the buffer
        # (a device_put from numpy sometimes came back as a buffer XLA would not donate in place,
        # seen on the CPU). XLA's host offloader is expected to create a zero broadcast moved to
        # the host directly in host memory; whether a GPU build stages it in device memory first
        # (a problem for pools larger than the device) is to check on a GPU (scripts/gpu_check.sh).
        to_host = _space("host")
        self._array = jax.jit(lambda: jax.device_put(jnp.zeros(shape, dtype), to_host), out_shardings=self.sharding)()
        self._array.block_until_ready()
        self.address = self._array.unsafe_buffer_pointer()
        # keeps the arena (hence whichever array currently holds the address) alive
        self.view = numpy_view(
            self.address, self._array.nbytes, geom.container_dtype, host_array_shape(geom, self.layout, num_pages), self
        )
        self.memory_kind = "pinned_host"

    @property
    def array(self) -> jax.Array:
        """The current array (replaced, at the same address, by every D2H executable)."""
        return self._array

    def install(self, new: jax.Array, check_address: bool = True) -> None:
        """Take the array a D2H executable returned for the donated arena.

        ``check_address`` reads the new buffer's address, which waits for the executable on
        some runtimes: the engine passes False on the dispatch path and checks at completion
        (``check``)."""
        if new.shape != self.shape or new.dtype != self.dtype:
            raise ValueError(f"new: expected {self.shape} {self.dtype}, got {new.shape} {new.dtype}")
        self._array = new
        if check_address:
            self.check(new)

    def check(self, arr: jax.Array | None = None) -> None:
        """Raise ``HostArenaMovedError`` unless ``arr`` (default: the current array) is at the arena's address."""
        arr = self._array if arr is None else arr
        if arr.is_deleted():  # a later D2H donated it: that one is checked on its own
            return
        addr = arr.unsafe_buffer_pointer()
        if addr != self.address:
            raise HostArenaMovedError(
                f"host arena: XLA returned the donated pinned-host pool at {addr:#x}, not at {self.address:#x}; "
                f"the numpy view no longer aliases it (something holds an external reference to the arena "
                f"array, e.g. np.asarray(arena.array); read host pages through the host pool instead)"
            )


@dataclass(frozen=True)
class StreamPlan:
    """Shapes of one host pool's stream executables."""

    order: str  # the host layout's transfer order
    num_layers: int
    page_shape: tuple[int, ...]  # (page, heads, width)
    dtype: jnp.dtype
    loop: str = "dynamic"  # "dynamic": n iterations; "static": nb (see the module docstring)
    unroll: int = 1  # static loops only

    def __post_init__(self) -> None:
        if self.loop not in STREAM_LOOPS:
            raise ValueError(f"stream_loop: expected one of {STREAM_LOOPS}, got {self.loop!r}")
        if not isinstance(self.unroll, int) or isinstance(self.unroll, bool) or self.unroll < 1:
            raise ValueError(f"stream_unroll: expected an int >= 1, got {self.unroll!r}")
        if self.unroll > 1 and self.loop != "static":
            raise ValueError("stream_unroll: > 1 needs stream_loop='static' (a dynamic bound cannot be unrolled)")

    def _loop(self, nb: int, n: jax.Array, body, init):
        if self.loop == "static":
            return lax.fori_loop(0, nb, body, init, unroll=self.unroll)
        return lax.fori_loop(0, n[0], body, init)

    def staging_shape(self, nb: int, layers: int) -> tuple[int, ...]:
        p = self.page_shape
        return {"nlp": (nb, layers) + p, "npl": (nb, p[0], layers) + p[1:], "lnp": (layers, nb) + p}[self.order]

    def _host_slice(self, arena: jax.Array, c: int, page: jax.Array, l0: int, layers: int) -> jax.Array:
        """Host page ``page`` of component c, layers [l0, l0+layers), shaped like one staging page (host)."""
        z = jnp.int32(0)
        page_, heads, width = self.page_shape
        if self.order == "nlp":  # arena (C, N, L, page, H, D)
            start, size = (c, page, l0, z, z, z), (1, 1, layers, page_, heads, width)
        elif self.order == "npl":  # arena (C, N, page, L, H, D)
            start, size = (c, page, z, l0, z, z), (1, 1, page_, layers, heads, width)
        else:  # lnp: arena (C, L, N, page, H, D)
            start, size = (c, l0, page, z, z, z), (1, layers, 1, page_, heads, width)
        return lax.dynamic_slice(arena, [jnp.int32(s) for s in start], size)

    def _staging_index(self, i: jax.Array) -> tuple:
        z = jnp.int32(0)
        return (i, z, z, z, z) if self.order in ("nlp", "npl") else (z, i, z, z, z)

    def h2d(self, nb: int, l0: int, layers: int):
        """``f(arena, ids, n, staging) -> staging``: host pages ``ids[:n]`` (layers [l0, l0+layers))
        into positions [0, n) of the donated device staging buffers (one per component)."""
        to_device = _space("device")

        def f(arena, ids, n, staging):
            def body(i, bufs):
                out = []
                for c, buf in enumerate(bufs):
                    page = jax.device_put(self._host_slice(arena, c, ids[i], l0, layers), to_device)
                    page = page.reshape(self.staging_shape(1, layers))
                    out.append(lax.dynamic_update_slice(buf, page, self._staging_index(i)))
                return tuple(out)

            return self._loop(nb, n, body, tuple(staging))

        return f

    def d2h(self):
        """``f(arena, bufs, ids, n) -> (arena, token)``: device transfer-buffer positions [0, n) (all
        layers) into host pages ``ids[:n]`` of the donated arena. ``token`` (the loop's count, a
        device scalar) is ready when the copies are: poll it, not the arena (a later backup may
        already have donated that)."""
        to_host = _space("host")
        L = self.num_layers

        def f(arena, bufs, ids, n):
            def body(i, carry):
                arena, count = carry
                for c, buf in enumerate(bufs):
                    page = lax.dynamic_slice(buf, self._staging_index(i), self.staging_shape(1, L))
                    z = jnp.int32(0)
                    if self.order == "lnp":
                        page = page.reshape((1, L, 1) + self.page_shape)
                        start = (jnp.int32(c), z, ids[i], z, z, z)
                    else:
                        page = page.reshape((1,) + page.shape)
                        start = (jnp.int32(c), ids[i], z, z, z, z)
                    arena = lax.dynamic_update_slice(arena, jax.device_put(page, to_host), start)
                return arena, count + 1

            return self._loop(ids.shape[0], n, body, (arena, jnp.int32(0)))

        return f


def layer_groups(num_layers: int, group_layers: int) -> list[tuple[int, int]]:
    """[(first layer, count), ...] covering ``num_layers`` in groups of ``group_layers``."""
    if not isinstance(group_layers, int) or isinstance(group_layers, bool) or group_layers < 1:
        raise ValueError(f"group_layers: expected an int >= 1, got {group_layers!r}")
    return [(l0, min(group_layers, num_layers - l0)) for l0 in range(0, num_layers, group_layers)]


def default_group_layers(geom: KVGeometry, min_bytes: int = 256 << 10) -> int:
    """Layers per H2D group so one page's run of a group is >= ``min_bytes`` (copy-engine
    efficiency: small DMAs waste the link) while earlier groups still land first."""
    per_layer = geom.page_size * geom.heads * geom.width * geom.itemsize
    return max(1, min(geom.num_layers, -(-min_bytes // per_layer)))
