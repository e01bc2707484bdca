"""A ``KVTransferEngine`` for engines that keep one fused K/V array per layer (EasyDeL's eSurge).

eSurge's device KV is, per layer, one array ``(num_pages, page_size, *rest)`` (v3 ragged
pages: ``rest = (kv_groups, packing, head_dim padded)``, K and V interleaved). hicache_jax moves
such pages as opaque raw bytes: ``fused_geometry`` describes one page of every layer as a
single-component geometry (``kind="mla"``, component ``"kv"``, width ``prod(rest)``), so the host
pool, the L3 keys (the width and layer count are folded into every key) and every L3 backend
handle it without knowing the layout.

The engine does not own the device arrays: ``get_arrays()`` returns the engine's current
per-layer arrays and ``set_arrays(list)`` installs new ones (eSurge replaces its arrays after
every step, so they are read at the moment of each copy, never kept). The cache's device page
ids are *slots*; ``map_slots(slots, page_ids)`` says which engine page each slot stands for at
the time of a backup (the adapter maps them just before ``HiRadixCache.insert``).

``backup`` dispatches the device gather at issue time (so the bytes are those of the page at
that moment, whatever the engine writes there later) and finishes the host copy on a worker
thread. ``load_pages`` scatters host pages straight into engine page ids (the adapter's
admission path) and returns once the new arrays are installed.

Threading: every method except the backup job runs on the owner thread (eSurge's scheduler
thread, under its lock); the backup job writes only its own host pages.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ...allocator import check_page_ids
from ...host_layout import HostLayout, page_major_shape
from ...host_pool import HostKVPool
from ...kv_geometry import KVGeometry, canonical_dtype
from ...transfer import CompletedHandle, FutureHandle, KVTransferEngine, LoadHandle, SerialWorker, TransferHandle

COMPONENT = "kv"  # the one component of a fused geometry


def fused_geometry(arrays: Sequence[jax.Array]) -> KVGeometry:
    """The opaque geometry of per-layer fused KV arrays ``(num_pages, page_size, *rest)``."""
    if not arrays:
        raise ValueError("arrays: expected one KV array per layer, got none")
    shape, dtype = tuple(arrays[0].shape), arrays[0].dtype
    if len(shape) < 3:
        raise ValueError(f"arrays: expected (num_pages, page_size, ...) per layer, got shape {shape}")
    for i, a in enumerate(arrays):
        if tuple(a.shape) != shape or a.dtype != dtype:
            raise ValueError(f"arrays[{i}]: expected {shape} {dtype} like layer 0, got {tuple(a.shape)} {a.dtype}")
    width = int(np.prod(shape[2:]))
    return KVGeometry.mla(
        num_layers=len(arrays), page_size=shape[1], kv_lora_rank=width, qk_rope_head_dim=0, dtype=canonical_dtype(dtype)
    )


def _bucket(n: int) -> int:
    """Copies are padded to a power of two pages: a few compiled shapes serve every count."""
    return 1 << max(0, n - 1).bit_length()


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter(arrays, ids, pages):
    # pages: (layers, n, page_size, *rest) in the arrays' dtype; the old arrays are donated.
    # Padding ids point past the last page and are dropped.
    return [a.at[ids].set(pages[i], mode="drop") for i, a in enumerate(arrays)]


@jax.jit
def _gather(arrays, ids):
    return jnp.stack([a[ids] for a in arrays], axis=0)  # (layers, n, page_size, *rest)


class FusedKVTransfer(KVTransferEngine):
    """Moves pages between per-layer fused device arrays (not owned) and a ``HostKVPool``."""

    def __init__(
        self, get_arrays: Callable[[], list], set_arrays: Callable[[list], None], host_pool: HostKVPool, num_slots: int
    ) -> None:
        if not callable(get_arrays) or not callable(set_arrays):
            raise TypeError("get_arrays, set_arrays: expected callables")
        if not isinstance(host_pool, HostKVPool):
            raise TypeError(f"host_pool: expected a HostKVPool, got {type(host_pool).__name__}")
        arrays = list(get_arrays())
        geom = fused_geometry(arrays)
        if host_pool.geom != geom:
            raise ValueError(f"host_pool: its geometry {host_pool.geom} does not match the arrays' {geom}")
        self._get, self._set = get_arrays, set_arrays
        self.geom = geom
        self.host_pool = host_pool
        self.engine_num_pages = int(arrays[0].shape[0])
        self._page_shape = tuple(arrays[0].shape[1:])
        self._dtype = arrays[0].dtype
        self.device_num_pages = int(num_slots)
        self._slots = np.full(self.device_num_pages, -1, np.int64)  # slot -> engine page id
        self._d2h = SerialWorker("hicache-fused-d2h")

    # ---- slots -------------------------------------------------------------------------
    def map_slots(self, slots: np.ndarray, page_ids: Sequence[int] | np.ndarray) -> None:
        """Let the cache's device ``slots`` stand for the engine's ``page_ids`` (same length)."""
        s = check_page_ids(slots, self.device_num_pages, "slots")
        # Several slots may stand for one page (the adapter maps slots it never copies to page 0).
        p = check_page_ids(page_ids, self.engine_num_pages, "page_ids", unique=False)
        if s.size != p.size:
            raise ValueError(f"slots and page_ids: expected equal lengths, got {s.size} and {p.size}")
        self._slots[s] = p

    def _engine_ids(self, slots: np.ndarray) -> np.ndarray:
        ids = self._slots[slots]
        if (ids < 0).any():
            raise ValueError(f"device_ids: slots {slots[ids < 0][:8].tolist()} are not mapped to engine pages")
        return ids

    # ---- raw page I/O (engine page ids) ------------------------------------------------
    def _gather_padded(self, page_ids: np.ndarray) -> tuple[jax.Array, int]:
        """Dispatch the gather of ``page_ids`` (padded with page 0); returns (array, n)."""
        n = int(page_ids.size)
        ids = np.zeros(_bucket(n), np.int32)
        ids[:n] = page_ids
        return _gather(list(self._get()), jnp.asarray(ids)), n

    def read_pages(self, page_ids: np.ndarray) -> np.ndarray:
        """The engine pages ``page_ids`` as host bytes in the pool's transfer order (a copy)."""
        p = check_page_ids(page_ids, self.engine_num_pages, "page_ids", unique=False)
        return self._to_host(*self._gather_padded(p))

    def _to_host(self, gathered: jax.Array, n: int) -> np.ndarray:
        g = self.geom
        host = np.asarray(gathered)[:, :n]  # (L, n, P, *rest)
        host = host.reshape(g.num_layers, n, g.page_size, 1, g.width)
        order = {
            HostLayout.PAGE_FIRST: (1, 2, 0, 3, 4),
            HostLayout.PAGE_FIRST_DIRECT: (1, 0, 2, 3, 4),
            HostLayout.LAYER_FIRST: (0, 1, 2, 3, 4),
        }[self.host_pool.layout]
        out = np.ascontiguousarray(host.transpose(order)).view(g.container_dtype)
        assert out.shape == page_major_shape(g, self.host_pool.layout, n)
        return out

    def _from_host(self, host_ids: np.ndarray) -> np.ndarray:
        """Host pages as (L, n, P, *rest) in the engine's dtype."""
        g = self.geom
        buf = self.host_pool.read_pages(COMPONENT, host_ids)
        back = {
            HostLayout.PAGE_FIRST: (2, 0, 1, 3, 4),
            HostLayout.PAGE_FIRST_DIRECT: (1, 0, 2, 3, 4),
            HostLayout.LAYER_FIRST: (0, 1, 2, 3, 4),
        }[self.host_pool.layout]
        arr = np.ascontiguousarray(buf.transpose(back))  # (L, n, P, 1, W)
        arr = arr.reshape((g.num_layers, host_ids.size) + self._page_shape)
        return arr.view(np.dtype(self._dtype))

    def load_pages(self, host_ids: Sequence[int] | np.ndarray, page_ids: Sequence[int] | np.ndarray) -> None:
        """Scatter host pages into engine pages and install the new arrays (synchronous)."""
        h = check_page_ids(host_ids, self.host_pool.num_pages, "host_ids")
        p = check_page_ids(page_ids, self.engine_num_pages, "page_ids")
        if h.size != p.size:
            raise ValueError(f"host_ids and page_ids: expected equal lengths, got {h.size} and {p.size}")
        if not h.size:
            return
        n, b = h.size, _bucket(h.size)
        host = self._from_host(h)
        if b > n:
            host = np.concatenate([host, np.zeros((host.shape[0], b - n) + host.shape[2:], host.dtype)], axis=1)
        ids = np.full(b, self.engine_num_pages, np.int32)  # out of range: dropped
        ids[:n] = p
        self._set(_scatter(list(self._get()), jnp.asarray(ids), jnp.asarray(host)))

    # ---- KVTransferEngine --------------------------------------------------------------
    def backup(self, device_ids, host_ids) -> TransferHandle:
        d, h = self.validate(device_ids, host_ids)
        if not d.size:
            return CompletedHandle()
        gathered, n = self._gather_padded(self._engine_ids(d))  # dispatched now: the bytes of this moment
        pool = self.host_pool

        def job() -> None:
            pool.write_pages_unchecked(COMPONENT, h, self._to_host(gathered, n))

        return FutureHandle(self._d2h.submit(job))

    def load(self, host_ids, device_ids) -> LoadHandle:
        d, h = self.validate(device_ids, host_ids)
        self.load_pages(h, self._engine_ids(d))
        return CompletedHandle(self.geom.num_layers)

    def close(self) -> None:
        self._d2h.shutdown()
