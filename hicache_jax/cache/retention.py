"""Soft retention: a prefix a request hints at lives longer in every tier's eviction order,
for a while, within a per-namespace budget. Never a pin.

Pure Python, owner thread only (the cache's). Installed on a live cache with
``enable_retention(cache, RetentionConfig(...))``; then ``begin_request(..., retain=hint)``
and ``insert(..., retain=hint)`` take a ``RetentionHint(seconds, weight)``.

How it orders (``RetentionStrategy``, an eviction strategy like ``eviction_policies``'): LRU
on an access time that a retained node has moved ``round(weight * bonus_ticks)`` ticks of the
tree's logical clock into the future. So a retained node leaves after unhinted nodes used up
to that many ticks later than it, and before younger ones: under pressure it is still
evicted (no pin), after unhinted data of similar age. The device, host and host-reclaim
indexes all use it (reclaim in reverse, as for plain LRU).

Lifetime: a hint lasts ``seconds`` of the injectable ``clock`` (``time.monotonic`` by
default). Expiry is lazy: the expired entries are dropped, and their nodes re-ordered without
the bonus, when an eviction of either tier starts (``before_evict``; a sliding-window pool's
own evictions too) and when a hint is applied; no timer thread.

Budget: a namespace (tenant) holds at most ``max_tokens_per_namespace`` retained tokens
(counted once per node whatever its tiers). A hint is applied from the root down, whole
nodes; the first node that would exceed the budget and everything below it are not retained
(``clamped_tokens``, ``clamped_hints``). Applying a hint to a node already retained extends
its expiry and keeps the larger bonus, at no budget cost.

Metrics (``stats()``, also under ``cache.stats()["retention"]``, and the ``retention_*``
families of ``metrics``, read by a scrape thread: plain ints only): retained tokens (total and
per namespace), hints applied and clamped, tokens clamped, tokens expired, and tokens evicted
while their hint was live ("evictions that overrode a hint", per tier; dropping the redundant
host copy of an on-device node does not count).

Hooks (``residency_watch``): splits divide a retained node's entry; a node that holds nothing
any more releases its budget; ``reset`` forgets every entry.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable

from .eviction_policies import EvictionStrategy, ReversedStrategy
from .residency_watch import ResidencyWatch
from .tree_node import TreeNode


@dataclass(frozen=True)
class RetentionHint:
    """Keep a prefix ``seconds`` longer in the eviction order, with strength ``weight`` in
    (0, 1] (the fraction of ``RetentionConfig.bonus_ticks`` it moves the prefix by)."""

    seconds: float
    weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("seconds", "weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise TypeError(f"{name}: expected a finite number, got {type(v).__name__} {v!r}")
        if self.seconds <= 0:
            raise ValueError(f"seconds: expected > 0, got {self.seconds!r}")
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight: expected a number in (0, 1], got {self.weight!r}")


@dataclass(frozen=True)
class RetentionConfig:
    """``max_tokens_per_namespace``: retained tokens one namespace may hold; ``bonus_ticks``:
    how far (in the tree's logical clock) a weight-1 hint moves a node; ``clock``: seconds."""

    max_tokens_per_namespace: int
    bonus_ticks: int = 4096
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        for name in ("max_tokens_per_namespace", "bonus_ticks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        if not callable(self.clock):
            raise TypeError(f"clock: expected a callable returning seconds, got {type(self.clock).__name__}")


class _Entry:
    __slots__ = ("until", "bonus", "namespace")

    def __init__(self, until: float, bonus: int, namespace: tuple) -> None:
        self.until, self.bonus, self.namespace = until, bonus, namespace


class RetentionStrategy(EvictionStrategy):
    """LRU on the access time plus the node's live retention bonus (see the module docstring)."""

    name = "lru_retention"

    def __init__(self, retention: "Retention") -> None:
        self.entries = retention.entries

    def key(self, node: TreeNode) -> tuple:
        e = self.entries.get(node)
        return (node.last_access + (e.bonus if e is not None else 0), node.last_access)


class Retention(ResidencyWatch):
    """The retention entries of one cache and their budget; see the module docstring."""

    def __init__(self, config: RetentionConfig, indexes: tuple) -> None:
        self.config = config
        self.clock = config.clock
        self.cap = config.max_tokens_per_namespace
        self.indexes = indexes
        self.entries: dict[TreeNode, _Entry] = {}
        self._expiry: list = []  # (until, seq, node): lazily stale (an entry extended or gone)
        self._seq = itertools.count()
        self.by_namespace: dict[tuple, int] = {}
        # The sum of ``by_namespace``, kept as one int: a metrics scrape on another thread reads
        # it without iterating a dict the owner thread may be resizing.
        self.total = 0
        self.hints = self.clamped_hints = self.clamped_tokens = self.expired_tokens = 0
        self.overridden_tokens = {"device": 0, "host": 0}

    # ------------------------------------------------------------------ hints
    def retain(self, root: TreeNode, leaf: TreeNode, hint: RetentionHint) -> int:
        """Apply ``hint`` to the path root -> ``leaf`` (whole nodes, top down, within the
        budget); returns the tokens newly retained."""
        now = self.clock()
        self.expire(now)
        self.hints += 1
        path = []
        n = leaf
        while n is not root and n is not None:
            path.append(n)
            n = n.parent
        until = now + hint.seconds
        bonus = round(hint.weight * self.config.bonus_ticks)
        added = 0
        clamped = 0
        for i, node in enumerate(reversed(path)):
            e = self.entries.get(node)
            if e is not None:
                if until > e.until:
                    e.until = until
                    heapq.heappush(self._expiry, (until, next(self._seq), node))
                if bonus > e.bonus:
                    e.bonus = bonus
                    self._reorder(node)
                continue
            ns = node.namespace
            used = self.by_namespace.get(ns, 0)
            if used + node.size > self.cap:
                clamped = sum(x.size for x in path[: len(path) - i] if x not in self.entries)
                break
            self.by_namespace[ns] = used + node.size
            self.total += node.size
            self.entries[node] = _Entry(until, bonus, ns)
            heapq.heappush(self._expiry, (until, next(self._seq), node))
            added += node.size
            self._reorder(node)
        if clamped:
            self.clamped_hints += 1
            self.clamped_tokens += clamped
        return added

    def expire(self, now: float | None = None) -> None:
        """Drop the entries whose time is up and re-order their nodes without the bonus."""
        if now is None:
            now = self.clock()
        heap = self._expiry
        while heap and heap[0][0] <= now:
            until, _seq, node = heapq.heappop(heap)
            e = self.entries.get(node)
            if e is None or e.until != until:
                continue  # gone, or extended (a later heap entry stands for it)
            self.expired_tokens += node.size
            self._drop(node, e)
            self._reorder(node)

    @property
    def retained_tokens(self) -> int:
        return self.total

    @property
    def scheduled_expiries(self) -> int:
        """Entries in the expiry schedule, stale ones (extended or gone, dropped lazily) included."""
        return len(self._expiry)

    def stats(self) -> dict:
        return {
            "retained_tokens": self.retained_tokens,
            "retained_tokens_by_namespace": {repr(k): v for k, v in self.by_namespace.items() if v},
            "hints": self.hints,
            "clamped_hints": self.clamped_hints,
            "clamped_tokens": self.clamped_tokens,
            "expired_tokens": self.expired_tokens,
            "overridden_tokens": dict(self.overridden_tokens),
        }

    # ------------------------------------------------------------------ watch hooks
    def before_evict(self, tier: str) -> None:
        if self._expiry and self._expiry[0][0] <= self.clock():
            self.expire()

    def removed(self, tier: str, node: TreeNode) -> None:
        e = self.entries.get(node)
        if e is None:
            return
        if tier == "host" and node.value is not None:
            return  # a redundant host copy of an on-device node (reclaim): the prefix stays cached
        self.overridden_tokens[tier] += node.size  # live: expiry ran when the eviction started
        if node.value is None and node.host_value is None:
            self._drop(node, e)  # deleted next: its budget is free again

    def split(self, upper: TreeNode, lower: TreeNode, k: int) -> None:
        e = self.entries.get(lower)
        if e is not None:  # the tokens are the same, now in two nodes: the budget is unchanged
            # No re-order: ``upper`` is in no index (``lower`` is its child on every tier it has).
            self.entries[upper] = _Entry(e.until, e.bonus, e.namespace)
            heapq.heappush(self._expiry, (e.until, next(self._seq), upper))

    def cleared(self) -> None:
        self.entries.clear()
        self._expiry.clear()
        self.by_namespace.clear()
        self.total = 0

    # ------------------------------------------------------------------ internals
    def _drop(self, node: TreeNode, e: _Entry) -> None:
        del self.entries[node]
        self.by_namespace[e.namespace] -= node.size
        self.total -= node.size

    def _reorder(self, node: TreeNode) -> None:
        for index in self.indexes:
            index.touch(node)


def enable_retention(cache, config: RetentionConfig) -> Retention:
    """``cache.enable_retention(config)``: install retention on a live cache (LRU eviction
    only); its device, host and reclaim indexes order by ``RetentionStrategy`` from now on."""
    return cache.enable_retention(config)


def install(cache_residency, config: RetentionConfig) -> Retention:
    """For the facade: build the retention over a ``Residency``'s indexes and re-order them."""
    res = cache_residency
    ret = Retention(config, res.indexes)
    strategy = RetentionStrategy(ret)
    res.device_index.set_strategy(strategy)
    res.host_index.set_strategy(strategy)
    res.reclaim_index.set_strategy(ReversedStrategy(strategy))
    return ret
