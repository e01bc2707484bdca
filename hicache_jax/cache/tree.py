"""The radix tree's structure: walk, split, attach, remove. No residency.

Pure numpy, owner thread only. ``RadixTree`` owns the root, the logical clock and the
parent/child links. Children are keyed by their first page's token bytes (the root's by
``(namespace, bytes)``), so keys in different namespaces never share a node. What a node
holds (pages, locks, index membership) is not this module's business: ``split`` divides a
node and hands both parts to the ``on_split`` hook (``Residency.split`` plus every registered
component's hook), and ``unlink`` only unlinks (the caller first takes the node's pages off).
"""

from __future__ import annotations

from typing import Callable

from .radix_key import RadixKey, common_prefix_len
from .tree_node import TreeNode


class RadixTree:
    """Links and walks; see the module docstring."""

    def __init__(self, page_size: int, owner: object, on_split: Callable[[TreeNode, TreeNode, int], None]) -> None:
        self.page_size = page_size
        self.owner = owner  # every node's ``owner``: the O(1) "is this node ours" test for handles
        self.on_split = on_split
        self.root = self.new_root()
        self.clock = 0

    def new_root(self) -> TreeNode:
        root = TreeNode(b"", None, None)
        root.owner = self.owner
        self.root = root
        self.clock = 0
        return root

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def child_key(self, node: TreeNode):
        k = node.kb[: 8 * self.page_size]
        return (node.namespace, k) if node.parent is self.root else k

    def walk(self, key: RadixKey, n: int, start: TreeNode | None = None, off: int = 0) -> tuple[list, int]:
        """Read-only walk of ``key``'s first ``n`` tokens (a page multiple): [(node, matched
        tokens, offset)] and total matched tokens. Compares ``key.token_bytes`` (a whole-node
        match is one memcmp; bytes past ``8 * n`` never match).

        With ``start`` (a node whose path spells the first ``off`` tokens) the walk continues
        below it: the list then holds only the nodes after ``start``."""
        segs = []
        if n == off:
            return segs, off
        tokens, qb = key.token_ids, key.token_bytes
        p = self.page_size
        pb = 8 * p
        nb = 8 * n
        if start is None or start is self.root:
            child = self.root.children.get((key.namespace, qb[8 * off : 8 * off + pb]))
        else:
            child = start.children.get(qb[8 * off : 8 * off + pb])
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
            child = child.children.get(qb[8 * off : 8 * off + pb])
        return segs, off

    def split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` tokens (a page multiple); returns the new upper node,
        which takes over ``child``'s place and statistics (hits, access, creation, priority)."""
        parent = child.parent
        ck = self.child_key(child)
        new = TreeNode(child.kb[: 8 * m], child.namespace, parent)
        new.hit_count = child.hit_count
        new.last_access = child.last_access
        new.created = child.created
        new.priority = child.priority
        child.kb = child.kb[8 * m :]
        child.size -= m
        child.parent = new
        parent.children[ck] = new
        new.children[self.child_key(child)] = child
        self.on_split(new, child, m // self.page_size)
        return new

    def attach(self, parent: TreeNode, kb: bytes, namespace: tuple) -> TreeNode:
        """A new childless node under ``parent`` holding the tokens ``kb`` (a page multiple, not
        matching any child's first page: the caller walked there)."""
        leaf = TreeNode(kb, namespace, parent)
        fk = kb[: 8 * self.page_size]
        parent.children[fk if parent is not self.root else (namespace, fk)] = leaf
        leaf.created = self.clock
        return leaf

    def unlink(self, node: TreeNode) -> None:
        """Detach a childless node (which holds nothing any more) and mark it deleted."""
        del node.parent.children[self.child_key(node)]
        node.deleted = True
        node.parent = None

    def nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def mark_all_deleted(self) -> None:
        """``reset``: every node but the root becomes a stale handle."""
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.deleted = n is not self.root

    def check_node(self, node: object, name: str = "node") -> TreeNode:
        """A caller's node handle: a live node of this tree, else TypeError / ValueError."""
        if not isinstance(node, TreeNode):
            raise TypeError(f"{name}: expected a TreeNode, got {type(node).__name__}")
        if node.deleted:
            raise ValueError(f"{name}: {node!r} was removed from the tree")
        if node.owner is not self.owner:  # every live node of this tree has this owner (sanity_check)
            raise ValueError(f"{name}: {node!r} does not belong to this cache")
        return node

    def path_bytes_match(self, node: TreeNode, qb: bytes, depth: int) -> list | None:
        """The nodes from the root to ``node`` when they spell the first ``depth`` tokens of
        ``qb`` exactly (checked bottom-up, one memcmp per node, no child lookups), else None."""
        path = []
        end = 8 * depth
        root = self.root
        while node is not root:
            kb = node.kb
            end -= len(kb)
            if end < 0 or not qb.startswith(kb, end):
                return None
            path.append(node)
            node = node.parent
        if end:
            return None
        path.reverse()
        return path
