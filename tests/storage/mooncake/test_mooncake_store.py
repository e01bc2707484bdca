"""The ``mooncake`` backend against a real master: round trips, pools, namespaces, integrity."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hicache_jax import HostKVPool, HostLayout, KVGeometry
from hicache_jax.storage import PoolHitPolicy, PoolSpec, PoolTransfer, StorageConfig, consecutive, create_storage

from mooncake_helpers import mc_config, mc_store
from storage_helpers import GEOM, assert_pages_equal, fill_random, keys_for, namespace

DTYPE_GEOMS = [
    KVGeometry.mha(2, 4, 2, 32, "bfloat16"),
    KVGeometry.mha(2, 4, 2, 32, "float16"),
    KVGeometry.mha(2, 4, 1, 32, "float32"),
    KVGeometry.mla(2, 4, 48, 16, "float8_e4m3fn"),
]


@pytest.fixture(scope="module")
def raw(master):
    """A second, plain Mooncake client of the same master (another writer; lends no memory:
    what it puts goes to the store node)."""
    from mooncake.store import MooncakeDistributedStore

    c = MooncakeDistributedStore()
    assert c.setup("127.0.0.1", master.metadata_url, 0, 16 << 20, "tcp", "", master.rpc_address) == 0
    yield c
    c.close()


POOLS = ("target", "draft", "swa")


@pytest.mark.parametrize("gi", range(len(DTYPE_GEOMS)), ids=[g.dtype for g in DTYPE_GEOMS])
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda l: l.value)
def test_roundtrip_bit_exact_every_pool_dtype_and_layout(master, gi, layout):
    geom = DTYPE_GEOMS[gi]
    src = {p: HostKVPool(geom, 12, layout) for p in POOLS}
    for i, pool in enumerate(src.values()):
        fill_random(pool, seed=10 * gi + i)
    ns = namespace(geom, layout.value)
    keys = {p: keys_for(6, seed=100 + gi, ns=ns.for_pool(p)) for p in POOLS}
    ids, out_ids = [3, 7, 1, 0, 11, 5], [0, 1, 2, 3, 4, 5]
    specs = [PoolSpec("target"), PoolSpec("draft"), PoolSpec("swa")]
    with mc_store(master, src, specs) as st:
        assert st.exists_multi([PoolTransfer(p, keys[p]) for p in POOLS]).hit_pages == 0
        res = st.set_multi([PoolTransfer(p, keys[p], ids) for p in POOLS])
        assert all(v == [True] * 6 for v in res.values()), res
        assert st.exists_multi([PoolTransfer(p, keys[p]) for p in POOLS]).hit_pages == 6
        dst = {p: HostKVPool(geom, 12, layout) for p in POOLS}
        for p in POOLS:
            st.codecs[p].pool = dst[p]  # read into different, zeroed pools
        hit = st.get_multi([PoolTransfer(p, keys[p], out_ids) for p in POOLS])
        assert hit.hit_pages == 6 and hit.pool_hits == {p: 6 for p in POOLS}
        for p in POOLS:  # each pool's own bytes (the pools hold different random data)
            assert_pages_equal(src[p], ids, dst[p], out_ids)
            assert not dst[p].read_pages(geom.components[0], [6, 7, 8]).any()  # nothing else touched
        m = st.metrics.snapshot()
        assert (m["hits"], m["corrupt"], m["verified"], m["pages_written"]) == (18, 0, 18, 18)


def test_pages_are_shared_between_clients(master):
    """A page one client (engine) stores, another reads from the first one's segment."""
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 5)
    keys = keys_for(4, seed=5)
    with mc_store(master, {"target": src}) as a:
        assert a.batch_set(keys, [4, 5, 6, 7]) == [True] * 4
        dst = HostKVPool(GEOM, 8, "page_first")
        with mc_store(master, {"target": dst}, mooncake_global_segment_bytes=0) as b:  # lends no memory
            assert b.batch_exists(keys) == 4
            assert b.batch_get(keys, [0, 1, 2, 3]) == [True] * 4
            assert_pages_equal(src, [4, 5, 6, 7], dst, [0, 1, 2, 3])


