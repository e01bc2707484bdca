"""A sidecar component (e.g. the draft model's KV, upstream ``HiCacheDraftMode.SIDECAR``).

It follows the full component's page ids 1:1 on both tiers, so it keeps no per-node state
and no allocator of its own: every backup and load of full pages issues the same copy on
the sidecar's engine (full first, then sidecars, as upstream), and the transfer counts as
done only when all of them are. Its pools must be at least as large as the full ones.
"""

from __future__ import annotations

from .base import KVComponent
from .full import FULL


class SidecarComponent(KVComponent):
    def __init__(self, name: str, engine, full_engine) -> None:
        super().__init__(name, engine)
        if name == FULL:
            raise ValueError(f"sidecars: the name {FULL!r} is reserved for the target KV")
        if engine.geom.page_size != full_engine.geom.page_size:
            raise ValueError(
                f"sidecars[{name!r}]: page_size {engine.geom.page_size} != full page_size {full_engine.geom.page_size}"
            )
        if engine.device_num_pages < full_engine.device_num_pages:
            raise ValueError(
                f"sidecars[{name!r}]: {engine.device_num_pages} device pages < full's "
                f"{full_engine.device_num_pages} (sidecars share the full page ids)"
            )
        if engine.host_pool.num_pages < full_engine.host_pool.num_pages:
            raise ValueError(
                f"sidecars[{name!r}]: {engine.host_pool.num_pages} host pages < full's "
                f"{full_engine.host_pool.num_pages} (sidecars share the full page ids)"
            )
