"""Per-request bookkeeping for the request-level helpers (``cache_unfinished_req`` etc.).

Pure numpy. A ``CacheRequest`` is the slice of a scheduler's request that the cache needs:
the tokens so far, one device page per started page, the node locked on the request's
behalf (one of the cache's caller locks on that node), how many leading pages belong to the tree (the rest belong to the request), and the request's
eviction priority (``eviction_policy="priority"``: a node keeps the highest priority that
inserted through it; larger survives longer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..allocator import ID_DTYPE, as_page_ids
from .radix_key import RadixKey, as_radix_key
from .tree_node import TreeNode


@dataclass
class CacheRequest:
    key: RadixKey
    page_size: int = 1
    # One device page id per started page of ``key`` (ceil(len / page_size)); the first
    # ``cached_pages`` are owned by the tree (and protected by the lock on ``last_node``),
    # the rest by the request until it inserts them.
    device_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, ID_DTYPE))
    last_node: TreeNode | None = None  # holds one device lock while not None
    cached_pages: int = 0
    priority: int = 0

    def extend(self, key: object, new_pages: object) -> None:
        """Grow the request to ``key`` (which must start with the current tokens), adding
        ``new_pages`` (freshly allocated device pages) so there is one page per started page.

        Validates before changing anything.
        """
        key = as_radix_key(key)
        if key.namespace != self.key.namespace:
            raise ValueError(f"key: namespace {key.namespace} differs from the request's {self.key.namespace}")
        if key is not self.key and not key.token_bytes.startswith(self.key.token_bytes):  # one memcmp
            raise ValueError("key: must extend the request's current tokens")
        pages = as_page_ids(new_pages, "new_pages")
        page_size = self.page_size
        want = -(-len(key) // page_size)
        if self.device_pages.shape[0] + pages.shape[0] != want:
            raise ValueError(f"new_pages: {len(key)} tokens need {want} pages in all, the request has "
                             f"{self.device_pages.shape[0]} and got {pages.shape[0]} more")
        self.key = key
        self.device_pages = np.concatenate([self.device_pages, pages])
