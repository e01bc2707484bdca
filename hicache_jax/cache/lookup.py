"""Prefix lookup: ``match`` (splits, refreshes access times) and ``peek`` (read-only).

Pure numpy, owner thread only. A match never counts a hit (upstream: hits are counted on
insert only). A match that ends inside a node splits it; whether the unmatched remainder
gets the access time too is ``decisions.stamp_split_remainder``. It returns the on-device prefix's page ids, the deepest on-device node, the
deepest node on any tier and the host-only continuation's length. Components with their
own residency may shorten the usable device prefix (``usable_device_nodes`` hook: e.g. a
sliding-window component needs the window before the end on the device too).
"""

from __future__ import annotations

import numpy as np

from .radix_key import RadixKey
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
        if self.hooked and dev_nodes:
            k = len(dev_nodes)
            for comp in self.hooked:
                k = min(k, comp.usable_device_nodes(dev_nodes))
            if k < len(dev_nodes):
                # Only the usable prefix is a hit; what lies past it needs that component's
                # own load path (not a plain host hit), so the match ends there.
                dev_nodes = dev_nodes[:k]
                last_dev = last = dev_nodes[-1] if dev_nodes else tree.root
                host_len = 0
        if not dev_nodes:
            dev = EMPTY_IDS.copy()
        elif len(dev_nodes) == 1:
            dev = dev_nodes[0].value.copy()
        else:
            dev = np.concatenate([x.value for x in dev_nodes])
        return MatchResult(dev, last_dev, last, host_len, self.page_size)

    def peek(self, key: RadixKey) -> tuple[int, int]:
        tokens = key.token_ids
        segs, _ = self.tree.walk(key, tokens.shape[0] - tokens.shape[0] % self.page_size)
        device = host = 0
        for node, m, _off in segs:
            if node.value is not None:
                device += m
            else:
                host += m
        return device, host
