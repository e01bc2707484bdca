"""The orbax backend's direct read path: pages requested ahead in the calling thread, split
requests for a lone page, in-place reads, descriptors closed exactly once (needs orbax)."""

import glob
import os

import numpy as np
import pytest

from hicache_jax import HostKVPool, HostLayout, KVGeometry
from hicache_jax.storage import PoolSpec, PoolTransfer
from hicache_jax.storage.orbax import ocdbt_direct
from hicache_jax.storage.orbax.reader import HandleCache

from storage_helpers import GEOM, assert_pages_equal, fill_random, keys_for, make_store, namespace, segment_dirs


class _CountingOs:
    """Stands in for ``ocdbt_direct.os``: counts the descriptors it opens and closes."""

    def __init__(self) -> None:
        self.open_fds: set[int] = set()
        self.opened = 0
        self.double_close = 0

    def open(self, *a, **k):
        fd = os.open(*a, **k)
        self.open_fds.add(fd)
        self.opened += 1
        return fd

    def close(self, fd):
        if fd not in self.open_fds:
            self.double_close += 1
        self.open_fds.discard(fd)
        os.close(fd)

    def __getattr__(self, name):
        return getattr(os, name)


@pytest.fixture
def fds(monkeypatch):
    c = _CountingOs()
    monkeypatch.setattr(ocdbt_direct, "os", c)
    yield c
    assert not c.open_fds, f"descriptors left open: {c.open_fds}"
    assert c.double_close == 0


def _written(tmp_path, n=8, seg=4, layout="page_first", geom=GEOM, **cfg):
    src = HostKVPool(geom, max(16, n), layout)
    fill_random(src, 31)
    keys = keys_for(n, seed=41, ns=namespace(geom, HostLayout(layout).value), page_size=geom.page_size)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=seg, **cfg)
    assert all(st.batch_set(keys, range(n)))
    assert st.flush(60)
    return st, src, keys


def _corrupt(tmp_path, st, page_id: int, seg_index: int) -> None:
    seg = segment_dirs(tmp_path)[seg_index]
    page = st.codecs["target"].pack(np.array([page_id]))[0].tobytes()
    for f in glob.glob(os.path.join(seg, "**", "*"), recursive=True):
        if os.path.isfile(f):
            data = open(f, "rb").read()
            off = data.find(page)
            if off >= 0:
                with open(f, "r+b") as fh:
                    fh.seek(off + 333)
                    fh.write(bytes([data[off + 333] ^ 0x08]))
                return
    raise AssertionError("page bytes not found")


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda l: l.value)
@pytest.mark.parametrize("ahead", [1, 3, 16])
def test_pages_requested_ahead_read_bit_exact(tmp_path, fds, layout, ahead):
    st, src, keys = _written(tmp_path, n=24, seg=4, layout=layout, read_concurrency=ahead)
    order = np.random.default_rng(ahead).permutation(24)
    dst_ids = np.random.default_rng(ahead + 1).permutation(32)[:24]
    dst = HostKVPool(GEOM, 32, layout)
    fill_random(dst, 77)  # not zeros: a page left unread would show
    st.codecs["target"].pool = dst
    flags = st.batch_get([keys[i] for i in order], dst_ids.tolist())
    assert flags == [True] * 24
    assert_pages_equal(src, order, dst, dst_ids)
    m = st.metrics.snapshot()
    assert m["verified"] == 24 and m["hits"] == 24 and m["corrupt"] == 0 and m["read_errors"] == 0
    # the multi-pool path (what the cache's controller uses) goes through the same reader
    dst2 = HostKVPool(GEOM, 32, layout)
    st.codecs["target"].pool = dst2
    hit = st.get_multi([PoolTransfer("target", [keys[i] for i in order], dst_ids)])
    assert hit.hit_pages == 24
    assert_pages_equal(src, order, dst2, dst_ids)
    assert st.metrics.verified == 48
    assert fds.opened == 48  # one descriptor per page read, each closed once (checked by the fixture)
    st.close()


