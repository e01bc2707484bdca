"""The orbax writer's two stages (``orbax.writer``): the writer thread saves a segment under
its staging name while the publisher syncs, names and indexes the one before (needs orbax).

What must hold while both run: a page stays pending (served from its buffer) until its
segment is indexed; ``flush`` returns only then; at most two segments are in flight; ``close``
drains both stages; a failed sync drops exactly that segment's pages (counted, ``removed``
told), leaves nothing under either name, and the next save works; commit order (eviction
order) is save order."""

import os
import threading
import time

import pytest

from hicache_jax import HostKVPool

from storage_helpers import GEOM, assert_pages_equal, fill_random, keys_for, make_store

pytest.importorskip("orbax.checkpoint")

from hicache_jax.storage.orbax import durable_save  # noqa: E402


def _gate_sync(monkeypatch):
    """Block every ``sync_tree`` (the publisher's pass) until the returned event is set; the
    second event is set when the first pass is blocked."""
    go, blocked = threading.Event(), threading.Event()
    real = durable_save.sync_tree

    def gated(root):
        blocked.set()
        assert go.wait(60)
        return real(root)

    monkeypatch.setattr(durable_save, "sync_tree", gated)
    return go, blocked


def _wait_for(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _entries(st):
    return sorted(n for n in os.listdir(st.writer_dir) if n != "LOCK")


def test_next_segment_saves_while_the_one_before_publishes_and_pages_stay_pending(tmp_path, monkeypatch):
    go, blocked = _gate_sync(monkeypatch)
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 41)
    keys = keys_for(12, seed=42)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, flush_interval_s=60)
    try:
        assert all(st.batch_set(keys, range(12)))  # three full segments: sealed at once
        assert blocked.wait(60)  # segment 0 saved, its sync pass held
        gen = _entries(st)[0].split("_")[0]
        # the writer saved segment 1 meanwhile (under its staging name), then waits: no third in flight
        _wait_for(lambda: f"{gen}_1.staged" in _entries(st))
        assert not st.flush(0.5)  # nothing published yet: flush does not return
        assert _entries(st) == [f"{gen}_0.staged", f"{gen}_1.staged"]  # no committed name, no step 2
        assert st.writer.pending_flags("target", keys) == [True] * 12
        assert st.index.oldest() is None
        dst = HostKVPool(GEOM, 16, "page_first")
        st.codecs["target"].pool = dst
        assert all(st.batch_get(keys, range(12)))  # served from the buffers
        assert_pages_equal(src, range(12), dst, range(12))
        go.set()
        assert st.flush(60)
        assert _entries(st) == [f"{gen}_0", f"{gen}_1", f"{gen}_2"]
        assert not any(st.writer.pending_flags("target", keys))
        assert st.index.oldest().name.endswith(f"{gen}_0")  # commit order is save order
        assert st.metrics.segments_written == 3 and st.metrics.pages_written == 12
        dst.array[...] = 0
        assert all(st.batch_get(keys, range(12)))  # now from disk
        assert_pages_equal(src, range(12), dst, range(12))
        assert st.metrics.verified == 12
    finally:
        go.set()
        st.codecs["target"].pool = src
        st.close()


