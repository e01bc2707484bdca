"""The ``mooncake`` backend's pipelined calls: a call's pages move in pieces, one batch call each on
a store worker, while the CRC threads check the piece before (reads) or compute the headers of
the piece after (writes); bytes come back exact, a damaged object in a middle piece is a miss
between hits, pieces not read after the store went down are left untouched, pieces not written
are dropped, and no call returns with a piece in flight (against a real master)."""

from __future__ import annotations

import threading
import time

import numpy as np

from hicache_jax import HostKVPool
from hicache_jax.storage.mooncake import store as mst
from hicache_jax.storage.mooncake.store import HEADER_BYTES, object_name

import host_io_checks as chk
from mooncake_helpers import mc_store
from storage_helpers import fill_random, keys_for

GEOM = chk.GEOMS["bf16"]
N = 12


class _SlowClient:
    """The real client, its batch reads logged and slowed (so that a piece's checks, when they
    overlap the next piece's read, do so every time)."""

    def __init__(self, real, log, delay=0.05):
        self._real, self._log, self._delay = real, log, delay

    def batch_put_from_multi_buffers(self, names, ptrs, sizes):
        self._log.append(("put", len(names), "start"))
        time.sleep(self._delay)
        try:
            return self._real.batch_put_from_multi_buffers(names, ptrs, sizes)
        finally:
            self._log.append(("put", len(names), "end"))

    def batch_get_into_multi_buffers(self, names, ptrs, sizes):
        self._log.append(("get", len(names), "start"))
        time.sleep(self._delay)
        try:
            return self._real.batch_get_into_multi_buffers(names, ptrs, sizes)
        finally:
            self._log.append(("get", len(names), "end"))

    def __getattr__(self, name):
        return getattr(self._real, name)


def _stored(master, seed):
    src = HostKVPool(GEOM, N, "page_first")
    fill_random(src, seed)
    keys = keys_for(N, seed=seed, ns=chk.namespace(GEOM, "page_first", model=f"pipeline-{seed}"))
    return src, keys


def test_pieces_overlap_checks_and_bytes_come_back(master, monkeypatch):
    monkeypatch.setattr(mst, "PIPELINE_CHUNK_BYTES", 4 * GEOM.bytes_per_page)  # 3 pieces of 4 pages
    src, keys = _stored(master, 31)
    with mc_store(master, {"target": src}) as st:
        assert st.batch_set(keys, range(N)) == [True] * N
        log: list = []
        st._store = _SlowClient(st._store, log)
        real_checksum = mst.integrity.checksum_at

        def checksum(*a, **kw):  # every page's check computes one (integrity "full")
            log.append(("check", threading.current_thread().name))
            return real_checksum(*a, **kw)

        monkeypatch.setattr(mst.integrity, "checksum_at", checksum)
        dst = chk.poisoned(GEOM, N, "page_first")
        st.codecs["target"].pool = dst
        assert st.batch_get(keys, range(N)) == [True] * N
        chk.assert_pages_equal(src, range(N), dst, range(N))
        assert st.metrics.verified == N
        gets = [e for e in log if e[0] == "get"]
        assert [e[1] for e in gets if e[2] == "start"] == [4, 4, 4]  # three pieces, in order
        # piece 1's checks ran while piece 2 was in flight: after piece 1 arrived, before piece 2 did
        ends = [i for i, e in enumerate(log) if e[0] == "get" and e[2] == "end"]
        assert sum(e[0] == "check" for e in log[ends[0] : ends[1]]) == 4, log
        assert all(e[1].startswith("l3-mooncake-crc") for e in log if e[0] == "check")
        st._store = st._store._real


def test_damaged_object_in_a_middle_piece_is_a_miss_between_hits(master, monkeypatch):
    monkeypatch.setattr(mst, "PIPELINE_CHUNK_BYTES", 4 * GEOM.bytes_per_page)
    src, keys = _stored(master, 32)
    with mc_store(master, {"target": src}) as st:
        assert st.batch_set(keys, range(N)) == [True] * N
        name = object_name("target", keys[6])
        bad = bytearray(st._store.get(name))
        bad[HEADER_BYTES + 7] ^= 0x01
        st._store.remove(name, True)
        assert st._store.put(name, bytes(bad)) == 0
        dst = chk.poisoned(GEOM, N, "page_first")
        st.codecs["target"].pool = dst
        got = st.batch_get(keys, range(N))
        assert got == [i != 6 for i in range(N)]
        ok = [i for i in range(N) if i != 6]
        chk.assert_pages_equal(src, ok, dst, ok)
        assert not st.codecs["target"].pack(np.array([6])).any()  # zero-filled: no bytes that failed the check
        assert st.metrics.corrupt == 1


def test_pieces_after_the_store_went_down_are_misses_left_untouched(master, monkeypatch):
    monkeypatch.setattr(mst, "PIPELINE_CHUNK_BYTES", 4 * GEOM.bytes_per_page)
    src, keys = _stored(master, 33)
    with mc_store(master, {"target": src}) as st:
        assert st.batch_set(keys, range(N)) == [True] * N
        real_start, starts = st._start, []

        def start(what, fn, *args):  # the second piece finds the store down (another thread's fault)
            starts.append(what)
            if len(starts) == 2:
                raise mst._StoreDown(what)
            return real_start(what, fn, *args)

        monkeypatch.setattr(st, "_start", start)
        dst = chk.poisoned(GEOM, N, "page_first")
        st.codecs["target"].pool = dst
        assert st.batch_get(keys, range(N)) == [True] * 4 + [False] * 8
        chk.assert_pages_equal(src, range(4), dst, range(4))
        chk.assert_poisoned(dst, range(4, N))
        assert st.metrics.corrupt == 0


