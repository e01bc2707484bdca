"""Every invariant of a HiRadixCache, recomputed from scratch through its read-only
``CacheDebugView`` (upstream's invariants: sglang ``hiradix_cache.py`` sanity checks).

Pure numpy. ``collect_violations`` never raises on the first problem: it gathers them all
so one failing fuzz step shows the whole picture; ``HiRadixCache.sanity_check`` raises once.
It is O(tree size) and meant for tests and debugging, not the serving hot path. Stateful
plug-in components add their own violations (``KVComponent.check``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .errors import CacheInvariantError
from .radix_key import page_key

if TYPE_CHECKING:  # pragma: no cover
    from .debug_view import CacheDebugView


def raise_violations(
    view: "CacheDebugView", external_device_pages: int | None = None, external_pages: dict | None = None
) -> None:
    """``HiRadixCache.sanity_check``: ``CacheInvariantError`` listing every violation, if any."""
    found = collect_violations(view, external_device_pages, external_pages)
    if found:
        raise CacheInvariantError(f"{len(found)} cache invariant violation(s):\n  " + "\n  ".join(found))


def collect_violations(
    view: "CacheDebugView", external_device_pages: int | None = None, external_pages: dict | None = None
) -> list[str]:
    errs: list[str] = []
    cache = view.cache  # only to test node ownership
    root = view.root
    p = view.page_size

    # ---- root and links -----------------------------------------------------------------
    if root.parent is not None:
        errs.append("root has a parent")
    if root.value is None or root.value.size or root.host_value is None or root.host_value.size:
        errs.append("root must hold an empty value on both tiers")
    if root.lock_ref < 1 or root.host_lock_ref < 1:
        errs.append(f"root must stay locked on both tiers (lock={root.lock_ref}, host_lock={root.host_lock_ref})")
    if len(root):
        errs.append("root has a non-empty key")

    nodes = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node.id in seen:
            errs.append(f"cycle or shared child at {node!r}")
            continue
        seen.add(node.id)
        nodes.append(node)
        if node.owner is not cache:
            errs.append(f"{node!r}: owner is not this cache (the O(1) handle check would misjudge it)")
        for ck, child in node.children.items():
            if child.parent is not node:
                errs.append(f"{child!r}: parent link does not point at {node!r}")
            if child.deleted:
                errs.append(f"{child!r}: deleted node still linked")
            if len(child) == 0 or len(child) % p:
                errs.append(f"{child!r}: key length {len(child)} is not a positive multiple of page_size {p}")
                continue
            expect = page_key(child.key, 0, p)
            if node is root:
                expect = (child.namespace, expect)
            elif child.namespace != node.namespace:
                errs.append(f"{child!r}: namespace {child.namespace} differs from its parent's {node.namespace}")
            if ck != expect:
                errs.append(f"{child!r}: child-dict key does not match its first page")
            stack.append(child)

    # ---- per node -------------------------------------------------------------------------
    evictable = protected = host_tokens = 0
    dev_pages, host_pages = [], []
    want_dev, want_host, want_reclaim = set(), set(), set()
    for node in nodes:
        if node is root:
            continue
        on_dev, backed = node.value is not None, node.host_value is not None
        k = len(node) // p
        if not on_dev and not backed:
            errs.append(f"{node!r}: dead node (neither on device nor backed up)")
        if on_dev:
            if node.value.shape != (k,):
                errs.append(f"{node!r}: {node.value.shape[0]} device pages for {k} pages of tokens")
            dev_pages.append(node.value)
            if node.lock_ref:
                protected += len(node)
            else:
                evictable += len(node)
            if node.parent.value is None:
                errs.append(f"{node!r}: on device but its parent {node.parent!r} is not")
        elif node.lock_ref:
            errs.append(f"{node!r}: evicted but device-locked")
        if backed:
            if node.host_value.shape != (k,):
                errs.append(f"{node!r}: {node.host_value.shape[0]} host pages for {k} pages of tokens")
            host_pages.append(node.host_value)
            host_tokens += len(node)
            if node.parent.host_value is None:
                errs.append(f"{node!r}: backed up but its parent {node.parent!r} is not (contiguity)")
        if node.lock_ref < 0 or node.host_lock_ref < 0:
            errs.append(f"{node!r}: negative lock count")
        # Path locks: every holder through a child also holds the node.
        if sum(c.lock_ref for c in node.children.values()) > node.lock_ref:
            errs.append(f"{node!r}: children's path locks exceed its own {node.lock_ref}")
        if sum(c.host_lock_ref for c in node.children.values()) > node.host_lock_ref:
            errs.append(f"{node!r}: children's host path locks exceed its own {node.host_lock_ref}")
        dc = sum(c.value is not None for c in node.children.values())
        hc = sum(c.host_value is not None for c in node.children.values())
        if dc != node.dev_children or hc != node.host_children:
            errs.append(f"{node!r}: child counters ({node.dev_children}, {node.host_children}) != actual ({dc}, {hc})")
        if on_dev and node.lock_ref == 0 and dc == 0:
            want_dev.add(node)
        if not on_dev and backed and node.host_lock_ref == 0 and hc == 0:
            want_host.add(node)
            if node.children:
                errs.append(f"{node!r}: host-only node with children that are not backed up")
        if view.config.host_reclaim and on_dev and backed and node.host_lock_ref == 0 and hc == 0:
            want_reclaim.add(node)
    # Root's counters too (its children are real nodes).
    dc = sum(c.value is not None for c in root.children.values())
    hc = sum(c.host_value is not None for c in root.children.values())
    if dc != root.dev_children or hc != root.host_children:
        errs.append(f"root: child counters ({root.dev_children}, {root.host_children}) != actual ({dc}, {hc})")

    # ---- tracking sets ----------------------------------------------------------------------
    device_index, host_index, reclaim_index = view.indexes
    for index, want in ((device_index, want_dev), (host_index, want_host), (reclaim_index, want_reclaim)):
        if index.members != want:
            extra = [n for n in index.members if n not in want][:4]
            missing = [n for n in want if n not in index.members][:4]
            errs.append(f"{index.name}: stale members {extra}, missing {missing}")
        errs.extend(index.check())
    both = device_index.members & host_index.members
    if both:
        errs.append(f"nodes in both the device and host eviction sets: {list(both)[:4]}")

    # ---- counts -----------------------------------------------------------------------------
    counters = view.counters
    if evictable != counters["evictable_tokens"] or protected != counters["protected_tokens"]:
        errs.append(
            f"device counts: evictable {counters['evictable_tokens']} / protected "
            f"{counters['protected_tokens']}, recomputed {evictable} / {protected}"
        )
    if host_tokens != counters["host_tokens"]:
        errs.append(f"host tokens {counters['host_tokens']}, recomputed {host_tokens}")

    # ---- in-flight transfers ----------------------------------------------------------------
    for kind, n in view.pending():
        if n.deleted:
            errs.append(f"{kind} in flight on a deleted node {n!r}")
        if n.lock_ref < 1 or n.host_lock_ref < 1:
            errs.append(f"{kind} in flight on {n!r} without device and host locks")
        if n.value is None or (kind == "backup" and n.host_value is None):
            errs.append(f"{kind} in flight on {n!r} whose pages are gone")

    # ---- pages and allocators ------------------------------------------------------------------
    for name, alloc, pages, owned in (
        ("device", view.device_allocator, dev_pages, view.device_owned),
        ("host", view.host_allocator, host_pages, view.host_owned),
    ):
        try:
            alloc.check()
        except AssertionError as e:
            errs.append(f"{name} allocator: {e}")
        ids = np.concatenate(pages) if pages else np.zeros(0, np.int64)
        uniq, counts = np.unique(ids, return_counts=True)
        if (counts > 1).any():
            errs.append(f"{name} pages held by two nodes: {uniq[counts > 1][:8].tolist()}")
        if ids.size and not alloc.is_allocated(ids).all():
            errs.append(
                f"{name} pages in the tree but free in the allocator: {ids[~alloc.is_allocated(ids)][:8].tolist()}"
            )
        mask = np.zeros(alloc.num_pages, bool)
        mask[ids] = True
        if not np.array_equal(mask, owned):
            errs.append(
                f"{name} ownership bitmap disagrees with the tree at pages {np.flatnonzero(mask != owned)[:8].tolist()}"
            )
        if name == "host":
            # Host pages an attached L3 controller holds for prefetches in flight (not the tree's).
            res = view.reserved_host_pages()
            if res.size and (np.unique(res).size != res.size or mask[res].any() or not alloc.is_allocated(res).all()):
                errs.append("host pages reserved by the storage controller are repeated, free or owned by the tree")
            if alloc.available + uniq.size + res.size != alloc.num_pages:
                errs.append(
                    f"host pool memory leak detected: free {alloc.available} + tree {uniq.size} + "
                    f"reserved {res.size} != total {alloc.num_pages}"
                )
        if name == "device":
            if (evictable + protected) // p != uniq.size:
                errs.append(f"device pages {uniq.size} != (evictable + protected) tokens / page_size")
            if (
                external_device_pages is not None
                and alloc.available + uniq.size + external_device_pages != alloc.num_pages
            ):
                errs.append(
                    f"device pool memory leak detected: free {alloc.available} + tree {uniq.size} + "
                    f"external {external_device_pages} != total {alloc.num_pages}"
                )
    # ---- caller locks ---------------------------------------------------------------------------
    # Every caller lock is a device path lock through one of the root's children.
    through_root = sum(c.lock_ref for c in root.children.values())
    if view.caller_locks > through_root:
        errs.append(f"{view.caller_locks} caller locks but only {through_root} device path locks reach the root")

    # ---- several ranks: reservations never outlive their step ----------------------------------
    phantom, pending = view.reservations
    if phantom or pending:
        errs.append(f"reservations outlive their agreement step: {pending} pending, {phantom} phantom host pages")
    if view.reserved_backup_nodes:  # they would keep L3 attaches off those nodes for good
        errs.append(f"{view.reserved_backup_nodes} nodes still count as reserved for a backup outside an agreement")

    # ---- plug-in components -------------------------------------------------------------------
    for comp in view.components:
        ext = None if external_pages is None else external_pages.get(comp.name)
        errs.extend(f"{comp.name}: {e}" for e in comp.check(nodes, view, ext))
    return errs
