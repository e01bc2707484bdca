"""The components of one cache: the full component, its sidecars and any stateful plug-ins.

Pure Python, owner thread only. Validated against the full component at construction. A
transfer issues one copy per component, full first, and returns one handle over all of them
(``MultiTransferHandle`` / ``MultiLoadHandle``; the full component's own handle when it is
alone). ``stateful`` is the tuple of components whose structural hooks the tree calls (empty
for the full component and sidecars). A component with its own page ids copies only what
its ``CopyPlan`` names (``plans``, keyed by component name) and is left out of
``bytes_per_page`` (its pages are not one per full page; it counts its own).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ...allocator import PageAllocator
from ...transfer import KVTransferEngine, LoadHandle, TransferHandle
from .base import KVComponent
from .full import FULL, FullComponent
from .sidecar import SidecarComponent


class _CombinedHandle:
    """One copy across components: done when every component's copy is."""

    handles: dict

    def done(self) -> bool:
        return all(h.done() for h in self.handles.values())

    def wait(self, timeout: float | None = None) -> None:
        for h in self.handles.values():
            h.wait(timeout)

    @property
    def completed_at(self) -> float | None:
        """When the last component's copy finished (None while any is unknown)."""
        stamps = [getattr(h, "completed_at", None) for h in self.handles.values()]
        return None if None in stamps else max(stamps)

    @property
    def error(self) -> BaseException | None:
        """The first component copy's failure, where its handle reports one (``error``)."""
        for h in self.handles.values():
            err = getattr(h, "error", None)
            if err is not None:
                return err
        return None


class MultiLoadHandle(_CombinedHandle, LoadHandle):
    """One H2D load across components; per-layer readiness of the full component by default."""

    def __init__(self, handles: Mapping[str, LoadHandle], names: tuple | None = None) -> None:
        self.handles = dict(handles)
        self.num_layers = self.handles[FULL].num_layers
        self.names = tuple(self.handles) if names is None else tuple(names)  # every component of the cache

    def layer_done(self, layer: int, component: str = FULL) -> bool:
        """Whether ``component``'s copy of ``layer`` landed (True when this load moves none of
        its pages, e.g. a window already on the device)."""
        h = self._handle(component)
        return True if h is None else h.layer_done(layer)

    def wait_layer(self, layer: int, timeout: float | None = None, component: str = FULL) -> None:
        h = self._handle(component)
        if h is not None:
            h.wait_layer(layer, timeout)

    def _handle(self, component: str) -> LoadHandle | None:
        if component not in self.names:
            raise ValueError(f"component: expected one of {list(self.names)}, got {component!r}")
        return self.handles.get(component)


class MultiTransferHandle(_CombinedHandle, TransferHandle):
    """One D2H backup across components."""

    def __init__(self, handles: Mapping[str, TransferHandle]) -> None:
        self.handles = dict(handles)


class ComponentRegistry:
    """The components of one cache, validated against the full component at construction."""

    def __init__(
        self,
        engine: KVTransferEngine,
        device_allocator: PageAllocator,
        sidecars: Mapping[str, KVTransferEngine] | None = None,
        plugins: "tuple[KVComponent, ...] | list[KVComponent]" = (),
    ) -> None:
        if not isinstance(engine, KVTransferEngine):
            raise TypeError(f"engine: expected a KVTransferEngine, got {type(engine).__name__}")
        if not isinstance(device_allocator, PageAllocator):
            raise TypeError(f"device_allocator: expected a PageAllocator, got {type(device_allocator).__name__}")
        if device_allocator.num_pages != engine.device_num_pages:
            raise ValueError(
                f"device_allocator: {device_allocator.num_pages} pages, but the engine's device pool "
                f"has {engine.device_num_pages}"
            )
        host_pool = getattr(engine, "host_pool", None)
        if device_allocator is getattr(host_pool, "allocator", None):
            raise ValueError("device_allocator: this is the engine's host pool's allocator; pass the device pool's")
        own = getattr(getattr(engine, "device_pool", None), "allocator", None)
        if isinstance(own, PageAllocator) and own is not device_allocator:
            raise ValueError(
                f"device_allocator: expected the engine's device pool's allocator ({own!r}), got "
                f"another one ({device_allocator!r})"
            )
        if sidecars is not None and not isinstance(sidecars, Mapping):
            raise TypeError(f"sidecars: expected a mapping of name -> KVTransferEngine, got {type(sidecars).__name__}")
        if isinstance(plugins, (str, bytes, Mapping)) or not isinstance(plugins, (tuple, list)):
            raise TypeError(f"components: expected a list or tuple of KVComponent, got {type(plugins).__name__}")
        sidecars = dict(sidecars or {})
        if FULL in sidecars:
            raise ValueError(f"sidecars: the name {FULL!r} is reserved for the target KV")
        comps: dict[str, KVComponent] = {FULL: FullComponent(engine)}
        for name, side in sidecars.items():
            if not isinstance(side, KVTransferEngine):
                raise TypeError(f"sidecars[{name!r}]: expected a KVTransferEngine, got {type(side).__name__}")
            comps[name] = SidecarComponent(name, side, engine)
        for comp in plugins:
            if not isinstance(comp, KVComponent):
                raise TypeError(f"components: expected KVComponent instances, got {type(comp).__name__}")
            if comp.name in comps:
                raise ValueError(f"components: the name {comp.name!r} is taken")
            if comp.engine.geom.page_size != engine.geom.page_size:
                raise ValueError(
                    f"components[{comp.name!r}]: page_size {comp.engine.geom.page_size} != full "
                    f"page_size {engine.geom.page_size}"
                )
            if comp.own_page_ids and (comp.engine is engine or getattr(comp.engine, "host_pool", None) is host_pool):
                raise ValueError(
                    f"components[{comp.name!r}]: a component with its own page ids needs its own pools, "
                    f"not the full component's engine"
                )
            comps[comp.name] = comp
        self.components = comps
        self.engines: dict[str, KVTransferEngine] = {n: c.engine for n, c in comps.items()}
        self.stateful: tuple[KVComponent, ...] = tuple(c for c in comps.values() if c.stateful)
        self.device_allocator = device_allocator
        self.host_allocator: PageAllocator = engine.host_pool.allocator
        self.page_size = engine.geom.page_size
        self.num_layers = engine.geom.num_layers
        self.bytes_per_page = sum(c.engine.geom.bytes_per_page for c in comps.values() if not c.own_page_ids)
        self._full = comps[FULL]
        self._single = len(comps) == 1

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.components)

    def backup(self, device_ids: np.ndarray, host_ids: np.ndarray, plans: dict | None = None) -> TransferHandle:
        """D2H copy on every component; the ids are the cache's own (``KVTransferEngine.backup_owned``).
        ``plans``: the copies of components with their own page ids, by name."""
        if self._single:
            return self._full.engine.backup_owned(device_ids, host_ids)
        handles = {}
        for n, c in self.components.items():
            h = c.backup(device_ids, host_ids, None if plans is None else plans.get(n))
            if h is not None:
                handles[n] = h
        return MultiTransferHandle(handles)

    def load(self, host_ids: np.ndarray, device_ids: np.ndarray, plans: dict | None = None) -> LoadHandle:
        """H2D copy on every component; the ids are the cache's own (``KVTransferEngine.load_owned``)."""
        if self._single:
            return self._full.engine.load_owned(host_ids, device_ids)
        handles = {}
        for n, c in self.components.items():
            h = c.load(host_ids, device_ids, None if plans is None else plans.get(n))
            if h is not None:
                handles[n] = h
        return MultiLoadHandle(handles, self.names)
