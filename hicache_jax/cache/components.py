"""KV components of one cache: the target ("full") KV plus sidecars, and their transfers.

Pure Python; only integer page ids cross into the engines.

A *component* is one KV pool pair (device pool + host pool) with its own transfer engine.

* ``full``: the target model's KV. Its page ids are what the tree stores; its device
  allocator is the one the scheduler allocates from; its host allocator is the one the
  cache allocates backups from.
* ``sidecar`` (e.g. the draft model's KV, upstream ``HiCacheDraftMode.SIDECAR``): follows
  the full component's page ids 1:1 on both tiers, so it needs no per-node state and no
  allocator of its own. Every backup and load of full pages issues the same copy on each
  sidecar engine (full first, then sidecars, as upstream), and the transfer counts as done
  only when all of them are.

A component with its own index space and residency (sliding-window KV, upstream SWA) is
the extension point: it would register here with its own device/host eviction indexes and
per-node fields, without changing how the full component drives the tree.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..allocator import PageAllocator
from ..transfer import KVTransferEngine, LoadHandle, TransferHandle

FULL = "full"


class MultiLoadHandle(LoadHandle):
    """One H2D load across components; per-layer readiness of the full component by default."""

    def __init__(self, handles: Mapping[str, LoadHandle]) -> None:
        self.handles = dict(handles)
        self.num_layers = self.handles[FULL].num_layers

    def layer_done(self, layer: int, component: str = FULL) -> bool:
        return self.handles[component].layer_done(layer)

    def wait_layer(self, layer: int, timeout: float | None = None, component: str = FULL) -> None:
        self.handles[component].wait_layer(layer, timeout)

    def done(self) -> bool:
        return all(h.done() for h in self.handles.values())

    def wait(self, timeout: float | None = None) -> None:
        for h in self.handles.values():
            h.wait(timeout)


class MultiTransferHandle(TransferHandle):
    """One D2H backup across components."""

    def __init__(self, handles: Mapping[str, TransferHandle]) -> None:
        self.handles = dict(handles)

    def done(self) -> bool:
        return all(h.done() for h in self.handles.values())

    def wait(self, timeout: float | None = None) -> None:
        for h in self.handles.values():
            h.wait(timeout)


class ComponentRegistry:
    """The components of one cache, validated against the full component at construction."""

    def __init__(self, engine: KVTransferEngine, device_allocator: PageAllocator,
                 sidecars: Mapping[str, KVTransferEngine] | None = None) -> None:
        if not isinstance(engine, KVTransferEngine):
            raise TypeError(f"engine: expected a KVTransferEngine, got {type(engine).__name__}")
        if not isinstance(device_allocator, PageAllocator):
            raise TypeError(f"device_allocator: expected a PageAllocator, got {type(device_allocator).__name__}")
        if device_allocator.num_pages != engine.device_num_pages:
            raise ValueError(f"device_allocator: {device_allocator.num_pages} pages, but the engine's device pool "
                             f"has {engine.device_num_pages}")
        sidecars = dict(sidecars or {})
        if FULL in sidecars:
            raise ValueError(f"sidecars: the name {FULL!r} is reserved for the target KV")
        page = engine.geom.page_size
        for name, side in sidecars.items():
            if not isinstance(side, KVTransferEngine):
                raise TypeError(f"sidecars[{name!r}]: expected a KVTransferEngine, got {type(side).__name__}")
            if side.geom.page_size != page:
                raise ValueError(f"sidecars[{name!r}]: page_size {side.geom.page_size} != full page_size {page}")
            if side.device_num_pages < engine.device_num_pages:
                raise ValueError(f"sidecars[{name!r}]: {side.device_num_pages} device pages < full's "
                                 f"{engine.device_num_pages} (sidecars share the full page ids)")
            if side.host_pool.num_pages < engine.host_pool.num_pages:
                raise ValueError(f"sidecars[{name!r}]: {side.host_pool.num_pages} host pages < full's "
                                 f"{engine.host_pool.num_pages} (sidecars share the full page ids)")
        self.engines: dict[str, KVTransferEngine] = {FULL: engine, **sidecars}
        self.device_allocator = device_allocator
        self.host_allocator: PageAllocator = engine.host_pool.allocator
        self.page_size = page
        self.num_layers = engine.geom.num_layers
        self.bytes_per_page = sum(e.geom.bytes_per_page for e in self.engines.values())
        self._single = len(self.engines) == 1

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.engines)

    def backup(self, device_ids: np.ndarray, host_ids: np.ndarray) -> TransferHandle:
        """D2H copy on every component; the ids are the cache's own (``KVTransferEngine.backup_owned``)."""
        # The cache's own page ids (see KVTransferEngine.backup_owned).
        if self._single:
            return self.engines[FULL].backup_owned(device_ids, host_ids)
        return MultiTransferHandle({n: e.backup_owned(device_ids, host_ids) for n, e in self.engines.items()})

    def load(self, host_ids: np.ndarray, device_ids: np.ndarray) -> LoadHandle:
        """H2D copy on every component; the ids are the cache's own (``KVTransferEngine.load_owned``)."""
        if self._single:
            return self.engines[FULL].load_owned(host_ids, device_ids)
        return MultiLoadHandle({n: e.load_owned(host_ids, device_ids) for n, e in self.engines.items()})
