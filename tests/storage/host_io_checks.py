"""Checks of reads straight into host pages, shared by every backend's tests.

Each check takes ``make(pools) -> store`` (a context manager over the given pools) so the
file / memory / orbax / mooncake tests run the same assertions. Host pages around the ones a
read fills are "poisoned" (every byte ``POISON``) and must come out unchanged; a page whose
read failed must never be reported loaded and never hold stored bytes (all zero or still
poison).
"""

from __future__ import annotations

import threading
import tracemalloc

import numpy as np

from hicache_jax import HostKVPool, HostLayout, KVGeometry
from hicache_jax.storage import PageCodec, PoolTransfer

from storage_helpers import assert_pages_equal, fill_random, keys_for, namespace

POISON = 0xA5
# bf16 / fp8 / float32 MHA and an MLA geometry (one "kv" component, odd widths); pages above
# OCDBT's 1 KiB inline threshold, so the orbax reads go through data files.
GEOMS = {
    "bf16": KVGeometry.mha(2, 4, 2, 32, "bfloat16"),
    "fp8": KVGeometry.mha(3, 4, 2, 32, "float8_e4m3fn"),
    "f32": KVGeometry.mha(2, 4, 1, 32, "float32"),
    "mla": KVGeometry.mla(2, 4, 48, 16, "bfloat16"),
}
LAYOUTS = list(HostLayout)
# Pages of 512 KiB, to see any page-sized staging buffer in the allocation peak.
BIG = KVGeometry.mha(8, 16, 8, 128, "bfloat16")


def poisoned(geom: KVGeometry, n: int, layout) -> HostKVPool:
    pool = HostKVPool(geom, n, layout)
    pool.array.reshape(-1).view(np.uint8)[...] = POISON
    return pool


def assert_poisoned(pool: HostKVPool, ids) -> None:
    for c in pool.geom.components:
        assert (pool.read_pages(c, np.asarray(ids)).view(np.uint8) == POISON).all(), f"page(s) {ids} were written"


def assert_no_stored_bytes(pool: HostKVPool, host_id: int) -> None:
    """A page not loaded: untouched (poison) or zero-filled, never (part of) a page's bytes."""
    codec = PageCodec(pool)
    b = codec.pack(np.array([host_id]))[0]
    assert (b == 0).all() or (b == POISON).all(), "a page that failed its read kept bytes"


def _ns(geom: KVGeometry, layout, what: str):
    """A namespace of its own per check and geometry: namespaces do not carry the shape, and a
    shared store (mooncake's session master) keeps pages across tests."""
    return namespace(geom, HostLayout(layout).value, model=f"host-io-{what}-{geom}")


def _stored(make, geom, layout, n, seed, what):
    src = HostKVPool(geom, 12, layout)
    fill_random(src, seed)
    keys = keys_for(n, seed=seed, ns=_ns(geom, layout, what), page_size=geom.page_size)
    return src, keys


def check_roundtrip_poisoned(make, geom: KVGeometry, layout) -> None:
    """Batched (several in flight), lone and ``get_multi`` reads land byte-exact in exactly
    their host pages."""
    src, keys = _stored(make, geom, layout, 5, seed=7, what="roundtrip")
    src_ids, read_ids = [3, 7, 1, 0, 11], [2, 4, 5, 9, 10]
    with make({"target": src}) as st:
        assert st.batch_set(keys, src_ids) == [True] * 5
        assert st.flush(60)
        dst = poisoned(geom, 12, layout)
        st.codecs["target"].pool = dst
        assert st.batch_get(keys, read_ids) == [True] * 5
        assert st.batch_get(keys[3:4], [0]) == [True]
        assert_pages_equal(src, src_ids, dst, read_ids)
        assert_pages_equal(src, [0], dst, [0])
        assert_poisoned(dst, [1, 3, 6, 7, 8, 11])
        dst2 = poisoned(geom, 12, layout)
        st.codecs["target"].pool = dst2
        assert st.get_multi([PoolTransfer("target", keys, [11, 6, 8, 1, 3])]).hit_pages == 5
        assert_pages_equal(src, src_ids, dst2, [11, 6, 8, 1, 3])
        assert_poisoned(dst2, [0, 2, 4, 5, 7, 9, 10])
        m = st.metrics.snapshot()
        assert m["hits"] == 11 and m["corrupt"] == 0 and m["verified"] == 11


