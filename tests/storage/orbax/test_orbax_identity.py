"""Issue 21, points 1-3 for the orbax log: segment names are never reused, stray entries in the
store directory never turn writes off, and a reader configured with another page size never
quarantines a writer's valid segments (needs orbax)."""

import glob
import os
import shutil

import numpy as np
import pytest

from hicache_jax import HostKVPool, KVGeometry
from hicache_jax.storage.orbax.segment import is_committed_step

from storage_helpers import GEOM, assert_pages_equal, fill_random, keys_for, make_store


def _committed(tmp_path) -> list[str]:
    """Step directories of every committed segment, as ``w####/<step>``."""
    root = tmp_path / "segments-v1"
    return sorted(
        os.path.relpath(d, root) for d in glob.glob(str(root / "w*" / "*")) if is_committed_step(os.path.basename(d))
    )


# ---- point 1: a reused writer directory never serves another key's bytes -------------------------
@pytest.mark.parametrize("integrity", ["off", "sampled", "full"])
def test_reused_writer_dir_never_serves_old_keys_new_bytes(tmp_path, integrity):
    old, new = keys_for(4, seed=1), keys_for(4, seed=2)
    src_a, src_d = HostKVPool(GEOM, 4, "page_first"), HostKVPool(GEOM, 4, "page_first")
    fill_random(src_a, 1)
    fill_random(src_d, 2)
    a = make_store("orbax", tmp_path, {"target": src_a}, segment_pages=4, refresh_interval_s=0)
    # b: the idle reader (it holds w0001), which indexes a's segment and then does nothing
    dst = HostKVPool(GEOM, 4, "page_first")
    b = make_store("orbax", tmp_path, {"target": dst}, segment_pages=4, refresh_interval_s=0, integrity=integrity)
    assert all(a.batch_set(old, range(4))) and a.flush(60)
    b.refresh()
    assert b.batch_exists(old) == 4
    a_dir = a.writer_dir
    a.close()  # w0000 released
    # c claims w0000 and, with a capacity below one segment, evicts everything; then releases it
    c = make_store(
        "orbax",
        tmp_path,
        {"target": HostKVPool(GEOM, 4, "page_first")},
        segment_pages=4,
        refresh_interval_s=0,
        capacity_bytes=1,
    )
    assert c.writer_dir == a_dir
    c.close()
    assert _committed(tmp_path) == []
    # d claims w0000 again and writes other keys into a new segment
    d = make_store("orbax", tmp_path, {"target": src_d}, segment_pages=4, refresh_interval_s=0)
    assert d.writer_dir == a_dir
    assert all(d.batch_set(new, range(4))) and d.flush(60)
    d_segments = _committed(tmp_path)
    assert len(d_segments) == 1

    # b's index still lists a's segment: its old keys must miss, never read d's bytes
    flags = b.batch_get(old, range(4))
    assert flags == [False] * 4
    for c_ in GEOM.components:  # never d's (or a's) bytes in b's host pages
        got = dst.read_pages(c_, np.arange(4))
        assert not any(
            np.array_equal(got[i], src_d.read_pages(c_, np.arange(4))[j]) for i in range(4) for j in range(4)
        )
    assert b.metrics.hits == 0 and b.metrics.quarantined == 0
    b.refresh()  # and a refresh forgets a's vanished segment
    assert b.batch_exists(old) == 0
    # d's valid segment is untouched, and b reads it
    assert _committed(tmp_path) == d_segments
    assert b.batch_exists(new) == 4
    assert all(b.batch_get(new, range(4)))
    assert_pages_equal(src_d, range(4), dst, range(4))
    assert b.metrics.quarantined == 0 and b.metrics.corrupt == 0
    b.close()
    d.close()


def test_segment_names_are_unique_per_claim(tmp_path):
    src = HostKVPool(GEOM, 4, "page_first")
    fill_random(src, 3)
    names = []
    for seed in range(3):
        st = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, refresh_interval_s=0)
        assert st.writer_dir.endswith("w0000")  # the same writer directory every time
        assert all(st.batch_set(keys_for(4, seed=10 + seed), range(4))) and st.flush(60)
        names += st.segment_names()
        st.close()
        for d in _committed(tmp_path):  # evicted (as by another process): the directory is empty again
            shutil.rmtree(tmp_path / "segments-v1" / d)
    assert len(names) == 3 and len(set(names)) == 3, names