@pytest.mark.parametrize("ahead", [3, 16])
def test_fault_mid_window_is_a_miss_and_releases_every_descriptor(tmp_path, fds, ahead):
    st, src, keys = _written(tmp_path, read_concurrency=ahead)  # pages 0-3, 4-7: two segments
    _corrupt(tmp_path, st, 1, 0)
    dst = HostKVPool(GEOM, 16, "page_first")
    fill_random(dst, 5)
    before = {c: dst.read_pages(c, range(16)) for c in GEOM.components}
    st.codecs["target"].pool = dst
    order = [1, 0, 2, 3, 4, 5, 6, 7]  # the bad page first; its neighbours are requested ahead
    flags = st.batch_get([keys[i] for i in order], range(8))
    assert flags == [False] * 4 + [True] * 4
    for c in GEOM.components:
        assert not dst.read_pages(c, [0]).any()  # the failed page: zero-filled
        # pages of the quarantined segment requested ahead are dropped unread: untouched
        np.testing.assert_array_equal(dst.read_pages(c, [1, 2, 3]), before[c][[1, 2, 3]])
    assert_pages_equal(src, [4, 5, 6, 7], dst, [4, 5, 6, 7])
    m = st.metrics.snapshot()
    assert m["corrupt"] == 1 and m["quarantined"] == 1 and m["misses"] == 4
    assert m["verified"] == 5  # the failed check + four good pages
    assert st.batch_exists(keys) == 0 and st.batch_exists(keys[4:]) == 4
    st.close()


def test_truncated_file_mid_window_releases_every_descriptor(tmp_path, fds):
    st, src, keys = _written(tmp_path, n=8, seg=8, read_concurrency=4)  # one segment
    seg = segment_dirs(tmp_path)[0]
    page = st.codecs["target"].pack(np.array([5]))[0].tobytes()
    for f in glob.glob(os.path.join(seg, "**", "*"), recursive=True):
        if os.path.isfile(f) and page in open(f, "rb").read():
            with open(f, "r+b") as fh:
                fh.truncate(open(f, "rb").read().find(page) + 100)
    dst = HostKVPool(GEOM, 16, "page_first")
    st.codecs["target"].pool = dst
    flags = st.batch_get(keys, range(8))
    assert flags[5] is False and not any(flags[5:])
    good = [i for i in range(8) if flags[i]]
    assert_pages_equal(src, good, dst, good)  # whatever was read before the failure is right
    assert not dst.read_pages("k", range(5, 8)).any()
    assert st.metrics.quarantined == 1 and st.metrics.read_errors >= 1
    st.close()


def test_segment_gone_between_request_and_read_is_a_miss(tmp_path, fds, monkeypatch):
    st, src, keys = _written(tmp_path)
    real = ocdbt_direct.request_page
    calls = []

    def request_then_forget(*a, **k):  # the segment is evicted right after its page was requested
        req = real(*a, **k)
        calls.append(1)
        if len(calls) == 1:
            st.index.forget(st.segment_names()[0])
        return req

    monkeypatch.setattr(ocdbt_direct, "request_page", request_then_forget)
    dst = HostKVPool(GEOM, 16, "page_first")
    fill_random(dst, 3)
    before = dst.read_pages("k", [0])
    st.codecs["target"].pool = dst
    assert st.batch_get(keys[:1], [0]) == [False]
    np.testing.assert_array_equal(dst.read_pages("k", [0]), before)  # never read into
    assert st.metrics.misses == 1 and st.metrics.quarantined == 0  # gone is a plain miss
    assert st.batch_get(keys[4:6], [1, 2]) == [True, True]
    assert_pages_equal(src, [4, 5], dst, [1, 2])
    st.close()