def test_exists_counts_consecutive_hits_only(master):
    src = HostKVPool(GEOM, 10, "page_first")
    fill_random(src, 2)
    keys = keys_for(6, seed=2)
    with mc_store(master, {"target": src}) as st:
        assert st.batch_set([keys[i] for i in (0, 1, 3, 4)], [0, 1, 3, 4]) == [True] * 4
        assert st.batch_exists(keys) == 2  # stops at the first gap
        assert st.batch_exists(keys[1:]) == 1
        assert st.batch_exists(keys[2:]) == 0  # a missing first page gives 0
        dst = HostKVPool(GEOM, 10, "page_first")
        st.codecs["target"].pool = dst
        flags = st.batch_get(keys, [9, 8, 7, 6, 5, 4])
        assert flags == [True, True, False, True, True, False] and consecutive(flags) == 2
        assert_pages_equal(src, [0, 1, 3, 4], dst, [9, 8, 6, 5])
        assert not dst.read_pages("k", [7, 4]).any()  # missed pages left untouched
        assert st.metrics.misses == 2


def test_sets_skip_stored_keys_and_repeats(master):
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 3)
    keys = keys_for(4, seed=3)
    with mc_store(master, {"target": src}) as st:
        assert st.batch_set(keys[:2], [0, 1]) == [True, True]
        assert st.batch_set(keys + [keys[3]], [0, 1, 2, 3, 3]) == [True] * 5
        m = st.metrics.snapshot()
        assert m["pages_written"] == 4 and m["sets_skipped"] == 3


def test_namespace_isolation(master):
    """Same tokens, other model / salt / TP rank / dtype / layout / pool: other keys, no hits."""
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 4)
    tokens_seed = 9
    base = namespace()
    others = [
        namespace(model="other-model"),
        namespace(extra_key="tenant-b"),
        namespace(tp_size=2, tp_rank=1),
        namespace(layout="layer_first"),
        base.for_pool("draft"),
        namespace(KVGeometry.mha(2, 4, 2, 32, "float16")),
    ]
    with mc_store(master, {"target": src}) as st:
        keys = keys_for(3, seed=tokens_seed, ns=base)
        assert st.batch_set(keys, [0, 1, 2]) == [True] * 3
        assert st.batch_exists(keys) == 3
        for ns in others:
            other = keys_for(3, seed=tokens_seed, ns=ns)
            assert not set(other) & set(keys)
            assert st.batch_exists(other) == 0
            assert st.batch_get(other, [5, 6, 7]) == [False] * 3
    # pools are namespaced in the object names too: the same key in another pool is absent
    tgt, drf = HostKVPool(GEOM, 4, "page_first"), HostKVPool(GEOM, 4, "page_first")
    fill_random(tgt, 6)
    with mc_store(master, {"target": tgt, "draft": drf}) as st:
        k = keys_for(1, seed=77)
        assert st.batch_set(k, [0], pool="target") == [True]
        assert st.batch_exists(k, pool="draft") == 0


