"""``hicache_jax.l3.node_keys``: per-node L3 page keys, on a hand-built tree.

Every expectation is computed independently: the keys of a node's pages are the keys of its
full path's tokens (``page_keys`` over the concatenation), sliced at the node's pages.
"""

from __future__ import annotations

import numpy as np
import pytest

from hicache_jax.l3.node_keys import NEW, STORED, NodeDigests, PageDigests
from hicache_jax.storage import Namespace, page_keys

P = 2
POOLS = {name: Namespace("m", "r", "bfloat16", P, "page_first", pool=name) for name in ("target", "draft", "swa")}


class Node:
    """The fields of a tree node the digests read."""

    def __init__(self, tokens, parent=None, namespace=()):
        self.key = np.asarray(tokens, np.int64)
        self.size = len(self.key)
        self.parent = parent
        self.children = {}
        self.namespace = namespace
        self.deleted = False
        if parent is not None:
            parent.children[int(self.key[0])] = self

    def path_tokens(self):
        parts, n = [], self
        while n.parent is not None:
            parts.append(n.key)
            n = n.parent
        return np.concatenate(parts[::-1]) if parts else np.zeros(0, np.int64)


def expected(node, pool):
    """Keys of the node's own pages: the whole path's keys, its last pages."""
    keys = page_keys(POOLS[pool], node.path_tokens())
    return keys[len(keys) - node.size // P :]


def split(node, k_tokens):
    """Split ``node`` after its first ``k_tokens`` tokens, as the tree does: a new node takes the
    head and becomes the parent of the shortened node."""
    parent = node.parent
    del parent.children[int(node.key[0])]
    head = Node(node.key[:k_tokens], parent, node.namespace)
    node.key = node.key[k_tokens:]
    node.size = len(node.key)
    node.parent = head
    head.children[int(node.key[0])] = node
    return head


def make():
    root = Node([], None)
    return root, NodeDigests(lambda: root, P, lambda ns: dict(POOLS))


def test_keys_chain_from_the_parent_in_every_pool():
    root, d = make()
    a = Node(np.arange(0, 8), root)
    b = Node(np.arange(8, 14), a)
    e = d.get(b)
    for pool in POOLS:
        assert e.digests[pool] == expected(b, pool)
        assert d.valid(a).digests[pool] == expected(a, pool)
    assert e.state == NEW and len(d) == 2


def test_a_split_trims_every_pool_alike_and_hands_the_head_to_the_new_parent():
    root, d = make()
    a = Node(np.arange(0, 12), root)
    d.get(a).state = STORED
    head = split(a, 4)  # pages 0-1 go to the new parent, 2-5 stay
    e = d.valid(a)
    for pool in POOLS:  # the bug: only the first pool was trimmed, the others kept 6 digests
        assert e.digests[pool] == expected(a, pool), pool
    h = d.valid(head)
    assert h is not None and h.state == STORED
    for pool in POOLS:
        assert h.digests[pool] == expected(head, pool)
    # the next page chains from the right one in every pool
    c = Node(np.arange(12, 16), a)
    for pool in POOLS:
        assert d.get(c).digests[pool] == expected(c, pool)


def test_a_split_parent_without_an_entry_is_found_through_its_child():
    root, d = make()
    a = Node(np.arange(0, 12), root)
    d.get(a)
    head = split(a, 6)
    assert d.valid(head).digests["draft"] == expected(head, "draft")  # fixed up from the child


def test_an_entry_longer_than_its_node_gives_the_head_to_the_ancestors():
    """A prefetch records one entry for a chain attached as one leaf; the leaf was split later."""
    root, d = make()
    a = Node(np.arange(0, 4), root)
    b = Node(np.arange(4, 10), a)
    whole = {pool: page_keys(ns, np.arange(0, 10)) for pool, ns in POOLS.items()}
    d.set(b, PageDigests({pool: ks[:] for pool, ks in whole.items()}, STORED))
    assert d.valid(b).digests["swa"] == expected(b, "swa")
    assert d.valid(a).digests["swa"] == expected(a, "swa") and d.valid(a).state == STORED


def test_unkeyable_namespaces_and_bad_entries():
    root = Node([], None)
    d = NodeDigests(lambda: root, P, lambda ns: None if ns == ("bad",) else dict(POOLS))
    assert d.get(Node(np.arange(4), root, namespace=("bad",))) is None
    assert d.get(root) is None
    with pytest.raises(ValueError, match="one digest per page"):
        PageDigests({"target": [b"x" * 32] * 2, "draft": [b"x" * 32]})
    e = PageDigests({"target": [b"a" * 32, b"b" * 32], "draft": [b"c" * 32, b"d" * 32]})
    with pytest.raises(ValueError, match="k: expected"):
        e.trim(3)
    with pytest.raises(ValueError, match="pages of digests"):
        d.set(Node(np.arange(8), root), e)


def test_the_root_is_read_each_time():
    """A cache reset replaces the root: digests must not chain from the old one."""
    roots = [Node([], None)]
    d = NodeDigests(lambda: roots[0], P, lambda ns: dict(POOLS))
    d.get(Node(np.arange(4), roots[0]))
    roots[0] = Node([], None)
    d.clear()
    fresh = Node(np.arange(100, 104), roots[0])
    assert d.get(fresh).digests["target"] == expected(fresh, "target")
