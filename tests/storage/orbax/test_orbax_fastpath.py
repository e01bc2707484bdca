"""The orbax backend's fast paths: direct OCDBT reads, in-place reads with restore, reusable
segment buffers, packing straight into them, and the tensorstore fallback (needs orbax)."""

import glob
import os
import threading

import numpy as np
import pytest

from hicache_jax import HostKVPool, HostLayout, KVGeometry
from hicache_jax.storage import PoolSpec, PoolTransfer, StorageConfig
from hicache_jax.storage.orbax import ocdbt_direct
from hicache_jax.storage.orbax.reader import host_pieces
from hicache_jax.storage.orbax.writer import pack_into

from storage_helpers import GEOM, assert_pages_equal, fill_random, keys_for, make_store, namespace, segment_dirs

LAYOUTS = list(HostLayout)


def _written(tmp_path, layout="page_first", n=8, seg=4, **cfg):
    src = HostKVPool(GEOM, 16, layout)
    fill_random(src, 31)
    keys = keys_for(n, seed=41, ns=namespace(GEOM, HostLayout(layout).value))
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=seg, **cfg)
    assert all(st.batch_set(keys, range(n)))
    assert st.flush(60)
    return st, src, keys


def _page_location(seg_dir, page: bytes):
    for f in glob.glob(os.path.join(seg_dir, "**", "*"), recursive=True):
        if os.path.isfile(f):
            data = open(f, "rb").read()
            off = data.find(page)
            if off >= 0:
                return f, off
    raise AssertionError("page bytes not found")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_pack_into_matches_codec_pack(tmp_path, layout):
    st, src, _ = _written(tmp_path, layout, n=1, seg=1)
    codec = st.codecs["target"]
    ids = np.array([5, 0, 15, 5, 9])
    out = np.full((len(ids), codec.page_bytes), 0xAB, np.uint8)
    pack_into(codec, ids, out)
    np.testing.assert_array_equal(out, codec.pack(ids))
    pieces = host_pieces(codec, 9)  # the in-place read destinations, in page-byte order
    np.testing.assert_array_equal(np.concatenate(pieces), codec.pack(np.array([9]))[0])
    st.close()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("read_path", ["direct", "tensorstore"])
def test_read_paths_roundtrip_single_and_batched(tmp_path, layout, read_path):
    st, src, keys = _written(tmp_path, layout, read_path=read_path)
    dst = HostKVPool(GEOM, 16, layout)
    st.codecs["target"].pool = dst
    assert st.batch_get(keys[:1], [10]) == [True]  # one page: read in the calling thread
    assert st.batch_get(keys, list(range(8))) == [True] * 8  # many: on the read pool
    assert_pages_equal(src, range(8), dst, range(8))
    assert_pages_equal(src, [0], dst, [10])
    assert not dst.read_pages(GEOM.components[0], [8, 9, 11]).any()
    m = st.metrics.snapshot()
    assert m["verified"] == 9 and m["corrupt"] == 0 and m["read_errors"] == 0
    if read_path == "direct":  # byte ranges resolved from the OCDBT B-tree, no fallback
        assert all(s.locs is not None and s.locs["target"] is not None for s in st.index.segments.values())
    st.close()


def test_multi_pool_get_uses_direct_reads(tmp_path):
    src = {p: HostKVPool(GEOM, 8, "page_first") for p in ("target", "draft")}
    for i, p in enumerate(src.values()):
        fill_random(p, 50 + i)
    keys = {p: keys_for(4, seed=60 + i) for i, p in enumerate(src)}
    # Buffers that never fill (8-page segments, 4 pages each) and a long flush interval: the
    # segment is saved by flush() with both pools in it, however slow this machine is between
    # the two pools' sets (a full buffer would be saved on its own at once).
    st = make_store(
        "orbax", tmp_path, src, [PoolSpec("target"), PoolSpec("draft")], segment_pages=8, flush_interval_s=30.0
    )
    st.set_multi([PoolTransfer(p, keys[p], range(4)) for p in src])
    assert st.flush(60)
    assert len(st.index.segments) == 1  # both pools' buffers saved as one segment
    dst = {p: HostKVPool(GEOM, 8, "page_first") for p in src}
    for p in src:
        st.codecs[p].pool = dst[p]
    hit = st.get_multi([PoolTransfer(p, keys[p], [4, 5, 6, 7]) for p in src])
    assert hit.hit_pages == 4
    for p in src:
        assert_pages_equal(src[p], range(4), dst[p], range(4, 8))
    st.close()