def test_a_failing_check_waits_for_the_piece_in_flight(master, monkeypatch):
    """A check that raises (a bug) while the next piece moves: the call ends only after that
    piece landed (no transfer keeps writing into host pages the caller got back), all misses."""
    monkeypatch.setattr(mst, "PIPELINE_CHUNK_BYTES", 4 * GEOM.bytes_per_page)
    src, keys = _stored(master, 34)
    with mc_store(master, {"target": src}) as st:
        assert st.batch_set(keys, range(N)) == [True] * N
        log: list = []
        st._store = _SlowClient(st._store, log, delay=0.2)

        def checksum(*a, **kw):
            log.append(("check",))
            raise RuntimeError("a bug in a check")

        monkeypatch.setattr(mst.integrity, "checksum_at", checksum)
        dst = chk.poisoned(GEOM, N, "page_first")
        st.codecs["target"].pool = dst
        assert st.batch_get(keys, range(N)) == [False] * N
        log.append(("returned",))
        assert [e[2] for e in log if e[0] == "get"] == ["start", "end", "start", "end"], log
        assert log.index(("returned",)) > max(i for i, e in enumerate(log) if e[0] == "get"), log
        st._store = st._store._real


def _logged_checksums(monkeypatch, log, fail_from=None):
    real = mst.integrity.checksum_at
    calls = []

    def checksum(*a, **kw):
        calls.append(1)
        log.append(("crc", threading.current_thread().name))
        if fail_from is not None and len(calls) >= fail_from:
            raise RuntimeError("a bug in a CRC")
        return real(*a, **kw)

    monkeypatch.setattr(mst.integrity, "checksum_at", checksum)
    return real


def test_write_pieces_overlap_the_next_pieces_crcs_and_bytes_come_back(master, monkeypatch):
    monkeypatch.setattr(mst, "PIPELINE_CHUNK_BYTES", 4 * GEOM.bytes_per_page)  # 3 pieces of 4 pages
    src, keys = _stored(master, 35)
    with mc_store(master, {"target": src}) as st:
        log: list = []
        st._store = _SlowClient(st._store, log)
        real = _logged_checksums(monkeypatch, log)
        assert st.batch_set(keys, range(N)) == [True] * N
        st._store = st._store._real
        puts = [e for e in log if e[0] == "put"]
        assert [e[1] for e in puts if e[2] == "start"] == [4, 4, 4]  # three pieces, in order
        # piece 2's CRCs ran while piece 1 moved (before its put returned); piece 3's only after
        ends = [i for i, e in enumerate(log) if e[0] == "put" and e[2] == "end"]
        assert sum(e[0] == "crc" for e in log[: ends[0]]) == 8, log
        assert sum(e[0] == "crc" for e in log[: ends[1]]) == 12, log
        assert all(e[1].startswith("l3-mooncake-crc") for e in log if e[0] == "crc")
        monkeypatch.setattr(mst.integrity, "checksum_at", real)
        dst = chk.poisoned(GEOM, N, "page_first")
        st.codecs["target"].pool = dst
        assert st.batch_get(keys, range(N)) == [True] * N  # every header's CRC matches its page
        chk.assert_pages_equal(src, range(N), dst, range(N))
        assert st.metrics.verified == N and st.metrics.corrupt == 0


def test_write_pieces_after_the_store_went_down_are_dropped(master, monkeypatch):
    monkeypatch.setattr(mst, "PIPELINE_CHUNK_BYTES", 4 * GEOM.bytes_per_page)
    src, keys = _stored(master, 36)
    with mc_store(master, {"target": src}) as st:
        stored: list = []
        st.add_listener(lambda ev, pool, ks: stored.extend(ks) if ev == "stored" else None)
        real_start, starts = st._start, []

        def start(what, fn, *args):  # the second piece finds the store down (another thread's fault)
            if what.startswith("batch_put"):
                starts.append(what)
                if len(starts) == 2:
                    raise mst._StoreDown(what)
            return real_start(what, fn, *args)

        monkeypatch.setattr(st, "_start", start)
        assert st.batch_set(keys, range(N)) == [True] * 4 + [False] * 8
        assert len(starts) == 2  # the third piece is not tried either
        monkeypatch.undo()
        assert st.metrics.pages_written == 4 and st.metrics.pages_dropped == 8 and st.metrics.write_errors == 0
        assert sorted(stored) == sorted(keys[:4])
        assert st.exists_each(keys) == [True] * 4 + [False] * 8


def test_a_failing_crc_waits_for_the_put_in_flight(master, monkeypatch):
    """A CRC that raises (a bug) while the previous piece moves: the call ends only after that
    piece's put returned (its transfer reads the headers and the host pages), all dropped."""
    monkeypatch.setattr(mst, "PIPELINE_CHUNK_BYTES", 4 * GEOM.bytes_per_page)
    src, keys = _stored(master, 37)
    with mc_store(master, {"target": src}) as st:
        log: list = []
        st._store = _SlowClient(st._store, log, delay=0.2)
        _logged_checksums(monkeypatch, log, fail_from=5)  # piece 2's first CRC
        assert st.batch_set(keys, range(N)) == [False] * N
        log.append(("returned",))
        st._store = st._store._real
        assert [e[2] for e in log if e[0] == "put"] == ["start", "end"], log
        assert log[-1] == ("returned",)
