"""Fault injection and multi-process tests for the numpy-only backends (file, memory).

Every fault must end as a miss plus counters: no exception, no wrong bytes.
"""

import errno
import glob
import json
import os
import shutil
import subprocess

import pytest

from hicache_jax import HostKVPool, KVGeometry

from storage_helpers import GEOM, assert_pages_equal, child_cmd, child_env, fill_random, keys_for, make_store


def _stored(tmp_path, n=4, **cfg):
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 7)
    keys = keys_for(n, seed=3)
    st = make_store("file", tmp_path, {"target": src}, **cfg)
    assert all(st.batch_set(keys, range(n)))
    return st, src, keys


def _file_of(st, key):
    return st._path("target", key)


def _read_back(st, keys):
    dst = HostKVPool(GEOM, 8, "page_first")
    st.codecs["target"].pool = dst
    return st.batch_get(keys, range(len(keys))), dst


@pytest.mark.parametrize("where", ["body", "header_key", "header_crc", "header_size"])
def test_file_flipped_byte_is_a_counted_miss(tmp_path, where):
    st, src, keys = _stored(tmp_path)
    path = _file_of(st, keys[1])
    off = {"body": 64 + 1000, "header_key": 40, "header_crc": 12, "header_size": 16}[where]
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))
    flags, dst = _read_back(st, keys)
    assert flags == [True, False, True, True]
    assert_pages_equal(src, [0, 2, 3], dst, [0, 2, 3])
    assert not dst.read_pages("k", [1]).any()  # never the wrong bytes
    m = st.metrics.snapshot()
    assert m["corrupt"] == 1 and m["quarantined"] == 1 and m["misses"] == 1
    assert not os.path.exists(path) and glob.glob(str(tmp_path / "pages-v1" / "quarantine" / "*.bad"))
    assert st.batch_exists(keys) == 1  # quarantined: gone from the store


@pytest.mark.parametrize("integrity", ["full", "off"])
def test_file_mismatched_page_size_reader_is_a_miss_not_a_quarantine(tmp_path, integrity):
    # issue 21 point 3: a raw reader (same keys) configured with another page size
    st, src, keys = _stored(tmp_path)
    st.close()
    files = sorted(glob.glob(str(tmp_path / "pages-v1" / "target" / "*" / "*.kv")))
    assert len(files) == 4
    other = KVGeometry.mha(2, 8, 2, 32, "bfloat16")  # twice GEOM's page size
    bad = make_store("file", tmp_path, {"target": HostKVPool(other, 8, "page_first")}, integrity=integrity)
    assert bad.batch_get(keys, range(4)) == [False] * 4
    m = bad.metrics.snapshot()
    assert m["hits"] == 0 and m["misses"] == 4 and m["corrupt"] == 0 and m["quarantined"] == 0
    assert m["read_errors"] == 4  # counted, not silent
    bad.close()
    assert sorted(glob.glob(str(tmp_path / "pages-v1" / "target" / "*" / "*.kv"))) == files  # left in place
    assert not glob.glob(str(tmp_path / "pages-v1" / "quarantine" / "*"))
    good = make_store("file", tmp_path, {"target": HostKVPool(GEOM, 8, "page_first")})
    flags, dst = _read_back(good, keys)
    assert all(flags)
    assert_pages_equal(src, range(4), dst, range(4))
    good.close()


def test_file_truncated_and_deleted(tmp_path):
    st, src, keys = _stored(tmp_path)
    with open(_file_of(st, keys[0]), "r+b") as f:
        f.truncate(64 + 100)
    with open(_file_of(st, keys[2]), "r+b") as f:
        f.truncate(10)  # inside the header
    os.unlink(_file_of(st, keys[3]))
    flags, dst = _read_back(st, keys)
    assert flags == [False, True, False, False]
    assert_pages_equal(src, [1], dst, [1])
    m = st.metrics.snapshot()
    assert m["corrupt"] == 2 and m["misses"] == 3 and m["read_errors"] == 0


def test_file_disk_full_injected(tmp_path, monkeypatch):
    import hicache_jax.storage.file as fmod

    st, src, keys = _stored(tmp_path, n=2)
    new = keys_for(3, seed=99)

    def enospc(fd, bufs, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fmod.os, "pwritev", enospc)  # the backend writes header + page with one pwritev
    assert st.batch_set(new, [4, 5, 6]) == [False] * 3
    monkeypatch.undo()
    m = st.metrics.snapshot()
    assert m["write_errors"] == 3 and m["pages_dropped"] == 3
    assert st.batch_exists(new) == 0
    assert not glob.glob(str(tmp_path / "pages-v1" / "target" / "*" / "*.tmp"))  # temp files cleaned
    assert st.batch_exists(keys) == 2  # earlier pages unharmed
    assert st.batch_set(new, [4, 5, 6]) == [True] * 3  # recovers once space is back


