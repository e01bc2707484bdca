"""L3 (persistent) KV page storage: keys, the storage interface and its backends.

Imports with numpy alone. The default ``orbax`` backend (the ``orbax`` subpackage,
``OrbaxSegmentStorage``) needs the ``jax`` extra (orbax-checkpoint, tensorstore,
google-crc32c) and is imported only when it is created; ``file`` and ``memory`` need nothing beyond numpy;
``mooncake`` (a shared Mooncake Store) needs the ``mooncake`` extra, also imported only when created.

Threading contracts are stated per module; in short, every backend's public methods may be
called from several threads at once, and the orbax backend writes from one writer thread.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .base import HiCacheStorage, HitResult, PageCodec, PoolHitPolicy, PoolSpec, PoolTransfer, consecutive
from .config import StorageConfig
from .keys import KEY_BYTES, Namespace, page_keys, pool_page_keys
from .metrics import StorageMetrics


def create_storage(config: StorageConfig, pools: Mapping, specs: Sequence[PoolSpec] | None = None) -> HiCacheStorage:
    """Build the backend named by ``config.backend`` over ``pools`` (name -> ``HostKVPool``)."""
    if not isinstance(config, StorageConfig):
        raise TypeError(f"config: expected StorageConfig, got {type(config).__name__}")
    if config.backend == "memory":
        from .memory import MemoryStorage
        return MemoryStorage(config, pools, specs)
    if config.backend == "file":
        from .file import FileStorage
        return FileStorage(config, pools, specs)
    if config.backend == "mooncake":
        from .mooncake.store import MooncakeStorage
        return MooncakeStorage(config, pools, specs)
    try:
        from .orbax import OrbaxSegmentStorage
    except ImportError as e:
        raise ImportError("the 'orbax' L3 backend needs orbax-checkpoint, tensorstore and google-crc32c "
                          "(pip install 'hicache-jax[storage]', Python 3.12+); use backend='file' without them") from e
    return OrbaxSegmentStorage(config, pools, specs)


__all__ = [
    "HiCacheStorage", "HitResult", "KEY_BYTES", "Namespace", "PageCodec", "PoolHitPolicy", "PoolSpec",
    "PoolTransfer", "StorageConfig", "StorageMetrics", "consecutive", "create_storage", "page_keys",
    "pool_page_keys",
]
