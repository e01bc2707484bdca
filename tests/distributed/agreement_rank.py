"""One rank of the agreement tests (``test_two_processes``): both implementations give the MIN
over ranks of fixed-shape int64 vectors (64-bit values included), the key-value store is
cleaned as it goes, instances on two worker threads run at once, and ranks sending different
shapes raise instead of misreading; the orbax L3 backend refuses a multi-process run (it would
write host arrays from process 0 only). Prints "ok"."""

from __future__ import annotations

import tempfile
import threading

import numpy as np

from hicache_jax.cache import AgreementError
from hicache_jax.distributed import DeviceAgreement, KVStoreAgreement, initialize_from_env, run_rank

BIG = (1 << 62) - 3  # a layout fingerprint's range: needs all 64 bits


def expect(rank: int, i: int) -> tuple[np.ndarray, np.ndarray]:
    mine = np.array([rank + i, -rank, i * (rank + 1), BIG - rank, -BIG + rank], np.int64)
    return mine, np.array([i, -1, i, BIG - 1, -BIG], np.int64)


def main() -> None:
    rank, n = initialize_from_env()
    assert n == 2
    kv, dev = KVStoreAgreement("t-kv", timeout_s=60), DeviceAgreement("t-dev")
    for i in range(150):
        for a in (kv, dev):
            mine, want = expect(rank, i)
            got = a.agree_min(mine)
            assert got.dtype == np.int64 and np.array_equal(got, want), (a, i, got, want)
    client = kv.client
    assert client.key_value_dir_get_bytes("t-kv/0/") == [] and client.key_value_dir_get_bytes("t-kv/1/") == []
    assert len(client.key_value_dir_get_bytes("t-kv/2/")) == 2 * (150 - 128)  # the current block only

    errors = []

    def worker(name: str, offset: int) -> None:
        try:
            a = KVStoreAgreement(name, timeout_s=60)
            for i in range(40):
                mine, want = expect(rank, i + offset)
                assert np.array_equal(a.agree_min(mine), want)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(f"t-thread{k}", 1000 * k)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors

    bad = KVStoreAgreement("t-shape", timeout_s=30)
    try:
        bad.agree_min(np.zeros(3 + rank, np.int64))
    except AgreementError as e:
        assert "shapes" in str(e)
    else:
        raise AssertionError("different shapes were not refused")
    from hicache_jax.host_pool import HostKVPool
    from hicache_jax.kv_geometry import KVGeometry
    from hicache_jax.storage import StorageConfig, create_storage

    pool = HostKVPool(KVGeometry.mha(1, 2, 1, 4, "float32"), 4)
    with tempfile.TemporaryDirectory() as d:
        try:
            create_storage(StorageConfig(backend="orbax", path=d), {"target": pool})
        except ValueError as e:
            assert "several jax.distributed processes" in str(e), e
        else:
            raise AssertionError("the orbax backend accepted a multi-process run")
    print("ok", rank)


if __name__ == "__main__":
    run_rank(main)
