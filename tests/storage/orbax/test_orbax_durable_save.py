"""Segment saves reach the disk through one fsync pass (``orbax.durable_save``): tensorstore's
own writes of a segment do not sync, every file and directory of the segment is fsync'ed
under its staging name before the step is renamed to its committed name (on the publisher
thread, beside the next save), and the pages read back (needs orbax)."""

import os
import threading
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from hicache_jax import HostKVPool

from storage_helpers import GEOM, assert_pages_equal, fill_random, keys_for, make_store, segment_dirs

STAGED = ".staged"


def _spy_fsync(monkeypatch):
    """Record the path of every ``os.fsync`` (and still sync)."""
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def _spy_contexts(monkeypatch):
    """Record the tensorstore context spec of every array write orbax's numpy handler makes."""
    specs = []
    real = ocp.type_handlers.NumpyHandler._open_and_write

    async def open_and_write(self, value, tspec, ts_context):
        specs.append(ts_context.spec.to_json())
        return await real(self, value, tspec, ts_context)

    monkeypatch.setattr(ocp.type_handlers.NumpyHandler, "_open_and_write", open_and_write)
    return specs


def test_segment_files_synced_before_their_committed_name_and_read_back(tmp_path, monkeypatch):
    events = _spy_sync_and_rename(monkeypatch)
    specs = _spy_contexts(monkeypatch)
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 5)
    keys = keys_for(8, seed=3)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=4)
    assert all(st.batch_set(keys, range(8)))
    assert st.flush(60)
    segs = segment_dirs(tmp_path)
    assert len(segs) == 2

    # every array of both saves (data, keys, crc) went through a context that does not sync
    assert len(specs) == 6 and all(s.get("file_io_sync") is False for s in specs), specs

    for seg in segs:
        parent, name = os.path.split(seg)
        staged = os.path.join(parent, name + STAGED)
        # the one rename that gives the step its committed name comes after every fsync of it
        named = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == seg]
        assert len(named) == 1 and events[named[0]][1] == staged, events
        synced = [e[1] for e in events[: named[0]] if e[0] == "fsync"]
        # (the publisher's own calls: the writer thread may already be saving the next step)
        after = [e[1] for e in events[named[0] :] if e[0] == "fsync" and e[2] == events[named[0]][3]]
        files = [os.path.join(d, f) for d, _, fs in os.walk(seg) for f in fs]
        # the page data: tensorstore may spread one save's chunks over several OCDBT data files
        # (how many depends on how its writes batch up), so count their bytes together
        data_files = [f for f in files if os.path.basename(os.path.dirname(f)) == "d"]
        assert sum(os.path.getsize(f) for f in data_files) >= 4 * src.geom.bytes_per_page, files
        for f in files:  # each synced under the staging name: before the step got its committed one
            rel = os.path.relpath(f, seg)
            assert os.path.join(staged, rel) in synced, (rel, synced)
        for d in [d for d, _, _ in os.walk(seg)]:
            rel = os.path.relpath(d, seg)
            assert os.path.normpath(os.path.join(staged, rel)) in synced, (rel, synced)
        assert not any(
            p == seg or p.startswith(seg + os.sep) for e in events[named[0] :] if e[0] == "fsync" for p in [e[1]]
        )  # nothing of it synced after, by any thread
        assert after and after[0] == parent  # then the committed name itself: the writer directory

    dst = HostKVPool(GEOM, 16, "page_first")
    st.codecs["target"].pool = dst
    assert all(st.batch_get(keys, range(8)))
    assert_pages_equal(src, range(8), dst, range(8))
    assert st.metrics.verified == 8 and st.metrics.corrupt == 0
    st.close()


def test_orbax_users_outside_the_store_keep_synced_writes(tmp_path, monkeypatch):
    """The store's handler and args classes change nothing for other orbax users in the process:
    a plain ``PyTreeSave`` still goes to orbax's own handler and tensorstore's default context."""
    specs = _spy_contexts(monkeypatch)
    src = HostKVPool(GEOM, 4, "page_first")
    st = make_store("orbax", tmp_path / "l3", {"target": src}, segment_pages=4)  # registers the store's classes
    with ocp.CheckpointManager(
        str(tmp_path / "other"), options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    ) as mgr:
        mgr.save(0, args=ocp.args.PyTreeSave({"w": np.arange(8, dtype=np.float32)}))
        mgr.wait_until_finished()
    assert specs and all(s.get("file_io_sync", True) is not False for s in specs), specs
    st.close()