def test_close_drains_both_stages(tmp_path, monkeypatch):
    go, blocked = _gate_sync(monkeypatch)
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 43)
    keys = keys_for(10, seed=44)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, flush_interval_s=60)
    assert all(st.batch_set(keys, range(10)))  # two full segments and two pages in an open buffer
    assert blocked.wait(60)
    closer = threading.Thread(target=st.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive()  # waiting for the publisher
    go.set()
    closer.join(60)
    assert not closer.is_alive()
    assert not st.writer.thread.is_alive() and not st.writer.publisher.is_alive()
    left = sorted(os.listdir(tmp_path / "segments-v1" / "w0000"))
    assert len(left) == 4 and "LOCK" in left and not [n for n in left if "." in n], left  # 3 committed steps
    st2 = make_store("orbax", tmp_path, {"target": HostKVPool(GEOM, 16, "page_first")}, segment_pages=4)
    dst = st2.codecs["target"].pool
    assert all(st2.batch_get(keys, range(10)))
    assert_pages_equal(src, range(10), dst, range(10))
    st2.close()


def test_a_failed_sync_drops_exactly_its_segment_and_the_next_save_works(tmp_path, monkeypatch):
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 45)
    keys = keys_for(12, seed=46)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, flush_interval_s=60)
    told = []
    st.add_listener(lambda kind, pool, ks: told.append((kind, list(ks))))
    assert all(st.batch_set(keys[:4], range(4)))
    assert st.flush(60)
    real = durable_save.sync_tree
    calls = []

    def fail_second(root):  # the segment of keys[4:8] fails its sync pass; the ones around it do not
        calls.append(root)
        if len(calls) == 1:
            raise OSError(5, "EIO")
        return real(root)

    monkeypatch.setattr(durable_save, "sync_tree", fail_second)
    assert all(st.batch_set(keys[4:8], range(4, 8)))
    assert st.flush(60)
    assert st.batch_exists(keys[4:8]) == 0 and not any(st.writer.pending_flags("target", keys[4:8]))
    assert st.metrics.write_errors == 1 and st.metrics.pages_dropped == 4 and st.metrics.segments_written == 1
    assert ("removed", keys[4:8]) in told
    gen = _entries(st)[0].split("_")[0]
    assert _entries(st) == [f"{gen}_0"]  # nothing of step 1 under either name
    assert all(st.batch_set(keys[8:12], range(8, 12)))
    assert st.flush(60)
    assert _entries(st) == [f"{gen}_0", f"{gen}_2"]  # step names never reused
    dst = HostKVPool(GEOM, 16, "page_first")
    st.codecs["target"].pool = dst
    flags = st.batch_get(keys, range(12))
    assert flags == [True] * 4 + [False] * 4 + [True] * 4
    assert_pages_equal(src, [*range(4), *range(8, 12)], dst, [*range(4), *range(8, 12)])
    st.codecs["target"].pool = src
    st.close()


def test_a_failed_rename_leaves_nothing_under_either_name(tmp_path, monkeypatch):
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 47)
    keys = keys_for(4, seed=48)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, flush_interval_s=60)
    real = os.fsync
    parent = st.writer_dir

    def fail_dir_sync(fd):  # the step is renamed, but its name cannot be made durable
        if os.readlink(f"/proc/self/fd/{fd}") == parent:
            raise OSError(5, "EIO")
        real(fd)

    monkeypatch.setattr(os, "fsync", fail_dir_sync)
    assert all(st.batch_set(keys, range(4)))
    assert st.flush(60)
    monkeypatch.setattr(os, "fsync", real)
    assert st.batch_exists(keys) == 0 and st.metrics.pages_dropped == 4
    assert _entries(st) == []
    st.close()


def test_pages_enqueued_after_a_flush_are_not_sealed_by_it(tmp_path):
    """``flush`` asks the writer to seal what is pending; once it has returned, pages enqueued
    after it wait for a full segment (or ``flush_interval_s``) again: a request left standing
    after the publisher finished would seal the next batch's first half on its own."""
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 49)
    keys = keys_for(40, seed=50)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, flush_interval_s=60)
    try:
        for i in range(0, 40, 4):
            assert all(st.batch_set(keys[i : i + 2], range(2)))
            time.sleep(0.05)  # the writer has every chance to act on a standing request
            assert all(st.batch_set(keys[i + 2 : i + 4], range(2, 4)))
            assert st.flush(60)
        assert st.metrics.segments_written == 10
        assert sorted(s.counts["target"] for s in st.index.segments.values()) == [4] * 10
    finally:
        st.close()


def test_two_stores_in_one_process_never_run_two_orbax_saves_at_once(tmp_path, monkeypatch):
    """orbax's save steps share a process-wide operation id: two saves at once in one process
    (two stores) can wait forever on each other's signals, so saves are serialised across
    stores (a store's publisher still overlaps its syncs with the other's saves)."""
    import orbax.checkpoint as ocp

    real = ocp.Checkpointer.save
    inside, most = [0], [0]
    lock = threading.Lock()

    def save(self, *a, **k):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.05)  # long enough for the other store's save to arrive meanwhile
            return real(self, *a, **k)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(ocp.Checkpointer, "save", save)
    srcs, stores, keys = [], [], []
    for i in range(2):
        src = HostKVPool(GEOM, 16, "page_first")
        fill_random(src, 51 + i)
        srcs.append(src)
        stores.append(make_store("orbax", tmp_path / f"s{i}", {"target": src}, segment_pages=4, flush_interval_s=60))
        keys.append(keys_for(16, seed=60 + i))
    try:

        def write(i):
            for j in range(0, 16, 4):
                assert all(stores[i].batch_set(keys[i][j : j + 4], range(j, j + 4)))
            assert stores[i].flush(60)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        assert most[0] == 1
        for i in range(2):
            assert stores[i].metrics.segments_written == 4 and stores[i].metrics.write_errors == 0
            assert stores[i].batch_exists(keys[i]) == 16
    finally:
        for st in stores:
            st.close()
