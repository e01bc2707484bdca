"""Observers of the full component's residency: pages arriving on and leaving each tier.

Pure Python, owner thread only. The cache calls a ``ResidencyWatch`` at the points where a
node's pages take effect on a tier, in the order they take effect, and only while one is
attached (``HiRadixCache.add_watch``): ``Residency.watch`` is None otherwise and every hook
site costs one ``is not None`` test (the eviction loops test a local bound once per call).

The hook points and what a watch may assume there:

* ``stored(tier, node)``: ``node``'s pages were just put on ``tier`` (``"device"`` or
  ``"host"``): an insert (new leaf or revived node), a load-back's chain (device, at issue:
  the pages count as on-device at once), a backup's chain (host, at issue), an L3 prefetch
  attached by ``insert_host`` (host). The node is linked; ``node.parent`` is valid.
* ``removed(tier, node)``: ``node``'s pages were just taken off ``tier`` (device eviction
  or demotion, host eviction or reclaim); the node is still linked (it is unlinked right
  after when it holds nothing any more).
* ``split(upper, lower, k)``: ``tree.split`` made ``upper`` from ``lower``'s first ``k``
  pages (no page changed tier).
* ``cleared()``: ``reset`` is about to drop every page of both tiers.
* ``before_evict(tier)``: an eviction of ``tier`` starts (a policy may settle lazy state
  first, e.g. retention expiry).
* ``step()``: ``check_events`` ran (one scheduler step).

Watches must not change the tree, the indexes' members or the allocators; they may re-order
members of the eviction indexes (``EvictionIndex.touch``). Several watches share the one
slot through ``WatchFanout``.
"""

from __future__ import annotations

from .tree_node import TreeNode

TIERS = ("device", "host")


class ResidencyWatch:
    """Base: every hook does nothing; subclasses override the ones they need."""

    def stored(self, tier: str, node: TreeNode) -> None:
        pass

    def removed(self, tier: str, node: TreeNode) -> None:
        pass

    def split(self, upper: TreeNode, lower: TreeNode, k: int) -> None:
        pass

    def cleared(self) -> None:
        pass

    def before_evict(self, tier: str) -> None:
        pass

    def step(self) -> None:
        pass


class WatchFanout(ResidencyWatch):
    """Several watches in one slot, called in attachment order."""

    def __init__(self, watches: tuple) -> None:
        self.watches = watches

    def stored(self, tier: str, node: TreeNode) -> None:
        for w in self.watches:
            w.stored(tier, node)

    def removed(self, tier: str, node: TreeNode) -> None:
        for w in self.watches:
            w.removed(tier, node)

    def split(self, upper: TreeNode, lower: TreeNode, k: int) -> None:
        for w in self.watches:
            w.split(upper, lower, k)

    def cleared(self) -> None:
        for w in self.watches:
            w.cleared()

    def before_evict(self, tier: str) -> None:
        for w in self.watches:
            w.before_evict(tier)

    def step(self) -> None:
        for w in self.watches:
            w.step()


def combine(watches: tuple) -> ResidencyWatch | None:
    """The slot's value for ``watches``: None, the one watch, or a fan-out."""
    if not watches:
        return None
    return watches[0] if len(watches) == 1 else WatchFanout(watches)


class WatchSet:
    """The watches attached to one cache (``add_watch`` / ``remove_watch``), installed as
    their combination (``combine``) in the ``watch`` slot of its residency. Owner thread only
    (the facade checks); validates before changing anything."""

    def __init__(self, residency) -> None:
        self._residency = residency
        self.watches: tuple = ()

    def add(self, watch: ResidencyWatch) -> None:
        if not isinstance(watch, ResidencyWatch):
            raise TypeError(f"watch: expected a ResidencyWatch, got {type(watch).__name__}")
        if watch in self.watches:
            raise ValueError(f"watch: {watch!r} is already attached")
        self.watches += (watch,)
        self._residency.watch = combine(self.watches)

    def remove(self, watch: ResidencyWatch) -> None:
        if watch not in self.watches:
            raise ValueError(f"watch: {watch!r} is not attached")
        self.watches = tuple(w for w in self.watches if w is not watch)
        self._residency.watch = combine(self.watches)
