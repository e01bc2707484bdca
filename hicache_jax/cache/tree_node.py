"""One node of the radix tree: a run of page-aligned tokens, its statistics and where its KV lives.

Pure numpy. Fields are mutated only by the modules of this package, on the cache's owner
thread; callers get nodes back from ``match_prefix`` as opaque handles to pass to
``inc_lock_ref`` / ``dec_lock_ref`` / ``load_back``.

Fields by owner (each module changes only its own; every name is public inside the package):

* structure (``tree``): ``kb``/``size`` (the tokens), ``namespace``, ``parent``,
  ``children``, ``deleted``, ``owner``;
* statistics (``tree``, ``insert``, ``lookup``): ``hit_count``, ``last_access`` (a logical
  clock), ``created`` (logical clock at creation; a split's upper part keeps its lower
  part's), ``priority`` (the highest request priority that inserted through the node);
* residency of the target ("full") KV component (``residency``, ``locks``): ``value`` /
  ``host_value`` (int32 page ids, ``size / page_size`` of them), ``lock_ref`` /
  ``host_lock_ref`` (path locks), ``dev_children`` / ``host_children`` (children holding
  pages on that tier, for O(1) leaf tests), ``heap_stamp`` (one stamp per eviction index);
* plug-in components with their own residency (``components``): ``ext``, a dict from
  component name to that component's per-node state, ``None`` while no such component is
  registered (today's ``full`` and ``sidecar`` components need none).

The full component shapes the tree: on device <=> ``value`` is not None; backed up <=>
``host_value`` is not None; a node with neither is dead and removed at once.

Locks are path locks: locking a node increments ``lock_ref`` on it and every ancestor up to
the root, so a node's count is the number of holders whose path passes through it.
``host_lock_ref`` does the same for the host copy.
"""

from __future__ import annotations

import itertools

import numpy as np

_ids = itertools.count()


class TreeNode:
    __slots__ = (
        "id",
        "kb",
        "size",
        "namespace",
        "parent",
        "children",
        "value",
        "host_value",
        "lock_ref",
        "host_lock_ref",
        "hit_count",
        "last_access",
        "created",
        "priority",
        "dev_children",
        "host_children",
        "deleted",
        "heap_stamp",
        "owner",
        "ext",
    )

    def __init__(self, key: "np.ndarray | bytes", namespace: tuple, parent: "TreeNode | None") -> None:
        self.id = next(_ids)
        self.key = key  # int64 token ids, a page multiple (empty for the root); see the property
        self.namespace = namespace
        self.parent = parent
        self.children: dict = {}  # page_key bytes (root: (namespace, bytes)) -> TreeNode
        self.value: np.ndarray | None = None
        self.host_value: np.ndarray | None = None
        self.lock_ref = 0
        self.host_lock_ref = 0
        self.hit_count = 0
        self.last_access = 0  # logical clock, not wall time: deterministic order, no ties
        self.created = 0
        self.priority = 0
        self.dev_children = 0  # children with value is not None: O(1) "device leaf" test
        self.host_children = 0  # children with host_value is not None
        self.deleted = False
        # One stamp per eviction index; a heap entry is live only while its stamp matches.
        self.heap_stamp = [0, 0, 0]
        # The cache whose tree holds the node (inherited from the parent; the cache sets its
        # root's): an O(1) "does this node belong to this cache" test for handles.
        self.owner = None if parent is None else parent.owner
        self.ext: dict | None = None

    @property
    def key(self) -> np.ndarray:
        """Token ids (read-only int64 view of ``kb``)."""
        return np.frombuffer(self.kb, np.int64)

    @key.setter
    def key(self, tokens: "np.ndarray | bytes") -> None:
        # The tree walks compare raw bytes (memcmp via bytes.startswith), so the bytes are
        # the stored form; ``size`` caches the token count for the hot paths. The cache may
        # pass the bytes directly (native-endian int64, as ``tobytes`` makes them).
        if isinstance(tokens, bytes):
            if len(tokens) % 8:
                raise ValueError(f"key: {len(tokens)} bytes is not a whole number of int64 tokens")
            self.kb = tokens
        else:
            self.kb = np.ascontiguousarray(tokens, np.int64).tobytes()
        self.size = len(self.kb) // 8

    @property
    def evicted(self) -> bool:
        return self.value is None

    @property
    def backuped(self) -> bool:
        return self.host_value is not None

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        state = ("D" if self.value is not None else "-") + ("H" if self.host_value is not None else "-")
        return (
            f"TreeNode(id={self.id}, len={len(self)}, {state}, lock={self.lock_ref}, "
            f"host_lock={self.host_lock_ref}, hits={self.hit_count}, t={self.last_access})"
        )