@pytest.mark.parametrize("batched", [False, True], ids=["one_page", "batched"])
def test_failed_in_place_read_scrubs_only_that_host_page(tmp_path, batched):
    # Reads go straight into the host page (no backup copy): a page whose read fails a check
    # is zero-filled (never left holding bytes that failed it), reported False and its
    # segment quarantined; host pages never read into keep their bytes.
    st, src, keys = _written(tmp_path)
    seg = segment_dirs(tmp_path)[0]  # pages 0-3
    f, off = _page_location(seg, st.codecs["target"].pack(np.array([1]))[0].tobytes())
    with open(f, "r+b") as fh:
        fh.seek(off + 1500)
        b = fh.read(1)
        fh.seek(off + 1500)
        fh.write(bytes([b[0] ^ 0x10]))
    dst = HostKVPool(GEOM, 16, "page_first")
    fill_random(dst, 99)  # not zeros: the scrub must show
    before = {c: dst.read_pages(c, range(16)) for c in GEOM.components}
    st.codecs["target"].pool = dst
    absent = keys_for(1, seed=12345)[0]
    if batched:  # page 1 (corrupt) among pages of another segment and an absent key
        flags = st.batch_get([keys[5], keys[1], absent, keys[6]], [2, 3, 4, 5])
        assert flags == [True, False, False, True]
        assert_pages_equal(src, [5, 6], dst, [2, 5])
    else:
        assert st.batch_get(keys[1:2], [3]) == [False]
        assert st.batch_get([absent], [4]) == [False]
    for c in GEOM.components:
        assert not dst.read_pages(c, [3]).any()  # the failed page: zeros, not the corrupt bytes
        untouched = [i for i in range(16) if i not in (2, 3, 5)]
        np.testing.assert_array_equal(dst.read_pages(c, untouched), before[c][untouched])
    m = st.metrics.snapshot()
    assert m["corrupt"] == 1 and m["quarantined"] == 1 and m["hits"] == (2 if batched else 0)
    assert m["verified"] == (3 if batched else 1)  # two good pages + the one that failed its CRC
    assert st.batch_get(keys[4:5], [3]) == [True]  # the scrubbed page is reusable
    assert_pages_equal(src, [4], dst, [3])
    st.close()


def test_shard_index_damage_is_a_miss(tmp_path):
    st, src, keys = _written(tmp_path)
    seg = segment_dirs(tmp_path)[1]  # pages 4-7
    page = st.codecs["target"].pack(np.array([6]))[0]
    f, off = _page_location(seg, page.tobytes())
    with open(f, "r+b") as fh:  # the shard index right after the page: offset field
        fh.seek(off + page.nbytes)
        fh.write((8).to_bytes(8, "little"))
    dst = HostKVPool(GEOM, 16, "page_first")
    st.codecs["target"].pool = dst
    flags = st.batch_get(keys, range(8))
    assert flags[:4] == [True] * 4 and flags[6] is False
    assert not dst.read_pages("k", [6]).any()
    assert st.metrics.quarantined == 1 and st.metrics.read_errors >= 1
    st.close()


def test_unexpected_layout_falls_back_to_tensorstore(tmp_path, monkeypatch):
    st, src, keys = _written(tmp_path)
    monkeypatch.setattr(ocdbt_direct, "_zarr_ok", lambda *a: False)
    dst = HostKVPool(GEOM, 16, "page_first")
    st.codecs["target"].pool = dst
    assert st.batch_get(keys, range(8)) == [True] * 8
    assert_pages_equal(src, range(8), dst, range(8))
    assert all(s.locs == {"target": None} for s in st.index.segments.values())
    st.close()


