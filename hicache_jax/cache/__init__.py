"""Hierarchical radix cache (device L1 + host L2): pure Python + numpy.

Entry point: ``HiRadixCache(HiCacheConfig(...), engine, device_allocator)``. See
``hiradix_cache`` for the contract (who allocates, who frees, what is locked, threads) and
the map of the modules behind it. L3 (storage): ``hicache_jax.l3.StorageController(cache,
...)``, which uses only the cache's public L3 surface.
"""

from .agreement import Agreement, AgreementError, NoExchangeAgreement, RankDivergenceError, SingleProcessAgreement
from .components import FULL, ComponentRegistry, KVComponent, MultiLoadHandle, MultiTransferHandle
from .config import EvictionPolicy, HiCacheConfig, TreeDecisions, WritePolicy
from .debug_view import CacheDebugView
from .rank_digest import tree_digest
from .errors import CacheClosedError, CacheFailedError, CacheInvariantError, OwnerThreadError
from .eviction_index import EvictionIndex
from .eviction_policies import EvictionStrategy
from .hiradix_cache import HiRadixCache
from .locks import LockReceipt
from .metrics import CacheMetrics, register_prometheus
from .radix_key import RadixKey, as_token_ids
from .cache_request import CacheRequest
from .results import DeviceFit, InsertResult, LoadBackResult, MatchResult
from .step_agreement import StepAgreement
from .tree_node import TreeNode

__all__ = [
    "FULL",
    "Agreement",
    "AgreementError",
    "CacheClosedError",
    "CacheDebugView",
    "CacheFailedError",
    "CacheInvariantError",
    "CacheMetrics",
    "CacheRequest",
    "ComponentRegistry",
    "DeviceFit",
    "EvictionIndex",
    "EvictionPolicy",
    "EvictionStrategy",
    "HiCacheConfig",
    "HiRadixCache",
    "InsertResult",
    "KVComponent",
    "LoadBackResult",
    "LockReceipt",
    "MatchResult",
    "MultiLoadHandle",
    "MultiTransferHandle",
    "NoExchangeAgreement",
    "OwnerThreadError",
    "RadixKey",
    "RankDivergenceError",
    "SingleProcessAgreement",
    "StepAgreement",
    "TreeDecisions",
    "TreeNode",
    "WritePolicy",
    "as_token_ids",
    "register_prometheus",
    "tree_digest",
]


def __getattr__(name: str):
    # The L3 controller moved to ``hicache_jax.l3`` (it depends on the cache, not the other
    # way round); these names still resolve here for existing callers, lazily.
    if name in ("StorageController", "PrefetchOperation"):
        from .. import l3

        return getattr(l3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
