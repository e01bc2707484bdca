"""Configuration of the hierarchical radix cache: a frozen dataclass validated at construction.

Pure Python. Names and defaults follow upstream HiCache flags (sglang's --hicache-* server arguments):
``--hicache-write-policy`` -> ``write_policy``, ``--radix-eviction-policy`` -> ``eviction_policy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .._checks import check_int
from ..storage.config import StorageConfig


class WritePolicy(str, Enum):
    """When device KV is copied to the host tier."""

    WRITE_THROUGH = "write_through"  # copy every newly inserted node right away
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # copy a node once it has 2 insert-hits
    WRITE_BACK = "write_back"  # copy only when device eviction would otherwise lose the node

    @classmethod
    def parse(cls, value: "str | WritePolicy") -> "WritePolicy":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"write_policy: expected one of {[m.value for m in cls]}, got {value!r}") from None


class EvictionPolicy(str, Enum):
    """Order in which unlocked leaves leave a tier."""

    LRU = "lru"  # oldest logical access first
    LFU = "lfu"  # fewest insert-hits first, ties by oldest access
    FIFO = "fifo"  # oldest creation first (a split's upper part keeps its creation time)
    MRU = "mru"  # newest logical access first
    PRIORITY = "priority"  # lowest request priority first, ties by oldest access

    @classmethod
    def parse(cls, value: "str | EvictionPolicy") -> "EvictionPolicy":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"eviction_policy: expected one of {[m.value for m in cls]}, got {value!r}") from None


class TreeDecisions(str, Enum):
    """Which tree choices that change what is cached follow upstream (``decisions``)."""

    AUTO = "auto"  # per write policy and pool sizes, by the differential benchmark (``decisions``)
    UPSTREAM = "upstream"  # sglang 0.5.18's: split remainder stamped, eviction batches, host-only leaves first
    OWN = "own"  # ours: remainder keeps its time, evictions free only the shortfall, copies dropped first

    @classmethod
    def parse(cls, value: "str | TreeDecisions") -> "TreeDecisions":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"tree_decisions: expected one of {[m.value for m in cls]}, got {value!r}") from None


# Upstream thresholds: hits needed before a node is backed up (sglang's HiRadixCache write policies).
_DEFAULT_WRITE_THRESHOLD = {
    WritePolicy.WRITE_THROUGH: 1,
    WritePolicy.WRITE_THROUGH_SELECTIVE: 2,
    WritePolicy.WRITE_BACK: None,
}


@dataclass(frozen=True)
class HiCacheConfig:
    """Settings of one ``HiRadixCache``.

    * ``page_size``: tokens per page; must equal the KV geometry's page size. Keys are
      matched and inserted in whole pages (a trailing partial page is never cached).
    * ``write_policy`` / ``eviction_policy``: strings or enums (see above). The eviction
      policies are upstream's ``--radix-eviction-policy`` choices (``slru`` is not offered);
      ``priority`` orders by the ``priority`` given to ``insert`` / ``begin_request`` (a node
      keeps the highest priority that inserted through it).
    * ``write_through_threshold``: insert-hits before backup; ``None`` takes the policy's
      upstream value (1 for write_through, 2 for write_through_selective). Ignored by write_back.
    * ``load_back_threshold``: a host hit shorter than this many tokens is not loaded back
      (recomputing it is cheaper than a transfer); upstream uses 10 for every page size.
    * ``host_reclaim``: when the host tier is full, drop host copies of on-device nodes
      (they stay on device, no longer backed up), the most recently used first, before
      host-only leaves (unless those are long off the device; ``evictor.evict_host``). Without
      it a host pool smaller than the device pool starves write-through (sglang #33862).
    * ``tree_decisions``: ``"auto"`` (default), ``"upstream"`` or ``"own"``: whether a split
      stamps the unmatched remainder with the access time, whether a load-back or backup
      short of room evicts upstream's batch or only the shortfall, and the host eviction
      order (``decisions`` and docs/deviations-from-upstream.md say what each
      does to the hit rates per tier). ``"auto"`` is never below upstream on the device or the
      host hit rate in the differential benchmark; ``"own"`` keeps more KV on the device
      (more device hits, fewer host hits under write_through).
    * ``transfer_retries``: a backup or load-back whose copy failed is issued again from its
      source (still locked) this many times when it is acknowledged. If it still fails, the
      cache stops: every call raises ``CacheFailedError`` until ``reset()``, so pages with
      undefined bytes are never served.
    * ``storage``: the L3 tier's settings (``hicache_jax.storage.StorageConfig``: backend name,
      path, capacity, prefetch policy, threshold, timeout formula), or a plain dict of its
      fields (e.g. parsed ``--hicache-storage-backend-extra-config`` JSON), or ``None`` for no
      L3. The cache itself never touches storage: a ``StorageController`` reads this field
      when built without an explicit ``storage_config``.
    * ``check_owner_thread``: every call must come from the cache's owner thread (the first
      thread that calls it; ``HiRadixCache.release_owner`` hands it over); a call from another
      thread raises ``OwnerThreadError`` before anything changes. ``False`` turns the check
      off, for an engine that moves the cache between threads itself (it must then make
      sure no two threads ever call at once).
    """

    page_size: int = 1
    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU
    write_through_threshold: int | None = None
    load_back_threshold: int = 10
    host_reclaim: bool = True
    tree_decisions: TreeDecisions | str = TreeDecisions.AUTO
    transfer_retries: int = 2
    storage: StorageConfig | dict | None = None
    check_owner_thread: bool = True

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, 1)
        object.__setattr__(self, "write_policy", WritePolicy.parse(self.write_policy))
        object.__setattr__(self, "eviction_policy", EvictionPolicy.parse(self.eviction_policy))
        if self.write_through_threshold is None:
            object.__setattr__(self, "write_through_threshold", _DEFAULT_WRITE_THRESHOLD[self.write_policy])
        else:
            check_int("write_through_threshold", self.write_through_threshold, 1)
        check_int("load_back_threshold", self.load_back_threshold, 0)
        check_int("transfer_retries", self.transfer_retries, 0, 10)
        object.__setattr__(self, "tree_decisions", TreeDecisions.parse(self.tree_decisions))
        if not isinstance(self.host_reclaim, bool):
            raise TypeError(f"host_reclaim: expected a bool, got {type(self.host_reclaim).__name__}")
        if not isinstance(self.check_owner_thread, bool):
            raise TypeError(f"check_owner_thread: expected a bool, got {type(self.check_owner_thread).__name__}")
        if isinstance(self.storage, dict):
            try:
                object.__setattr__(self, "storage", StorageConfig.from_dict(self.storage))
            except (TypeError, ValueError) as e:
                raise type(e)(f"storage: {e}") from None
        elif self.storage is not None and not isinstance(self.storage, StorageConfig):
            raise TypeError(f"storage: expected a StorageConfig, a dict or None, got {type(self.storage).__name__}")