def test_memory_flipped_byte_and_integrity_modes():
    src = HostKVPool(GEOM, 4, "page_first")
    fill_random(src, 8)
    keys = keys_for(2, seed=5)
    st = make_store("memory", None, {"target": src})
    st.batch_set(keys, [0, 1])
    st._corrupt_for_test("target", keys[0], 17)
    dst = HostKVPool(GEOM, 4, "page_first")
    st.codecs["target"].pool = dst
    assert st.batch_get(keys, [2, 3]) == [False, True]
    assert not dst.read_pages("k", [2]).any()
    assert st.metrics.corrupt == 1 and st.batch_exists(keys) == 0
    # integrity off: nothing is verified (documented: off forgoes the wrong-bytes guarantee)
    off = make_store("memory", None, {"target": src}, integrity="off")
    off.batch_set(keys, [0, 1])
    off.batch_get(keys, [2, 3])
    assert off.metrics.verified == 0
    sampled = make_store("memory", None, {"target": src}, integrity="sampled", integrity_sample_rate=0.5)
    sampled.batch_set(keys, [0, 1])
    for _ in range(20):
        sampled.batch_get(keys, [2, 3])
    assert 0 < sampled.metrics.verified < 40


def test_restart_in_new_process_file(tmp_path):
    env = child_env()
    w = subprocess.run(child_cmd("write", "file", str(tmp_path), "0", "40"), capture_output=True, text=True, env=env)
    assert w.returncode == 0, w.stderr
    r = subprocess.run(child_cmd("verify", "file", str(tmp_path), "0", "48"), capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["hits"] == 40 and res["wrong"] == 0 and res["exists"] == 40 and res["corrupt"] == 0


def test_two_writer_processes_file(tmp_path):
    env = child_env()
    procs = [
        subprocess.Popen(
            child_cmd("write", "file", str(tmp_path), str(a), "96"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for a in (0, 48)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    r = subprocess.run(child_cmd("verify", "file", str(tmp_path), "0", "144"), capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["hits"] == 144 and res["wrong"] == 0 and res["corrupt"] == 0


def _run_readonly(backend: str, path: str, count: int | None = None, mode: str = "readonly"):
    """Run the child in ``mode`` against a store it cannot write (root: drop capabilities)."""
    env = child_env()
    for d, _dirs, files in os.walk(path):
        os.chmod(d, 0o555)
        for f in files:
            os.chmod(os.path.join(d, f), 0o444)
    cmd = child_cmd(mode, backend, path, *([] if count is None else [str(count)]))
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root and setpriv is missing: cannot make a directory read-only")
        cmd = [setpriv, "--bounding-set=-all", "--inh-caps=-all", *cmd]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    finally:
        for d, _dirs, _files in os.walk(path):
            os.chmod(d, 0o755)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_read_only_directory_file(tmp_path):
    env = child_env()
    w = subprocess.run(child_cmd("write", "file", str(tmp_path), "0", "16"), capture_output=True, text=True, env=env)
    assert w.returncode == 0, w.stderr
    res = _run_readonly("file", str(tmp_path), 16)
    assert res["hits"] == 16 and res["wrong"] == 0  # reads still served
    assert res["new_exists"] == 0 and res["write_errors"] >= 1 and res["pages_written"] == 0


def test_disk_full_file_rlimit(tmp_path):
    # RLIMIT_FSIZE makes writes past the limit fail with EFBIG, as a full disk fails them with ENOSPC.
    r = subprocess.run(
        child_cmd("fsize", "file", str(tmp_path), "1024", "4"),
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["accepted"] == 0 and res["exists"] == 0 and res["hits"] == 0 and res["write_errors"] == 4
    assert not glob.glob(str(tmp_path / "pages-v1" / "target" / "*" / "*.tmp"))


def test_stale_temp_files_are_ignored_and_cleaned(tmp_path):
    st, src, keys = _stored(tmp_path, n=1)
    d = os.path.dirname(_file_of(st, keys[0]))
    tmp = os.path.join(d, "deadbeef.kv.123.abc.tmp")  # what a killed writer leaves behind
    with open(tmp, "wb") as f:
        f.write(b"partial")
    os.utime(tmp, (0, 0))
    st2 = make_store("file", tmp_path, {"target": src})
    assert not os.path.exists(tmp)
    assert st2.batch_exists(keys) == 1
