"""The orbax segment log: restart, fault injection, crash safety, two writers (needs orbax)."""

import glob
import json
import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from hicache_jax import HostKVPool

from storage_helpers import (
    GEOM,
    assert_pages_equal,
    child_cmd,
    child_env,
    fill_random,
    keys_for,
    make_store,
    segment_dirs,
)
from test_faults import _run_readonly


def _store(tmp_path, n=8, seg=4, **cfg):
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 11)
    keys = keys_for(n, seed=21)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=seg, **cfg)
    assert all(st.batch_set(keys, range(n)))
    assert st.flush(60)
    return st, src, keys


def _read_back(st, keys):
    dst = HostKVPool(GEOM, 16, "page_first")
    st.codecs["target"].pool = dst
    return st.batch_get(keys, range(len(keys))), dst


def _seg_dirs(tmp_path):
    return segment_dirs(tmp_path)


def _page_location(seg_dir, page: bytes):
    for f in glob.glob(os.path.join(seg_dir, "**", "*"), recursive=True):
        if os.path.isfile(f):
            with open(f, "rb") as fh:
                data = fh.read()
            off = data.find(page)
            if off >= 0:
                return f, off
    raise AssertionError("page bytes not found in any segment file")


def test_segments_one_chunk_per_page_and_reopen(tmp_path):
    st, src, keys = _store(tmp_path)
    assert st.metrics.segments_written == 2 and len(_seg_dirs(tmp_path)) == 2
    # each page is stored contiguously (one chunk per page, uncompressed): its bytes appear verbatim
    page = st.codecs["target"].pack(np.array([5]))[0].tobytes()
    _page_location(_seg_dirs(tmp_path)[1], page)
    st.close()
    st2 = make_store("orbax", tmp_path, {"target": src}, segment_pages=4)
    assert st2.batch_exists(keys) == 8  # index rebuilt from the segments' key arrays
    flags, dst = _read_back(st2, keys)
    assert all(flags)
    assert_pages_equal(src, range(8), dst, range(8))
    assert st2.writer_dir.endswith("w0000")  # the dead owner's writer dir is reused
    st2.close()


@pytest.mark.parametrize("max_pending,want", [(1024, 256), (100, 100)])
def test_default_segments_are_sized_by_bytes(tmp_path, max_pending, want):
    # segment_pages=None: GEOM's pages are small, so a segment takes the most pages allowed.
    n = want + 7
    src = HostKVPool(GEOM, n, "page_first")
    fill_random(src, 13)
    keys = keys_for(n, seed=23)
    st = make_store(
        "orbax", tmp_path, {"target": src}, segment_pages=None, max_pending_pages=max_pending, flush_interval_s=60
    )
    assert all(st.batch_set(keys[:want], range(want)))  # one full segment: saved without a flush
    deadline = time.monotonic() + 60
    while st.metrics.segments_written < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(st.batch_set(keys[want:], range(want, n)))
    assert st.flush(60)
    assert sorted(seg.counts["target"] for seg in st.index.segments.values()) == [7, want]
    dst = HostKVPool(GEOM, n, "page_first")
    st.codecs["target"].pool = dst
    assert all(st.batch_get(keys, range(n)))
    assert_pages_equal(src, range(n), dst, range(n))
    st.close()


def test_pending_pages_are_readable_before_the_save(tmp_path):
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 12)
    keys = keys_for(3, seed=22)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=64, flush_interval_s=60)
    st.batch_set(keys, [0, 1, 2])
    assert st.batch_exists(keys) == 3 and st.metrics.segments_written == 0  # in flight, not yet saved
    flags, dst = _read_back(st, keys)
    assert all(flags)
    assert_pages_equal(src, [0, 1, 2], dst, [0, 1, 2])
    st.close()  # close flushes
    assert st.metrics.segments_written == 1