def test_target_draft_swa_pools(master):
    geom_swa = KVGeometry.mha(1, 4, 2, 16, "bfloat16")
    pools = {
        "target": HostKVPool(GEOM, 16, "page_first"),
        "draft": HostKVPool(GEOM, 16, "layer_first"),
        "swa": HostKVPool(geom_swa, 16, "page_first_direct"),
    }
    for i, p in enumerate(pools.values()):
        fill_random(p, 20 + i)
    specs = [PoolSpec("target"), PoolSpec("draft"), PoolSpec("swa", PoolHitPolicy.TRAILING_PAGES, 2)]
    n = 6
    keys = {p: keys_for(n, seed=31, ns=namespace(pools[p].geom, pools[p].layout.value).for_pool(p)) for p in pools}
    with mc_store(master, pools, specs) as st:
        res = st.set_multi(
            [
                PoolTransfer("target", keys["target"], list(range(n))),
                PoolTransfer("draft", keys["draft"], list(range(n))),
                PoolTransfer("swa", keys["swa"][n - 2 :], [n - 2, n - 1]),
            ]
        )
        assert all(all(v) for v in res.values())
        q = [PoolTransfer(p, keys[p]) for p in pools]
        assert st.exists_multi(q).hit_pages == n
        dst = {p: HostKVPool(pools[p].geom, 16, pools[p].layout) for p in pools}
        for p in pools:
            st.codecs[p].pool = dst[p]
        ids = list(range(8, 8 + n))
        hit = st.get_multi([PoolTransfer(p, keys[p], ids) for p in pools])
        assert hit.hit_pages == n and hit.pool_hits == {"target": n, "draft": n, "swa": 2}
        assert_pages_equal(pools["target"], range(n), dst["target"], ids)
        assert_pages_equal(pools["draft"], range(n), dst["draft"], ids)
        assert_pages_equal(pools["swa"], [n - 2, n - 1], dst["swa"], ids[-2:])
        # a missing draft page caps the hit for every pool (draft never counts without target)
        missing = keys_for(1, seed=999)[0]
        kd = list(keys["draft"])
        kd[3] = missing
        q = [PoolTransfer("target", keys["target"]), PoolTransfer("draft", kd), PoolTransfer("swa", keys["swa"])]
        assert st.exists_multi(q).hit_pages == 0  # swa window of hit 3 = pages 1, 2: not stored


def _overwrite(client, name: str, value: bytes) -> None:
    client.remove(name, True)
    assert client.put(name, value) == 0


@pytest.mark.parametrize("how", ["flipped_body", "other_key_header", "short", "long", "garbage"])
def test_overwritten_value_is_a_miss_never_wrong_kv(master, raw, how):
    from hicache_jax.storage.mooncake.store import HEADER_BYTES, object_name

    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 11)
    keys = keys_for(3, seed=40 + len(how))
    with mc_store(master, {"target": src}) as st:
        assert st.batch_set(keys, [0, 1, 2]) == [True] * 3
        name = object_name("target", keys[1])
        good = raw.get(name)
        other = raw.get(object_name("target", keys[2]))
        assert len(good) == HEADER_BYTES + st.codecs["target"].page_bytes
        if how == "flipped_body":
            bad = bytearray(good)
            bad[HEADER_BYTES + 17] ^= 0x40
        elif how == "other_key_header":
            bad = bytearray(other)  # a valid value, of another key
        elif how == "short":
            bad = bytearray(good[:-8])
        elif how == "long":
            bad = bytearray(good + b"\0" * 8)
        else:
            bad = bytearray(np.random.default_rng(1).integers(0, 256, len(good), dtype=np.uint8).tobytes())
        _overwrite(raw, name, bytes(bad))
        dst = HostKVPool(GEOM, 8, "page_first")
        st.codecs["target"].pool = dst
        flags = st.batch_get(keys, [5, 6, 7])
        assert flags == [True, False, True]
        assert_pages_equal(src, [0, 2], dst, [5, 7])
        assert not dst.array[:, 6 * GEOM.page_size : 7 * GEOM.page_size].any()  # zero-filled or untouched
        m = st.metrics.snapshot()
        assert m["corrupt"] == 1 and m["hits"] == 2 and m["misses"] == 1
        # the bad object was removed: the next write stores the page afresh and it reads back
        st.codecs["target"].pool = src
        assert m["quarantined"] == 1 and st.batch_exists(keys) == 1
        assert st.batch_set(keys, [0, 1, 2]) == [True] * 3
        st.codecs["target"].pool = dst
        assert st.batch_get(keys[1:2], [6]) == [True]
        assert_pages_equal(src, [1], dst, [6])


