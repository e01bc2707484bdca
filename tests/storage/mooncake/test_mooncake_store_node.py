"""The store node (a long-lived memory-lending client the helper starts) and the helper's
process lifecycle: pages outlive the client that wrote them only with a node; a dead node
is a miss, never wrong KV; every process the helper starts dies with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hicache_jax import HostKVPool

from mooncake_helpers import OP_TIMEOUT_S, mc_store, start_master
from storage_helpers import GEOM, assert_pages_equal, fill_random, keys_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_dead(pids, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("own_master", [{}, {"store_node_bytes": 0}], indirect=True, ids=["store_node", "no_node"])
def test_pages_outlive_the_client_that_wrote_them_only_with_a_store_node(own_master):
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 21)
    keys = keys_for(4, seed=21)
    with mc_store(own_master, {"target": src}, fresh=True, mooncake_op_timeout_s=OP_TIMEOUT_S) as writer:
        assert writer.batch_set(keys, [7, 5, 3, 1]) == [True] * 4
        assert writer.batch_exists(keys) == 4
    # the writer's client is closed: an engine that exited
    dst = HostKVPool(GEOM, 8, "page_first")
    with mc_store(own_master, {"target": dst}, fresh=True, mooncake_op_timeout_s=OP_TIMEOUT_S) as reader:
        if own_master.store_node_bytes:
            assert reader.batch_exists(keys) == 4
            assert reader.batch_get(keys, [0, 1, 2, 3]) == [True] * 4
            assert_pages_equal(src, [7, 5, 3, 1], dst, [0, 1, 2, 3])
            assert reader.metrics.hits == 4 and reader.metrics.verified == 4
        else:  # the pages lived in the writer's own segment, gone with it
            assert reader.batch_exists(keys) == 0
            assert reader.batch_get(keys, [0, 1, 2, 3]) == [False] * 4
            assert not dst.array.any()


@pytest.mark.parametrize("own_master", [{"client_ttl_s": 2}], indirect=True)
def test_store_node_killed_reads_miss_cleanly_then_writes_resume(own_master):
    """Until the master notices (``client_ttl_s``), the dead node's objects are still listed:
    reads of them fail (transfer errors: misses, never corruption, nothing removed) and new
    puts placed in its segment fail. Then the index forgets them; a new node takes writes."""
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 22)
    keys = keys_for(4, seed=22)
    with mc_store(own_master, {"target": src}, fresh=True, mooncake_op_timeout_s=OP_TIMEOUT_S) as st:
        assert st.batch_set(keys, [0, 1, 2, 3]) == [True] * 4
        dst = HostKVPool(GEOM, 8, "page_first")
        st.codecs["target"].pool = dst
        own_master.kill_store_node()
        t0 = time.monotonic()
        flags = st.batch_get(keys, [4, 5, 6, 7])
        assert time.monotonic() - t0 < OP_TIMEOUT_S + 1.5
        assert flags == [False] * 4 and not dst.array.any()
        m = st.metrics.snapshot()
        assert m["read_errors"] >= 1 and m["corrupt"] == 0 and m["quarantined"] == 0 and m["hits"] == 0
        st.codecs["target"].pool = src
        assert st.batch_set(keys_for(2, seed=23), [0, 1]) == [False, False]  # the only segment is dead
        deadline = time.monotonic() + 15
        while st.batch_exists(keys) != 0:  # the master drops the dead node's segment and objects
            assert time.monotonic() < deadline, "the master never dropped the dead store node"
            time.sleep(0.2)
        assert st.batch_set(keys_for(2, seed=24), [0, 1]) == [False, False]  # no segment at all now
        own_master.start_store_node()
        deadline = time.monotonic() + 15
        while st.batch_set(keys, [0, 1, 2, 3]) != [True] * 4:
            assert time.monotonic() < deadline, "no writes after the store node came back"
            time.sleep(0.1)
        st.codecs["target"].pool = dst
        assert st.batch_get(keys, [4, 5, 6, 7]) == [True] * 4
        assert_pages_equal(src, [0, 1, 2, 3], dst, [4, 5, 6, 7])
        assert st.metrics.corrupt == 0


_CHILD = """
import sys, time
from hicache_jax.storage.mooncake import MooncakeMaster
m = MooncakeMaster(store_node_bytes=16 << 20, log_dir=sys.argv[1]).start()
print(m.master_pid, m.metadata_pid, m.store_node_pid, flush=True)
time.sleep(120)
"""


def test_every_process_dies_with_its_parent(tmp_path):
    start_master(store_node_bytes=0).stop()  # skips (with the reason) where no master can run
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        pids = [int(x) for x in child.stdout.readline().split()]
        assert len(pids) == 3 and all(_alive(p) for p in pids), pids
        child.send_signal(signal.SIGKILL)  # no atexit, no stop(): only the kernel and the polls
        child.wait(10)
        assert _wait_dead(pids, 5.0) == [], "outlived their parent"
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def test_stop_stops_every_process():
    m = start_master(store_node_bytes=16 << 20)
    pids = [m.master_pid, m.metadata_pid, m.store_node_pid]
    assert all(p is not None and _alive(p) for p in pids), pids
    m.stop()
    assert _wait_dead(pids, 5.0) == []
    assert (m.master_pid, m.metadata_pid, m.store_node_pid) == (None, None, None)


def test_bad_store_node_size_is_a_clear_error():
    from hicache_jax.storage.mooncake import MooncakeMaster

    for bad, exc in [(-1, ValueError), (1000, ValueError), (1.5, ValueError), (True, ValueError)]:
        with pytest.raises(exc, match="store_node_bytes"):
            MooncakeMaster(store_node_bytes=bad)
