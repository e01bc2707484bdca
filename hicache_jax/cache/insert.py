"""Insertion: a key's whole pages into the tree, with device pages (``insert``) or, from L3,
with host pages (``attach_host``).

Pure numpy, owner thread only. The facade validates arguments; this module validates the
pages against the tree (before anything changes) and applies the insert.

Who frees duplicates: the tree. ``insert(key, pages)`` takes one page id per whole page of
``key``. Where the tree already holds a page on the device for the same position, the
caller's page is a duplicate and is freed (unless it *is* the tree's page, e.g. a prefix the
caller got from ``match_prefix``). Where the tree holds the tokens on the host only, the
caller's page revives the node on the device. Every page the tree would take or free is
checked first: allocated, not already owned by the tree, no repeats.

Statistics: the walked nodes, split parents and the new leaf get the access time, a hit
and the request's priority (the highest one wins); then the write policy sees the deepest
node (``after_insert``). No hit is counted for a chunked insert, under write_back (as
upstream: its LFU then orders by access time) or for a revived node (recomputed, not
served); a split's unmatched remainder gets the access time too when
``stamp_split_remainder`` (``decisions``).
"""

from __future__ import annotations

import numpy as np

from ..allocator import ID_DTYPE, check_page_ids, count_nonzero, has_duplicates
from .radix_key import RadixKey
from .residency import Residency
from .results import InsertResult
from .tree import RadixTree
from .tree_node import TreeNode
from .write_policy import WritePolicyDriver


