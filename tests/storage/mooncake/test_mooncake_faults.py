"""Faults with a real master: killed mid-write / mid-read, hung, restarted; Mooncake's own eviction.

Every store call must come back within the op timeout (plus scheduling slack) with misses /
failed sets and counters, never an exception, and no page reported loaded may hold bytes
other than the ones stored under its key.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from hicache_jax import HostKVPool, KVGeometry
from hicache_jax.storage import PoolTransfer

from mooncake_helpers import OP_TIMEOUT_S, mc_store
from storage_helpers import GEOM, assert_pages_equal, fill_random, keys_for, namespace

# A call may take the op timeout, plus the time to notice; nothing may take much longer.
BOUND_S = OP_TIMEOUT_S + 1.5


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def _loop_until(stop: threading.Event, step, errors: list, durations: list) -> None:
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            step()
            durations.append(time.monotonic() - t0)
    except BaseException as e:  # any escape is a failure
        errors.append(e)


def test_master_killed_during_write_through(own_master):
    src = HostKVPool(GEOM, 64, "page_first")
    fill_random(src, 1)
    keys = keys_for(400, seed=1)
    results: list[list[bool]] = []
    stop, errors, durations = threading.Event(), [], []
    state = {"i": 0}
    with mc_store(own_master, {"target": src}, fresh=True, mooncake_op_timeout_s=OP_TIMEOUT_S) as st:

        def step():
            i = state["i"] % 100
            state["i"] += 1
            results.append(st.batch_set(keys[4 * i : 4 * i + 4], [i % 16 * 4 + j for j in range(4)]))
            time.sleep(0.005)

        t = threading.Thread(target=_loop_until, args=(stop, step, errors, durations))
        t.start()
        while len(results) < 10:
            time.sleep(0.01)
        n_at_kill = len(results)  # calls finished before the kill: index n_at_kill may straddle it
        own_master.kill_master()
        time.sleep(2 * OP_TIMEOUT_S + 0.5)
        stop.set()
        t.join(BOUND_S + 5)
        assert not t.is_alive(), "a write hung"
        assert not errors, errors
        assert max(durations) < BOUND_S, max(durations)
        assert all(all(r) for r in results[:n_at_kill])  # stored while the master lived
        assert not any(any(r) for r in results[n_at_kill + 3 :])  # then failed sets, not errors
        m = st.metrics.snapshot()
        assert m["pages_dropped"] > 0 and m["read_errors"] + m["write_errors"] > 0
        assert m["pages_written"] >= 4 * n_at_kill
        own_master.restart_master()  # a client closes in ~1.5 s with a master, ~9 s without


def test_master_killed_during_prefetch(own_master):
    pools = {"target": HostKVPool(GEOM, 64, "page_first"), "draft": HostKVPool(GEOM, 64, "layer_first")}
    for i, p in enumerate(pools.values()):
        fill_random(p, 10 + i)
    n = 16
    keys = {p: keys_for(n, seed=3 + i) for i, p in enumerate(pools)}
    ids = list(range(n))
    dst = {p: HostKVPool(GEOM, 64, pools[p].layout) for p in pools}
    hits, stop, errors, durations = [], threading.Event(), [], []
    with mc_store(own_master, pools, fresh=True, mooncake_op_timeout_s=OP_TIMEOUT_S) as st:
        assert all(all(v) for v in st.set_multi([PoolTransfer(p, keys[p], ids) for p in pools]).values())
        for p in pools:
            st.codecs[p].pool = dst[p]
        out_ids = list(range(32, 32 + n))

        def step():
            for p in pools:
                dst[p].array[...] = 0
            h = st.get_multi([PoolTransfer(p, keys[p], out_ids) for p in pools]).hit_pages
            for p in pools:  # whatever is reported loaded is exactly what was stored
                assert_pages_equal(pools[p], ids[:h], dst[p], out_ids[:h])
            hits.append(h)

        t = threading.Thread(target=_loop_until, args=(stop, step, errors, durations))
        t.start()
        while len(hits) < 5:
            time.sleep(0.01)
        n_at_kill = len(hits)
        own_master.kill_master()
        time.sleep(2 * OP_TIMEOUT_S + 0.5)
        stop.set()
        t.join(BOUND_S + 5)
        assert not t.is_alive(), "a read hung"
        assert not errors, errors
        assert max(durations) < BOUND_S, max(durations)
        assert set(hits[:n_at_kill]) == {n}
        assert set(hits[n_at_kill + 3 :]) == {0}
        m = st.metrics.snapshot()
        assert m["hits"] >= n * n_at_kill and m["read_errors"] > 0 and m["corrupt"] == 0  # misses: the index says 0
        own_master.restart_master()


def test_master_hung_calls_are_bounded_then_recover(own_master):
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 2)
    keys = keys_for(4, seed=6)
    with mc_store(own_master, {"target": src}, fresh=True, mooncake_op_timeout_s=OP_TIMEOUT_S) as st:
        assert st.batch_set(keys[:2], [0, 1]) == [True, True]
        dst = HostKVPool(GEOM, 8, "page_first")
        st.codecs["target"].pool = dst
        pid = own_master.master_pid
        import os

        os.kill(pid, signal.SIGSTOP)
        try:
            for call in (
                lambda: st.batch_exists(keys),
                lambda: st.batch_get(keys[:2], [4, 5]),
                lambda: st.batch_set(keys[2:], [2, 3]),
            ):
                out, dt = _timed(call)
                assert dt < BOUND_S, dt
                assert not out or out == 0 or not any(out)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert st.metrics.read_errors > 0
        deadline = time.monotonic() + 15
        while st.batch_get(keys[:2], [4, 5]) != [True, True]:  # serves again once the master does
            assert time.monotonic() < deadline, "no recovery after SIGCONT"
            time.sleep(0.2)
        st.codecs["target"].pool = src
        assert_pages_equal(src, [0, 1], dst, [4, 5])


def test_master_restarted_misses_cleanly_then_reconnects(own_master):
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 3)
    keys = keys_for(6, seed=7)
    with mc_store(own_master, {"target": src}, fresh=True, mooncake_op_timeout_s=OP_TIMEOUT_S) as st:
        assert st.batch_set(keys[:3], [0, 1, 2]) == [True] * 3
        own_master.restart_master()  # same ports, empty store
        dst = HostKVPool(GEOM, 8, "page_first")
        deadline = time.monotonic() + 20
        while True:
            st.codecs["target"].pool = dst
            flags, dt = _timed(st.batch_get, keys[:3], [3, 4, 5])
            assert dt < BOUND_S and flags == [False] * 3  # the new master knows no pages
            st.codecs["target"].pool = src
            if st.batch_set(keys[3:], [3, 4, 5]) == [True] * 3:
                break  # reconnected: the client re-mounted its segment with the new master
            assert time.monotonic() < deadline, "never reconnected to the restarted master"
            time.sleep(0.2)
        st.codecs["target"].pool = dst
        assert st.batch_exists(keys[3:]) == 3
        assert st.batch_get(keys[3:], [5, 6, 7]) == [True] * 3
        assert_pages_equal(src, [3, 4, 5], dst, [5, 6, 7])
        assert not dst.read_pages("k", [3, 4]).any()


BIG = KVGeometry.mha(4, 16, 8, 128, "bfloat16")  # 256 KiB pages


# The lease must outlast one page's transfer on a loaded machine: Mooncake fails a read whose
# lease ran out mid-transfer ("lease_expired_before_data_transfer_completed"), which CI hit
# with a 50 ms lease and one 96-page batch read. Writes sleep past the lease so the master may
# evict what was written before.
@pytest.mark.parametrize(
    "own_master", [{"lease_ttl_ms": 300, "eviction_high_watermark": 0.5, "store_node_bytes": 16 << 20}], indirect=True
)
def test_pages_evicted_by_mooncake_are_misses(own_master):
    n = 96  # 24 MiB of pages into the store node's 16 MiB segment
    src = HostKVPool(BIG, n, "page_first")
    fill_random(src, 4)
    keys = keys_for(n, seed=8, ns=namespace(BIG), page_size=BIG.page_size)
    with mc_store(own_master, {"target": src}, fresh=True, mooncake_op_timeout_s=OP_TIMEOUT_S) as st:
        stored = []
        for i in range(0, n, 8):
            stored += st.batch_set(keys[i : i + 8], list(range(i, i + 8)))
            time.sleep(0.35)  # leases run out; the master evicts
        assert sum(stored) >= 48
        dst = HostKVPool(BIG, n, "page_first")
        st.codecs["target"].pool = dst
        present = [st.batch_exists([k]) == 1 for k in keys]
        assert not all(present), "nothing was evicted"
        assert any(present)
        # One page per read keeps each transfer well inside its lease; a read that still
        # loses its lease is a miss, so look at the pages that were present and retry once.
        flags = [st.batch_get([k], [i])[0] for i, k in enumerate(keys)]
        for i in [i for i, (p, f) in enumerate(zip(present, flags)) if p and not f]:
            flags[i] = st.batch_get([keys[i]], [i])[0]
        got = [i for i, f in enumerate(flags) if f]
        assert got and len(got) < n
        assert_pages_equal(src, got, dst, got)  # every page served is the stored one
        missed = [i for i, f in enumerate(flags) if not f]
        assert not dst.read_pages("k", missed).any()
        assert st.metrics.corrupt == 0


class _HeldClient:
    """The real Mooncake client, whose puts can be held inside the call (as a put to a dead
    master outliving the op timeout on a loaded machine), recording whether ``close`` ran
    while one was inside."""

    hold = threading.Event()
    inside = threading.Event()
    closed_under_a_call: list = []

    real_class = None  # the client class, taken before the test replaces it with this one

    def __init__(self) -> None:
        self.real = _HeldClient.real_class()
        self.closed = False
        self.in_put = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def batch_put_from_multi_buffers(self, *args):
        self.in_put += 1
        _HeldClient.inside.set()
        try:
            _HeldClient.hold.wait(30)
            return self.real.batch_put_from_multi_buffers(*args)
        finally:
            self.in_put -= 1

    def close(self):
        _HeldClient.closed_under_a_call.append(self.in_put > 0)
        self.closed = True
        return self.real.close()


@pytest.mark.parametrize("released", [True, False], ids=["call-ends", "call-stuck"])
def test_close_never_closes_the_client_under_a_running_call(own_master, monkeypatch, released):
    """A put still inside the native client after its op timeout: closing the client under it
    crashed the process (a segfault in a full run after the master was killed mid-put). close()
    waits for the call (bounded by the op timeout + 1 s); a call stuck past that leaves the
    client open rather than crash."""
    import mooncake.store

    from mooncake_helpers import mc_config
    from hicache_jax.storage import create_storage

    _HeldClient.real_class = mooncake.store.MooncakeDistributedStore
    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", _HeldClient)
    _HeldClient.hold.clear()
    _HeldClient.inside.clear()
    _HeldClient.closed_under_a_call.clear()
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 5)
    st = create_storage(mc_config(own_master, mooncake_op_timeout_s=OP_TIMEOUT_S), {"target": src})
    flags, dt = _timed(st.batch_set, keys_for(2, seed=5), [0, 1])
    assert flags == [False, False] and dt < BOUND_S  # our side gave up at the op timeout
    assert _HeldClient.inside.is_set()
    if released:
        threading.Timer(0.5, _HeldClient.hold.set).start()
    _, dt = _timed(st.close)
    assert dt < OP_TIMEOUT_S + 1.0 + 1.5
    assert _HeldClient.closed_under_a_call == ([False] if released else [])
    _HeldClient.hold.set()  # let a stuck call end (the client stays open; the process exits later)