def test_flipped_byte_quarantines_segment(tmp_path):
    st, src, keys = _store(tmp_path)
    seg = _seg_dirs(tmp_path)[0]  # pages 0-3
    f, off = _page_location(seg, st.codecs["target"].pack(np.array([2]))[0].tobytes())
    with open(f, "r+b") as fh:
        fh.seek(off + 777)
        b = fh.read(1)
        fh.seek(off + 777)
        fh.write(bytes([b[0] ^ 0x40]))
    flags, dst = _read_back(st, keys)
    assert flags[2] is False and flags[4:] == [True] * 4
    assert not dst.read_pages("k", [2]).any()  # never the wrong bytes
    assert_pages_equal(src, range(4, 8), dst, range(4, 8))
    m = st.metrics.snapshot()
    assert m["corrupt"] >= 1 and m["quarantined"] == 1
    assert st.batch_exists(keys) == 0 and st.batch_exists(keys[4:]) == 4  # whole segment left the index
    assert not os.path.exists(seg) and glob.glob(str(tmp_path / "segments-v1" / "quarantine" / "*"))
    st.close()
    st2 = make_store("orbax", tmp_path, {"target": src}, segment_pages=4)  # stays out after restart
    assert st2.batch_exists(keys[4:]) == 4 and st2.batch_exists(keys) == 0
    st2.close()


def test_truncated_data_file_is_a_miss(tmp_path):
    st, src, keys = _store(tmp_path)
    seg = _seg_dirs(tmp_path)[1]
    f, off = _page_location(seg, st.codecs["target"].pack(np.array([6]))[0].tobytes())
    with open(f, "r+b") as fh:
        fh.truncate(off + 100)
    flags, dst = _read_back(st, keys)
    assert flags[:4] == [True] * 4 and flags[6] is False
    assert not dst.read_pages("k", [6]).any()
    # pages of that segment read before the quarantine are CRC-verified, hence right
    good = [i for i in range(8) if flags[i]]
    assert_pages_equal(src, good, dst, good)
    assert st.metrics.quarantined == 1 and st.metrics.corrupt >= 1
    assert st.batch_exists(keys) == 4 and st.batch_exists(keys[4:]) == 0
    st.close()


def test_deleted_segment_is_a_miss(tmp_path):
    st, src, keys = _store(tmp_path)
    flags, _ = _read_back(st, keys)  # open and cache handles first
    assert all(flags)
    shutil.rmtree(_seg_dirs(tmp_path)[0])
    flags, dst = _read_back(st, keys)
    assert flags == [False] * 4 + [True] * 4
    assert not dst.read_pages("k", range(4)).any()
    st.refresh()
    assert st.batch_exists(keys) == 0 and st.batch_exists(keys[4:]) == 4
    st.close()


def test_corrupt_segment_metadata_is_skipped_at_startup(tmp_path):
    st, src, keys = _store(tmp_path)
    st.close()
    seg = _seg_dirs(tmp_path)[1]
    with open(os.path.join(seg, "default", "_METADATA"), "w") as f:
        f.write("{not json")
    st2 = make_store("orbax", tmp_path, {"target": src}, segment_pages=4)
    assert st2.batch_exists(keys) == 4 and st2.metrics.quarantined == 1
    st2.close()


