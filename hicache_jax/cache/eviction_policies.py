"""Eviction strategies: the order in which unlocked leaves leave a tier.

Pure Python, stateless. A strategy maps a node to a sort key; the lowest key leaves first.
``EvictionIndex`` (``eviction_index``) keeps the candidates in a lazy heap ordered by that
key and re-pushes a node whenever the cache changes what the key reads (access time, hit
count, priority), so a key may move either way (MRU's falls on every access).

The policies are upstream's ``--radix-eviction-policy`` choices (sglang
``mem_cache/evict_policy.py``): ``lru``, ``lfu``, ``fifo``, ``mru`` and ``priority``. Each key
ends with a deterministic tie-break on the logical clock, so the order never depends on
object addresses. ``kind`` lets the index build the two hottest keys (LRU, LFU) inline.
"""

from __future__ import annotations

from .config import EvictionPolicy
from .tree_node import TreeNode


class EvictionStrategy:
    """Base: ``key(node)`` is a tuple; lower leaves first."""

    name = ""
    kind = 0  # 0: the index calls ``key``; 1: LRU and 2: LFU, built inline by the index

    def key(self, node: TreeNode) -> tuple:  # pragma: no cover - every strategy overrides it
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LRUStrategy(EvictionStrategy):
    name, kind = "lru", 1

    def key(self, node: TreeNode) -> tuple:
        return (node.last_access,)


class LFUStrategy(EvictionStrategy):
    name, kind = "lfu", 2

    def key(self, node: TreeNode) -> tuple:
        return (node.hit_count, node.last_access)


class FIFOStrategy(EvictionStrategy):
    name = "fifo"

    def key(self, node: TreeNode) -> tuple:
        return (node.created, node.last_access)


class MRUStrategy(EvictionStrategy):
    name = "mru"

    def key(self, node: TreeNode) -> tuple:
        return (-node.last_access,)


class PriorityStrategy(EvictionStrategy):
    """Lowest priority first; among equals, least recently used first (upstream's rule)."""

    name = "priority"

    def key(self, node: TreeNode) -> tuple:
        return (node.priority, node.last_access)


class ReversedStrategy(EvictionStrategy):
    """``inner``'s order backwards: the node ``inner`` would evict last leaves first. The
    host-reclaim index uses it (``residency``): the host copies of the on-device nodes that
    device eviction demotes last are the least useful ones to keep."""

    def __init__(self, inner: EvictionStrategy) -> None:
        self.inner = inner
        self.name = f"reversed_{inner.name}"
        # 3 / 4: LRU / LFU backwards, built inline by the index like 1 / 2.
        self.kind = inner.kind + 2 if inner.kind in (1, 2) else 0

    def key(self, node: TreeNode) -> tuple:
        return tuple(-k for k in self.inner.key(node))

    def __repr__(self) -> str:
        return f"ReversedStrategy({self.inner!r})"


STRATEGIES: dict[EvictionPolicy, type[EvictionStrategy]] = {
    EvictionPolicy.LRU: LRUStrategy,
    EvictionPolicy.LFU: LFUStrategy,
    EvictionPolicy.FIFO: FIFOStrategy,
    EvictionPolicy.MRU: MRUStrategy,
    EvictionPolicy.PRIORITY: PriorityStrategy,
}


def strategy_for(policy: EvictionPolicy) -> EvictionStrategy:
    return STRATEGIES[EvictionPolicy.parse(policy)]()
