"""L3 (persistent) KV page storage: keys, the storage interface and its backends.

Imports with numpy alone. The default ``orbax`` backend (the ``orbax`` subpackage,
``OrbaxSegmentStorage``) needs the ``storage`` extra (orbax-checkpoint, tensorstore,
crc32c or google-crc32c) and is imported only when it is created; ``file`` and ``memory`` need nothing beyond numpy;
``mooncake`` (a shared Mooncake Store) needs the ``mooncake`` extra, also imported only when created.
``disabled`` (``DisabledStorage``, no L3) is what ``create_storage`` returns for a store that could
not be set up when ``StorageConfig.strict`` is False.

Threading contracts are stated per module; in short, every backend's public methods may be
called from several threads at once, and the orbax backend writes from one writer thread.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

from .base import HiCacheStorage, HitResult, PageCodec, PoolHitPolicy, PoolSpec, PoolTransfer, consecutive
from .config import StorageConfig, StorageSetupError
from .keys import KEY_BYTES, Namespace, page_keys, pool_page_keys
from .metrics import StorageMetrics

log = logging.getLogger("hicache_jax.storage")


def create_storage(config: StorageConfig, pools: Mapping, specs: Sequence[PoolSpec] | None = None) -> HiCacheStorage:
    """Build the backend named by ``config.backend`` over ``pools`` (name -> ``HostKVPool``).

    A store that cannot be set up (``StorageSetupError`` naming ``path``, ``ConnectionError``
    naming ``mooncake_master`` / ``mooncake_metadata``) raises when ``config.strict`` (default);
    otherwise it logs one warning and returns a ``DisabledStorage`` (no L3). Caller mistakes
    (wrong types, bad pools) and a missing backend package raise either way."""
    if not isinstance(config, StorageConfig):
        raise TypeError(f"config: expected StorageConfig, got {type(config).__name__}")
    try:
        return _create(config, pools, specs)
    except (StorageSetupError, ConnectionError) as e:
        if config.strict:
            raise
        from .disabled import DisabledStorage

        log.warning("L3 %s: %s; running without L3 (strict=False)", config.backend, e)
        return DisabledStorage(config, pools, specs, reason=str(e))


def _create(config: StorageConfig, pools: Mapping, specs: Sequence[PoolSpec] | None) -> HiCacheStorage:
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
        raise ImportError(
            "the 'orbax' L3 backend needs orbax-checkpoint, tensorstore and crc32c (or google-crc32c) "
            "(pip install 'hicache-jax[storage]', Python 3.12+); use backend='file' without them"
        ) from e
    return OrbaxSegmentStorage(config, pools, specs)


__all__ = [
    "HiCacheStorage",
    "HitResult",
    "KEY_BYTES",
    "Namespace",
    "PageCodec",
    "PoolHitPolicy",
    "PoolSpec",
    "PoolTransfer",
    "StorageConfig",
    "StorageMetrics",
    "StorageSetupError",
    "consecutive",
    "create_storage",
    "page_keys",
    "pool_page_keys",
]
