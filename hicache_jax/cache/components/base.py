"""The component plug-in interface: one KV pool pair (device + host) riding through the tree.

Pure Python, owner thread only; only integer page ids cross into the engines.

A component moves its pages with every transfer of the tree (``backup`` / ``load``: given
the full component's page ids, it copies the pages it keeps for them) and, when it keeps
per-node state of its own (``stateful``), hears about every change of the tree's shape and
residency through hooks:

=========================  =================================================================
hook                       called when
=========================  =================================================================
``on_split(upper, lower,   ``tree.split`` divided ``lower``: ``upper`` took its first ``k``
k)``                       pages (after the full component's split)
``on_insert(node)``        ``node`` gained pages on a tier: a new leaf, a revived host-only
                           node, attached L3 pages
``on_backup(nodes)``       these nodes (root first) were just marked backed up; their copy is
                           issued right after (``backup``, with the full component's ids)
``on_load(nodes)``         these host-only nodes just got device pages (a load-back, issued)
``usable_device_nodes(     ``match`` found these on-device nodes, root first; returns how
nodes)``                   many leading ones this component can serve
``on_lock(receipt)`` /     a path lock was taken / released (``locks.LockReceipt``)
``on_release(receipt)``
``on_evict(node, tier)``   ``node`` is about to leave ``"device"`` or ``"host"``
``check(nodes)``           ``sanity_check``: this component's invariant violations
``reset()``                the cache dropped everything
=========================  =================================================================

Hooks of stateless components are never called: the cache keeps one tuple of stateful
components and checks it once per operation, so the full component's fast paths cost
nothing extra while none is registered. Per-node state lives in ``TreeNode.ext[name]``.
"""

from __future__ import annotations

import numpy as np

from ...transfer import KVTransferEngine, LoadHandle, TransferHandle


class KVComponent:
    """One KV pool pair and its hooks; see the module docstring."""

    stateful = False  # True: the tree calls the structural hooks below

    def __init__(self, name: str, engine: KVTransferEngine) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty str, got {name!r}")
        if not isinstance(engine, KVTransferEngine):
            raise TypeError(f"engine: expected a KVTransferEngine, got {type(engine).__name__}")
        self.name = name
        self.engine = engine

    # ------------------------------------------------------------------ transfers
    def backup(self, device_ids: np.ndarray, host_ids: np.ndarray) -> TransferHandle:
        """D2H copy of this component's pages for the full pages ``device_ids`` -> ``host_ids``
        (the cache's own ids: ``KVTransferEngine.backup_owned``)."""
        return self.engine.backup_owned(device_ids, host_ids)

    def load(self, host_ids: np.ndarray, device_ids: np.ndarray) -> LoadHandle:
        """H2D copy of this component's pages for the full pages ``host_ids`` -> ``device_ids``."""
        return self.engine.load_owned(host_ids, device_ids)

    # ------------------------------------------------------------------ structural hooks
    def on_split(self, upper, lower, k: int) -> None:
        pass

    def on_insert(self, node) -> None:
        pass

    def on_backup(self, nodes: list) -> None:
        pass

    def on_load(self, nodes: list) -> None:
        pass

    def usable_device_nodes(self, nodes: list) -> int:
        return len(nodes)

    def on_lock(self, receipt) -> None:
        pass

    def on_release(self, receipt) -> None:
        pass

    def on_evict(self, node, tier: str) -> None:
        pass

    def check(self, nodes: list) -> list[str]:
        return []

    def reset(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
