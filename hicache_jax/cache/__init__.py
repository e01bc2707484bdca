"""Hierarchical radix cache (device L1 + host L2): pure Python + numpy.

Entry point: ``HiRadixCache(HiCacheConfig(...), engine, device_allocator)``. See
``hiradix_cache`` for the contract (who allocates, who frees, what is locked, threads).
L3 (storage): ``StorageController(cache, ...)``; see ``storage_controller``.
"""

from .components import FULL, ComponentRegistry, MultiLoadHandle, MultiTransferHandle
from .config import EvictionPolicy, HiCacheConfig, WritePolicy
from .eviction import EvictionIndex
from .hiradix_cache import CacheFailedError, CacheInvariantError, HiRadixCache, InsertResult, LoadBackResult, MatchResult
from .metrics import CacheMetrics, register_prometheus
from .radix_key import RadixKey, as_token_ids
from .request import CacheRequest
from .storage_controller import PrefetchOperation, StorageController
from .tree_node import TreeNode

__all__ = [
    "FULL", "CacheFailedError", "CacheInvariantError", "CacheMetrics", "CacheRequest", "ComponentRegistry", "EvictionIndex",
    "EvictionPolicy", "HiCacheConfig", "HiRadixCache", "InsertResult", "LoadBackResult", "MatchResult",
    "MultiLoadHandle", "MultiTransferHandle", "PrefetchOperation", "RadixKey", "StorageController", "TreeNode",
    "WritePolicy", "as_token_ids", "register_prometheus",
]