def check_corrupt_page_in_batch(make, corrupt, geom: KVGeometry = GEOMS["bf16"], layout="page_first") -> None:
    """``corrupt(store, key)`` damages one stored page (it still exists): in a batch it is a
    miss whose host page keeps no stored bytes, and its neighbours hit; ``get_multi`` stops
    its hit there."""
    src, keys = _stored(make, geom, layout, 10, seed=9, what="corrupt")
    with make({"target": src}) as st:
        assert st.batch_set(keys, range(10)) == [True] * 10
        assert st.flush(60)
        dst = poisoned(geom, 12, layout)
        st.codecs["target"].pool = dst
        corrupt(st, keys[2])
        assert st.batch_get(keys[:5], [7, 1, 5, 3, 9]) == [True, True, False, True, True]
        assert_pages_equal(src, [0, 1, 3, 4], dst, [7, 1, 3, 9])
        assert_no_stored_bytes(dst, 5)
        assert_poisoned(dst, [0, 2, 4, 6, 8, 10, 11])
        m = st.metrics.snapshot()
        assert m["corrupt"] == 1 and m["hits"] == 4 and m["misses"] == 1
        corrupt(st, keys[7])  # still indexed / on disk: get_multi must read it to find out
        dst2 = poisoned(geom, 12, layout)
        st.codecs["target"].pool = dst2
        hit = st.get_multi([PoolTransfer("target", keys[5:10], [0, 2, 4, 6, 8])])
        assert hit.hit_pages == 2
        assert_pages_equal(src, [5, 6], dst2, [0, 2])
        assert_no_stored_bytes(dst2, 4)
        assert_poisoned(dst2, [1, 3, 5, 7, 9, 10, 11])  # never touched: not in the call


def check_no_staging_copy(make, monkeypatch, layout="page_first", n: int = 6) -> None:
    """A read allocates nothing page-sized and never goes through the codec's copy-in
    (``unpack_one`` / ``unpack``): the bytes go straight into the host pages."""
    src = HostKVPool(BIG, n, layout)
    fill_random(src, 3)
    keys = keys_for(n, seed=3, ns=_ns(BIG, layout, "staging"), page_size=BIG.page_size)
    with make({"target": src}) as st:
        assert st.batch_set(keys, range(n)) == [True] * n
        assert st.flush(60)
        dst = HostKVPool(BIG, n, layout)
        st.codecs["target"].pool = dst
        assert st.batch_get(keys[:1], [0]) == [True]  # warm-up: thread pools, handles, indexes

        def staged(*a, **k):
            raise AssertionError("a read went through a per-page copy (PageCodec.unpack_one / unpack)")

        monkeypatch.setattr(PageCodec, "unpack_one", staged)
        monkeypatch.setattr(PageCodec, "unpack", staged)
        pb = st.codecs["target"].page_bytes
        for call in (
            lambda: st.batch_get(keys, list(range(n))),
            lambda: st.get_multi([PoolTransfer("target", keys, list(range(n))[::-1])]),
        ):
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                call()
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak - base < pb // 4, f"a read allocated {peak - base} bytes (page: {pb})"
        monkeypatch.undo()
        assert_pages_equal(src, list(range(n)), dst, list(range(n))[::-1])


def check_concurrent_reads(make, threads: int = 4, rounds: int = 3, layout="layer_first") -> None:
    """Several reads in flight at once from several threads, disjoint host pages: every page
    byte-exact, nothing else written."""
    geom = GEOMS["bf16"]
    n = 4 * threads
    src = HostKVPool(geom, n, layout)
    fill_random(src, 5)
    keys = keys_for(n, seed=5, ns=_ns(geom, layout, "concurrent"))
    with make({"target": src}) as st:
        assert st.batch_set(keys, range(n)) == [True] * n
        assert st.flush(60)
        dst = poisoned(geom, n + 2, layout)
        st.codecs["target"].pool = dst
        errors = []
        go = threading.Barrier(threads)

        def reader(t: int) -> None:
            try:
                mine = list(range(t, n, threads))  # host ids == page index: disjoint per thread
                go.wait()
                for _ in range(rounds):
                    assert st.batch_get([keys[i] for i in mine], mine) == [True] * len(mine)
                    assert st.get_multi([PoolTransfer("target", [keys[i] for i in mine], mine)]).hit_pages == len(mine)
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        ts = [threading.Thread(target=reader, args=(t,)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors
        assert_pages_equal(src, range(n), dst, range(n))
        assert_poisoned(dst, [n, n + 1])
