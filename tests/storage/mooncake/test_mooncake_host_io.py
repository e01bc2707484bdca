"""The ``mooncake`` backend's reads straight into host pages (``host_io_checks``) against a
real master: byte-exact round trips into poisoned pools, a damaged object in a batch, no
staging copy, concurrent reads."""

from __future__ import annotations

import pytest

from hicache_jax.storage.mooncake.store import HEADER_BYTES, object_name

import host_io_checks as chk
from mooncake_helpers import mc_store


@pytest.fixture(scope="module")
def raw(master):
    """A plain Mooncake client of the same master, to damage stored objects."""
    from mooncake.store import MooncakeDistributedStore

    c = MooncakeDistributedStore()
    assert c.setup("127.0.0.1", master.metadata_url, 0, 16 << 20, "tcp", "", master.rpc_address) == 0
    yield c
    c.close()


def _maker(master, **kw):
    return lambda pools: mc_store(master, pools, **kw)


@pytest.mark.parametrize("layout", chk.LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("geom", list(chk.GEOMS), ids=list(chk.GEOMS))
def test_roundtrip_bit_exact_into_poisoned_pools(master, geom, layout):
    chk.check_roundtrip_poisoned(_maker(master), chk.GEOMS[geom], layout)


@pytest.mark.parametrize("layout", chk.LAYOUTS, ids=lambda l: l.value)
def test_corrupt_object_in_a_batch_is_a_miss_and_neighbours_hit(master, raw, layout):
    def flip(st, key):  # the same key, a body byte flipped (Mooncake keeps the first put: replace it)
        name = object_name("target", key)
        bad = bytearray(raw.get(name))
        bad[HEADER_BYTES + 100] ^= 0x10
        raw.remove(name, True)
        assert raw.put(name, bytes(bad)) == 0

    chk.check_corrupt_page_in_batch(_maker(master), flip, layout=layout)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_reads_make_no_staging_copy(master, monkeypatch, layout):
    chk.check_no_staging_copy(_maker(master, mooncake_op_timeout_s=10.0), monkeypatch, layout)


def test_concurrent_reads_of_disjoint_pages(master):
    chk.check_concurrent_reads(_maker(master, read_concurrency=4))


def test_crcs_run_in_parallel_ranges(master):
    """A call's page checks run as several ranges on the CRC threads, results in page order."""
    import threading

    from hicache_jax import HostKVPool
    from storage_helpers import fill_random, keys_for

    src = HostKVPool(chk.GEOMS["bf16"], 40, "page_first")
    fill_random(src, 8)
    keys = keys_for(40, seed=8, ns=chk.namespace(chk.GEOMS["bf16"], "page_first", model="crc-ranges"))
    with mc_store(master, {"target": src}, read_concurrency=2) as st:
        seen = []

        def rng(lo, hi):
            seen.append((lo, hi, threading.current_thread().name))
            return list(range(lo, hi))

        assert st._in_parallel(40, rng) == list(range(40))
        assert len(seen) == 4 and sorted(x[:2] for x in seen) == [(0, 10), (10, 20), (20, 30), (30, 40)]
        assert all(name.startswith("l3-mooncake-crc") for *_, name in seen)
        assert st.batch_set(keys, range(40)) == [True] * 40
        dst = chk.poisoned(chk.GEOMS["bf16"], 40, "page_first")
        st.codecs["target"].pool = dst
        assert st.batch_get(keys, range(40)) == [True] * 40
        chk.assert_pages_equal(src, range(40), dst, range(40))
        assert st.metrics.verified == 40