# ---- point 2: stray entries in the store directory never turn writes off --------------------------
def _writer_works(tmp_path, seed=5):
    src = HostKVPool(GEOM, 4, "page_first")
    fill_random(src, seed)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, refresh_interval_s=0)
    keys = keys_for(4, seed=seed)
    ok = st.batch_set(keys, range(4))
    flushed = st.flush(60)
    return st, ok, flushed, keys


@pytest.mark.parametrize("stray", ["file", "symlink_dir", "symlink_dangling", "lock_dir", "lock_symlink", "lock_fifo"])
def test_stray_entry_is_skipped_by_the_claim(tmp_path, stray):
    holder, ok, _, _ = _writer_works(tmp_path, seed=1)  # holds w0000
    assert all(ok) and holder.writer_dir.endswith("w0000")
    root = tmp_path / "segments-v1"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep me")
    w1 = root / "w0001"
    if stray == "file":
        w1.write_bytes(b"not a writer directory")
    elif stray == "symlink_dir":
        w1.symlink_to(outside, target_is_directory=True)
    elif stray == "symlink_dangling":
        w1.symlink_to(tmp_path / "nowhere")
    else:
        w1.mkdir()
        if stray == "lock_dir":
            (w1 / "LOCK").mkdir()
        elif stray == "lock_symlink":
            (w1 / "LOCK").symlink_to(outside / "precious")
        else:
            os.mkfifo(w1 / "LOCK")
    st, ok, flushed, keys = _writer_works(tmp_path, seed=2)
    try:
        assert all(ok) and flushed, "storing was disabled by a stray entry"
        assert st.writer_dir is not None and os.path.basename(st.writer_dir) == "w0002"
        assert st.batch_exists(keys) == 4
        assert st.metrics.write_errors == 0
        # nothing it does not own was deleted, followed or written through
        assert os.path.lexists(w1)
        assert sorted(os.listdir(outside)) == ["precious"]
        assert (outside / "precious").read_bytes() == b"keep me"
        if stray.startswith("lock"):
            assert sorted(os.listdir(w1)) == ["LOCK"]
    finally:
        st.close()
        holder.close()


# ---- point 3: a reader with another page size never quarantines valid data -------------------------
OTHER_GEOM = KVGeometry.mha(2, 8, 2, 32, "bfloat16")  # twice GEOM's page size


@pytest.mark.parametrize("read_path", ["direct", "tensorstore"])
@pytest.mark.parametrize("integrity", ["full", "off"])
def test_mismatched_page_size_reader_is_a_miss_not_a_quarantine(tmp_path, read_path, integrity):
    keys = keys_for(8, seed=4)
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 4)
    w = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, refresh_interval_s=0)
    assert all(w.batch_set(keys, range(8))) and w.flush(60)
    w.close()
    segments = _committed(tmp_path)
    assert len(segments) == 2
    # a raw reader (same keys) configured with another page size, and a capacity bound that its
    # own bytes could never justify evicting the writer's segments for
    bad = make_store(
        "orbax",
        tmp_path,
        {"target": HostKVPool(OTHER_GEOM, 8, "page_first")},
        segment_pages=4,
        refresh_interval_s=0,
        read_path=read_path,
        integrity=integrity,
        capacity_bytes=1,
    )
    assert bad.batch_get(keys, range(8)) == [False] * 8
    m = bad.metrics.snapshot()
    assert m["hits"] == 0 and m["quarantined"] == 0 and m["corrupt"] == 0 and m["segments_evicted"] == 0
    assert m["read_errors"] == 2  # counted once per segment, not silent
    assert bad.batch_exists(keys) == 0  # unreadable with its settings: a miss
    bad.refresh()
    bad.close()
    assert _committed(tmp_path) == segments  # left in place
    assert not glob.glob(str(tmp_path / "segments-v1" / "quarantine" / "*"))
    # a correctly configured reader still hits everything
    dst = HostKVPool(GEOM, 8, "page_first")
    good = make_store("orbax", tmp_path, {"target": dst}, segment_pages=4, refresh_interval_s=0, read_path=read_path)
    assert all(good.batch_get(keys, range(8)))
    assert_pages_equal(src, range(8), dst, range(8))
    good.close()
