"""Reads straight into host pages and writes straight out of them: every backend's behaviour
(``host_io_checks``), here for ``memory``, ``file`` and (where installed) ``orbax``; the
``file`` backend's own faults; the host page runs (``host_pages.PageRuns``)."""

import itertools
import os

import numpy as np
import pytest

from hicache_jax import HostKVPool
from hicache_jax.storage import PageCodec
from hicache_jax.storage.host_pages import PageRuns

import host_io_checks as chk
from storage_helpers import BACKENDS, fill_random, make_store

_n = itertools.count()


def _maker(backend, tmp_path, **cfg):
    # orbax: make_store's 8-page segments, so a call's pages share segments (and their CRCs,
    # computed as pages are enqueued, must each belong to its own row)
    return lambda pools: make_store(backend, tmp_path / f"s{next(_n)}", pools, **cfg)


@pytest.mark.parametrize("layout", chk.LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("geom", list(chk.GEOMS), ids=list(chk.GEOMS))
def test_roundtrip_bit_exact_into_poisoned_pools(backend, tmp_path, geom, layout):
    chk.check_roundtrip_poisoned(_maker(backend, tmp_path), chk.GEOMS[geom], layout)


def _file_flip(st, key):
    path = st._path("target", key)
    with open(path, "r+b") as f:
        f.seek(64 + 100)  # in the page body, past the 64-byte header
        b = f.read(1)
        f.seek(64 + 100)
        f.write(bytes([b[0] ^ 0x10]))


def _memory_flip(st, key):
    st._corrupt_for_test("target", key, 100)


@pytest.mark.parametrize("layout", chk.LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("backend,corrupt", [("file", _file_flip), ("memory", _memory_flip)], ids=["file", "memory"])
def test_corrupt_page_in_a_batch_is_a_miss_and_neighbours_hit(tmp_path, backend, corrupt, layout):
    chk.check_corrupt_page_in_batch(_maker(backend, tmp_path), corrupt, layout=layout)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "memory"])
def test_reads_make_no_staging_copy(backend, tmp_path, monkeypatch, layout):
    # memory (a test backend) reads through ``_read`` on purpose: the controller's tests gate
    # reads by overriding that hook
    chk.check_no_staging_copy(_maker(backend, tmp_path), monkeypatch, layout)


def test_concurrent_reads_of_disjoint_pages(backend, tmp_path):
    chk.check_concurrent_reads(_maker(backend, tmp_path, read_concurrency=4))


def test_file_short_body_and_foreign_page_size_zero_fill_and_miss(tmp_path):
    """A truncated body and an overlong file are corrupt (quarantined); a sound page of
    another size is a miss left in place; each leaves its host page without stored bytes."""
    src = HostKVPool(chk.GEOMS["bf16"], 6, "layer_first")
    fill_random(src, 2)
    keys = chk.keys_for(4, seed=2, ns=chk.namespace(chk.GEOMS["bf16"], "layer_first"))
    with make_store("file", tmp_path, {"target": src}) as st:
        assert st.batch_set(keys, range(4)) == [True] * 4
        pb = st.codecs["target"].page_bytes
        with open(st._path("target", keys[0]), "r+b") as f:
            f.truncate(64 + pb - 1)
        with open(st._path("target", keys[1]), "ab") as f:
            f.write(b"\0")
        with open(st._path("target", keys[2]), "r+b") as f:  # a sound page of another size
            import struct

            head = bytearray(f.read(64))
            struct.pack_into("<Q", head, 16, pb // 2)
            f.seek(0)
            f.write(head)
            f.truncate(64 + pb // 2)
        dst = chk.poisoned(chk.GEOMS["bf16"], 6, "layer_first")
        st.codecs["target"].pool = dst
        assert st.batch_get(keys, [0, 1, 2, 3]) == [False, False, False, True]
        for h in (0, 1, 2):
            chk.assert_no_stored_bytes(dst, h)
        chk.assert_pages_equal(src, [3], dst, [3])
        chk.assert_poisoned(dst, [4, 5])
        m = st.metrics.snapshot()
        assert m["corrupt"] == 2 and m["quarantined"] == 2 and m["read_errors"] == 1
        assert os.path.exists(st._path("target", keys[2]))  # another store's page: left in place


def test_file_write_from_host_pages_matches_codec_bytes(tmp_path):
    """What a write puts in a file is the header and then exactly ``PageCodec.pack``'s bytes
    of the host page (straight out of its runs, every layout)."""
    for layout, g in itertools.product(chk.LAYOUTS, ("bf16", "mla")):
        src = HostKVPool(chk.GEOMS[g], 5, layout)
        fill_random(src, 4)
        keys = chk.keys_for(2, seed=4, ns=chk.namespace(chk.GEOMS[g], layout.value))
        with make_store("file", tmp_path / f"{layout.value}-{g}", {"target": src}) as st:
            assert st.batch_set(keys, [4, 1]) == [True, True]
            for k, h in zip(keys, [4, 1]):
                body = open(st._path("target", k), "rb").read()[64:]
                assert body == st.codecs["target"].pack(np.array([h]))[0].tobytes()


@pytest.mark.parametrize("layout", chk.LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("geom", list(chk.GEOMS), ids=list(chk.GEOMS))
def test_page_runs_are_the_codec_page_bytes(layout, geom):
    g = chk.GEOMS[geom]
    pool = HostKVPool(g, 7, layout)
    fill_random(pool, 1)
    runs, codec = PageRuns(pool), PageCodec(pool)
    for h in (0, 3, 6):
        want = codec.pack(np.array([h]))[0]
        assert np.concatenate(runs.arrays(h)).tobytes() == want.tobytes()
        assert b"".join(bytes(v) for v in runs.views(h)) == want.tobytes()
        assert [n for _, n in runs.runs(h)] == runs.sizes and sum(runs.sizes) == codec.page_bytes
    before = pool.array.copy()
    runs.zero(3)
    assert not codec.pack(np.array([3])).any()
    others = [h for h in range(7) if h != 3]
    np.testing.assert_array_equal(
        PageCodec(HostKVPool(g, 7, layout, buffer=before)).pack(np.array(others)), codec.pack(np.array(others))
    )
    with pytest.raises(ValueError, match="host_id"):
        runs.runs(7)
