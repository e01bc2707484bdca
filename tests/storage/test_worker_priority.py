"""The L3 stores' own threads run at StorageConfig.worker_nice below their creator; stores report
whether accepted writes are still uncommitted (writes_pending)."""

from __future__ import annotations

import os
import sys

import pytest

from hicache_jax import HostKVPool
from hicache_jax.workers import thread_nice
from storage_helpers import GEOM, HAVE_ORBAX, fill_random, keys_for, make_store

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux-only")


@pytest.mark.skipif(not HAVE_ORBAX, reason="orbax / tensorstore not installed (the JAX env runs this)")
def test_orbax_segment_writer_is_niced(tmp_path):
    pool = HostKVPool(GEOM, 8)
    fill_random(pool, 1)
    store = make_store("orbax", tmp_path / "s", {"target": pool}, worker_nice=6)
    try:
        store.batch_set(keys_for(2), [0, 1], "target")  # the writer thread is running now
        assert store.flush(30)
        writer = store.writer.thread
        assert writer.is_alive()
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == min(19, thread_nice() + 6)
    finally:
        store.close()


def test_file_read_and_write_pools_are_niced(tmp_path):
    pool = HostKVPool(GEOM, 8)
    fill_random(pool, 2)
    store = make_store("file", tmp_path / "f", {"target": pool}, worker_nice=3)
    try:
        keys = keys_for(2)
        store.batch_set(keys, [0, 1], "target")  # starts the write pool
        store.batch_get(keys, [2, 3], "target")  # starts the read pool
        for kind in ("read", "write"):
            assert store._executors[kind].submit(thread_nice).result() == min(19, thread_nice() + 3)
    finally:
        store.close()


@pytest.mark.skipif(not HAVE_ORBAX, reason="orbax / tensorstore not installed (the JAX env runs this)")
def test_orbax_writes_pending_until_flushed(tmp_path):
    pool = HostKVPool(GEOM, 8)
    fill_random(pool, 3)
    # A long flush interval: a partial segment stays pending until flush() asks for it.
    store = make_store("orbax", tmp_path / "p", {"target": pool}, segment_pages=4, flush_interval_s=60.0)
    try:
        assert not store.writes_pending()
        store.batch_set(keys_for(2), [0, 1], "target")
        assert store.writes_pending()
        assert store.flush(30)
        assert not store.writes_pending()
    finally:
        store.close()


def test_synchronous_backends_have_nothing_pending(tmp_path, backend):
    if backend == "orbax":
        pytest.skip("asynchronous: covered above")
    pool = HostKVPool(GEOM, 8)
    fill_random(pool, 4)
    store = make_store(backend, tmp_path / "m", {"target": pool})
    try:
        store.batch_set(keys_for(2), [0, 1], "target")
        assert not store.writes_pending()
    finally:
        store.close()


@pytest.mark.skipif(not HAVE_ORBAX, reason="orbax / tensorstore not installed (the JAX env runs this)")
def test_orbax_chunk_size_warning_is_filtered_and_nothing_else():
    import logging
    from hicache_jax.storage.orbax import writer

    f = writer._ChunkSizeWarningFilter()
    rec = lambda msg: logging.LogRecord("absl", logging.WARNING, __file__, 1, msg, None, None)
    assert not f.filter(rec("Setting the target_byte_size too small could reduce performance."))
    assert f.filter(rec("some other orbax warning"))
    assert any(isinstance(x, writer._ChunkSizeWarningFilter) for x in logging.getLogger("absl").filters)