class Inserter:
    """Applies inserts; see the module docstring."""

    def __init__(
        self,
        tree: RadixTree,
        residency: Residency,
        policy: WritePolicyDriver,
        page_size: int,
        count_hits: bool,
        stamp_split_remainder: bool,
    ) -> None:
        self.tree = tree
        self.res = residency
        self.policy = policy
        self.page_size = page_size
        self.count_hits = count_hits  # False under write_back (``decisions``)
        self.stamp_split_remainder = stamp_split_remainder
        self.hooked: tuple = ()  # components with their own residency (``components``)
        # Whether ``insert_host`` gives device-only nodes on its path the pages read for them
        # (False with a stateful component that cannot place its pages there: the owner sets it).
        self.device_only_host_copies = True
        # Several ranks: nodes of backup chains reserved for an agreement and not yet decided
        # (``BackupIssuer.reserved``, the same dict); such a node never takes pages here.
        self.reserved: dict = {}

    def bad_pages(self, pages: np.ndarray) -> None:
        """On a failed insert check, raise the full ``check_page_ids`` error first (duplicates),
        so errors keep their precedence over the length / ownership / allocation checks."""
        check_page_ids(pages, self.res.device_allocator.num_pages, "device_pages")

    def insert(
        self,
        key: RadixKey,
        pages: np.ndarray,
        chunked: bool,
        path: list | None = None,
        off0: int = 0,
        priority: int = 0,
        comp_pages: dict | None = None,
    ) -> tuple[InsertResult, np.ndarray | None, np.ndarray | None]:
        """Insert for page ids that passed ``check_page_ids`` without its duplicate test (a
        private copy: the tree may keep slices of it). Also returns ``(dup_mask, tree_head)``:
        where the caller's page was a duplicate (freed) among the first ``len(tree_head)``
        pages and the tree's page ids there; ``(None, None)`` when the tree kept every page.

        ``path`` / ``off0``: the request helpers' locked path (``request_helpers``), the tree's
        on-device nodes that already spell the first ``off0`` tokens with the caller's own
        pages there. The walk then starts below them, ``pages`` covers only the tokens after
        them, and ``dup_mask`` / ``tree_head`` are relative to that start. The path nodes are
        touched (and hit) as a walk from the root would touch them.

        ``comp_pages``: the pages of components with their own page ids (by name; one id per
        page of ``pages``, -1 where the caller has none), handed to their ``check_insert``
        (before anything changes) and ``on_insert_span`` (before the write policy runs) hooks:
        the component takes or frees every id that is not -1."""
        p = self.page_size
        res = self.res
        tree = self.tree
        namespace, qb = key.namespace, key.token_bytes
        n = len(key) - len(key) % p
        if pages.shape[0] != (n - off0) // p:
            self.bad_pages(pages)
            raise ValueError(
                f"device_pages: expected {(n - off0) // p} page ids for {len(key)} tokens "
                f"(page_size {p}), got {pages.shape[0]}"
            )
        # segs: the walked nodes below the path (all of them without one); their pages
        # are the caller's ``pages[:mp]``.
        segs, matched = tree.walk(key, n, path[-1], off0) if path else tree.walk(key, n)
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
                    vals.append(v if m == node.size else v[: m // p])
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
                self.bad_pages(pages)
            owned = res.dev_owned[taken]
            if count_nonzero(owned):
                self.bad_pages(pages)
                raise ValueError(
                    f"device_pages: pages {taken[owned][:8].tolist()} are already owned by the cache at other positions"
                )
            held = res.device_allocator.allocated_mask(taken)
            if count_nonzero(held) != taken.shape[0]:
                self.bad_pages(pages)
                raise ValueError(f"device_pages: pages {taken[~held][:8].tolist()} are not allocated (double free?)")

        hooked = self.hooked
        if hooked:
            for comp in hooked:
                comp.check_insert(segs, off0, None if comp_pages is None else comp_pages.get(comp.name))
        t = tree.tick()
        hit = self.count_hits and not chunked
        root = tree.root
        node = root
        dm, hm, rm = res.dev_members, res.host_members, res.reclaim_members
        dl, hl, rl = res.device_index, res.host_index, res.reclaim_index
        if path:
            # The request's path: device-locked, so in neither the device index (unlocked
            # leaves) nor the host one (host-only nodes); whole nodes, nothing to split or revive.
            for node in path:
                node.last_access = t
                if hit:
                    node.hit_count += 1
                if priority > node.priority:
                    node.priority = priority
                if node in rm:
                    rl.push(node)
        for node, m, off in segs:
            if m < node.size:
                lower = node
                node = tree.split(lower, m)
                if self.stamp_split_remainder:
                    res.stamp(lower, t)
            if node.value is None:  # revive a host-only node (never a path node: those are locked)
                # No hit: the caller recomputed these tokens, the cache did not serve them.
                res.set_device(node, pages[(off - off0) // p : (off - off0 + m) // p])
                if hooked:
                    for comp in hooked:
                        comp.on_insert(node)
            elif hit:
                node.hit_count += 1
            node.last_access = t  # inlined touch: re-order the node where it is listed
            if priority > node.priority:
                node.priority = priority
            if node in dm:
                dl.push(node)
            if node in hm:
                hl.push(node)
            if node in rm:
                rl.push(node)
        if matched < n:
            leaf = tree.attach(node, qb[8 * matched : 8 * n], namespace)
            leaf.last_access = t
            leaf.created = t
            leaf.hit_count = int(hit)
            leaf.priority = priority
            # Inlined set_device(leaf, tail): the leaf (unlocked, not backed up) joins the
            # device index; its parent, now with an on-device child, leaves it.
            leaf.value = tail
            res.dev_owned[tail] = True
            res.evictable_tokens += leaf.size
            node.dev_children += 1
            dm.add(leaf)
            dl.push(leaf)
            if node in dm:
                dl.set_member(node, False)
            node = leaf
            if res.watch is not None:
                res.watch.stored("device", leaf)
            if hooked:
                for comp in hooked:
                    comp.on_insert(leaf)
        if dup is not None:
            res.device_allocator.free_owned(dup)  # checked above: distinct, allocated, not the tree's
        if hooked and node is not root:
            for comp in hooked:
                comp.on_insert_span(node, n - off0, None if comp_pages is None else comp_pages.get(comp.name))
        if hit and node is not root:
            self.policy.after_insert(node)
        return InsertResult(matched, node), dup_mask, tree_head

    def attach_host(
        self, key: RadixKey, ids: np.ndarray, start: int, comp_pages: dict | None = None
    ) -> tuple[int, TreeNode | None]:
        """Attach host pages (allocated, not the tree's; ``ids[i]`` holds page
        ``start // page_size + i`` of ``key``) as host-only nodes; returns (tokens attached,
        leaf). The tree takes every page: it attaches the run that continues its backed-up
        path from its end and frees the rest (pages it already holds, or pages that no longer
        connect because the backed-up path now ends before ``start``). Device-only nodes
        after the backed-up path (a prefetch anchored before them: ``backed_up_prefix``) take
        the pages of their tokens as host copies, parent first, the last one split at the
        walk's end, and the rest attaches below them; where ``device_only_host_copies`` is off
        (a stateful component without it), or one of those nodes is in a backup chain reserved
        for the ranks' agreement and not yet decided (``reserved``: its host copy is promised
        to that backup; only reachable from inside an agreement), the pages are freed there
        instead, and so is the rest (it would not connect). The leaf is the deepest node given
        pages, None when nothing was attached.
        ``comp_pages``: host pages of components with their own ids (by name, aligned with
        ``ids``, -1 where none), handed to their ``on_attach_host`` hook, which keeps or frees
        each one."""
        p = self.page_size
        res = self.res
        tree = self.tree
        end = start + ids.shape[0] * p
        segs, matched = tree.walk(key, end)
        root = tree.root
        backed, last, last_m = 0, root, 0
        k = 0  # segs[k:]: the walked nodes after the backed-up ones (on the device only)
        for node, m, off in segs:
            if node.host_value is None:
                break
            backed, last, last_m = off + m, node, m
            k += 1
        if (
            ids.size == 0
            or backed < start
            or backed >= end
            or matched > backed
            and (
                not self.device_only_host_copies
                or self.reserved
                and any(node in self.reserved for node, _m, _off in segs[k:])
            )
        ):
            if ids.size:
                res.host_allocator.free(ids)
            if self.hooked:
                for comp in self.hooked:
                    comp.on_attach_host(None, None if comp_pages is None else comp_pages.get(comp.name), 0)
            return 0, None
        skip = (backed - start) // p
        if last is not root and last_m < last.size:
            last = tree.split(last, last_m)
        for node, m, off in segs[k:]:
            # On the device only (contiguity: nothing below a node without a host copy has
            # one): the pages read for its tokens become its host copy, parent first, so the
            # backed-up path stays a prefix from the root.
            if m < node.size:
                node = tree.split(node, m)
            res.set_host(node, ids[(off - start) // p : (off + m - start) // p].copy())
            last = node
        leaf = last
        if matched < end:
            leaf = tree.attach(last, key.token_bytes[8 * matched : 8 * end], key.namespace)
            leaf.last_access = leaf.created = tree.tick()
            res.set_host(leaf, ids[(matched - start) // p :].copy())
        if self.hooked:
            for comp in self.hooked:
                comp.on_insert(leaf)
                comp.on_attach_host(leaf, None if comp_pages is None else comp_pages.get(comp.name), skip)
        if skip:
            res.host_allocator.free(ids[:skip])
        return end - backed, leaf
