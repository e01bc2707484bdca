"""What the cache's public calls return: frozen dataclasses holding page ids and node handles."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from ..transfer import LoadHandle
from .tree_node import TreeNode


@dataclass(frozen=True)
class MatchResult:
    """What ``match_prefix`` found.

    ``device_indices``: device page ids of the on-device prefix (a copy).
    ``last_device_node``: deepest on-device node matched (the root if none); lock it to keep
    ``device_indices`` valid. ``last_host_node``: deepest node matched on any tier.
    ``host_hit_length``: tokens after the device prefix that exist on the host only; pass
    ``last_host_node`` to ``load_back`` to bring them to the device. With stateful components
    (e.g. a sliding window) both ends are where every component can serve the prefix (on the
    device, and from some tier), and ``host_hit_length`` counts the tokens between, whose full
    pages may already be on the device (a load-back then moves only the component's pages).
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
    """A load-back in flight. ``device_pages`` continue the device prefix of the match
    (``num_tokens`` of it). ``handle``: per-layer readiness of the full component; with other
    components a ``MultiLoadHandle`` (``wait_layer(i, component=name)`` for theirs)."""

    device_pages: np.ndarray
    num_tokens: int
    node: TreeNode
    handle: LoadHandle

    def layer_ready(self, layer: int) -> bool:
        return self.handle.layer_done(layer)

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        self.handle.wait_layer(layer, timeout)


class DeviceFit(str, Enum):
    """``HiRadixCache.device_fit(n)``: whether ``alloc_device(n)`` can succeed."""

    FITS = "fits"  # free pages plus evictable pages cover it now
    FULL_NOW = "full_now"  # not now (pages locked by requests or copies in flight); it can later
    TOO_LARGE = "too_large"  # more pages than the device pool has: it never fits
