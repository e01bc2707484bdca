"""Engine-side cache configuration (validated at construction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._checks import check_int
from ..cache.config import EvictionPolicy, HiCacheConfig, WritePolicy
from ..storage.config import StorageConfig
from ..workers import DEFAULT_WORKER_NICE, check_nice
from ..host_layout import HostLayout
from ..host_pool import HostPoolConfig


# The page-copy implementations ``pallas_kernels.page_copy`` accepts (its ``PageCopyConfig``;
# checked here without importing JAX, and against the dispatcher in tests/jax_backend).
COPY_IMPLS = ("auto", "xla", "tpu", "gpu", "mgpu", "kernel", "direct")


@dataclass(frozen=True)
class EngineCacheConfig:
    """How the engine caches KV.

    * ``device_pages``: L1 pool size in pages (page_size tokens each).
    * ``host``: L2 pool sizing and layout (ratio of device pages, or bytes).
    * ``write_policy`` / ``eviction_policy``: as ``HiCacheConfig``.
    * ``copy_impl``: page-copy implementation (``auto``: Pallas on GPU/TPU, XLA on CPU).
    * ``max_batch``: sequences decoded together; ``prefill_chunk``: tokens per prefill step.
    * ``max_context``: longest prompt + output in tokens; fixes the attention width, so
      ``Engine.warmup`` can compile every step shape before serving.
    * ``storage``: the L3 tier (``StorageConfig``: backend orbax / file / memory, path,
      capacity, prefetch policy, threshold, timeout), or None for L1 + L2 only.
    * ``worker_nice``: how much lower than the scheduler's the OS priority of the D2H copy
      worker is (0..19; ``hicache_jax.workers``). The L3 threads take theirs from
      ``storage.worker_nice``.
    * ``swa_device_pages``: hybrid models only: the SWA pool's size in pages (its L2 pool
      has the same ratio to it as the full pool's host pool to ``device_pages``). None: the
      pages the running requests can need at once (``Engine.swa_pages_needed``) plus a
      quarter of ``device_pages`` for cached windows. Ignored for a model without
      sliding-window layers.
    * ``deterministic``: every model step runs in one fixed shape, ``(max_batch,
      deterministic_step_tokens)`` (``PagedRunner``'s deterministic mode): a position's KV and
      logits do not depend on how its tokens were chunked, batched or served from the cache,
      so tokens are identical with and without the cache on any platform. Slower (a decode
      step computes ``max_batch * deterministic_step_tokens`` token slots). L3 pages written
      in this mode are keyed apart from the default mode's.
    * ``deterministic_step_tokens``: tokens per row of that shape (>= the speculative verify's
      ``k + 1``).
    """

    page_size: int = 16
    device_pages: int = 256
    host: HostPoolConfig = field(default_factory=lambda: HostPoolConfig(layout=HostLayout.PAGE_FIRST, ratio=4.0))
    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    eviction_policy: EvictionPolicy | str = EvictionPolicy.LRU
    copy_impl: str = "auto"
    max_batch: int = 8
    prefill_chunk: int = 512
    max_context: int = 4096
    storage: StorageConfig | None = None
    worker_nice: int = DEFAULT_WORKER_NICE
    swa_device_pages: int | None = None
    deterministic: bool = False
    deterministic_step_tokens: int = 16

    def __post_init__(self) -> None:
        check_nice(self.worker_nice)
        check_int("page_size", self.page_size, 1)
        check_int("device_pages", self.device_pages, 2)
        check_int("max_batch", self.max_batch, 1)
        check_int("prefill_chunk", self.prefill_chunk, 1)
        check_int("max_context", self.max_context, 2)
        if not isinstance(self.deterministic, bool):
            raise TypeError(f"deterministic: expected a bool, got {type(self.deterministic).__name__}")
        check_int("deterministic_step_tokens", self.deterministic_step_tokens, 1)
        if self.swa_device_pages is not None:
            check_int("swa_device_pages", self.swa_device_pages, 2)
        if self.copy_impl not in COPY_IMPLS:
            raise ValueError(f"copy_impl: expected one of {list(COPY_IMPLS)}, got {self.copy_impl!r}")
        if not isinstance(self.host, HostPoolConfig):
            raise TypeError(f"host: expected a HostPoolConfig, got {type(self.host).__name__}")
        if self.storage is not None and not isinstance(self.storage, StorageConfig):
            raise TypeError(f"storage: expected a StorageConfig or None, got {type(self.storage).__name__}")
        # Validates the policies (raises ValueError naming the field).
        self.tree_config()

    def tree_config(self) -> HiCacheConfig:
        return HiCacheConfig(
            page_size=self.page_size,
            write_policy=self.write_policy,
            eviction_policy=self.eviction_policy,
            storage=self.storage,
        )

    @property
    def fixed_step_shape(self) -> tuple[int, int] | None:
        """The deterministic mode's one model-step shape ``(rows, tokens)``; None by default."""
        return (self.max_batch, self.deterministic_step_tokens) if self.deterministic else None