def test_restart_in_new_process(tmp_path):
    env = child_env()
    w = subprocess.run(
        child_cmd("write", "orbax", str(tmp_path), "0", "40"), capture_output=True, text=True, env=env, timeout=300
    )
    assert w.returncode == 0, w.stderr[-3000:]
    assert json.loads(w.stdout.strip().splitlines()[-1])["pages_written"] == 40
    r = subprocess.run(
        child_cmd("verify", "orbax", str(tmp_path), "0", "48"), capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["hits"] == 40 and res["wrong"] == 0 and res["exists"] == 40 and res["corrupt"] == 0


def test_two_writer_processes(tmp_path):
    env = child_env()
    procs = [
        subprocess.Popen(
            child_cmd("write", "orbax", str(tmp_path), str(a), "64"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for a in (0, 32)
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["write_errors"] == 0
    writers = sorted(os.path.basename(d) for d in glob.glob(str(tmp_path / "segments-v1" / "w*")))
    assert writers == ["w0000", "w0001"]  # one writer directory each: no shared step numbers
    r = subprocess.run(
        child_cmd("verify", "orbax", str(tmp_path), "0", "96"), capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["hits"] == 96 and res["wrong"] == 0 and res["corrupt"] == 0 and res["quarantined"] == 0


def test_other_process_segments_are_picked_up_by_refresh(tmp_path):
    src = HostKVPool(GEOM, 16, "page_first")
    st = make_store("orbax", tmp_path, {"target": src}, refresh_interval_s=0.0)
    keys = keys_for(512, seed=0)[:16]  # the child's key list
    assert st.batch_exists(keys) == 0
    w = subprocess.run(
        child_cmd("write", "orbax", str(tmp_path), "0", "16"),
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert w.returncode == 0, w.stderr[-3000:]
    assert st.batch_exists(keys) == 0  # not yet scanned
    st.refresh()
    assert st.batch_exists(keys) == 16
    st.close()


def test_sigkill_mid_save_reopens_cleanly(tmp_path):
    left = _sigkill_round(tmp_path, kill_after_s=None)
    assert any("tmp" in n for n in left), left  # killed with a half-written step on disk


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.005, 0.01, 0.03, 0.05, 0.08, 0.12])
def test_sigkill_stress(tmp_path, delay):
    _sigkill_round(tmp_path, kill_after_s=delay)


def _sigkill_round(tmp_path, kill_after_s):
    env = child_env()
    # 32 pages x 2 KiB per segment; the child saves in a loop and we kill it during a save
    p = subprocess.Popen(
        child_cmd("loop", "orbax", str(tmp_path), "32"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    committed = []
    try:
        for line in p.stdout:
            kind, i = line.split()
            if kind == "C":
                committed.append(int(i))
            elif kind == "S" and int(i) == 3:
                if kill_after_s is not None:
                    time.sleep(kill_after_s)
                    break
                wdir = tmp_path / "segments-v1" / "w0000"
                deadline = time.monotonic() + 30
                while not any("tmp" in n for n in os.listdir(wdir)) and time.monotonic() < deadline:
                    time.sleep(0.0005)  # kill as soon as orbax has started the 4th step
                break
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    assert len(committed) >= 3
    left = sorted(os.listdir(tmp_path / "segments-v1" / "w0000"))
    src = HostKVPool(GEOM, 32, "page_first")
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=32, refresh_interval_s=0.0)
    # every committed batch hits in full and reads back bit-exact
    from storage_helpers import check_keyed_pages

    for i in committed:
        keys = keys_for(32, seed=1000 + i)
        assert st.batch_exists(keys) == 32
        assert all(st.batch_get(keys, range(32)))
        check_keyed_pages(st, "target", keys, range(32))
    # the interrupted batch is all or nothing
    last = keys_for(32, seed=1000 + 3)
    assert st.batch_exists(last) in (0, 32)
    assert st.metrics.corrupt == 0 and st.metrics.quarantined == 0
    # the dead writer's directory is reclaimed and its half-written temp step removed
    assert st.writer_dir.endswith("w0000")
    assert not [n for n in os.listdir(st.writer_dir) if "tmp" in n]
    # and the store keeps working
    fill_random(src, 1)
    new = keys_for(4, seed=5555)
    st.batch_set(new, range(4))
    assert st.flush(60) and st.batch_exists(new) == 4
    st.close()
    return left


def test_read_only_directory(tmp_path):
    env = child_env()
    w = subprocess.run(
        child_cmd("write", "orbax", str(tmp_path), "0", "16"), capture_output=True, text=True, env=env, timeout=300
    )
    assert w.returncode == 0, w.stderr[-3000:]
    res = _run_readonly("orbax", str(tmp_path), 16)
    assert res["hits"] == 16 and res["wrong"] == 0
    assert res["new_exists"] == 0 and res["pages_written"] == 0 and res["write_errors"] >= 1


def test_disk_full_rlimit(tmp_path):
    # 8 pages x 2 KiB = 16 KiB of page data per segment; files may not exceed 4 KiB
    r = subprocess.run(
        child_cmd("fsize", "orbax", str(tmp_path), "4096", "8"),
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["exists"] == 0 and res["hits"] == 0 and res["wrong"] == 0
    assert res["write_errors"] >= 1 and res["pages_dropped"] == 8 and res["pages_written"] == 0
    assert not _seg_dirs(tmp_path)  # nothing half-written is published


def test_disk_full_injected_then_recovers(tmp_path, monkeypatch):
    import errno

    st, src, keys = _store(tmp_path, n=4)
    real = type(st.writer.manager).save

    def enospc(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(st.writer.manager), "save", enospc)
    new = keys_for(4, seed=77)
    assert st.batch_set(new, range(4, 8)) == [True] * 4  # accepted; the save fails in the writer
    assert st.flush(60)
    assert st.batch_exists(new) == 0 and st.metrics.write_errors == 1 and st.metrics.pages_dropped == 4
    monkeypatch.setattr(type(st.writer.manager), "save", real)
    st.batch_set(new, range(4, 8))
    assert st.flush(60) and st.batch_exists(new) == 4
    flags, dst = _read_back(st, keys + new)
    assert all(flags)
    assert_pages_equal(src, range(8), dst, range(8))
    st.close()


def test_backpressure_drops_beyond_max_pending(tmp_path, monkeypatch):
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 3)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, max_pending_pages=4, flush_interval_s=30)
    gate = __import__("threading").Event()
    real = type(st.writer.manager).save

    def slow(self, *a, **k):
        gate.wait(30)
        return real(self, *a, **k)

    monkeypatch.setattr(type(st.writer.manager), "save", slow)
    keys = keys_for(8, seed=8)
    ok = st.batch_set(keys, range(8))
    assert ok == [True] * 4 + [False] * 4 and st.metrics.pages_dropped == 4
    gate.set()
    assert st.flush(60) and st.batch_exists(keys) == 4
    st.close()


@pytest.mark.parametrize("call", ["batch_exists", "batch_get"])
def test_page_saved_between_the_two_lookups_is_found(tmp_path, call):
    # A pending page moves from its segment buffer into the index as its segment is saved.
    # Whichever of the two places a lookup asks first, the save lands right after that
    # question: the page must still be found (the writer indexes before it un-pends).
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 14)
    keys = keys_for(2, seed=24)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=64, flush_interval_s=60)
    assert all(st.batch_set(keys, [0, 1]))
    asked = []

    def save_after_first(obj, name):
        real = getattr(obj, name)

        def wrapped(*a, **k):
            out = real(*a, **k)
            if not asked:
                asked.append(name)
                assert st.flush(60)
            return out

        setattr(obj, name, wrapped)

    first = "pending_flags" if call == "batch_exists" else "serve_pending"
    second = "contains" if call == "batch_exists" else "locate"
    save_after_first(st.writer, first)
    save_after_first(st.index, second)
    dst = HostKVPool(GEOM, 16, "page_first")
    st.codecs["target"].pool = dst
    if call == "batch_exists":
        assert st.batch_exists(keys) == 2
    else:
        assert st.batch_get(keys, [5, 6]) == [True, True]
        assert_pages_equal(src, [0, 1], dst, [5, 6])
    assert asked and st.metrics.segments_written == 1 and not st.writes_pending()
    st.codecs["target"].pool = src
    st.close()


def test_writer_indexes_a_segment_before_its_pages_stop_pending(tmp_path):
    # The other half of the lookup order above: at the moment a saved segment enters the
    # index, its pages are still pending, so no lookup can fall between the two.
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 15)
    keys = keys_for(6, seed=25)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=4)
    still_pending = []
    real_add = st.index.add

    def add(seg):
        still_pending.append(st.writer.pending_flags("target", seg.keys["target"]))
        real_add(seg)

    st.index.add = add
    assert all(st.batch_set(keys, range(6)))
    assert st.flush(60)
    assert [len(f) for f in still_pending] == [4, 2] and all(all(f) for f in still_pending)
    assert st.batch_exists(keys) == 6 and not st.writes_pending()
    st.close()


def test_old_module_path_still_names_the_backend(tmp_path):
    from hicache_jax.storage import orbax, orbax_log

    assert orbax_log.OrbaxSegmentStorage is orbax.OrbaxSegmentStorage
    st = make_store("orbax", tmp_path, {"target": HostKVPool(GEOM, 2)})
    assert type(st) is orbax.OrbaxSegmentStorage
    st.close()
