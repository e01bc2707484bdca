"""Backend-neutral tests of the storage interface (memory, file, and orbax where installed)."""

import numpy as np
import pytest

from hicache_jax import HostKVPool, HostLayout, KVGeometry
from hicache_jax.storage import PoolHitPolicy, PoolSpec, PoolTransfer, consecutive

from hicache_jax.storage import page_keys

from storage_helpers import GEOM, assert_pages_equal, fill_random, keys_for, make_store, namespace

DTYPE_GEOMS = [
    KVGeometry.mha(2, 4, 2, 32, "bfloat16"),
    KVGeometry.mha(2, 4, 2, 32, "float16"),
    KVGeometry.mha(2, 4, 1, 32, "float32"),
    KVGeometry.mla(2, 4, 48, 16, "float8_e4m3fn"),
]
LAYOUTS = list(HostLayout)


@pytest.mark.parametrize("gi", range(len(DTYPE_GEOMS)), ids=[g.dtype for g in DTYPE_GEOMS])
def test_roundtrip_bit_exact_every_dtype(backend, tmp_path, gi):
    geom = DTYPE_GEOMS[gi]
    layout = LAYOUTS[gi % len(LAYOUTS)]
    src = HostKVPool(geom, 12, layout)
    fill_random(src, seed=gi)
    dst = HostKVPool(geom, 12, layout)
    keys = keys_for(6, seed=gi, ns=namespace(geom, layout.value))
    with make_store(backend, tmp_path, {"target": src}) as st:
        assert st.batch_set(keys, [3, 7, 1, 0, 11, 5]) == [True] * 6
        assert st.flush(30)
        assert st.batch_exists(keys) == 6
        st.codecs["target"].pool = dst  # read into a different, zeroed pool
        assert st.batch_get(keys, [0, 1, 2, 3, 4, 5]) == [True] * 6
        assert_pages_equal(src, [3, 7, 1, 0, 11, 5], dst, [0, 1, 2, 3, 4, 5])
        assert not dst.read_pages(geom.components[0], [6, 7]).any()  # nothing else touched
        m = st.metrics.snapshot()
        assert m["hits"] == 6 and m["corrupt"] == 0 and m["verified"] == 6


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_roundtrip_every_layout_file_and_memory(tmp_path, layout):
    for backend in ("memory", "file"):
        src = HostKVPool(GEOM, 8, layout)
        fill_random(src, 1)
        keys = keys_for(3, ns=namespace(GEOM, layout.value))
        with make_store(backend, tmp_path / backend, {"target": src}) as st:
            st.batch_set(keys, [5, 6, 2])
            dst = HostKVPool(GEOM, 8, layout)
            st.codecs["target"].pool = dst
            assert st.batch_get(keys, [1, 2, 3]) == [True] * 3
            assert_pages_equal(src, [5, 6, 2], dst, [1, 2, 3])


def test_consecutive_exists_and_partial_get(backend, tmp_path):
    src = HostKVPool(GEOM, 10, "page_first")
    fill_random(src, 2)
    keys = keys_for(6)
    with make_store(backend, tmp_path, {"target": src}) as st:
        assert st.batch_exists(keys) == 0
        st.batch_set([keys[i] for i in (0, 1, 3, 4)], [0, 1, 3, 4])
        st.flush(30)
        assert st.batch_exists(keys) == 2  # stops at the first gap
        assert st.batch_exists(keys[1:]) == 1
        assert st.batch_exists(keys[2:]) == 0  # missing first page -> 0 (upstream #26886)
        dst = HostKVPool(GEOM, 10, "page_first")
        st.codecs["target"].pool = dst
        flags = st.batch_get(keys, [9, 8, 7, 6, 5, 4])
        assert flags == [True, True, False, True, True, False] and consecutive(flags) == 2
        assert_pages_equal(src, [0, 1, 3, 4], dst, [9, 8, 6, 5])
        assert not dst.read_pages("k", [7, 4]).any()  # missed pages left untouched
        m = st.metrics.snapshot()
        assert m["misses"] == 2 and m["hits"] == 4


def test_sets_are_idempotent_and_skip_stored(backend, tmp_path):
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 3)
    keys = keys_for(4)
    with make_store(backend, tmp_path, {"target": src}) as st:
        assert st.batch_set(keys[:2], [0, 1]) == [True, True]
        st.flush(30)
        assert st.batch_set(keys + [keys[3]], [0, 1, 2, 3, 3]) == [True] * 5
        st.flush(30)
        m = st.metrics.snapshot()
        assert m["sets_skipped"] == 3 and m["pages_written"] == 4
        assert st.batch_exists(keys) == 4


