"""Host memory for the JAX backend: pinned where the platform has it, numpy otherwise.

``host_buffer`` allocates a JAX array in a host memory kind (``pinned_host``) and returns a
*writable numpy view* of its bytes. The JAX array is only the allocation vehicle: it is
never handed to XLA again, so writing through the view cannot race with a computation. The
view keeps the JAX array alive. ``StagingRing`` hands out such buffers for H2D loads and
only reuses one after the device copy that read it has finished.

Threading: allocation and the ring belong to the owner thread.
"""

from __future__ import annotations

import logging
from collections import deque

import jax
import numpy as np

from ...host_layout import HostLayout
from ...host_pool import HostKVPool
from ...kv_geometry import KVGeometry
from .host_stream import PinnedHostArena, numpy_view

log = logging.getLogger(__name__)


def host_memory_kind(device: jax.Device | None = None) -> str | None:
    """The best host memory kind a device can address: 'pinned_host', 'unpinned_host' or None.

    'unpinned_host' is never chosen on TPU: it corrupts bf16 there (seen by sglang-jax, the JAX port without L3).
    """
    device = device or jax.local_devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 - very old runtimes have no memories API
        return None
    if "pinned_host" in kinds:
        return "pinned_host"
    if "unpinned_host" in kinds and device.platform != "tpu":
        return "unpinned_host"
    return None


def host_buffer(
    shape: tuple[int, ...], dtype, device: jax.Device | None = None, memory_kind: str = "pinned_host"
) -> tuple[np.ndarray, jax.Array]:
    """(writable numpy view, owning JAX array) of a zeroed buffer in ``memory_kind``.

    The buffer is made by an eager ``device_put`` of numpy zeros, not as the output of a
    ``jit``: since jax 0.12 a jit output in host memory carries the memory space in its layout
    (``S(5)``), and the CPU client refuses to ``device_put`` such an array to the device
    ("Unsupported layout used for PjRt CPU buffers"); an eager transfer's buffer has the plain
    layout on every version. The transfer copies: the buffer never aliases the numpy zeros."""
    device = device or jax.local_devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
    dtype = np.dtype(dtype)
    owner = jax.device_put(np.zeros(shape, dtype), sharding)
    owner.block_until_ready()
    return numpy_view(owner.unsafe_buffer_pointer(), owner.nbytes, dtype, shape, owner), owner


def staging_works(device: jax.Device, memory_kind: str = "pinned_host") -> str:
    """'' if a ``host_buffer`` written through its view reaches ``device`` by ``device_put`` with
    those bytes and without aliasing them (so a ring may rewrite it once the copy is done), else
    what went wrong. Costs one small allocation and copy; run once per engine."""
    try:
        view, owner = host_buffer((2, 64), np.float32, device, memory_kind)
        pattern = np.arange(view.size, dtype=np.float32).reshape(view.shape) + 1
        view[...] = pattern
        moved = jax.device_put(owner, jax.sharding.SingleDeviceSharding(device))
        moved.block_until_ready()
        got = np.array(moved, copy=True)  # a copy: the check below compares against these bytes
        if not np.array_equal(got, pattern):
            return "a staging buffer's bytes did not reach the device"
        view[...] = 0
        if not np.array_equal(np.asarray(moved), got):
            return "the device copy of a staging buffer aliases it (a rewrite of the buffer changed it)"
    except Exception as e:  # noqa: BLE001 - a runtime that cannot place or move pinned buffers
        return f"{type(e).__name__}: {e}"
    return ""


def pinned_host_pool(
    geom: KVGeometry, num_pages: int, layout: HostLayout | str = HostLayout.PAGE_FIRST, device: jax.Device | None = None
) -> HostKVPool:
    """A HostKVPool whose array lives in pinned host memory (plain numpy if there is none).

    The memory is a ``PinnedHostArena`` (``pool.buffer_owner``): a ``pinned_host`` jax.Array
    the ``JaxTransferEngine`` streams pages in and out of inside XLA executables, so no host
    thread copies KV bytes; the pool's numpy ``array`` is a view of the same bytes."""
    device = device or jax.local_devices()[0]
    if host_memory_kind(device) != "pinned_host":
        return HostKVPool(geom, num_pages, layout)
    try:
        arena = PinnedHostArena(geom, layout, num_pages, device)
    except Exception as e:  # noqa: BLE001 - runtimes that list pinned_host but cannot place arrays there
        # e.g. jax 0.9's CPU backend: "No registered implementation for ... annotate_device_placement"
        log.warning(
            "pinned host memory is listed but unusable here (%s: %s); the host pool is plain numpy", type(e).__name__, e
        )
        return HostKVPool(geom, num_pages, layout)
    return HostKVPool(geom, num_pages, layout, buffer=arena.view, buffer_owner=arena)


class StagingRing:
    """Reusable pinned staging buffers for H2D, keyed by shape and dtype.

    ``acquire`` returns a (view, owner) pair that no in-flight copy still reads; ``release``
    records the device array a copy produced from it, which must be ready before reuse.
    """

    def __init__(self, device: jax.Device, memory_kind: str, per_shape: int = 2) -> None:
        self.device, self.memory_kind, self.per_shape = device, memory_kind, per_shape
        self._free: dict[tuple, deque] = {}
        self._busy: dict[tuple, deque] = {}

    def acquire(self, shape: tuple[int, ...], dtype) -> tuple[np.ndarray, jax.Array]:
        key = (tuple(shape), np.dtype(dtype).str)
        free, busy = self._free.setdefault(key, deque()), self._busy.setdefault(key, deque())
        if free:
            return free.popleft()
        if len(busy) >= self.per_shape:  # all in use: wait for the oldest copy to finish
            buf, consumer = busy.popleft()
            consumer.block_until_ready()
            return buf
        return host_buffer(shape, dtype, self.device, self.memory_kind)

    def release(self, buf: tuple[np.ndarray, jax.Array], consumer: jax.Array) -> None:
        key = (buf[0].shape, buf[0].dtype.str)
        busy = self._busy[key]
        busy.append((buf, consumer))
        while busy and busy[0][1].is_ready():  # recycle finished ones eagerly
            self._free[key].append(busy.popleft()[0])
