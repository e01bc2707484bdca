"""An indexed set of eviction candidates, ordered by an eviction strategy.

Pure Python, owner thread only. An ``EvictionIndex`` holds the nodes that may leave a tier
right now (for example "unlocked device leaves") and hands them out lowest key first, the
key being the strategy's (``eviction_policies``). It is a set plus a lazy min-heap: instead
of re-sorting, a fresh heap entry is pushed (``push``) whenever a member's key changes and
stale entries are skipped on pop (each entry carries a stamp that must match the node's
current stamp for this index), so a key may move either way. The heap is compacted (stale entries
dropped, live ones kept with their stamps, so ties keep their order) when stale entries
outnumber live ones, which keeps pop and push O(log n) amortised.

Membership is decided by the cache (it knows the tier rules); this module only orders.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator

from .eviction_policies import EvictionStrategy
from .tree_node import TreeNode

_stamps = itertools.count(1)


class EvictionIndex:
    """Candidates for one tier of one component, ordered by an eviction strategy."""

    def __init__(self, name: str, slot: int, strategy: EvictionStrategy) -> None:
        if not isinstance(strategy, EvictionStrategy):
            raise TypeError(f"strategy: expected an EvictionStrategy, got {type(strategy).__name__}")
        self.name = name
        self.slot = slot  # which entry of TreeNode.heap_stamp this index owns
        self.strategy = strategy
        self.priority = strategy.key
        self._kind = strategy.kind
        self.members: set[TreeNode] = set()
        self._heap: list[tuple] = []

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, node: TreeNode) -> bool:
        return node in self.members

    def __iter__(self) -> Iterator[TreeNode]:
        return iter(self.members)

    def set_strategy(self, strategy: EvictionStrategy) -> None:
        """Order by ``strategy`` from now on (e.g. retention installed on a live cache): the
        heap is rebuilt from the members with their new keys."""
        if not isinstance(strategy, EvictionStrategy):
            raise TypeError(f"strategy: expected an EvictionStrategy, got {type(strategy).__name__}")
        self.strategy = strategy
        self.priority = strategy.key
        self._kind = strategy.kind
        self._heap = []
        # Deterministic ties (the stamps follow push order): by key, then creation order.
        for node in sorted(self.members, key=lambda n: (strategy.key(n), n.id)):
            self.push(node)

    def push(self, node: TreeNode) -> None:
        """(Re-)order a member after its key changed (the caller checked membership)."""
        stamp = next(_stamps)
        node.heap_stamp[self.slot] = stamp
        kind = self._kind  # the two built-in policies build their tuple directly (every touch)
        if kind == 1:
            entry = (node.last_access, stamp, node)
        elif kind == 2:
            entry = (node.hit_count, node.last_access, stamp, node)
        elif kind == 3:  # ReversedStrategy: LRU and LFU backwards
            entry = (-node.last_access, stamp, node)
        elif kind == 4:
            entry = (-node.hit_count, -node.last_access, stamp, node)
        else:
            entry = (*self.priority(node), stamp, node)
        heap = self._heap
        heapq.heappush(heap, entry)
        if len(heap) > 4 * len(self.members) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        # Keep the live entries as they are (the test ``pop`` applies): same priorities and
        # stamps, so the pop order is unchanged.
        members, slot = self.members, self.slot
        heap = [e for e in self._heap if e[-1] in members and e[-1].heap_stamp[slot] == e[-2]]
        heapq.heapify(heap)
        self._heap = heap

    def set_member(self, node: TreeNode, member: bool) -> None:
        if member:
            if node not in self.members:
                self.members.add(node)
                self.push(node)
        elif node in self.members:
            self.members.discard(node)
            node.heap_stamp[self.slot] = 0

    def touch(self, node: TreeNode) -> None:
        """The node's priority changed: re-order it if it is a member."""
        if node in self.members:
            self.push(node)

    def pop(self) -> TreeNode | None:
        """Remove and return the lowest-priority member, or None when empty."""
        heap, members, slot = self._heap, self.members, self.slot
        while heap:
            entry = heapq.heappop(heap)
            node = entry[-1]
            if node in members and node.heap_stamp[slot] == entry[-2]:
                members.discard(node)
                node.heap_stamp[slot] = 0
                return node
        return None

    def peek(self) -> TreeNode | None:
        """The member ``pop`` would return next, left in place (None when empty); drops the
        stale entries off the heap's top on the way, as ``pop`` would."""
        heap, members, slot = self._heap, self.members, self.slot
        while heap:
            top = heap[0]
            node = top[-1]
            if node in members and node.heap_stamp[slot] == top[-2]:
                return node
            heapq.heappop(heap)
        return None

    def precedes(self, node: TreeNode) -> bool:
        """Whether ``node`` (not a member), if it joined now, would be the next ``pop``: its
        priority is below every member's (a tie goes to the member, whose stamp is older).
        Drops the stale entries off the heap's top on the way, as ``pop`` would.

        Lets eviction take a parent that just became a leaf straight away instead of pushing
        it and popping it again, with the same eviction order."""
        heap, members, slot = self._heap, self.members, self.slot
        while heap:
            top = heap[0]
            if top[-1] in members and top[-1].heap_stamp[slot] == top[-2]:
                break
            heapq.heappop(heap)
        else:
            return True
        kind = self._kind
        if kind == 1:
            return node.last_access < top[0]
        if kind == 2:
            return (node.hit_count, node.last_access) < top[:2]
        if kind == 3:
            return -node.last_access < top[0]
        if kind == 4:
            return (-node.hit_count, -node.last_access) < top[:2]
        return tuple(self.priority(node)) < top[:-2]

    def heap_snapshot(self) -> list[tuple]:
        """A copy of the lazy heap's entries, live and stale: ``(*key, stamp, node)``; an entry
        is live while its node is a member and its stamp is the node's (debugging, tests)."""
        return list(self._heap)

    def inject_entry(self, entry: tuple) -> None:
        """Fault injection for tests of ``check`` / ``sanity_check``: push a raw
        ``(*key, stamp, node)`` entry onto the lazy heap, bypassing ``push``."""
        heapq.heappush(self._heap, entry)

    def clear(self) -> None:
        for node in self.members:
            node.heap_stamp[self.slot] = 0
        self.members.clear()
        self._heap.clear()

    def check(self) -> list[str]:
        """Violations: a member without a live heap entry, or a live entry for a non-member."""
        errors = []
        live = {}
        for entry in self._heap:
            node = entry[-1]
            if node.heap_stamp[self.slot] == entry[-2]:
                if node in live:
                    errors.append(f"{self.name}: two live heap entries for {node!r}")
                live[node] = entry
        for node in self.members:
            entry = live.get(node)
            if entry is None:
                errors.append(f"{self.name}: member {node!r} has no live heap entry")
            elif tuple(entry[:-2]) != self.priority(node):
                errors.append(f"{self.name}: stale priority {entry[:-2]} for {node!r}")
        for node in live:
            if node not in self.members:
                errors.append(f"{self.name}: live heap entry for non-member {node!r}")
        return errors
