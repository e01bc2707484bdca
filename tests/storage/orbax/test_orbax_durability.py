"""When an orbax segment is durable: with ``integrity="full"`` every file of a saved step is
fsync'ed (once, all at once) before the writer indexes the segment, and tensorstore's fsync per
file is off; with other integrity modes tensorstore keeps syncing file by file."""

from __future__ import annotations

import os

import numpy as np
import pytest

from storage_helpers import GEOM, HAVE_ORBAX, HostKVPool, check_keyed_pages, keys_for, make_store, put_keyed_pages

pytestmark = pytest.mark.skipif(not HAVE_ORBAX, reason="orbax-checkpoint / tensorstore not installed")


def _record_fsyncs(monkeypatch) -> list[str]:
    """Paths fsync'ed from Python from now on (tensorstore's own fsyncs are in C++, not seen)."""
    seen: list[str] = []
    real = os.fsync

    def fsync(fd):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd to name fsync'ed files")
def test_every_file_of_a_segment_is_fsynced_before_it_is_indexed(tmp_path, monkeypatch):
    from hicache_jax.storage.orbax import writer as wmod

    seen = _record_fsyncs(monkeypatch)
    pool = HostKVPool(GEOM, 8, "page_first")
    st = make_store("orbax", tmp_path, {"target": pool}, segment_pages=8, integrity="full")
    assert st.writer._sync_per_step == wmod._CAN_SYNC_PER_STEP
    if not wmod._CAN_SYNC_PER_STEP:
        st.close()
        pytest.skip("this orbax has no _open_and_write hook: tensorstore syncs per file")
    at_index: dict[str, set[str]] = {}
    real_add = st.index.add

    def add(seg):
        at_index[seg.path] = set(seen)  # what had been fsync'ed when the segment became visible
        return real_add(seg)

    monkeypatch.setattr(st.index, "add", add)
    keys = keys_for(8, seed=5)
    put_keyed_pages(st, "target", keys, np.arange(8))
    assert all(st.batch_set(keys, np.arange(8)))
    assert st.flush(60)
    assert len(at_index) == 1
    (path, synced), = at_index.items()
    files = {os.path.realpath(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs}
    assert len(files) >= 3  # data, manifest, zarr metadata at least
    assert files <= {os.path.realpath(p) for p in synced}, sorted(files - synced)
    pool.array[...] = 0
    assert st.batch_get(keys, np.arange(8)) == [True] * 8
    check_keyed_pages(st, "target", keys, np.arange(8))
    st.close()


@pytest.mark.parametrize("integrity", ["sampled", "off"])
def test_unverified_stores_keep_tensorstores_sync_per_file(tmp_path, integrity):
    st = make_store("orbax", tmp_path, {"target": HostKVPool(GEOM, 8, "page_first")}, integrity=integrity)
    assert st.writer._sync_per_step is False
    st.close()
