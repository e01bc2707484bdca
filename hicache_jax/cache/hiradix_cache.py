"""HiRadixCache: a radix tree over token pages with a device tier (L1) and a host tier (L2).

Pure Python + numpy; the KV bytes are moved by a ``KVTransferEngine`` (numpy, JAX or torch),
and only integer page ids cross into it: ids the cache owns, through the engine's
``backup_owned`` / ``load_owned`` (an engine may skip re-validating those; every public entry
point of the cache validates its caller's input before changing anything).

Contract
========

Who allocates device pages
    The caller (the scheduler). It takes pages from the device allocator, directly or via
    ``alloc_device`` (which evicts unlocked leaves when the pool is short), writes KV into
    them, and hands them to ``insert``. From then on the tree owns them.

Who frees duplicates on insert
    The cache. ``insert(key, pages)`` takes one page id per whole page of ``key``. Where the
    tree already holds a page on the device for the same position, the caller's page is a
    duplicate and the cache frees it (unless it *is* the tree's page, e.g. a prefix the
    caller got from ``match_prefix``). Where the tree holds the tokens on the host only, the
    caller's page revives the node on the device. Before anything changes, every page the
    cache would take or free is checked: allocated, not already owned by the tree, no
    repeats. The trailing partial page of a key is never cached: ``cache_finished_req``
    frees it, ``cache_unfinished_req`` leaves it with the request.

Request helpers
    ``begin_request`` / ``cache_unfinished_req`` / ``cache_finished_req`` keep a
    ``CacheRequest`` whose first ``cached_pages`` pages are the tree's, on the path to the
    node it holds locked (``last_node``). The helpers insert from that node: the path is
    checked against the request's tokens byte by byte (one memcmp per node, no child
    lookups) and only the pages after it are validated and compared with the tree's. A
    request whose node does not spell its first ``cached_pages`` pages is inserted by a walk
    from the root, as ``insert`` does. Either way the tree ends up identical (tested).

What is locked when
    * ``inc_lock_ref(node)`` / ``dec_lock_ref(node)``: device path locks (node up to the
      root). A locked node is never evicted from the device; callers lock the
      ``last_device_node`` of a match for as long as they use the matched pages.
    * A backup (D2H) holds a device path lock and a host path lock on its deepest node from
      issue until ``writing_check`` sees it done, so neither copy is freed mid-transfer. A
      backup the engine reports done and successful as soon as it is issued (a synchronous
      engine), with no earlier backup waiting, is acknowledged at once and takes no locks.
    * A load-back (H2D) holds the same two locks from issue until ``loading_check`` sees it
      done. The loaded pages appear in ``match_prefix`` at once; a forward pass must wait on
      the handle (per layer) before reading them, as upstream.
    * Host eviction skips host-locked nodes; device eviction skips device-locked nodes.

Which thread may call what
    Every method runs on one owner thread (the scheduler's). The cache is not thread-safe.
    Engines may run copies on their own workers; the cache only polls their handles, from
    the owner thread, in ``writing_check`` / ``loading_check`` / ``check_events``.

Write policies (REFERENCE.md 2.3)
    Hits are counted on insert only (walked nodes, split parents, the new leaf; not for
    chunked inserts). ``write_through`` backs a node up once it has 1 hit,
    ``write_through_selective`` once it has 2; the un-backed ancestors are backed up first
    in the same transfer, so backed-up nodes always form a prefix from the root.
    ``write_back`` backs up only inside ``evict``, blocking on the copy; when the host has no
    room even after host eviction, the node is dropped (``dropped_tokens``).

L3 hook (``storage_hook``)
    ``None`` unless a ``StorageController`` (``storage_controller``) attaches itself. Then,
    on the owner thread: each acknowledged backup calls ``on_backup_acked(node)`` (before the
    backup's locks drop, or, for a backup acknowledged when issued, at the end of the insert
    that made it; it may only take host locks and queue work), ``writing_check`` and
    ``check_events`` call ``poll()``, ``reset`` calls ``on_reset()`` before freeing pages, and
    ``sanity_check`` counts ``reserved_host_pages()`` (host pages the controller holds for
    prefetches in flight) as accounted for. ``insert_host`` attaches prefetched host pages.

Failed copies
    A backup or load-back whose handle reports a failure is issued again, from the same
    source pages into the same destination pages (both still locked), when it is
    acknowledged, up to ``config.transfer_retries`` times. If it still fails, the cache
    stops: every call raises ``CacheFailedError`` until ``reset()``, which empties it (and
    forgets callers' locks: they must abandon their requests). A load-back's caller that
    read the pages before the acknowledgement sees the failure through its own handle.

Eviction
    Device: unlocked leaves of the device tier, LRU or LFU. A backed-up leaf is demoted to
    host-only; otherwise it is deleted. Host: host-only, host-unlocked leaves; then (option
    ``host_reclaim``) the host copies of on-device nodes with no backed-up child.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .._checks import check_int
from ..allocator import ID_DTYPE, PageAllocator, check_page_ids, count_nonzero, has_duplicates
from ..transfer import KVTransferEngine, LoadHandle, TransferHandle
from .components import ComponentRegistry
from .config import HiCacheConfig, WritePolicy
from .eviction import PRIORITY_FNS, EvictionIndex
from .metrics import CacheMetrics
from .radix_key import RadixKey, as_radix_key, common_prefix_len, page_key
from .request import CacheRequest
from .tree_node import TreeNode

_EMPTY = np.zeros(0, ID_DTYPE)


class CacheInvariantError(AssertionError):
    """``sanity_check`` found violations; the message lists all of them."""


@dataclass(frozen=True)
class MatchResult:
    """What ``match_prefix`` found.

    ``device_indices``: device page ids of the on-device prefix (a copy).
    ``last_device_node``: deepest on-device node matched (the root if none); lock it to keep
    ``device_indices`` valid. ``last_host_node``: deepest node matched on any tier.
    ``host_hit_length``: tokens after the device prefix that exist on the host only; pass
    ``last_host_node`` to ``load_back`` to bring them to the device.
    """

    device_indices: np.ndarray
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int
    page_size: int

    @property
    def device_hit_length(self) -> int:
        return int(self.device_indices.shape[0]) * self.page_size


@dataclass(frozen=True)
class InsertResult:
    prefix_len: int  # tokens of the key that were already in the tree (either tier)
    last_node: TreeNode  # the node ending at the last inserted page


@dataclass(frozen=True)
class LoadBackResult:
    """A load-back in flight. ``device_pages`` continue the device prefix of the match."""

    device_pages: np.ndarray
    num_tokens: int
    node: TreeNode
    handle: LoadHandle

    def layer_ready(self, layer: int) -> bool:
        return self.handle.layer_done(layer)

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        self.handle.wait_layer(layer, timeout)


class CacheFailedError(RuntimeError):
    """A KV copy failed even after its retries. The cache refuses every call until
    ``reset()`` (the pages the copy named hold undefined bytes and must never be served)."""


class _PendingOp:
    __slots__ = ("node", "handle", "tokens", "t0", "src", "dst", "load")

    def __init__(self, node: TreeNode, handle: TransferHandle, tokens: int, src: np.ndarray, dst: np.ndarray,
                 load: bool) -> None:
        self.node, self.handle, self.tokens, self.t0 = node, handle, tokens, time.perf_counter()
        self.src, self.dst, self.load = src, dst, load  # page ids, to issue the copy again


class HiRadixCache:
    """Radix cache with device and host tiers. See the module docstring for the contract."""

    def __init__(self, config: HiCacheConfig, engine: KVTransferEngine, device_allocator: PageAllocator,
                 sidecars: Mapping[str, KVTransferEngine] | None = None) -> None:
        if not isinstance(config, HiCacheConfig):
            raise TypeError(f"config: expected a HiCacheConfig, got {type(config).__name__}")
        self.components = ComponentRegistry(engine, device_allocator, sidecars)
        if config.page_size != self.components.page_size:
            raise ValueError(f"config: page_size {config.page_size} != the KV geometry's page_size "
                             f"{self.components.page_size}")
        host_alloc = self.components.host_allocator
        if host_alloc.used:
            raise ValueError(f"engine: the host pool must start empty (the cache owns it), {host_alloc.used} "
                             f"pages are in use")
        self.config = config
        self.page_size = config.page_size
        self.device_allocator = device_allocator
        self.host_allocator = host_alloc
        self.write_policy = config.write_policy
        self._threshold = config.write_through_threshold if config.write_policy != WritePolicy.WRITE_BACK else None
        prio = PRIORITY_FNS[config.eviction_policy]
        # One index per tier rule; a node is in at most one of device/host (disjoint by rule).
        self.device_lru = EvictionIndex("device_leaves", 0, prio)
        self.host_lru = EvictionIndex("host_leaves", 1, prio)
        self.reclaim_lru = EvictionIndex("host_reclaimable", 2, prio)
        self._indexes = (self.device_lru, self.host_lru, self.reclaim_lru)
        # The member sets, bound once: _refresh and the walks test membership on every node.
        self._dev_members = self.device_lru.members
        self._host_members = self.host_lru.members
        self._reclaim_members = self.reclaim_lru.members
        self._reclaim = config.host_reclaim
        self.metrics = CacheMetrics()
        self._dev_owned = np.zeros(device_allocator.num_pages, bool)
        self._host_owned = np.zeros(host_alloc.num_pages, bool)
        self._writes: deque[_PendingOp] = deque()
        self._loads: deque[_PendingOp] = deque()
        self._failure: CacheFailedError | None = None  # set when a copy failed for good
        self.storage_hook = None  # a StorageController, when attached (see the module docstring)
        self._init_tree()

    # ------------------------------------------------------------------ tree basics
    def _init_tree(self) -> None:
        root = TreeNode(np.zeros(0, np.int64), None, None)
        root.value = _EMPTY
        root.host_value = _EMPTY
        root.lock_ref = 1  # the root is never evicted on either tier
        root.host_lock_ref = 1
        root.owner = self
        self.root = root
        self._clock = 0
        self.evictable_tokens = 0  # on device, lock_ref == 0
        self.protected_tokens = 0  # on device, lock_ref > 0
        self.host_tokens = 0  # held on the host tier
        for index in self._indexes:
            index.clear()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, node: TreeNode):
        k = node.kb[:8 * self.page_size]
        return (node.namespace, k) if node.parent is self.root else k

    def _refresh(self, node: TreeNode) -> None:
        """Recompute node's membership in every eviction index (after any state change)."""
        if node is self.root or node.deleted:
            return
        on_dev = node.value is not None
        if node.host_value is not None and node.host_lock_ref == 0 and node.host_children == 0:
            host = not on_dev
            reclaim = on_dev and self._reclaim
        else:
            host = reclaim = False
        dev = on_dev and node.lock_ref == 0 and node.dev_children == 0
        # Hot path: most refreshes change nothing, so compare before touching the sets.
        if dev != (node in self._dev_members):
            self.device_lru.set_member(node, dev)
        if host != (node in self._host_members):
            self.host_lru.set_member(node, host)
        if reclaim != (node in self._reclaim_members):
            self.reclaim_lru.set_member(node, reclaim)

    def _touch(self, node: TreeNode, t: int, hit: bool) -> None:
        node.last_access = t
        if hit:
            node.hit_count += 1
        # Re-order the node in the indexes that hold it (inlined EvictionIndex.touch).
        if node in self._dev_members:
            self.device_lru._push(node)
        if node in self._host_members:
            self.host_lru._push(node)
        if node in self._reclaim_members:
            self.reclaim_lru._push(node)

    def _set_device(self, node: TreeNode, ids: np.ndarray) -> None:
        node.value = ids
        self._dev_owned[ids] = True
        if node.lock_ref:
            self.protected_tokens += node.size
        else:
            self.evictable_tokens += node.size
        node.parent.dev_children += 1
        self._refresh(node)
        self._refresh(node.parent)

    def _clear_device(self, node: TreeNode, owned: bool = True) -> np.ndarray:
        """Take ``node``'s pages off the device tier; ``owned=False``: the caller clears
        ``_dev_owned`` for them (one batched write per eviction)."""
        ids = node.value
        assert node.lock_ref == 0, "evicting a locked node"
        node.value = None
        if owned:
            self._dev_owned[ids] = False
        self.evictable_tokens -= node.size
        node.parent.dev_children -= 1
        self._refresh(node)
        self._refresh(node.parent)
        return ids

    def _set_host(self, node: TreeNode, ids: np.ndarray) -> None:
        node.host_value = ids
        self._host_owned[ids] = True
        self.host_tokens += node.size
        node.parent.host_children += 1
        self._refresh(node)
        self._refresh(node.parent)

    def _clear_host(self, node: TreeNode, owned: bool = True) -> np.ndarray:
        ids = node.host_value
        node.host_value = None
        if owned:
            self._host_owned[ids] = False
        self.host_tokens -= node.size
        node.parent.host_children -= 1
        self._refresh(node)
        self._refresh(node.parent)
        return ids

    def _remove_leaf(self, node: TreeNode) -> None:
        """Unlink a node that holds nothing on either tier and has no children."""
        assert node.value is None and node.host_value is None and not node.children
        parent = node.parent
        del parent.children[self._child_key(node)]
        for index in self._indexes:
            index.set_member(node, False)
        node.deleted = True
        node.parent = None
        self._refresh(parent)

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` tokens (a page multiple); returns the new upper node."""
        k = m // self.page_size
        parent = child.parent
        ck = self._child_key(child)
        new = TreeNode(child.kb[:8 * m], child.namespace, parent)
        new.value = None if child.value is None else child.value[:k]
        new.host_value = None if child.host_value is None else child.host_value[:k]
        # Path locks: every holder whose path crossed child crosses the new upper part too.
        new.lock_ref = child.lock_ref
        new.host_lock_ref = child.host_lock_ref
        new.hit_count = child.hit_count
        new.last_access = child.last_access
        child.kb = child.kb[8 * m:]
        child.size -= m
        if child.value is not None:
            child.value = child.value[k:]
        if child.host_value is not None:
            child.host_value = child.host_value[k:]
        child.parent = new
        parent.children[ck] = new
        new.children[self._child_key(child)] = child
        new.dev_children = int(child.value is not None)
        new.host_children = int(child.host_value is not None)
        self._refresh(new)
        return new

    def _walk(self, key: RadixKey, n: int, start: TreeNode | None = None, off: int = 0) -> tuple[list, int]:
        """Read-only walk of ``key``'s first ``n`` tokens (a page multiple): [(node, matched
        tokens, offset)] and total matched tokens. Compares ``key.token_bytes`` (a whole-node
        match is one memcmp; bytes past ``8 * n`` never match).

        With ``start`` (a node whose path spells the first ``off`` tokens, see
        ``_request_path``) the walk continues below it: ``segs`` then lists only the nodes
        after ``start``."""
        segs = []
        if n == off:
            return segs, off
        tokens, qb = key.token_ids, key.token_bytes
        p = self.page_size
        pb = 8 * p
        nb = 8 * n
        if start is None or start is self.root:
            child = self.root.children.get((key.namespace, qb[8 * off:8 * off + pb]))
        else:
            child = start.children.get(qb[8 * off:8 * off + pb])
        while child is not None:
            if qb.startswith(child.kb, 8 * off, nb):
                m = child.size
            else:  # the match ends inside this node: find where (once per walk)
                m = common_prefix_len(child.key, tokens[off:n])
                m -= m % p
            segs.append((child, m, off))
            off += m
            if m < child.size or off == n:
                break
            child = child.children.get(qb[8 * off:8 * off + pb])
        return segs, off

    def _check_node(self, node: object, name: str = "node") -> TreeNode:
        if not isinstance(node, TreeNode):
            raise TypeError(f"{name}: expected a TreeNode, got {type(node).__name__}")
        if node.deleted:
            raise ValueError(f"{name}: {node!r} was removed from the tree")
        if node.owner is not self:  # every live node of this tree has owner == self (sanity_check)
            raise ValueError(f"{name}: {node!r} does not belong to this cache")
        return node

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: object) -> MatchResult:
        """Longest cached page-aligned prefix of ``key``; splits a node the match ends inside.

        Refreshes the access time of every matched node; never counts a hit.
        """
        if self._failure is not None:
            raise self._failure
        key = as_radix_key(key)
        res = self._match(key)
        m = self.metrics
        m.match_calls += 1
        m.match_tokens += len(key) - len(key) % self.page_size
        m.device_hit_tokens += res.device_hit_length
        m.host_hit_tokens += res.host_hit_length
        return res

    def peek_prefix(self, key: object) -> tuple[int, int]:
        """``(device tokens, host-only tokens)`` of the cached page-aligned prefix of ``key``.

        Read-only, unlike ``match_prefix``: no split, no access-time refresh, no metrics, so a
        scheduler may ask it about waiting requests as often as it likes.
        """
        if self._failure is not None:
            raise self._failure
        key = as_radix_key(key)
        tokens = key.token_ids
        segs, _ = self._walk(key, tokens.shape[0] - tokens.shape[0] % self.page_size)
        device = host = 0
        for node, m, _off in segs:
            if node.value is not None:
                device += m
            else:
                host += m
        return device, host

    def _match(self, key: RadixKey) -> MatchResult:
        tokens = key.token_ids
        n = tokens.shape[0] - tokens.shape[0] % self.page_size
        segs, _ = self._walk(key, n)
        t = self._tick()
        dev_vals = []
        last_dev = last = self.root
        host_len = 0
        dm, hm, rm = self._dev_members, self._host_members, self._reclaim_members
        for node, m, _off in segs:
            if m < node.size:
                node = self._split(node, m)
            node.last_access = t  # inlined _touch(node, t, False)
            if node in dm:
                self.device_lru._push(node)
            if node in hm:
                self.host_lru._push(node)
            if node in rm:
                self.reclaim_lru._push(node)
            if node.value is not None:
                dev_vals.append(node.value)
                last_dev = node
            else:
                host_len += m
            last = node
        if not dev_vals:
            dev = _EMPTY.copy()
        elif len(dev_vals) == 1:
            dev = dev_vals[0].copy()
        else:
            dev = np.concatenate(dev_vals)
        return MatchResult(dev, last_dev, last, host_len, self.page_size)

    # ------------------------------------------------------------------ insert
    def insert(self, key: object, device_pages: object, *, chunked: bool = False) -> InsertResult:
        """Insert ``key``'s whole pages with their device pages (one id per whole page).

        The tree takes ownership of the pages it keeps and frees the caller's duplicates
        (see the module docstring). ``chunked=True`` (a chunked-prefill insert) counts no hits.
        """
        if self._failure is not None:
            raise self._failure
        key = as_radix_key(key)
        pages = self._device_pages(device_pages)
        return self._insert(key, pages, chunked)[0]  # pages: a private copy

    def _device_pages(self, ids: object) -> np.ndarray:
        """``check_page_ids`` without the duplicate test, which ``_insert`` does on the pages it
        takes only (the rest equal the tree's own, distinct, pages); see ``_bad_pages``."""
        return check_page_ids(ids, self.device_allocator.num_pages, "device_pages", unique=False)

    def _bad_pages(self, pages: np.ndarray) -> None:
        """On a failed insert check, raise the full ``check_page_ids`` error first (duplicates),
        so errors keep their precedence over the length / ownership / allocation checks."""
        check_page_ids(pages, self.device_allocator.num_pages, "device_pages")

    def _insert(self, key: RadixKey, pages: np.ndarray, chunked: bool, path: list | None = None,
                off0: int = 0) -> tuple[InsertResult, np.ndarray | None, np.ndarray | None]:
        """``insert`` for page ids that passed ``check_page_ids`` (a private copy: the tree may
        keep slices of it). Also returns ``(dup_mask, tree_head)``: where the caller's page
        was a duplicate (freed) among the first ``len(tree_head)`` pages and the tree's page
        ids there; ``(None, None)`` when the tree kept every page of the caller.

        ``path`` / ``off0``: ``_request_path``'s nodes and depth, the tree's on-device nodes that
        already spell the first ``off0`` tokens with the caller's own pages there. The walk
        then starts below them, ``pages`` covers only the tokens after them, and ``dup_mask`` /
        ``tree_head`` are relative to that start. The path nodes are touched (and hit) as a
        walk from the root would touch them."""
        p = self.page_size
        namespace, qb = key.namespace, key.token_bytes
        n = len(key) - len(key) % p
        if pages.shape[0] != (n - off0) // p:
            self._bad_pages(pages)
            raise ValueError(f"device_pages: expected {(n - off0) // p} page ids for {len(key)} tokens "
                             f"(page_size {p}), got {pages.shape[0]}")
        # segs: the walked nodes below the path (all of them without one); their pages
        # are the caller's ``pages[:mp]``.
        segs, matched = self._walk(key, n, path[-1], off0) if path else self._walk(key, n)
        mp = (matched - off0) // p
        # Validate every page the tree would take or free before changing anything: the
        # caller's pages where they differ from the tree's along the matched path, and the
        # new leaf's pages. The tree's page ids are -1 where only the host holds the tokens
        # (there the caller's page is taken, reviving the node).
        dup = dup_mask = tree_head = None
        taken = tail = pages[mp:]
        if segs:
            vals = []
            revive = False
            for node, m, _off in segs:
                v = node.value
                if v is None:
                    revive = True
                    vals.append(np.full(m // p, -1, ID_DTYPE))
                else:
                    vals.append(v if m == node.size else v[:m // p])
            tree_head = np.concatenate(vals) if len(vals) > 1 else vals[0]
            head = pages[:mp]
            mine = head != tree_head  # the caller's page (taken or freed), not the tree's
            if count_nonzero(mine):
                taken = np.concatenate([head[mine], tail])
                dup_mask = (mine & (tree_head >= 0)) if revive else mine
                if count_nonzero(dup_mask):
                    dup = head[dup_mask]
                else:
                    dup_mask = None
        if taken.shape[0]:
            # No repeats in ``pages``: the rest are the tree's pages (distinct), and a taken page
            # that repeats one of them is owned by the tree (caught just below).
            if has_duplicates(taken):
                self._bad_pages(pages)
            owned = self._dev_owned[taken]
            if count_nonzero(owned):
                self._bad_pages(pages)
                raise ValueError(f"device_pages: pages {taken[owned][:8].tolist()} are already owned by the cache "
                                 f"at other positions")
            held = self.device_allocator.allocated_mask(taken)
            if count_nonzero(held) != taken.shape[0]:
                self._bad_pages(pages)
                raise ValueError(f"device_pages: pages {taken[~held][:8].tolist()} are not allocated (double free?)")

        t = self._tick()
        hit = not chunked
        node = self.root
        dm, hm, rm = self._dev_members, self._host_members, self._reclaim_members
        if path:
            # The request's path: device-locked, so in neither the device index (unlocked
            # leaves) nor the host one (host-only nodes); whole nodes, nothing to split or revive.
            for node in path:
                node.last_access = t
                if hit:
                    node.hit_count += 1
                if node in rm:
                    self.reclaim_lru._push(node)
        for node, m, off in segs:
            if m < node.size:
                node = self._split(node, m)
            if node.value is None:  # revive a host-only node (never a path node: those are locked)
                self._set_device(node, pages[(off - off0) // p:(off - off0 + m) // p])
            node.last_access = t  # inlined _touch(node, t, hit)
            if hit:
                node.hit_count += 1
            if node in dm:
                self.device_lru._push(node)
            if node in hm:
                self.host_lru._push(node)
            if node in rm:
                self.reclaim_lru._push(node)
        if matched < n:
            leaf = TreeNode(qb[8 * matched:8 * n], namespace, node)
            fk = qb[8 * matched:8 * (matched + p)]
            node.children[fk if node is not self.root else (namespace, fk)] = leaf
            leaf.last_access = t
            leaf.hit_count = int(hit)
            # Inlined _set_device(leaf, tail): the leaf (unlocked, not backed up) joins the
            # device index; its parent, now with an on-device child, leaves it.
            leaf.value = tail
            self._dev_owned[tail] = True
            self.evictable_tokens += leaf.size
            node.dev_children += 1
            dm.add(leaf)
            self.device_lru._push(leaf)
            if node in dm:
                self.device_lru.set_member(node, False)
            node = leaf
        if dup is not None:
            self.device_allocator.free_owned(dup)  # checked above: distinct, allocated, not the tree's
        if self._threshold is not None and hit and node is not self.root:
            # Deepest node on the path that reached the threshold; its backup carries the
            # un-backed ancestors too (contiguity from the root).
            target = node
            while target is not self.root and target.hit_count < self._threshold:
                target = target.parent
            if target is not self.root and target.host_value is None:
                op = self._backup(target)
                if op is not None:
                    self._writes.append(op)
        return InsertResult(matched, node), dup_mask, tree_head

    def insert_host(self, key: object, host_pages: object, start: int) -> tuple[int, TreeNode | None]:
        """Attach host pages (e.g. read from L3) as host-only nodes; returns (tokens attached, leaf).

        ``host_pages[i]`` (allocated from the host pool, not owned by the tree) holds page
        ``start // page_size + i`` of ``key``. The cache takes every page: it attaches the run
        that continues the tree's backed-up path from its end and frees the rest (pages the tree
        already holds, or pages that no longer connect because the backed-up path now ends
        before ``start`` or a not-backed-up node sits where they would go). The leaf is None
        when nothing was attached.
        """
        if self._failure is not None:
            raise self._failure
        key = as_radix_key(key)
        p = self.page_size
        start = check_int("start", start, 0)
        ids = check_page_ids(host_pages, self.host_allocator.num_pages, "host_pages")
        end = start + ids.shape[0] * p
        if start % p or end > len(key):
            raise ValueError(f"start: {start} must be a page multiple with start + pages <= {len(key)} tokens")
        if ids.size:
            bad = ids[self._host_owned[ids] | ~self.host_allocator.is_allocated(ids)]
            if bad.size:
                raise ValueError(f"host_pages: {bad[:8].tolist()} are free or owned by the tree")
        tokens = key.token_ids
        segs, matched = self._walk(key, end)
        backed, last, last_m = 0, self.root, 0
        for node, m, off in segs:
            if node.host_value is None:
                break
            backed, last, last_m = off + m, node, m
        if ids.size == 0 or backed < start or backed >= end or matched > backed:
            if ids.size:
                self.host_allocator.free(ids)
            return 0, None
        skip = (backed - start) // p
        if last is not self.root and last_m < last.size:
            last = self._split(last, last_m)
        leaf = TreeNode(tokens[backed:end].copy(), key.namespace, last)
        last.children[page_key(leaf.key, 0, p) if last is not self.root
                      else (key.namespace, page_key(leaf.key, 0, p))] = leaf
        leaf.last_access = self._tick()
        self._set_host(leaf, ids[skip:].copy())
        if skip:
            self.host_allocator.free(ids[:skip])
        return end - backed, leaf

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock ``node`` and its ancestors on the device tier. The root is a no-op."""
        if self._failure is not None:
            raise self._failure
        self._check_node(node)
        if node.value is None:
            raise ValueError(f"node: {node!r} is not on the device; lock the last_device_node of a match")
        self._lock(node)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``. Raises ValueError (no change) if that would go below zero."""
        if self._failure is not None:
            raise self._failure
        self._check_node(node)
        n = node
        while n is not self.root:
            if n.lock_ref < 1:
                raise ValueError(f"node: unlock below zero at {n!r}")
            n = n.parent
        self._unlock(node)

    def _lock(self, node: TreeNode) -> None:
        root = self.root
        dm = self._dev_members
        moved = 0
        while node is not root:
            if node.lock_ref == 0:
                moved += node.size
                node.lock_ref = 1
                if node in dm:  # inlined device_lru.set_member(node, False)
                    dm.discard(node)
                    node.heap_stamp[0] = 0
            else:
                node.lock_ref += 1
            node = node.parent
        if moved:
            self.evictable_tokens -= moved
            self.protected_tokens += moved

    def _unlock(self, node: TreeNode) -> None:
        root = self.root
        dl = self.device_lru
        moved = 0
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                moved += node.size
                # Inlined _refresh: the device lock only decides device-index membership, and
                # a locked node is on the device: it joins the index iff it is a device leaf.
                if node.dev_children == 0:
                    dl.set_member(node, True)
            node = node.parent
        if moved:
            self.evictable_tokens += moved
            self.protected_tokens -= moved

    def _move_lock(self, old: TreeNode, new: TreeNode) -> None:
        """``_lock(new)`` then ``_unlock(old)``. When ``old`` is an ancestor of ``new`` (a request
        growing down its path), only the nodes below ``old`` change: the rest keep their count."""
        root = self.root
        path = []
        n = new
        while n is not old:
            if n is root:
                self._lock(new)
                self._unlock(old)
                return
            path.append(n)
            n = n.parent
        dm = self._dev_members
        moved = 0
        for n in path:
            if n.lock_ref == 0:
                moved += n.size
                n.lock_ref = 1
                if n in dm:
                    dm.discard(n)
                    n.heap_stamp[0] = 0
            else:
                n.lock_ref += 1
        if moved:
            self.evictable_tokens -= moved
            self.protected_tokens += moved

    def _host_lock(self, node: TreeNode) -> None:
        root = self.root
        hm, rm = self._host_members, self._reclaim_members
        while node is not root:
            node.host_lock_ref += 1
            if node.host_lock_ref == 1:
                # A host-locked node is in neither host index (inlined _refresh: nothing else changes).
                if node in hm:
                    self.host_lru.set_member(node, False)
                if node in rm:
                    self.reclaim_lru.set_member(node, False)
            node = node.parent

    def _host_unlock(self, node: TreeNode) -> None:
        root = self.root
        while node is not root:
            node.host_lock_ref -= 1
            if node.host_lock_ref == 0:
                self._refresh(node)
            node = node.parent

    def _lock_both(self, node: TreeNode, dev_from: TreeNode | None = None) -> None:
        """``_host_lock(node)`` and ``_lock(dev_from or node)`` in one walk (a transfer's two
        path locks); ``dev_from`` must be ``node`` or one of its ancestors."""
        root = self.root
        dm, hm, rm = self._dev_members, self._host_members, self._reclaim_members
        moved = 0
        if dev_from is None:  # TreeNode has __len__: never test it for truth
            dev_from = node
        dev = dev_from is node  # device locks start at dev_from; host locks at node
        while node is not root:
            if node is dev_from:
                dev = True
            if dev:
                if node.lock_ref == 0:
                    moved += node.size
                    node.lock_ref = 1
                    if node in dm:
                        dm.discard(node)
                        node.heap_stamp[0] = 0
                else:
                    node.lock_ref += 1
            node.host_lock_ref += 1
            if node.host_lock_ref == 1:
                if node in hm:
                    self.host_lru.set_member(node, False)
                if node in rm:
                    self.reclaim_lru.set_member(node, False)
            node = node.parent
        if moved:
            self.evictable_tokens -= moved
            self.protected_tokens += moved

    def _unlock_both(self, node: TreeNode) -> None:
        """``_unlock(node)`` and ``_host_unlock(node)`` in one walk."""
        root = self.root
        dl = self.device_lru
        moved = 0
        while node is not root:
            node.lock_ref -= 1
            node.host_lock_ref -= 1
            if node.lock_ref == 0:
                moved += node.size
                if node.dev_children == 0:  # as in _unlock
                    dl.set_member(node, True)
            if node.host_lock_ref == 0 and node.host_children == 0 and node.host_value is not None:
                self._refresh(node)  # it may join a host index now
            node = node.parent
        if moved:
            self.evictable_tokens += moved
            self.protected_tokens -= moved

    # ------------------------------------------------------------------ backup (D2H)
    def _backup(self, node: TreeNode, ack_now: bool = True) -> _PendingOp | None:
        """Back up ``node`` and its un-backed ancestors, parent first, in one transfer.

        Returns the op to acknowledge later (it holds a device and a host path lock on
        ``node``), or None: no host room (``backup_failed_tokens``), or, with ``ack_now``,
        a copy the engine reports finished and successful when issued while no earlier
        backup waits (a synchronous engine): it is acknowledged here, FIFO order kept, and
        never locks the path."""
        chain = []
        tokens = 0
        n = node
        while n.host_value is None:
            chain.append(n)
            tokens += n.size
            n = n.parent
        anchor = n
        chain.reverse()
        npages = tokens // self.page_size
        # Host eviction must keep the backed-up path's copies (the prefix stays contiguous
        # from the root). The only candidate on the path is the anchor's copy (host reclaim:
        # an on-device node without backed-up children; every node above it has one), so the
        # anchor alone is host-locked meanwhile (a lock, not just leaving the index: host
        # eviction re-indexes a parent whose last backed-up child it removes).
        guard = anchor is not self.root
        if guard:
            anchor.host_lock_ref += 1
            if anchor in self._reclaim_members:
                self.reclaim_lru.set_member(anchor, False)
        host_ids = self._alloc_host(npages)
        if guard:
            anchor.host_lock_ref -= 1
        if host_ids is None:
            self._refresh(anchor)
            self.metrics.backup_failed_tokens += tokens
            return None
        dev_ids = np.concatenate([c.value for c in chain]) if len(chain) > 1 else chain[0].value
        t0 = time.perf_counter()
        handle = self.components.backup(dev_ids, host_ids)
        # _set_host for the whole chain at once: every chain node but the last has a backed-up
        # child now, so only the last and the anchor can change index membership.
        self._host_owned[host_ids] = True
        self.host_tokens += tokens
        off = 0
        p = self.page_size
        for c in chain:
            k = c.size // p
            c.host_value = host_ids[off:off + k]
            c.parent.host_children += 1
            off += k
        m = self.metrics
        m.backup_tokens += tokens
        m.backup_bytes += npages * self.components.bytes_per_page
        if ack_now and not self._writes and handle.done():
            try:
                handle.wait()
            except Exception:  # noqa: BLE001 - a failed copy: acknowledged (and retried) later
                pass
            else:
                self._refresh(node)
                self._refresh(anchor)
                if self.storage_hook is not None:
                    self.storage_hook.on_backup_acked(node)  # L2 -> L3 write-through
                m.backup_seconds += time.perf_counter() - t0
                return None
        # Until acknowledged: the device pages stay (device lock), and so do the new host
        # copies and the anchor's (host lock; the chain joins no host index meanwhile).
        self._lock_both(node)
        self._refresh(anchor)
        return _PendingOp(node, handle, tokens, dev_ids, host_ids, False)

    def _alloc_host(self, npages: int) -> np.ndarray | None:
        ids = self.host_allocator.alloc(npages)
        if ids is None:
            self._evict_host(npages - self.host_allocator.available)
            ids = self.host_allocator.alloc(npages)
        return ids

    def _release(self, op: _PendingOp) -> None:
        self._unlock_both(op.node)

    def writing_check(self, block: bool = False) -> int:
        """Acknowledge finished backups (FIFO, up to the first unfinished one; all if ``block``)."""
        if self._failure is not None:
            raise self._failure
        n = self._ack(self._writes, block)
        if self.storage_hook is not None:
            self.storage_hook.poll()
        return n

    def loading_check(self, block: bool = False) -> int:
        """Acknowledge finished load-backs (FIFO, up to the first unfinished one; all if ``block``)."""
        if self._failure is not None:
            raise self._failure
        return self._ack(self._loads, block)

    def check_events(self) -> None:
        """Poll both queues without blocking (call once per scheduler step)."""
        if self._failure is not None:
            raise self._failure
        if self._writes:
            self.writing_check()
        elif self.storage_hook is not None:
            self.storage_hook.poll()
        if self._loads:
            self.loading_check()

    def flush(self) -> None:
        """Block until every transfer in flight is acknowledged."""
        if self._failure is not None:
            raise self._failure
        self.writing_check(block=True)
        self.loading_check(block=True)

    def _ack(self, queue: deque, block: bool) -> int:
        count = 0
        while queue and (block or queue[0].handle.done()):
            self._finish(queue.popleft())
            count += 1
        return count

    def _finish(self, op: _PendingOp) -> None:
        """Acknowledge ``op``: wait for it (retrying a failed copy), run the L3 hook of a
        backup while its locks still hold, drop the locks, count its time."""
        try:
            self._wait_op(op)
            if not op.load and self.storage_hook is not None:
                self.storage_hook.on_backup_acked(op.node)  # L2 -> L3 write-through
        finally:
            self._release(op)
        m = self.metrics
        if op.load:
            m.load_back_seconds += time.perf_counter() - op.t0
        else:
            m.backup_seconds += time.perf_counter() - op.t0

    def _wait_op(self, op: _PendingOp) -> None:
        """Wait for ``op``'s copy; a failed one is issued again from its source.

        Both ends of the copy are locked until the op is released (after this returns), so
        a retry copies the same bytes into the same pages, and nothing read the destination
        meanwhile (except a load-back's own caller, which sees the failure through its
        handle). If every retry fails, the cache stops (``CacheFailedError``).
        """
        try:
            op.handle.wait()
            return
        except Exception as e:  # noqa: BLE001 - an engine may raise its own error types
            error = e
        m = self.metrics
        for _ in range(self.config.transfer_retries):
            m.transfer_retries += 1
            try:
                (self.components.load if op.load else self.components.backup)(op.src, op.dst).wait()
                return
            except Exception as e:  # noqa: BLE001
                error = e
        m.transfer_failures += 1
        what = "load-back" if op.load else "backup"
        self._failure = CacheFailedError(
            f"a {what} of {op.tokens} tokens failed after {self.config.transfer_retries} retries ({error!r}); "
            f"the cache refuses every call until reset()")
        raise self._failure from error

    @property
    def in_flight(self) -> tuple[int, int]:
        """(backups, load-backs) not yet acknowledged."""
        return len(self._writes), len(self._loads)

    # ------------------------------------------------------------------ eviction
    def alloc_device(self, num_pages: int) -> np.ndarray | None:
        """Allocate device pages for the caller, evicting unlocked leaves if short; None on failure."""
        if self._failure is not None:
            raise self._failure
        return self._alloc(check_int("num_pages", num_pages, 0), False)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens if possible; returns tokens freed."""
        if self._failure is not None:
            raise self._failure
        return self._evict(check_int("num_tokens", num_tokens, 0))[0]

    def _evict(self, num_tokens: int, keep: int = 0) -> tuple[int, np.ndarray | None]:
        """``evict``; returns ``(tokens freed, kept pages)``. With ``keep``, up to that many of
        the pages taken off the tree (the first ones evicted) are not freed: they stay
        allocated and marked as the tree's, and come back as an int32 array (None if none)
        for the tree's own use or the caller's (``_alloc``)."""
        t0 = time.perf_counter()
        m = self.metrics
        m.evict_calls += 1
        freed = demoted = deleted = 0
        free_ids = []
        dm, hm, rm = self._dev_members, self._host_members, self._reclaim_members
        write_back = self.write_policy == WritePolicy.WRITE_BACK
        dl = self.device_lru
        root = self.root
        nxt = None  # a parent that just became the next candidate (see below)
        while freed < num_tokens:
            if nxt is None:
                node = dl.pop()
                if node is None:
                    break
            else:
                node, nxt = nxt, None
            size = node.size
            if node.host_value is None and write_back:
                op = self._backup(node, ack_now=False)
                if op is None:
                    m.dropped_tokens += size
                else:
                    self._finish(op)  # write_back blocks on the copy, as upstream
            # Inlined _clear_device(node, owned=False) (+ _remove_leaf): the node left the
            # device index when popped (write_back: the backup's unlock may have re-listed it).
            assert node.lock_ref == 0, "evicting a locked node"
            free_ids.append(node.value)
            node.value = None
            parent = node.parent
            parent.dev_children -= 1
            freed += size
            if node in dm:
                self.device_lru.set_member(node, False)
            if node.host_value is None:
                # Holds nothing now: it is in no index (never backed up), unlink it.
                del parent.children[self._child_key(node)]
                node.deleted = True
                node.parent = None
                deleted += size
            else:
                # Host-only from now on: a host eviction candidate unless host-locked or a
                # parent of host copies; no longer a reclaim candidate (not on the device).
                if node.host_lock_ref == 0 and node.host_children == 0 and node not in hm:
                    hm.add(node)  # inlined host_lru.set_member(node, True)
                    self.host_lru._push(node)
                if node in rm:
                    self.reclaim_lru.set_member(node, False)
                demoted += size
            # Inlined _refresh(parent): only its device-leaf status can change (one device
            # child fewer); the root is never in an index. A parent that would be popped next
            # anyway (usually: a chain of one conversation's nodes shares its access time) is
            # taken directly, skipping a heap push and pop; the eviction order is the same.
            if parent.dev_children == 0 and parent.lock_ref == 0 and parent is not root and parent not in dm:
                if freed < num_tokens and dl.precedes(parent):
                    nxt = parent
                else:
                    dm.add(parent)  # inlined device_lru.set_member(parent, True)
                    dl._push(parent)
        self.evictable_tokens -= freed  # every evicted node was unlocked: evictable
        m.deleted_device_tokens += deleted
        m.demoted_tokens += demoted
        kept = None
        if free_ids and keep:
            ids = np.concatenate(free_ids) if len(free_ids) > 1 else free_ids[0]
            kept = ids[:keep].copy()  # never a view of a former node's pages
            if ids.shape[0] > keep:
                self._free_tree_pages([ids[keep:]], self._dev_owned, self.device_allocator)
        elif free_ids:
            self._free_tree_pages(free_ids, self._dev_owned, self.device_allocator)
        m.evicted_device_tokens += freed
        m.eviction_seconds += time.perf_counter() - t0
        return freed, kept

    def _alloc(self, num_pages: int, owned: bool) -> np.ndarray | None:
        """``num_pages`` device pages, evicting if short: the caller's (``alloc_device``), or,
        with ``owned``, the tree's own, already marked as the tree's (a load-back's
        destination). The pages an eviction takes off the tree for this go straight to the
        new owner, skipping a free and a re-allocation. None (nothing allocated, the eviction
        done) when the device has no room even after eviction."""
        a = self.device_allocator
        short = num_pages - a.available
        if short <= 0:
            ids = a.alloc(num_pages)
            if owned:
                self._dev_owned[ids] = True
            return ids
        _freed, kept = self._evict(short * self.page_size, keep=num_pages)
        rest = num_pages - (0 if kept is None else kept.shape[0])
        more = a.alloc(rest) if rest else None
        if rest and more is None:
            if kept is not None:  # still the tree's: free them as an eviction would have
                self._free_tree_pages([kept], self._dev_owned, a)
            return None
        if kept is not None and not owned:
            self._dev_owned[kept] = False  # the caller's now (still allocated)
        if more is not None and owned:
            self._dev_owned[more] = True
        if kept is None:
            return more
        return kept if more is None else np.concatenate([kept, more])

    @staticmethod
    def _free_tree_pages(free_ids: list, owned: np.ndarray, allocator: PageAllocator) -> None:
        """Return the pages an eviction took off one tier: one ownership-bitmap write and one
        allocator free for the whole batch (distinct by the ownership bitmap)."""
        ids = np.concatenate(free_ids, dtype=np.intp) if len(free_ids) > 1 else free_ids[0].astype(np.intp)
        owned[ids] = False
        allocator.free_owned(ids)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens if possible; returns tokens freed."""
        if self._failure is not None:
            raise self._failure
        pages = -(-check_int("num_tokens", num_tokens, 0) // self.page_size)
        return self._evict_host(pages) * self.page_size

    def _evict_host(self, num_pages: int) -> int:
        t0 = time.perf_counter()
        m = self.metrics
        m.evict_host_calls += 1
        want = num_pages * self.page_size
        freed = 0
        free_ids = []
        while freed < want:
            node = self.host_lru.pop()
            if node is None:
                break
            free_ids.append(self._clear_host(node, owned=False))
            freed += node.size
            m.evicted_host_tokens += node.size
            self._remove_leaf(node)
        while freed < want:
            node = self.reclaim_lru.pop()
            if node is None:
                break
            free_ids.append(self._clear_host(node, owned=False))
            freed += node.size
            m.reclaimed_host_tokens += node.size
        if free_ids:
            self._free_tree_pages(free_ids, self._host_owned, self.host_allocator)
        m.host_eviction_seconds += time.perf_counter() - t0
        return freed // self.page_size

    # ------------------------------------------------------------------ load-back (H2D)
    def load_back(self, node: TreeNode, mem_quota: int | None = None) -> LoadBackResult | None:
        """Load the host-only chain ending at ``node`` (a match's ``last_host_node``) to the device.

        All or nothing: returns None (and changes nothing) when the chain is shorter than
        ``load_back_threshold`` tokens, longer than ``mem_quota`` tokens, or the device has
        no room even after eviction. The loaded nodes count as on-device at once, locked
        until ``loading_check`` acknowledges the copy.
        """
        if self._failure is not None:
            raise self._failure
        self._check_node(node)
        if mem_quota is not None:
            mem_quota = check_int("mem_quota", mem_quota, 0)
        chain = []
        tokens = 0
        n = node
        while n.value is None:
            chain.append(n)
            tokens += n.size
            n = n.parent
        anchor = n
        m = self.metrics
        if not chain:
            return None
        if tokens < self.config.load_back_threshold or (mem_quota is not None and tokens > mem_quota):
            m.load_back_skipped += 1
            return None
        chain.reverse()
        npages = tokens // self.page_size
        # Protect the anchor (device) and the chain (host) while eviction makes room; one walk.
        self._lock_both(node, anchor)
        dev = self._alloc(npages, True)
        if dev is None:
            self._unlock(anchor)
            self._host_unlock(node)
            m.load_back_skipped += 1
            return None
        host_ids = np.concatenate([c.host_value for c in chain]) if len(chain) > 1 else chain[0].host_value
        try:
            handle = self.components.load(host_ids, dev)
        except BaseException:  # the engine refused the copy: give the pages back, then raise
            self._free_tree_pages([dev], self._dev_owned, self.device_allocator)
            self._unlock(anchor)
            self._host_unlock(node)
            raise
        # _set_device for the whole chain at once, then _lock(node): the anchor's path already
        # holds the lock taken above, so only the chain nodes (evicted, so unlocked) get theirs.
        # Each chain node but the last gets an on-device child and the last is locked, so no
        # chain node joins the device index; chain nodes are host-locked, so they join no host
        # index: only the anchor's membership can change.
        self.protected_tokens += tokens
        off = 0
        p = self.page_size
        for c in chain:
            k = c.size // p
            c.value = dev[off:off + k]
            c.lock_ref = 1
            c.parent.dev_children += 1
            off += k
        self._refresh(anchor)
        self._loads.append(_PendingOp(node, handle, tokens, host_ids, dev, True))
        m.load_back_calls += 1
        m.loaded_tokens += tokens
        m.loaded_bytes += npages * self.components.bytes_per_page
        return LoadBackResult(dev.copy(), tokens, node, handle)

    # ------------------------------------------------------------------ request helpers
    def begin_request(self, key: object, mem_quota: int | None = None,
                      load_back: bool = True) -> tuple[CacheRequest, LoadBackResult | None]:
        """Match ``key``, load back its host continuation (if worth it), lock the device prefix.

        Returns the request (its ``device_pages`` = the cached prefix, owned by the tree) and
        the load-back in flight, if any.
        """
        if self._failure is not None:
            raise self._failure
        key = as_radix_key(key)
        res = self.match_prefix(key)
        pages, last = res.device_indices, res.last_device_node
        lb = None
        if load_back and res.host_hit_length:
            lb = self.load_back(res.last_host_node, mem_quota)
            if lb is not None:
                pages = np.concatenate([pages, lb.device_pages])
                last = lb.node
        if last is not self.root:
            self._lock(last)
        req = CacheRequest(key, self.page_size, pages, last if last is not self.root else None,
                           pages.shape[0])
        return req, lb

    def _check_request(self, req: object) -> CacheRequest:
        if not isinstance(req, CacheRequest):
            raise TypeError(f"req: expected a CacheRequest, got {type(req).__name__}")
        if req.page_size != self.page_size:
            raise ValueError(f"req: page_size {req.page_size} != cache page_size {self.page_size}")
        want = -(-len(req.key) // self.page_size)
        if req.device_pages.shape[0] != want:
            raise ValueError(f"req: {len(req.key)} tokens need {want} device pages, it holds "
                             f"{req.device_pages.shape[0]}")
        if req.last_node is not None:
            self._check_node(req.last_node, "req.last_node")
        return req

    def _request_path(self, req: CacheRequest, qb: bytes, n: int) -> tuple[list | None, bytes | None, int]:
        """The nodes from the root to ``req.last_node``, when they spell the request's first
        ``cached_pages`` pages (checked byte by byte against ``qb``, the bytes of at least
        the request's first ``n`` tokens, its whole pages): the request helpers then insert
        from there, with ``qb`` and the path's length in tokens. ``(None, None, 0)`` when they
        do not (the insert then walks from the root).

        Their pages are the request's first ``cached_pages`` (``CacheRequest``'s contract: the
        tree's pages, kept on the device by the request's lock), so only the pages after them
        need checking, and the walk over them needs no child lookups."""
        node = req.last_node
        if node is None or node.lock_ref < 1 or node.namespace != req.key.namespace:
            return None, None, 0
        depth = req.cached_pages * self.page_size
        if depth > n:
            return None, None, 0
        # Walk up from the node, checking each one's bytes where it must sit: one memcmp per
        # node, no child lookups; the path must end at the root exactly at offset 0.
        path = []
        end = 8 * depth
        root = self.root
        while node is not root:
            kb = node.kb
            end -= len(kb)
            if end < 0 or not qb.startswith(kb, end):
                return None, None, 0
            path.append(node)
            node = node.parent
        if end:
            return None, None, 0
        path.reverse()
        return path, qb, depth

    def _insert_request(self, req: CacheRequest, chunked: bool):
        """``_insert`` of the request's whole pages; returns ``(result, dup_mask, tree_head,
        first page dup_mask refers to)``."""
        p = self.page_size
        key = req.key
        aligned = len(key) // p
        path, _qb, depth = self._request_path(req, key.token_bytes, aligned * p)
        if path is None:
            pages = self._device_pages(req.device_pages[:aligned])
            return self._insert(key, pages, chunked) + (0,)
        pages = self._device_pages(req.device_pages[req.cached_pages:aligned])
        return self._insert(key, pages, chunked, path, depth) + (req.cached_pages,)

    def cache_unfinished_req(self, req: CacheRequest, chunked: bool = False) -> None:
        """Insert the request's whole pages so far and re-point it at the tree's pages.

        Duplicate pages are freed and replaced in ``req.device_pages`` by the tree's; the lock
        moves to the new deepest node. A trailing partial page stays with the request.
        """
        if self._failure is not None:
            raise self._failure
        self._check_request(req)
        p = self.page_size
        aligned = req.key.token_ids.shape[0] // p
        ins, dup_mask, tree_head, head0 = self._insert_request(req, chunked)
        node = ins.last_node
        if node is not self.root:
            # Everything just inserted is on the device: point the request at the tree's page
            # ids along the path (they differ from its own only where its pages were duplicates).
            if dup_mask is not None:
                dev = req.device_pages.copy()
                head = dev[head0:head0 + tree_head.shape[0]]
                head[dup_mask] = tree_head[dup_mask]
                req.device_pages = dev
            if req.last_node is not None:
                self._move_lock(req.last_node, node)
            else:
                self._lock(node)
        elif req.last_node is not None:
            self._unlock(req.last_node)
        req.last_node = node if node is not self.root else None
        req.cached_pages = aligned

    def cache_finished_req(self, req: CacheRequest) -> None:
        """Insert the finished request's whole pages, free its partial tail page, unlock it."""
        if self._failure is not None:
            raise self._failure
        self._check_request(req)
        p = self.page_size
        aligned = req.key.token_ids.shape[0] // p
        tail = req.device_pages[aligned:]
        if tail.size:
            bad = tail[self._dev_owned[tail] | ~self.device_allocator.is_allocated(tail)]
            if bad.size:
                raise ValueError(f"req.device_pages: tail pages {bad.tolist()} are not the request's to free")
        self._insert_request(req, False)
        if tail.size:
            self.device_allocator.free(tail)
        if req.last_node is not None:
            self._unlock(req.last_node)
        req.last_node = None
        req.device_pages = _EMPTY.copy()
        req.cached_pages = 0

    # ------------------------------------------------------------------ reset / stats / checks
    def reset(self) -> None:
        """Drop everything: wait for transfers, free every page the tree owns.

        Raises RuntimeError (after the wait, before freeing) while callers still hold locks.
        After a ``CacheFailedError`` it waits for the copies in flight ignoring their errors,
        and drops callers' locks too: callers must abandon every request they held.
        """
        if self._failure is None:
            self.flush()
            if self.protected_tokens:
                raise RuntimeError(f"reset: callers still hold locks on {self.protected_tokens} device tokens")
        else:
            for op in (*self._writes, *self._loads):
                try:  # a copy still running must not land in pages the next user gets
                    op.handle.wait()
                except Exception:  # noqa: BLE001 - the cache is being emptied anyway
                    pass
            self._writes.clear()
            self._loads.clear()
            self._failure = None
        if self.storage_hook is not None:
            self.storage_hook.on_reset()  # L3 backups still reading host pages finish first
        dev = np.flatnonzero(self._dev_owned).astype(ID_DTYPE)
        host = np.flatnonzero(self._host_owned).astype(ID_DTYPE)
        self.device_allocator.free(dev)
        self.host_allocator.free(host)
        self._dev_owned[:] = False
        self._host_owned[:] = False
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.deleted = n is not self.root
        self._init_tree()

    def all_nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def stats(self) -> dict:
        m = self.metrics
        cached = m.device_hit_tokens + m.loaded_tokens
        return {
            "write_policy": self.write_policy.value,
            "eviction_policy": self.config.eviction_policy.value,
            "page_size": self.page_size,
            "nodes": len(self.all_nodes()) - 1,
            "device_tree_tokens": self.evictable_tokens + self.protected_tokens,
            "device_evictable_tokens": self.evictable_tokens,
            "device_protected_tokens": self.protected_tokens,
            "device_free_tokens": self.device_allocator.available * self.page_size,
            "device_total_tokens": self.device_allocator.num_pages * self.page_size,
            "host_tree_tokens": self.host_tokens,
            "host_free_tokens": self.host_allocator.available * self.page_size,
            "host_total_tokens": self.host_allocator.num_pages * self.page_size,
            "backups_in_flight": len(self._writes),
            "loads_in_flight": len(self._loads),
            "hit_rate": cached / m.match_tokens if m.match_tokens else 0.0,
            "metrics": m.as_dict(),
        }

    def sanity_check(self, external_device_pages: int | None = None) -> None:
        """Verify every invariant; gathers all violations, then raises CacheInvariantError once.

        ``external_device_pages``: device pages the caller holds outside the tree (allocated,
        not yet inserted). When given, also checks free + tree + external == total.
        """
        from .invariants import collect_violations

        errors = collect_violations(self, external_device_pages)
        if errors:
            raise CacheInvariantError(f"{len(errors)} cache invariant violation(s):\n  " + "\n  ".join(errors))