@pytest.mark.parametrize("buffer_bytes", [0, 1 << 20])
def test_segment_buffers_are_reused_up_to_the_bound(tmp_path, buffer_bytes):
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 5)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, write_buffer_bytes=buffer_bytes)
    seg_bytes = 4 * st.codecs["target"].page_bytes
    all_keys = keys_for(24, seed=7)
    for r in range(3):  # each round reuses the buffers the previous one saved
        keys = all_keys[8 * r : 8 * r + 8]
        fill_random(src, 100 + r)
        expect = st.codecs["target"].pack(np.arange(8))
        assert all(st.batch_set(keys, range(8)))
        assert st.flush(60)
        dst = HostKVPool(GEOM, 16, "page_first")
        st.codecs["target"].pool = dst
        assert all(st.batch_get(keys, range(8)))
        np.testing.assert_array_equal(st.codecs["target"].pack(np.arange(8)), expect)
        st.codecs["target"].pool = src
        assert st.writer.free_buffer_bytes == (0 if buffer_bytes == 0 else 2 * seg_bytes)
    # every earlier round still reads back right (a reused buffer never rewrote a saved page)
    dst = HostKVPool(GEOM, 24, "page_first")
    st.codecs["target"].pool = dst
    assert all(st.batch_get(all_keys, range(24)))
    assert st.metrics.corrupt == 0
    st.close()


def test_partial_segments_and_pending_reads_from_buffers(tmp_path):
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 8)
    keys = keys_for(7, seed=9)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=4, flush_interval_s=60)
    assert all(st.batch_set(keys[:3], [0, 1, 2]))  # a partly filled buffer
    assert all(st.batch_set(keys[3:], [3, 4, 5, 6]))  # fills it, spills into the next
    assert st.metrics.segments_written <= 1
    dst = HostKVPool(GEOM, 16, "page_first")
    st.codecs["target"].pool = dst
    assert all(st.batch_get(keys, range(7)))  # pending (in a buffer) or saved: either way right
    assert_pages_equal(src, range(7), dst, range(7))
    st.codecs["target"].pool = src
    assert st.flush(60)
    assert st.metrics.pages_written == 7 and st.metrics.segments_written == 2
    st.close()


def test_concurrent_writers_and_readers(tmp_path):
    src = HostKVPool(GEOM, 64, "page_first")
    fill_random(src, 12)
    keys = keys_for(64, seed=13)
    st = make_store("orbax", tmp_path, {"target": src}, segment_pages=8, max_pending_pages=64)
    errors = []

    def writer(lo: int) -> None:
        try:
            for i in range(lo, 64, 4):
                assert st.batch_set([keys[i]], [i]) == [True]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(lo,)) for lo in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and st.flush(60)
    dst = HostKVPool(GEOM, 64, "page_first")
    st.codecs["target"].pool = dst
    got = []

    def reader(lo: int) -> None:
        got.append(st.batch_get(keys[lo::4], list(range(lo, 64, 4))))

    threads = [threading.Thread(target=reader, args=(lo,)) for lo in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(all(g) for g in got) and len(got) == 4
    assert_pages_equal(src, range(64), dst, range(64))
    st.close()


def test_config_fields_validate():
    assert StorageConfig(path="/x").read_path == "direct"
    with pytest.raises(ValueError, match="read_path"):
        StorageConfig(path="/x", read_path="mmap")
    with pytest.raises(ValueError, match="write_buffer_bytes"):
        StorageConfig(path="/x", write_buffer_bytes=-1)
    with pytest.raises(TypeError, match="write_buffer_bytes"):
        StorageConfig(path="/x", write_buffer_bytes=1.5)


def test_larger_geometry_multi_chunk_reads(tmp_path):
    # 2 MiB-class pages take the chunked read + CRC path (several CHUNK_BYTES groups)
    geom = KVGeometry.mha(4, 16, 8, 128, "bfloat16")  # 256 KiB per page
    src = HostKVPool(geom, 4, "layer_first")
    fill_random(src, 3)
    keys = keys_for(4, seed=3, ns=namespace(geom, "layer_first"), page_size=geom.page_size)
    old = ocdbt_direct.CHUNK_BYTES
    ocdbt_direct.CHUNK_BYTES = 64 << 10
    try:
        st = make_store("orbax", tmp_path, {"target": src}, segment_pages=4)
        assert all(st.batch_set(keys, range(4))) and st.flush(60)
        dst = HostKVPool(geom, 4, "layer_first")
        st.codecs["target"].pool = dst
        assert st.batch_get(keys[2:3], [0]) == [True]
        assert all(st.batch_get(keys, [3, 2, 1, 0]))
        assert_pages_equal(src, range(4), dst, [3, 2, 1, 0])
        assert st.metrics.corrupt == 0
        st.close()
    finally:
        ocdbt_direct.CHUNK_BYTES = old
