"""Prefix lookup: ``match`` (splits, refreshes access times) and ``peek`` (read-only).

Pure numpy, owner thread only. A match never counts a hit (upstream: hits are counted on
insert only). A match that ends inside a node splits it; whether the unmatched remainder
gets the access time too is ``decisions.stamp_split_remainder``. It returns the on-device prefix's page ids, the deepest on-device node, the
deepest node on any tier and the host-only continuation's length. Components with their
own residency may shorten both (``usable_prefix`` hook: e.g. a sliding-window component
needs the window before the end on the device for a device hit, and on some tier for a
loadable one); the continuation then counts the on-device nodes past the usable device
prefix too (a load-back brings their component pages).
"""

from __future__ import annotations

import numpy as np

from .radix_key import RadixKey, aligned_len
from .residency import EMPTY_IDS, Residency
from .results import MatchResult
from .tree import RadixTree


class Lookup:
    """Match and peek; see the module docstring."""

    def __init__(self, tree: RadixTree, residency: Residency, page_size: int, stamp_split_remainder: bool) -> None:
        self.tree = tree
        self.res = residency
        self.page_size = page_size
        # A split's unmatched remainder gets the access time too (upstream), or keeps its own
        # (``decisions``).
        self.stamp_split_remainder = stamp_split_remainder
        self.hooked: tuple = ()  # components with their own residency (``components``)

    def backed_up(self, key: RadixKey, device_only_host_copies: bool) -> tuple:
        """``backed_up_prefix`` (read-only): ``(node, tokens, tokens of that node inside the
        match)`` of ``key``'s whole pages, ending at the deepest backed-up node of the match
        where it ends before the key on device-only nodes and ``device_only_host_copies``
        (those nodes take their host copies from the L3 read then)."""
        n = aligned_len(len(key), self.page_size)
        segs, matched = self.tree.walk(key, n)
        if not segs:
            return self.tree.root, 0, 0
        if matched < n and segs[-1][0].host_value is None and device_only_host_copies:
            # Backed-up nodes form a prefix of the path: the last one before the first that is not.
            k = next(i for i, (node, _m, _off) in enumerate(segs) if node.host_value is None)
            if k == 0:
                return self.tree.root, 0, 0
            node, m, off = segs[k - 1]
            return node, off + m, m
        return segs[-1][0], matched, segs[-1][1]

    def match(self, key: RadixKey) -> MatchResult:
        tokens = key.token_ids
        n = tokens.shape[0] - tokens.shape[0] % self.page_size
        tree = self.tree
        segs, _ = tree.walk(key, n)
        t = tree.tick()
        res = self.res
        dev_nodes = []
        last_dev = last = tree.root
        host_len = 0
        dm, hm, rm = res.dev_members, res.host_members, res.reclaim_members
        dl, hl, rl = res.device_index, res.host_index, res.reclaim_index
        for node, m, _off in segs:
            if m < node.size:
                lower = node
                node = tree.split(lower, m)
                if self.stamp_split_remainder:
                    res.stamp(lower, t)
            node.last_access = t  # inlined touch
            if node in dm:
                dl.push(node)
            if node in hm:
                hl.push(node)
            if node in rm:
                rl.push(node)
            if node.value is not None:
                dev_nodes.append(node)
                last_dev = node
            else:
                host_len += m
            last = node
        if self.hooked and segs:
            dev_nodes, last_dev, last, host_len = self._usable(last, dev_nodes)
        if not dev_nodes:
            dev = EMPTY_IDS.copy()
        elif len(dev_nodes) == 1:
            dev = dev_nodes[0].value.copy()
        else:
            dev = np.concatenate([x.value for x in dev_nodes])
        return MatchResult(dev, last_dev, last, host_len, self.page_size)

    def _usable(self, last, dev_nodes: list):
        """Ask the stateful components how much of the matched path they can serve: the
        device prefix ends at the deepest node every one can serve from the device, the match
        (``last_host_node``) at the deepest one every one can serve from some tier, and the
        tokens between are what a load-back makes usable (``host_hit_length``)."""
        root = self.tree.root
        nodes = []
        n = last
        while n is not root:
            nodes.append(n)
            n = n.parent
        nodes.reverse()
        sizes = [x.size for x in nodes]
        k_dev, k_any = len(dev_nodes), len(nodes)
        for comp in self.hooked:
            a, b = comp.usable_prefix(nodes, sizes, len(dev_nodes), True)
            k_dev, k_any = min(k_dev, a), min(k_any, b)
        last_dev = nodes[k_dev - 1] if k_dev else root
        last = nodes[k_any - 1] if k_any else root
        return dev_nodes[:k_dev], last_dev, last, sum(sizes[k_dev:k_any])

    def peek(self, key: RadixKey) -> tuple[int, int]:
        tokens = key.token_ids
        segs, _ = self.tree.walk(key, tokens.shape[0] - tokens.shape[0] % self.page_size)
        if self.hooked and segs:
            nodes = [x[0] for x in segs]
            sizes = [x[1] for x in segs]
            n_dev = sum(1 for x in nodes if x.value is not None)
            k_dev, k_any = n_dev, len(nodes)
            for comp in self.hooked:
                a, b = comp.usable_prefix(nodes, sizes, n_dev, False)
                k_dev, k_any = min(k_dev, a), min(k_any, b)
            return sum(sizes[:k_dev]), sum(sizes[k_dev:k_any])
        device = host = 0
        for node, m, _off in segs:
            if node.value is not None:
                device += m
            else:
                host += m
        return device, host
