"""Helpers of the Mooncake backend tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib

import pytest

from hicache_jax.storage import PageCodec, StorageConfig, StorageMetrics, create_storage  # noqa: F401
from hicache_jax.storage.mooncake import MasterStartError, MooncakeMaster, unavailable_reason

# The bound on every store call (and the client's RPC timeout with it) in the fault tests, which
# pass it: a dead master must cost little time there.
OP_TIMEOUT_S = 1.5
# The default bound elsewhere: a data call on a loaded 2-core CI machine took over 1.5 s (a
# round trip then failed as a timeout, and the retry interval missed the next calls too).
DATA_OP_TIMEOUT_S = 10.0
# What a client lends when the master has no store node (store_node_bytes=0).
SEGMENT_BYTES = 32 << 20
# The store node's segment in these tests (the default deployment: engines lend nothing).
NODE_BYTES = 128 << 20


def start_master(**kw) -> MooncakeMaster:
    """A started master (and store node), or a skip with the reason none can run here."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no Mooncake master here: {reason}")
    kw.setdefault("store_node_bytes", NODE_BYTES)
    try:
        return MooncakeMaster(**kw).start()
    except MasterStartError as e:
        pytest.skip(f"the Mooncake master did not start: {e}")


def mc_config(master: MooncakeMaster, **kw) -> StorageConfig:
    """The test clients' settings: the helper's (``storage_config``: the client lends no
    memory when the master has a store node), with short timeouts (``OP_TIMEOUT_S`` where a fault test passes it)."""
    if not master.store_node_bytes:
        kw.setdefault("mooncake_global_segment_bytes", SEGMENT_BYTES)
    kw.setdefault("mooncake_op_timeout_s", DATA_OP_TIMEOUT_S)
    kw.setdefault("mooncake_connect_timeout_s", 10.0)
    kw.setdefault("mooncake_retry_interval_s", 0.5)
    return master.storage_config(**kw)


_stores: dict = {}


@contextlib.contextmanager
def mc_store(master: MooncakeMaster, pools: dict, specs=None, fresh: bool = False, **kw):
    """A ``mooncake`` store over ``pools``. A Mooncake client holds the GIL for 1-2 s while it
    closes (it joins threads that poll every second), so unless ``fresh`` one client per
    (master, pool names, specs, settings) is reused across tests: on reuse its codecs are
    rebuilt for the given pools and its metrics start from zero. ``close_stores`` (run by the
    master fixtures) closes them."""
    if fresh:
        st = create_storage(mc_config(master, **kw), pools, specs)
        try:
            yield st
        finally:
            st.close()
        return
    key = (id(master), tuple(sorted(pools)), repr(specs), tuple(sorted(kw.items())))
    st = _stores.get(key)
    if st is None:
        st = _stores[key] = create_storage(mc_config(master, **kw), pools, specs)
    else:
        for name, pool in pools.items():
            st.codecs[name] = PageCodec(pool)
        st.metrics = StorageMetrics()
    yield st


def close_stores(master: MooncakeMaster) -> None:
    for key in [k for k in _stores if k[0] == id(master)]:
        _stores.pop(key).close()
