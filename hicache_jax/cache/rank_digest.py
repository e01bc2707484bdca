"""A digest of a tree's state: structure and residency per node, equal across processes.

Pure Python + hashlib, read-only. Ranks of a multi-process server each hold a tree over
their own shard of every page; their trees must stay identical (``agreement``). Comparing
digests is how tests (and ``StepAgreement``'s optional check) see that they do.

What goes in, per node, in a canonical order (depth first, children sorted by their tokens,
so neither dict order nor node ids matter): the node's tokens (and, below the root, its
namespace), whether it is on the device and backed up, its device and host lock counts, hit
count, logical access / creation times and priority, and its number of children. Page ids go
in only with ``pages=True``: ranks hold their own allocators, and what must agree is which
nodes hold pages, not which ids. ``state_digest`` adds the tree's clock, the token counters
and the copies in flight (by the nodes' positions in that order).

Components with state of their own (``components``, e.g. ``swa``) add, per node, their
``digest_node(node)`` bytes after the node's own, and their ``digest_state()`` counters after
the tree's, each under the component's name. Without such components nothing is added, so a
full-only digest is byte for byte what it was before components took part.

Every value is encoded with a fixed width (``struct``), and nothing uses Python's ``hash``, so
the digest is the same in every process for the same state.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Iterable

from .tree_node import TreeNode

_NODE = struct.Struct("<QBqqqqqqI")  # tokens bytes, flags, locks, host locks, hits, access, created, priority, kids


def _sorted_children(node: TreeNode) -> list[TreeNode]:
    kids = list(node.children.values())
    if len(kids) > 1:
        kids.sort(key=lambda c: (repr(c.namespace), c.kb))
    return kids


def walk(root: TreeNode) -> list[TreeNode]:
    """Every node, root first, in the digest's canonical order."""
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(_sorted_children(node)))
    return out


def _feed(h, nodes: Iterable[TreeNode], root: TreeNode, pages: bool, components: tuple = ()) -> None:
    for node in nodes:
        flags = (node.value is not None) | (node.host_value is not None) << 1
        h.update(
            _NODE.pack(
                node.size,
                flags,
                node.lock_ref,
                node.host_lock_ref,
                node.hit_count,
                node.last_access,
                node.created,
                node.priority,
                len(node.children),
            )
        )
        h.update(node.kb)
        if node.parent is root:
            h.update(repr(node.namespace).encode())
        if pages:
            for ids in (node.value, node.host_value):
                if ids is not None:
                    h.update(ids.astype("<i8").tobytes())
        for comp in components:
            b = comp.digest_node(node)
            if b:
                h.update(struct.pack("<H", len(b)) + b)


def tree_digest(root: TreeNode, pages: bool = False) -> str:
    """Hex SHA-256 of the tree under ``root`` (see the module docstring)."""
    h = hashlib.sha256(b"hicache_jax/tree/v1\0")
    _feed(h, walk(root), root, pages)
    return h.hexdigest()


def state_digest(
    root: TreeNode,
    clock: int,
    counters: dict[str, int],
    pending: list[tuple[str, TreeNode]],
    pages: bool = False,
    components: tuple = (),
) -> str:
    """``tree_digest`` plus the logical clock, the token ``counters`` and the copies in flight
    (``(kind, node)`` in queue order, each node by its position in the canonical order), and
    the per-node and per-component state of ``components`` (stateful ones: see the module
    docstring)."""
    nodes = walk(root)
    h = hashlib.sha256(b"hicache_jax/state/v1\0")
    _feed(h, nodes, root, pages, components)
    pos = {id(n): i for i, n in enumerate(nodes)}
    h.update(struct.pack("<q", clock))
    for name in sorted(counters):
        h.update(name.encode() + struct.pack("<q", counters[name]))
    for kind, node in pending:
        h.update(kind.encode() + struct.pack("<q", pos.get(id(node), -1)))
    for comp in components:
        state = comp.digest_state()
        if state:
            h.update(b"\0component\0" + comp.name.encode())
            for name in sorted(state):
                h.update(name.encode() + struct.pack("<q", state[name]))
    return h.hexdigest()
