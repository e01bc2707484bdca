"""The ``mooncake`` store's contents listener against a real master: puts are reported stored,
objects this store removes after a failed check are reported removed, and an object that goes
behind its back (Mooncake's eviction, another client) is not reported, only found by
``exists_each`` (what ``KVEventSource``'s probe asks)."""

from __future__ import annotations

import time

import pytest

from hicache_jax import HostKVPool

from mooncake_helpers import mc_store
from storage_helpers import GEOM, fill_random, keys_for


@pytest.fixture(scope="module")
def raw(master):
    """A second, plain client of the same master (it lends no memory)."""
    from mooncake.store import MooncakeDistributedStore

    c = MooncakeDistributedStore()
    assert c.setup("127.0.0.1", master.metadata_url, 0, 16 << 20, "tcp", "", master.rpc_address) == 0
    yield c
    c.close()


def test_puts_and_own_removals_are_reported_and_removals_behind_its_back_are_not(master, raw):
    from hicache_jax.storage.mooncake.store import HEADER_BYTES, object_name

    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 31)
    keys = keys_for(3, seed=131)
    calls = []
    with mc_store(master, {"target": src}) as st:
        fn = lambda kind, pool, ks: calls.append((kind, pool, list(ks)))  # noqa: E731
        st.add_listener(fn)
        try:
            assert st.batch_set(keys, [0, 1, 2]) == [True] * 3
            assert calls == [("stored", "target", keys)]
            # Behind the store's back (as Mooncake evicting it): unreported, but exists_each sees it.
            assert raw.remove(object_name("target", keys[0]), True) == 0
            assert st.exists_each(keys) == [False, True, True] and len(calls) == 1
            # A damaged value: the read misses, the store removes the object and says so.
            name = object_name("target", keys[1])
            bad = bytearray(raw.get(name))
            bad[HEADER_BYTES + 5] ^= 0x10
            raw.remove(name, True)
            assert raw.put(name, bytes(bad)) == 0
            assert st.batch_get(keys[1:], [4, 5]) == [False, True]
            assert calls[-1] == ("removed", "target", [keys[1]])
            assert st.exists_each(keys) == [False, False, True]
        finally:
            st.remove_listener(fn)


def test_exists_each_of_a_probes_size_costs_one_rpc(master):
    """What a probe of 64 pages costs here (one ``batch_is_exist``), printed for the report."""
    src = HostKVPool(GEOM, 64, "page_first")
    fill_random(src, 32)
    keys = keys_for(64, seed=132)
    with mc_store(master, {"target": src}) as st:
        st.batch_set(keys[:32], list(range(32)))
        st.exists_each(keys)  # warm
        t = []
        for _ in range(20):
            t0 = time.perf_counter()
            got = st.exists_each(keys)
            t.append(time.perf_counter() - t0)
        assert got == [True] * 32 + [False] * 32
        t.sort()
        print(f"exists_each(64 keys): median {t[10] * 1e3:.2f} ms, min {t[0] * 1e3:.2f} ms")


def test_exists_each_is_none_while_the_master_is_down(own_master):
    src = HostKVPool(GEOM, 4, "page_first")
    fill_random(src, 33)
    keys = keys_for(2, seed=133)
    with mc_store(own_master, {"target": src}, fresh=True) as st:
        assert st.batch_set(keys, [0, 1]) == [True, True]
        own_master.kill_master()
        assert st.exists_each(keys) is None  # an unknown, not an absence: a probe reports nothing
        assert st.exists_each(keys) is None  # inside the retry interval too
