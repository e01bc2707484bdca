"""``DisabledStorage``: no L3, for a store that could not be set up under ``strict=False``.

Every lookup misses and every page set is dropped (counted in ``metrics.pages_dropped``, never
logged per page: ``create_storage`` logged the one warning saying why). It keeps the interface so
the cache and controller run unchanged, as they would with an empty store that accepts nothing.

Threading: stateless apart from the metrics (thread-safe); any thread may call it.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..host_pool import HostKVPool
from .base import HiCacheStorage, PoolSpec
from .config import StorageConfig


class DisabledStorage(HiCacheStorage):
    backend_name = "disabled"

    def __init__(
        self,
        config: StorageConfig,
        pools: Mapping[str, HostKVPool],
        specs: Sequence[PoolSpec] | None = None,
        *,
        reason: str = "",
    ) -> None:
        super().__init__(config, pools, specs)
        self.reason = reason  # why the configured backend is not used (the warning's text)

    def _contains(self, pool: str, keys: list[bytes]) -> list[bool]:
        return [False] * len(keys)

    def _read(self, pool: str, keys: list[bytes]) -> list[np.ndarray | None]:
        return [None] * len(keys)

    def _read_into_host(self, pool: str, keys: list[bytes], ids: Sequence[int], loaded: list[bool]) -> int:
        return 0  # nothing stored, nothing loaded, host pages untouched

    def _write(self, pool: str, keys: list[bytes], pages: np.ndarray) -> list[bool]:
        self.metrics.add(pages_dropped=len(keys))
        return [False] * len(keys)

    def _write_from_host(self, pool: str, keys: list[bytes], ids: np.ndarray) -> list[bool]:
        self.metrics.add(pages_dropped=len(keys))
        return [False] * len(keys)
