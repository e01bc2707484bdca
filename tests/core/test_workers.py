"""Worker threads run at a lower OS priority than the thread that starts them."""

from __future__ import annotations

import sys
import threading

import pytest

from hicache_jax.transfer import SerialWorker
from hicache_jax.workers import DEFAULT_WORKER_NICE, background_executor, check_nice, lower_thread_priority, thread_nice

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux-only")


@linux
def test_executor_threads_are_niced_and_the_caller_is_not():
    before = thread_nice()
    ex = background_executor("test-nice", 5)
    try:
        got = ex.submit(thread_nice).result()
    finally:
        ex.shutdown()
    assert got == min(19, before + 5)
    assert thread_nice() == before


@linux
def test_threads_started_by_a_worker_inherit_its_priority():
    before = thread_nice()

    def spawn() -> int:
        out = []
        t = threading.Thread(target=lambda: out.append(thread_nice()))
        t.start()
        t.join()
        return out[0]

    ex = background_executor("test-nice-child", 3)
    try:
        assert ex.submit(spawn).result() == min(19, before + 3)
    finally:
        ex.shutdown()


@linux
def test_serial_worker_default_priority():
    before = thread_nice()
    w = SerialWorker("test-serial")
    try:
        assert w.submit(thread_nice).result() == min(19, before + DEFAULT_WORKER_NICE)
    finally:
        w.shutdown()
    w = SerialWorker("test-serial-0", nice=0)
    try:
        assert w.submit(thread_nice).result() == before
    finally:
        w.shutdown()


def test_nice_zero_changes_nothing():
    before = thread_nice()
    assert lower_thread_priority(0) is True
    assert thread_nice() == before


@pytest.mark.parametrize(
    "bad, exc", [(-1, ValueError), (20, ValueError), (1.5, TypeError), (True, TypeError), ("5", TypeError)]
)
def test_check_nice_rejects(bad, exc):
    with pytest.raises(exc, match="worker_nice"):
        check_nice(bad)
    with pytest.raises(exc, match="nice"):
        background_executor("x", bad)


def test_storage_config_validates_worker_nice():
    from hicache_jax.storage import StorageConfig

    assert StorageConfig(backend="memory").worker_nice == DEFAULT_WORKER_NICE
    assert StorageConfig(backend="memory", worker_nice=0).worker_nice == 0
    with pytest.raises(ValueError, match="worker_nice"):
        StorageConfig(backend="memory", worker_nice=25)
    with pytest.raises(TypeError, match="worker_nice"):
        StorageConfig(backend="memory", worker_nice="high")


@linux
def test_storage_controller_threads_are_niced():
    from hicache_jax import KVGeometry
    from hicache_jax.backends.numpy_backend import make_numpy_backend
    from hicache_jax.cache import HiCacheConfig, HiRadixCache
    from hicache_jax.l3 import StorageController
    from hicache_jax.storage import StorageConfig

    geom = KVGeometry.mha(1, 1, 1, 2, "float32")
    device, host, engine = make_numpy_backend(geom, 8, 8)
    cache = HiRadixCache(HiCacheConfig(page_size=1), engine, device.allocator)
    ctl = StorageController(cache, StorageConfig(backend="memory", worker_nice=4), model="m")
    try:
        before = thread_nice()
        for ex in (ctl._query, ctl._io, ctl._writer):
            assert ex.submit(thread_nice).result() == min(19, before + 4)
    finally:
        ctl.close()
