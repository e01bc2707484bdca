"""Storage misconfiguration at construction: strict (default) raises naming the setting;
``strict=False`` degrades with one warning (no L3, or a read-only store that serves its pages).
Faults after construction stay counted misses (test_faults.py)."""

from __future__ import annotations

import logging
import socket

import numpy as np
import pytest

from storage_helpers import GEOM, HAVE_ORBAX, HostKVPool, keys_for, make_store
from test_faults import _run_readonly

from hicache_jax.storage import StorageConfig, StorageSetupError, create_storage
from hicache_jax.storage.disabled import DisabledStorage

DISK = ["file"] + (["orbax"] if HAVE_ORBAX else [])


def _pools():
    return {"target": HostKVPool(GEOM, 8, "page_first")}


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("hicache_jax.storage")
    ]


def test_strict_must_be_a_bool():
    with pytest.raises(TypeError, match="strict: expected a bool"):
        StorageConfig(backend="memory", strict=1)


@pytest.mark.parametrize("backend", DISK)
def test_path_that_is_a_file_raises_naming_path(tmp_path, backend):
    f = tmp_path / "store"
    f.write_bytes(b"not a directory")
    with pytest.raises(StorageSetupError, match=r"^path: .*store' is a file") as ei:
        make_store(backend, f, _pools())
    assert isinstance(ei.value, ValueError)
    assert f.read_bytes() == b"not a directory"  # nothing changed


@pytest.mark.parametrize("backend", DISK)
def test_path_under_a_file_raises_naming_path(tmp_path, backend):
    f = tmp_path / "plain"
    f.write_bytes(b"x")
    with pytest.raises(StorageSetupError, match=r"^path: .* is under .*plain', which is a file"):
        make_store(backend, f / "a" / "b", _pools())


@pytest.mark.parametrize("backend", DISK)
def test_missing_directory_is_created(tmp_path, backend):
    st = make_store(backend, tmp_path / "new" / "store", _pools())
    try:
        assert not isinstance(st, DisabledStorage)
        assert (tmp_path / "new" / "store").is_dir()
        assert not [p for p in (tmp_path / "new" / "store").rglob(".hicache-write-probe-*")]  # probe removed
    finally:
        st.close()


@pytest.mark.parametrize("backend", DISK)
def test_not_strict_path_that_is_a_file_runs_without_l3_with_one_warning(tmp_path, backend, caplog):
    f = tmp_path / "store"
    f.write_bytes(b"x")
    caplog.set_level(logging.WARNING, logger="hicache_jax.storage")
    pools = _pools()
    st = make_store(backend, f, pools, strict=False)
    assert isinstance(st, DisabledStorage) and "is a file" in st.reason
    keys = keys_for(4)
    pools["target"].array[...] = 7
    assert st.batch_set(keys, np.arange(4)) == [False] * 4
    assert st.flush(5) is True
    assert st.batch_exists(keys) == 0
    pools["target"].array[...] = 3
    assert st.batch_get(keys, np.arange(4)) == [False] * 4
    assert (pools["target"].array == 3).all()  # host pages untouched
    assert st.metrics.snapshot()["pages_dropped"] == 4
    st.close()
    msgs = _warnings(caplog)
    assert len(msgs) == 1 and "path:" in msgs[0] and "without L3" in msgs[0], msgs


def test_memory_backend_ignores_strict():
    st = make_store("memory", None, _pools(), strict=False)
    assert not isinstance(st, DisabledStorage)
    st.close()


@pytest.mark.parametrize("existing", [False, True], ids=["empty", "store_dirs_exist"])
@pytest.mark.parametrize("backend", DISK)
def test_unwritable_directory_raises_naming_path(tmp_path, backend, existing):
    """Root writes anywhere, so the child drops its capabilities (as the read-only tests do).
    ``store_dirs_exist``: the backend's directories are there, so only writing into them can tell."""
    (tmp_path / "ro").mkdir()
    if existing:
        for sub in ("pages-v1", "segments-v1"):
            (tmp_path / "ro" / sub).mkdir()
    res = _run_readonly(backend, str(tmp_path / "ro"), mode="open")
    assert res["error"] == "StorageSetupError" and res["is_value_error"], res
    assert res["message"].startswith("path: ") and "is not writable" in res["message"], res


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _down_mooncake(**kw) -> StorageConfig:
    pytest.importorskip("mooncake.store", reason="the 'mooncake' extra is not installed")
    return StorageConfig(
        backend="mooncake",
        mooncake_master=f"127.0.0.1:{_free_port()}",
        mooncake_metadata=f"http://127.0.0.1:{_free_port()}/metadata",
        mooncake_connect_timeout_s=1.0,
        **kw,
    )


def test_mooncake_master_down_raises_naming_the_setting():
    with pytest.raises(ConnectionError, match="^mooncake_master: no Mooncake master reachable"):
        create_storage(_down_mooncake(), _pools())


def test_mooncake_master_down_not_strict_runs_without_l3(caplog):
    caplog.set_level(logging.WARNING, logger="hicache_jax.storage")
    st = create_storage(_down_mooncake(strict=False), _pools())
    assert isinstance(st, DisabledStorage) and "mooncake_master" in st.reason
    assert st.batch_exists(keys_for(2)) == 0
    st.close()
    assert len(_warnings(caplog)) == 1


def test_cache_with_a_misconfigured_store_serves_without_l3_when_not_strict(tmp_path, caplog):
    """End to end: the controller builds its store with ``create_storage``; strict raises at
    construction naming ``path``, ``strict=False`` serves every request from L1/L2 with no L3."""
    import sys
    from pathlib import Path

    cache_tests = str(Path(__file__).resolve().parents[1] / "cache")
    if cache_tests not in sys.path:
        sys.path.insert(0, cache_tests)
    from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert

    from hicache_jax.cache import RadixKey
    from hicache_jax.l3 import StorageController

    f = tmp_path / "store"
    f.write_bytes(b"x")
    cache, be = make_cache(numpy_backend_factory, page_size=2, device_pages=32, host_pages=64)
    with pytest.raises(StorageSetupError, match="^path: "):
        StorageController(cache, StorageConfig(backend="file", path=str(f)), model="m")
    caplog.set_level(logging.WARNING, logger="hicache_jax.storage")
    ctl = StorageController(
        cache, StorageConfig(backend="file", path=str(f), strict=False, prefetch_threshold_tokens=4), model="m"
    )
    assert isinstance(ctl.storage, DisabledStorage)
    key = RadixKey(np.arange(0, 16, dtype=np.int64))
    prefill_insert(cache, KVOracle(be), key)
    cache.flush()
    assert ctl.flush(10)
    assert ctl.storage.metrics.pages_dropped > 0  # the backups reached the store and were dropped
    assert ctl.finish_prefetch(ctl.prefetch(RadixKey(np.arange(0, 24, dtype=np.int64)))) == 0
    cache.sanity_check()
    ctl.close()
    assert len(_warnings(caplog)) == 1
    assert f.read_bytes() == b"x"
