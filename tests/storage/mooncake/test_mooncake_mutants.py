"""While the master stays down, calls miss fast without touching the store (issue 28 point 2:
the health check after a fault was not pinned by any test).

After a fault the store misses for ``mooncake_retry_interval_s`` without calling the client;
then the client's health check and a connection to the master's port decide whether a call may go
through. With the master killed the port refuses, so a new interval starts and the call still
misses at once. Without the check every interval ends with a real call to a dead master (the
whole op timeout each, and a new fault). The client's own ``health_check`` alone is not enough:
it reports 0 (healthy) with the master killed (seen with mooncake-transfer-engine-non-cuda;
this test failed so before the port probe was added). Counted at the client: data calls after
the first fault, beside the health checks.
"""

from __future__ import annotations

import signal
import time

from hicache_jax import HostKVPool

from mooncake_helpers import OP_TIMEOUT_S, mc_store
from storage_helpers import GEOM, fill_random, keys_for


class _CountingClient:
    """The real client, counting every call but the health check (the data calls)."""

    def __init__(self, real) -> None:
        self.real = real
        self.data_calls = 0
        self.health_checks = 0

    def __getattr__(self, name):
        fn = getattr(self.real, name)
        if not callable(fn) or name == "close":
            return fn

        def counted(*a, **kw):
            if name == "health_check":
                self.health_checks += 1
            else:
                self.data_calls += 1
            return fn(*a, **kw)

        return counted


def test_calls_miss_fast_while_the_master_stays_down(own_master):
    src = HostKVPool(GEOM, 8, "page_first")
    fill_random(src, 11)
    keys = keys_for(4, seed=12)
    retry = 0.3
    with mc_store(
        own_master, {"target": src}, fresh=True, mooncake_op_timeout_s=OP_TIMEOUT_S, mooncake_retry_interval_s=retry
    ) as st:
        assert st.batch_set(keys[:2], [0, 1]) == [True, True]
        counting = st._store = _CountingClient(st._store)
        own_master.kill_master(signal.SIGKILL)
        # The first call after the kill notices (a fault: the retry interval starts).
        deadline = time.monotonic() + 20
        while not st._down_until:
            st.batch_exists(keys[:2])
            assert time.monotonic() < deadline, "the dead master was never noticed"
        assert counting.data_calls >= 1
        before = counting.data_calls
        # Several retry intervals: every call misses, quickly, and none reaches the client's
        # data path (the port probe keeps failing).
        t_end = time.monotonic() + 8 * retry
        slowest, calls = 0.0, 0
        while time.monotonic() < t_end:
            t0 = time.monotonic()
            assert st.batch_exists(keys) == 0
            slowest = max(slowest, time.monotonic() - t0)
            calls += 1
            time.sleep(retry / 4)
        assert slowest < OP_TIMEOUT_S / 2, slowest
        assert calls >= 16
        assert counting.health_checks >= 4  # each interval's end asked the client
        assert counting.data_calls == before, (counting.data_calls, before)