def _fail_fsync_of(monkeypatch, suffix: str) -> None:
    """``os.fsync`` fails with EIO for a path ending with ``suffix`` (and syncs the others)."""
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(suffix):
            raise OSError(5, "EIO")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def _tree(root):
    """A small step-like tree: two files at the top, one in a subdirectory."""
    (root / "d").mkdir(parents=True)
    for rel in ("manifest", "meta", "d/data"):
        (root / rel).write_bytes(b"x" * 100)
    return {str(root), str(root / "d"), str(root / "manifest"), str(root / "meta"), str(root / "d" / "data")}


def test_sync_tree_syncs_every_file_and_directory(tmp_path, monkeypatch):
    from hicache_jax.storage.orbax.durable_save import sync_tree

    synced = _spy_fsync(monkeypatch)
    want = _tree(tmp_path / "step")
    assert sync_tree(str(tmp_path / "step")) == len(want)
    assert sorted(synced) == sorted(want)  # each exactly once


def test_sync_tree_waits_for_every_fsync_and_raises_the_first_failure(tmp_path, monkeypatch):
    """The fsyncs run concurrently, but ``sync_tree`` returns only after all of them have
    returned (the caller publishes the step right after), and a failed fsync fails the pass."""
    from hicache_jax.storage.orbax.durable_save import sync_tree

    _tree(tmp_path / "step")
    real = os.fsync
    done = []

    def slow_fsync(fd):  # the data file's writeback takes longest
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith("data"):
            time.sleep(0.3)
        real(fd)
        done.append(path)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    sync_tree(str(tmp_path / "step"))
    assert len(done) == 5 and done[-1].endswith("data"), done  # returned after the slow one

    monkeypatch.setattr(os, "fsync", real)
    _fail_fsync_of(monkeypatch, "meta")
    with pytest.raises(OSError):
        sync_tree(str(tmp_path / "step"))
    assert not [t for t in threading.enumerate() if t.name.startswith("l3-orbax-sync")]  # no thread left behind


def _spy_sync_and_rename(monkeypatch):
    """Record ("fsync", path, thread) and ("rename", src, dst, thread) events in order (both
    still happen)."""
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        real_fsync(fd)
        events.append(("fsync", path, threading.get_ident()))

    def rename(src, dst, *a, **k):
        events.append(("rename", os.fspath(src), os.fspath(dst), threading.get_ident()))
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    return events


def test_publish_step_names_a_step_only_after_all_of_it_is_synced(tmp_path, monkeypatch):
    from hicache_jax.storage.orbax.durable_save import publish_step

    staged = tmp_path / "w0000" / "g0123456789abcdef_3.staged"
    want = _tree(staged)
    committed = str(tmp_path / "w0000" / "g0123456789abcdef_3")
    events = _spy_sync_and_rename(monkeypatch)
    publish_step(str(staged), committed)
    renames = [i for i, e in enumerate(events) if e[0] == "rename"]
    assert [events[i][:3] for i in renames] == [("rename", str(staged), committed)]
    before = {e[1] for e in events[: renames[0]] if e[0] == "fsync"}
    assert before == want  # every file and directory synced before it had the name
    assert [e[:2] for e in events[renames[0] + 1 :]] == [("fsync", str(tmp_path / "w0000"))]  # then the name
    assert sorted(os.listdir(tmp_path / "w0000")) == ["g0123456789abcdef_3"]
    assert (tmp_path / "w0000" / "g0123456789abcdef_3" / "d" / "data").read_bytes() == b"x" * 100


def test_publish_step_that_fails_to_sync_never_names_the_step(tmp_path, monkeypatch):
    from hicache_jax.storage.orbax.durable_save import publish_step

    staged = tmp_path / "w0000" / "s.staged"
    _tree(staged)
    _fail_fsync_of(monkeypatch, "data")
    with pytest.raises(OSError):
        publish_step(str(staged), str(tmp_path / "w0000" / "s"))
    assert os.listdir(tmp_path / "w0000") == ["s.staged"]  # never renamed
    with pytest.raises(ValueError, match="committed"):
        publish_step(str(staged), str(tmp_path / "elsewhere" / "s"))
    assert os.listdir(tmp_path / "w0000") == ["s.staged"]
