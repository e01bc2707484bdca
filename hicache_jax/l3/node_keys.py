"""Per-node L3 page keys: the chained digests of every tree node's pages, per storage pool.

A page's L3 key chains from the previous page's key (``storage.keys.page_keys``), so a node's
keys follow from its parent's last key and its own tokens. ``NodeDigests`` computes them once
per node (walking up to the nearest node that has them), keeps them while the node lives, and
fixes them up after the tree changed shape: a split node's lower half keeps the digests of its
last ``k`` pages and hands the head to the new ancestors above it, in *every* pool by the same
rule (pools are aligned page for page: target, draft, SWA, ...).

Each entry also carries its node's L3 state (``NEW``: not queued, ``INFLIGHT``: queued for L3,
``STORED``: in L3); the controller's backup and prefetch paths set it.

Threading: owner thread only (the scheduler's, the one that calls the cache). Nodes are the
cache's ``TreeNode`` objects; this module reads their public fields (``key``, ``size``,
``parent``, ``children``, ``namespace``, ``deleted``) and never changes them.
"""

from __future__ import annotations

import logging
from typing import Callable

from ..storage.keys import Namespace, page_keys

log = logging.getLogger("hicache_jax.cache.storage")

NEW, INFLIGHT, STORED = 0, 1, 2


class PageDigests:
    """Page digests of one tree node, per pool, and whether its pages are in L3."""

    __slots__ = ("digests", "state")

    def __init__(self, digests: dict[str, list[bytes]], state: int = NEW) -> None:
        lengths = {len(d) for d in digests.values()}
        if len(lengths) > 1:
            raise ValueError(
                f"digests: every pool must have one digest per page, got lengths "
                f"{ {p: len(d) for p, d in digests.items()} }"
            )
        self.digests = digests
        self.state = state

    def __len__(self) -> int:
        return len(next(iter(self.digests.values())))

    def last(self) -> dict[str, bytes]:
        """The last page's digest per pool (what the next node's keys chain from)."""
        return {p: d[-1] for p, d in self.digests.items()}

    def at(self, k: int) -> dict[str, bytes]:
        """Page ``k``'s digest per pool."""
        return {p: d[k] for p, d in self.digests.items()}

    def trim(self, k: int) -> dict[str, list[bytes]]:
        """The node was split: keep the digests of its last ``k`` pages (in place), in every
        pool; returns the head (the pages cut off)."""
        n = len(self)  # read once: every pool is cut at the same page
        if not 0 <= k <= n:
            raise ValueError(f"k: expected 0 <= k <= {n}, got {k}")
        head = {pool: d[: n - k] for pool, d in self.digests.items()}
        for pool in self.digests:
            self.digests[pool] = self.digests[pool][n - k :]
        return head


class NodeDigests:
    """The digests of the tree's nodes, computed on demand and fixed up after splits.

    ``root()`` returns the tree's current root (a reset replaces it); ``namespaces(radix_namespace)``
    gives the storage namespace of every pool for a node's namespace, or None when that
    namespace cannot be stored (its nodes get no digests).
    """

    def __init__(
        self, root: Callable[[], object], page_size: int, namespaces: Callable[[tuple], dict[str, Namespace] | None]
    ) -> None:
        self._root, self.page_size, self.namespaces = root, page_size, namespaces
        self._entries: dict[object, PageDigests] = {}
        self._prune_at = 4096

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def set(self, node: object, entry: PageDigests) -> None:
        """Record the digests a node got elsewhere (e.g. the keys a prefetch read it under).

        ``entry`` may cover more pages than ``node`` (a chain attached as one leaf that was then
        split): ``valid`` hands the head to the ancestors, as after any split."""
        if len(entry) < node.size // self.page_size:
            raise ValueError(f"entry: {len(entry)} pages of digests for a node of {node.size // self.page_size}")
        self._entries[node] = entry

    def valid(self, node: object) -> PageDigests | None:
        """The node's entry if it has one (fixing it up after splits), without hashing."""
        p = self.page_size
        e = self._entries.get(node)
        if e is None:
            # A node made by a split: its lower half (now a child) still holds the digests.
            for c in node.children.values():
                ce = self._entries.get(c)
                if ce is not None and len(ce) > c.size // p:
                    self.valid(c)
                    return self._entries.get(node)
            return None
        k = node.size // p
        if len(e) > k:  # split since: hand the head digests to the new ancestors
            cut = len(e) - k
            head = e.trim(k)
            a = node.parent
            root = self._root()
            while cut > 0 and a is not root and a not in self._entries and a.size // p <= cut:
                ka = a.size // p
                self._entries[a] = PageDigests(
                    {pool: d[cut - ka : cut] for pool, d in head.items()}, STORED if e.state == STORED else NEW
                )
                cut -= ka
                a = a.parent
        elif len(e) < k:  # cannot happen (nodes only shrink); recompute to be safe
            del self._entries[node]
            return None
        return e

    def get(self, node: object) -> PageDigests | None:
        """The node's digests (computing them and its ancestors' as needed); None if unkeyable."""
        root = self._root()
        if node is root:
            return None
        path = []
        n, e = node, None
        while n is not root:
            e = self.valid(n)
            if e is not None:
                break
            path.append(n)
            n = n.parent
        prev = None if n is root else e.last()
        for n in reversed(path):
            ns = self.namespaces(n.namespace)
            if ns is None:
                return None
            try:
                digests = {pool: page_keys(ns[pool], n.key, None if prev is None else prev[pool]) for pool in ns}
            except ValueError as err:  # token ids outside the uint32 key encoding
                log.warning("L3: cannot key node %r: %s", n, err)
                return None
            self._entries[n] = e = PageDigests(digests)
            prev = e.last()
        if len(self._entries) > self._prune_at:
            for dead in [x for x in self._entries if x.deleted]:
                del self._entries[dead]
            self._prune_at = max(4096, 2 * len(self._entries))
        return self._entries.get(node)
