"""What the eSurge adapter tests share (``test_easydel_esurge``, ``test_easydel_gemma3``): the
cache config they attach with, resetting eSurge's own prefix cache, the last admission, and
closing an engine with a check that its worker processes are gone. Imports nothing of easydel."""

from __future__ import annotations

import gc

from hicache_jax.cache import HiCacheConfig
from hicache_jax.integrations.easydel import testing as F
from hicache_jax.storage import StorageConfig


def hicache_config(l3_dir: str) -> HiCacheConfig:
    """Pages of ``F.PAGE`` tokens, a file L3 in ``l3_dir``; thresholds of one page (these prompts
    are short: the default 256-token prefetch threshold would skip every L3 read)."""
    return HiCacheConfig(
        page_size=F.PAGE,
        load_back_threshold=F.PAGE,
        storage=StorageConfig(backend="file", path=l3_dir, prefetch_threshold_tokens=F.PAGE),
    )


def reset_l1(engine) -> None:
    """Empty eSurge's own prefix cache (L1); fails if a request still holds pages."""
    assert engine.scheduler.kv_cache_manager.reset_prefix_cache(), "eSurge still holds pages"


def last_admission(handle):
    return handle.admissions[-1]


def close_checked(engine, workers: int | None = None) -> None:
    """``F.close_engine``, then assert that none of its worker processes outlived it (and, with
    ``workers``, that it had that many)."""
    pids = F.worker_pids(engine)
    F.close_engine(engine)
    gc.collect()
    if workers is not None:
        assert len(pids) == workers, f"expected {workers} eSurge worker processes, found pids {pids}"
    alive = [pid for pid in pids if F.process_alive(pid)]
    assert not alive, f"eSurge worker processes {alive} outlived close_engine"
