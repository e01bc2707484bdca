"""L3 driver: moves pages between the cache's host tier (L2) and a storage backend
(``hicache_jax.storage``): write-through of acknowledged backups, prefetch on a hit.

Depends on the cache (``hicache_jax.cache``) through its public L3 surface only; the cache
never imports this package. See ``controller`` for the contract; ``StorageController`` is a
facade over ``pools``, ``node_keys``, ``backup``, ``prefetch``, ``rank_steps`` and ``exit_flush``.
"""

from .controller import PrefetchOperation, StorageController, encode_namespace

__all__ = ["PrefetchOperation", "StorageController", "encode_namespace"]