def _pools(n=12):
    target = HostKVPool(GEOM, n, "page_first")
    draft = HostKVPool(KVGeometry.mha(1, 4, 1, 32, "float16"), n, "page_first_direct")
    swa = HostKVPool(KVGeometry.mha(2, 4, 2, 32, "bfloat16"), n, "layer_first")
    for i, p in enumerate((target, draft, swa)):
        fill_random(p, 10 + i)
    return {"target": target, "draft": draft, "swa": swa}


SPECS = [PoolSpec("target"), PoolSpec("draft"), PoolSpec("swa", PoolHitPolicy.TRAILING_PAGES, window_pages=2)]


def _pool_keys(n, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 50_000, n * 4)
    return {p: page_keys(namespace(pool=p), tokens) for p in ("target", "draft", "swa")}


def test_multi_pool_hit_policies_and_roundtrip(backend, tmp_path):
    pools = _pools()
    keys = _pool_keys(6)
    with make_store(backend, tmp_path, pools, SPECS) as st:
        # target and draft for all 6 pages; swa only the trailing window of the first 4 and of all 6
        st.set_multi(
            [
                PoolTransfer("target", keys["target"], range(6)),
                PoolTransfer("draft", keys["draft"], range(6)),
                PoolTransfer("swa", [keys["swa"][i] for i in (2, 3, 4, 5)], [2, 3, 4, 5]),
            ]
        )
        st.flush(30)
        tr = [PoolTransfer(p, keys[p]) for p in ("target", "draft", "swa")]
        r = st.exists_multi(tr)
        assert r.hit_pages == 6 and r.pool_hits == {"target": 6, "draft": 6, "swa": 2}
        dst = _pools()
        for p in dst:
            st.codecs[p].pool = dst[p]
        ids = {p: np.arange(6) + 6 for p in dst}
        r = st.get_multi([PoolTransfer(p, keys[p], ids[p]) for p in ("target", "draft", "swa")])
        assert r.hit_pages == 6 and r.pool_hits == {"target": 6, "draft": 6, "swa": 2}
        assert_pages_equal(pools["target"], range(6), dst["target"], range(6, 12))
        assert_pages_equal(pools["draft"], range(6), dst["draft"], range(6, 12))
        assert_pages_equal(pools["swa"], [4, 5], dst["swa"], [10, 11])
        # swa pages outside the window were not written
        fill_check = _pools()["swa"]
        assert_pages_equal(fill_check, [6, 7, 8, 9], dst["swa"], [6, 7, 8, 9])


def test_multi_pool_shrinks_hit_to_a_complete_window(backend, tmp_path):
    pools = _pools()
    keys = _pool_keys(6, seed=1)
    with make_store(backend, tmp_path, pools, SPECS) as st:
        st.set_multi(
            [
                PoolTransfer("target", keys["target"], range(6)),
                PoolTransfer("draft", keys["draft"][:5], range(5)),  # draft misses page 5
                PoolTransfer("swa", [keys["swa"][i] for i in (1, 2, 4)], [1, 2, 4]),
            ]
        )
        st.flush(30)
        tr = [PoolTransfer(p, keys[p], np.arange(6)) for p in ("target", "draft", "swa")]
        # draft limits to 5; the window [3, 5) lacks swa page 3; [2, 4) lacks 3; [1, 3) is complete
        r = st.exists_multi(tr)
        assert r.hit_pages == 3 and r.pool_hits["swa"] == 2 and r.pool_hits["draft"] == 5
        dst = _pools()
        for p in dst:
            st.codecs[p].pool = dst[p]
        r2 = st.get_multi(tr)
        assert r2.hit_pages == 3
        assert_pages_equal(pools["target"], range(3), dst["target"], range(3))
        assert_pages_equal(pools["swa"], [1, 2], dst["swa"], [1, 2])
        # nothing beyond the hit was published
        assert_pages_equal(_pools()["target"], range(3, 6), dst["target"], range(3, 6))
        # a trailing pool needs only its window: the first page's swa may be absent
        r3 = st.exists_multi([PoolTransfer(p, keys[p][:3]) for p in ("target", "swa")])
        assert r3.hit_pages == 3


