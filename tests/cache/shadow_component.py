"""A stateful plug-in component for tests: it mirrors the full component's residency in its
own per-node state, kept only through the plug-in hooks, and checks the mirror in
``sanity_check``. If the cache skips a hook anywhere (a split, an insert, a backup, a
load-back, an eviction on either tier), the mirror drifts and ``check`` reports it.

It moves real bytes too: its engine is a second numpy pool pair that shares the full page ids
(like a sidecar), so its copies ride through every transfer.
"""

from __future__ import annotations

import numpy as np

from hicache_jax.cache import KVComponent


class ShadowComponent(KVComponent):
    stateful = True

    def __init__(self, engine, name: str = "shadow", max_usable_nodes: int | None = None) -> None:
        super().__init__(name, engine)
        self.max_usable_nodes = max_usable_nodes
        self.live_receipts: set[int] = set()
        self.calls: dict[str, int] = {}
        self.errors: list[str] = []

    def _count(self, hook: str) -> None:
        self.calls[hook] = self.calls.get(hook, 0) + 1

    def _state(self, node) -> dict:
        if node.ext is None:
            node.ext = {}
        return node.ext.setdefault(self.name, {"dev": None, "host": None})

    @staticmethod
    def _ids(v):
        return None if v is None else tuple(int(x) for x in v)

    def on_split(self, upper, lower, k: int) -> None:
        self._count("on_split")
        st = self._state(lower)
        up = self._state(upper)
        up["dev"] = None if st["dev"] is None else st["dev"][:k]
        up["host"] = None if st["host"] is None else st["host"][:k]
        st["dev"] = None if st["dev"] is None else st["dev"][k:]
        st["host"] = None if st["host"] is None else st["host"][k:]

    def on_insert(self, node) -> None:
        self._count("on_insert")
        st = self._state(node)
        st["dev"], st["host"] = self._ids(node.value), self._ids(node.host_value)

    def on_backup(self, nodes: list) -> None:
        self._count("on_backup")
        for node in nodes:
            self._state(node)["host"] = self._ids(node.host_value)

    def on_load(self, nodes: list) -> None:
        self._count("on_load")
        for node in nodes:
            self._state(node)["dev"] = self._ids(node.value)

    def on_evict(self, node, tier: str) -> None:
        self._count(f"on_evict_{tier}")
        self._state(node)["dev" if tier == "device" else "host"] = None

    def on_lock(self, receipt) -> None:
        self._count("on_lock")
        self.live_receipts.add(id(receipt))

    def on_release(self, receipt) -> None:
        self._count("on_release")
        if id(receipt) not in self.live_receipts:
            self.errors.append(f"released a receipt it never saw taken: {receipt!r}")
        self.live_receipts.discard(id(receipt))

    def usable_device_nodes(self, nodes: list) -> int:
        self._count("usable_device_nodes")
        return len(nodes) if self.max_usable_nodes is None else min(len(nodes), self.max_usable_nodes)

    def reset(self) -> None:
        self._count("reset")
        self.live_receipts.clear()

    def check(self, nodes: list, view=None, external=None) -> list[str]:
        errs = list(self.errors)
        for node in nodes:
            if node.parent is None:  # the root
                continue
            st = (node.ext or {}).get(self.name)
            if st is None:
                errs.append(f"{node!r}: no shadow state (a hook was skipped)")
                continue
            if st["dev"] != self._ids(node.value) or st["host"] != self._ids(node.host_value):
                errs.append(
                    f"{node!r}: shadow {st} != tree (dev {self._ids(node.value)}, host {self._ids(node.host_value)})"
                )
        return errs


def shadow_pages_equal(shadow_engine, full_device, ids: np.ndarray) -> bool:
    """Whether the shadow pool's device pages hold the same bytes as the full pool's."""
    return all(
        np.array_equal(shadow_engine.device.read(c, ids), full_device.read(c, ids))
        for c in shadow_engine.geom.components
    )