def test_lone_page_split_requests_and_chunks_bit_exact(tmp_path, fds, monkeypatch):
    geom = KVGeometry.mha(4, 16, 8, 128, "bfloat16")  # 256 KiB pages
    # pieces not a multiple of 4 KiB at unaligned value offsets; groups smaller than a slab
    monkeypatch.setattr(ocdbt_direct, "REQUEST_BYTES", 12 << 10)
    monkeypatch.setattr(ocdbt_direct, "CHUNK_BYTES", 40 << 10)
    st, src, keys = _written(tmp_path, n=4, seg=4, layout="layer_first", geom=geom)
    advised = []
    real_fadvise = os.posix_fadvise

    def record(fd, off, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append((off, length))
        return real_fadvise(fd, off, length, advice)

    monkeypatch.setattr(fds, "posix_fadvise", record, raising=False)
    dst = HostKVPool(geom, 4, "layer_first")
    st.codecs["target"].pool = dst
    for i, h in zip(range(4), [3, 2, 1, 0]):
        advised.clear()
        assert st.batch_get(keys[i : i + 1], [h]) == [True]
        seg_name, slot = st.index.location("target", keys[i])
        loc = st.index.segments[seg_name].locs["target"][slot]
        _, off, length = loc
        assert advised[0][0] == off and sum(n for _, n in advised) == length  # the whole value, once
        for (a, n), (b, _) in zip(advised, advised[1:]):
            assert a + n == b and b % 4096 == 0 and n <= 12 << 10  # contiguous, split at 4 KiB pages
    assert_pages_equal(src, range(4), dst, [3, 2, 1, 0])
    advised.clear()
    assert all(st.batch_get(keys, [0, 1, 2, 3]))  # requested ahead: one request per page
    assert len(advised) == 4
    assert_pages_equal(src, range(4), dst, range(4))
    assert st.metrics.corrupt == 0
    st.close()


@pytest.mark.parametrize("integrity", ["full", "off"])
def test_lone_page_read_in_groups_only_when_its_crc_is_checked(tmp_path, fds, monkeypatch, integrity):
    """A lone page whose CRC is checked is read in ``CHUNK_BYTES`` groups (each group's CRC
    overlaps the device delivering the next); with no check there is nothing to overlap and
    it is read with one ``preadv`` (fewer wake-ups). Bytes exact either way."""
    geom = KVGeometry.mha(4, 16, 8, 128, "bfloat16")  # 256 KiB pages
    monkeypatch.setattr(ocdbt_direct, "CHUNK_BYTES", 64 << 10)
    st, src, keys = _written(tmp_path, n=4, seg=4, geom=geom, integrity=integrity)
    reads = []
    real_preadv = os.preadv

    def record(fd, bufs, offset):
        reads.append(sum(len(b) for b in bufs))
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(fds, "preadv", record, raising=False)
    dst = HostKVPool(geom, 4, "page_first")
    st.codecs["target"].pool = dst
    for i in range(4):
        reads.clear()
        assert st.batch_get(keys[i : i + 1], [i]) == [True]
        pb = geom.bytes_per_page
        assert sum(reads) == pb + ocdbt_direct.SHARD_TAIL
        if integrity == "full":
            assert len(reads) == pb // (64 << 10) and max(reads) <= (64 << 10) + ocdbt_direct.SHARD_TAIL, reads
        else:
            assert reads == [pb + ocdbt_direct.SHARD_TAIL], reads
    assert_pages_equal(src, range(4), dst, range(4))
    assert st.metrics.verified == (4 if integrity == "full" else 0) and st.metrics.corrupt == 0
    st.close()


def test_page_request_is_released_exactly_once(tmp_path, fds):
    st, src, keys = _written(tmp_path)
    st.batch_get(keys[:1], [0])  # resolves the segment's locations
    seg_name, slot = st.index.location("target", keys[2])
    loc = st.index.segments[seg_name].locs["target"][slot]
    pb = st.codecs["target"].page_bytes
    req = ocdbt_direct.request_page(loc, pb)
    dst = np.empty(pb, np.uint8)
    crc = ocdbt_direct.read_requested(req, dst, 0)
    assert req.fd == -1 and crc is not None
    np.testing.assert_array_equal(dst, st.codecs["target"].pack(np.array([2]))[0])
    ocdbt_direct.release(req)  # again: a no-op, never a second close
    with pytest.raises(ValueError):
        ocdbt_direct.read_requested(req, dst)
    req = ocdbt_direct.request_page(loc, pb)
    with pytest.raises(ValueError):  # a wrong destination is our bug, not the store's
        ocdbt_direct.read_requested(req, np.empty(pb - 1, np.uint8))
    assert req.fd == -1
    with pytest.raises(ocdbt_direct.DirectReadError):
        ocdbt_direct.request_page(loc, pb + 1)  # the value's length is checked before opening
    with pytest.raises(ocdbt_direct.DirectReadError):
        ocdbt_direct.request_page(None, pb)
    st.close()


def test_inline_values_roundtrip(tmp_path, fds):
    geom = KVGeometry.mha(1, 2, 1, 16, "bfloat16")  # 128-byte pages: stored inline in the B-tree
    st, src, keys = _written(tmp_path, n=6, seg=3, geom=geom)
    dst = HostKVPool(geom, 16, "page_first")
    st.codecs["target"].pool = dst
    assert st.batch_get(keys[2:3], [9]) == [True]
    assert all(st.batch_get(keys, [5, 4, 3, 2, 1, 0]))
    assert_pages_equal(src, range(6), dst, [5, 4, 3, 2, 1, 0])
    assert_pages_equal(src, [2], dst, [9])
    assert all(isinstance(l, bytes) for s in st.index.segments.values() for l in s.locs["target"])
    assert fds.opened == 0 and st.metrics.verified == 7
    st.close()


def test_get_multi_stops_at_a_bad_page_and_reports_nothing_beyond(tmp_path, fds, monkeypatch):
    src = {p: HostKVPool(GEOM, 8, "page_first") for p in ("target", "draft")}
    for i, p in enumerate(src.values()):
        fill_random(p, 70 + i)
    keys = {p: keys_for(6, seed=80 + i) for i, p in enumerate(src)}
    st = make_store(
        "orbax",
        tmp_path,
        src,
        [PoolSpec("target"), PoolSpec("draft")],
        segment_pages=8,
        flush_interval_s=30.0,
        read_concurrency=4,
    )
    st.set_multi([PoolTransfer(p, keys[p], range(6)) for p in src])
    assert st.flush(60)
    st.codecs["target"].pool, st.codecs["draft"].pool = src["target"], src["draft"]
    _corrupt(tmp_path, st, 3, 0)  # target page 3 (the draft's pages differ)
    dst = {p: HostKVPool(GEOM, 8, "page_first") for p in src}
    for p in src:
        st.codecs[p].pool = dst[p]
    monkeypatch.setattr(st, "_read", None)  # ALL_PAGES pools are read in place, never via _read
    hit = st.get_multi([PoolTransfer(p, keys[p], range(6)) for p in src])
    assert hit.hit_pages == 3 and hit.pool_hits == {"target": 3, "draft": 3}
    for p in src:
        assert_pages_equal(src[p], range(3), dst[p], range(3))
        assert not dst[p].read_pages("k", range(6, 8)).any()  # beyond the call's pages: untouched
    # Past the hit the call's host pages may hold bytes (read in place, draft first), never
    # wrong ones: the failed target page is zero-filled, the draft's pages are its own.
    assert not dst["target"].read_pages("k", [3]).any()
    assert_pages_equal(src["draft"], range(3, 6), dst["draft"], range(3, 6))
    assert st.metrics.corrupt == 1 and st.metrics.quarantined == 1
    st.close()


@pytest.mark.parametrize("fault", ["corrupt_page", "unopenable_array"])
def test_tensorstore_fallback_faults_quarantine(tmp_path, monkeypatch, fault):
    st, src, keys = _written(tmp_path, read_concurrency=3)
    monkeypatch.setattr(ocdbt_direct, "_zarr_ok", lambda *a: False)  # every segment via tensorstore
    if fault == "corrupt_page":
        _corrupt(tmp_path, st, 5, 1)
    else:
        real = HandleCache.get

        def broken(self, seg, pool, page_bytes):
            if seg.counts and st.segment_names().index(seg.name) == 1:
                raise ValueError("data array (3, 2048) uint8, expected (4, 2048) uint8")
            return real(self, seg, pool, page_bytes)

        monkeypatch.setattr(HandleCache, "get", broken)
    dst = HostKVPool(GEOM, 16, "page_first")
    st.codecs["target"].pool = dst
    flags = st.batch_get(keys, range(8))
    assert flags[:4] == [True] * 4 and flags[5] is False
    assert_pages_equal(src, range(4), dst, range(4))
    good = [i for i in range(8) if flags[i]]
    assert_pages_equal(src, good, dst, good)
    assert st.metrics.quarantined == 1 and st.batch_exists(keys[4:]) == 0
    st.close()