def test_namespace_isolation(backend, tmp_path):
    src = HostKVPool(GEOM, 4, "page_first")
    fill_random(src, 4)
    tokens = np.arange(16)
    base = namespace()
    with make_store(backend, tmp_path, {"target": src}) as st:
        st.batch_set(page_keys(base, tokens), range(4))
        st.flush(30)
        assert st.batch_exists(page_keys(base, tokens)) == 4
        for other in (
            namespace(model="other-model"),
            namespace(KVGeometry.mha(2, 4, 2, 32, "float8_e4m3fn")),
            namespace(extra_key="salt-2"),
            namespace(weights_revision="r2"),
            namespace(tp_size=2, tp_rank=1),
            namespace(layout="layer_first"),
        ):
            assert st.batch_exists(page_keys(other, tokens)) == 0, other


def test_caller_errors_raise(backend, tmp_path):
    src = HostKVPool(GEOM, 4, "page_first")
    keys = keys_for(2)
    with make_store(backend, tmp_path, {"target": src}) as st:
        with pytest.raises(ValueError, match="pool"):
            st.batch_exists(keys, pool="nope")
        with pytest.raises(ValueError, match="key"):
            st.batch_exists([b"short"])
        with pytest.raises(TypeError):
            st.batch_exists(keys[0])
        with pytest.raises(ValueError, match="host_page_ids"):
            st.batch_get(keys, [0])
        with pytest.raises(ValueError, match="out of range"):
            st.batch_set(keys, [0, 4])
        with pytest.raises(ValueError, match="duplicate"):
            st.batch_get(keys, [1, 1])
        with pytest.raises(TypeError):
            st.batch_get(keys, [0.0, 1.0])


def test_pool_spec_validation():
    with pytest.raises(ValueError, match="window_pages"):
        PoolSpec("swa", PoolHitPolicy.TRAILING_PAGES)
    with pytest.raises(ValueError):
        PoolSpec("bad/name")
    with pytest.raises(ValueError, match="ALL_PAGES"):
        make_store("memory", None, {"swa": HostKVPool(GEOM, 2)}, [PoolSpec("swa", "trailing_pages", 1)])
    with pytest.raises(ValueError, match="one PoolSpec per pool"):
        make_store("memory", None, {"target": HostKVPool(GEOM, 2)}, [PoolSpec("draft")])


def test_capacity_evicts_oldest(backend, tmp_path):
    src = HostKVPool(GEOM, 16, "page_first")
    fill_random(src, 5)
    pb = GEOM.bytes_per_page
    keys = keys_for(16, seed=9)
    # room for ~8 pages (file pages carry a 64-byte header; orbax evicts whole 4-page segments)
    with make_store(backend, tmp_path, {"target": src}, capacity_bytes=8 * (pb + 64), segment_pages=4) as st:
        for i in range(0, 16, 4):
            st.batch_set(keys[i : i + 4], range(i, i + 4))
            st.flush(30)
        present = [st.batch_exists([k]) for k in keys]
        assert present[-4:] == [1] * 4  # newest kept
        assert present[:4] == [0] * 4  # oldest gone
        assert 4 <= sum(present) <= 8
        assert st.metrics.pages_evicted >= 8


def test_backends_implement_hooks_not_public_methods(backend, tmp_path):
    # The base class's public methods own the checks, metrics and fault handling; a backend
    # that overrode one would skip them.
    from hicache_jax.storage import HiCacheStorage

    with make_store(backend, tmp_path, {"target": HostKVPool(GEOM, 2)}) as st:
        public = {n for n, v in vars(HiCacheStorage).items() if not n.startswith("_") and callable(v)}
        overridden = {
            n for cls in type(st).__mro__[: type(st).__mro__.index(HiCacheStorage)] for n in vars(cls) if n in public
        }
        assert not overridden, f"{type(st).__name__} overrides {sorted(overridden)}"


def test_flush_timeout_is_checked_and_close_is_idempotent(backend, tmp_path):
    src = HostKVPool(GEOM, 4, "page_first")
    fill_random(src, 1)
    keys = keys_for(2)
    st = make_store(backend, tmp_path, {"target": src})
    for bad, err in (("5", TypeError), (True, TypeError), (float("nan"), ValueError)):
        with pytest.raises(err, match="timeout"):
            st.flush(bad)
    assert st.batch_set(keys, [0, 1]) == [True, True]
    assert st.flush(np.int64(60)) and st.flush(-1.0)  # any real number; nothing left: no wait needed
    st.close()
    st.close()  # a no-op
    assert st.metrics.pages_written == 2