def test_integrity_off_still_checks_header_and_size(master, raw):
    from hicache_jax.storage.mooncake.store import object_name

    src = HostKVPool(GEOM, 4, "page_first")
    fill_random(src, 12)
    keys = keys_for(2, seed=50)
    with mc_store(master, {"target": src}, integrity="off") as st:
        st.batch_set(keys, [0, 1])
        other = raw.get(object_name("target", keys[1]))
        _overwrite(raw, object_name("target", keys[0]), other)  # another key's valid value
        assert st.batch_get(keys, [2, 3]) == [False, True]
        assert st.metrics.verified == 0 and st.metrics.corrupt == 1


def test_bad_arguments_raise_and_change_nothing(master):
    src = HostKVPool(GEOM, 4, "page_first")
    keys = keys_for(2, seed=60)
    with mc_store(master, {"target": src}) as st:
        with pytest.raises(ValueError, match="pool"):
            st.batch_set(keys, [0, 1], pool="nope")
        with pytest.raises(ValueError, match="host_page_ids"):
            st.batch_set(keys, [0, 9])
        with pytest.raises(ValueError, match="key"):
            st.batch_get([b"short"], [0])
        assert st.batch_exists(keys) == 0
        assert st.metrics.pages_written == 0


def test_config_names_what_is_wrong():
    ok = dict(backend="mooncake", mooncake_master="127.0.0.1:5000", mooncake_metadata="http://127.0.0.1:5001/metadata")
    for kw, exc, field in [
        ({"mooncake_master": None}, ValueError, "mooncake_master"),
        ({"mooncake_master": "127.0.0.1"}, ValueError, "mooncake_master"),
        ({"mooncake_master": "no such host:1"}, ValueError, "mooncake_master"),
        ({"mooncake_master": 5000}, TypeError, "mooncake_master"),
        ({"mooncake_metadata": "127.0.0.1:5001"}, ValueError, "mooncake_metadata"),
        ({"mooncake_metadata": "http://127.0.0.1:99999/m"}, ValueError, "mooncake_metadata"),
        ({"mooncake_protocol": "udp"}, ValueError, "mooncake_protocol"),
        ({"mooncake_op_timeout_s": 0}, ValueError, "mooncake_op_timeout_s"),
        ({"mooncake_global_segment_bytes": -1}, ValueError, "mooncake_global_segment_bytes"),
        ({"capacity_bytes": 1 << 20}, ValueError, "capacity_bytes"),
    ]:
        with pytest.raises(exc, match=field):
            StorageConfig(**{**ok, **kw})


def test_no_master_is_a_clear_error_at_construction(master):
    from hicache_jax.storage.mooncake import free_port
    from hicache_jax.storage.mooncake.server import unavailable_reason

    assert unavailable_reason() is None
    pools = {"target": HostKVPool(GEOM, 2, "page_first")}
    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="mooncake_master: no Mooncake master reachable"):
        create_storage(
            StorageConfig(
                backend="mooncake",
                mooncake_master=dead,
                mooncake_metadata=master.metadata_url,
                mooncake_connect_timeout_s=2.0,
            ),
            pools,
        )
    with pytest.raises(ConnectionError, match="mooncake_metadata: no HTTP metadata server"):
        create_storage(
            StorageConfig(
                backend="mooncake",
                mooncake_master=master.rpc_address,
                mooncake_metadata=f"http://127.0.0.1:{free_port()}/metadata",
                mooncake_connect_timeout_s=2.0,
            ),
            pools,
        )
    assert time.monotonic() - t0 < 10
    # the master's address and the metadata server's swapped: the master port speaks no HTTP
    with pytest.raises(ConnectionError, match="mooncake_metadata"):
        create_storage(
            mc_config(
                master, mooncake_metadata=f"http://{master.rpc_address}/metadata", mooncake_connect_timeout_s=2.0
            ),
            pools,
        )
