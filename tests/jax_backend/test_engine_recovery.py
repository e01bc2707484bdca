"""The engine survives a copy that fails after every retry (``CacheFailedError``).

``FailingCopies`` wraps the engine's transfer engine so that the next N backups or loads
fail, and so do all their retries (the handle is done, waiting raises ``TransferError``; a
failed load leaves its destination pages as they were). The engine must abandon the requests
it holds, reset the cache, re-admit them and produce the cold run's tokens, counting each
recovery in ``metrics.cache_failures_recovered``.
"""

from __future__ import annotations

import numpy as np
import pytest

from hicache_jax.cache import CacheFailedError
from hicache_jax.engine import Engine, EngineCacheConfig
from hicache_jax.engine.engine import MAX_FAILURES_WITHOUT_PROGRESS
from hicache_jax.reference_model import ModelConfig
from hicache_jax.storage.config import StorageConfig
from hicache_jax.transfer import LoadHandle, TransferError

PAGE, NEW = 4, 4


class _Failed(LoadHandle):
    num_layers = 1

    def layer_done(self, layer: int) -> bool:
        return True

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        raise TransferError("injected copy failure")


class FailingCopies:
    """The next ``ops`` copies of ``kind`` ("backup" / "load") fail, and so do all their
    retries (the cache issues a retry with the same source and destination pages)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.left = {"backup": 0, "load": 0}
        self.failed = {"backup": 0, "load": 0}
        self.doomed: dict[tuple, int] = {}  # (kind, src, dst) -> failures still to give
        t = engine.transfer
        self.inner = {"backup": t.backup_owned, "load": t.load_owned}
        t.backup_owned = lambda d, h: self._copy("backup", d, h)
        t.load_owned = lambda h, d: self._copy("load", h, d)

    def arm(self, kind: str, ops: int) -> None:
        self.left[kind] = ops

    def _copy(self, kind: str, src, dst):
        key = (kind, np.asarray(src).tobytes(), np.asarray(dst).tobytes())
        if key not in self.doomed and self.left[kind] > 0:
            self.left[kind] -= 1
            self.doomed[key] = 1 + self.engine.cache.config.transfer_retries
        if self.doomed.get(key, 0) > 0:
            self.doomed[key] -= 1
            self.failed[kind] += 1
            return _Failed()
        return self.inner[kind](src, dst)


def _prompts(seed: int, n: int, length: int = 30) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 512, 16).tolist()
    return [system + rng.integers(0, 512, length - 16).tolist() for _ in range(n)]


def _engine(tmp_path=None) -> Engine:
    storage = (
        None
        if tmp_path is None
        else StorageConfig(
            backend="file", path=str(tmp_path / "l3"), prefetch_policy="wait_complete", prefetch_threshold_tokens=8
        )
    )
    return Engine(
        ModelConfig(num_layers=2, hidden=32, ffn=64),
        EngineCacheConfig(
            page_size=PAGE, device_pages=64, max_batch=3, prefill_chunk=16, max_context=64, storage=storage
        ),
    )


def _consistent(engine: Engine) -> None:
    engine.cache.flush()
    engine.cache.sanity_check(0)
    engine.evict_device_cache()
    assert engine.device_pool.allocator.used == 0  # no page leaked by an abandoned request


@pytest.fixture(scope="module")
def engine():
    eng = _engine()
    yield eng, FailingCopies(eng)
    eng.close()


def test_failed_backup_recovered_with_identical_tokens(engine):
    eng, failing = engine
    prompts = _prompts(1, 3)
    cold = eng.generate(prompts, NEW, use_cache=False)
    before = eng.metrics.cache_failures_recovered
    failing.arm("backup", 1)  # the first prompt's write-through backup
    res = eng.generate(prompts, NEW)
    assert failing.failed["backup"] == 1 + eng.cache.config.transfer_retries
    assert [r.tokens for r in res] == [r.tokens for r in cold]
    assert eng.metrics.cache_failures_recovered == before + 1
    assert eng.stats()["cache_failures_recovered"] == before + 1
    assert eng.metrics.requests_readmitted >= 1
    assert eng.cache.failure is None
    _consistent(eng)
    again = eng.generate(prompts, NEW)  # the cache works again: the prefixes hit
    assert [r.tokens for r in again] == [r.tokens for r in cold]
    assert all(r.cached_total > 0 for r in again)


def test_failed_load_back_recovered_by_recomputing(engine):
    eng, failing = engine
    prompts = _prompts(2, 2)
    cold = eng.generate(prompts, NEW, use_cache=False)
    eng.generate(prompts, NEW)
    eng.evict_device_cache()  # the prefixes are on the host only
    before = eng.metrics.cache_failures_recovered
    failing.arm("load", 1)
    res = eng.generate(prompts, NEW)
    assert failing.failed["load"] == 1 + eng.cache.config.transfer_retries
    assert [r.tokens for r in res] == [r.tokens for r in cold]
    assert eng.metrics.cache_failures_recovered == before + 1
    # The load's garbage was never read: the prefix was recomputed after the reset (no L3).
    assert res[0].cached_total == 0 and res[0].prefill_tokens == res[0].prompt_len
    _consistent(eng)


def test_failures_that_never_stop_end_generate(engine):
    eng, failing = engine
    prompts = _prompts(3, 2)
    before = eng.metrics.cache_failures_recovered
    failing.arm("backup", 100)
    with pytest.raises(CacheFailedError):
        eng.generate(prompts, NEW)
    assert eng.metrics.cache_failures_recovered == before + MAX_FAILURES_WITHOUT_PROGRESS
    failing.left["backup"], failing.doomed = 0, {}
    # The latch is still closed: the next generate resets the cache first and serves.
    cold = eng.generate(prompts, NEW, use_cache=False)
    assert [r.tokens for r in eng.generate(prompts, NEW)] == [r.tokens for r in cold]
    _consistent(eng)


def test_failed_load_recovered_from_storage(tmp_path):
    """With L3: after the reset the abandoned request's prefix comes back from storage."""
    eng = _engine(tmp_path)
    failing = FailingCopies(eng)
    prompts = _prompts(4, 2)
    cold = eng.generate(prompts, NEW, use_cache=False)
    eng.generate(prompts, NEW)
    eng.flush()
    eng.evict_device_cache()  # host only (and in L3)
    failing.arm("load", 1)
    res = eng.generate(prompts, NEW)
    assert [r.tokens for r in res] == [r.tokens for r in cold]
    assert eng.metrics.cache_failures_recovered == 1
    assert res[0].cached_tokens["storage"] == (len(prompts[0]) - 1) // PAGE * PAGE
    _consistent(eng)
    eng.close()
