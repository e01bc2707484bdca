"""Page checksums: every entry point agrees with the reference CRCs through every CRC-32C engine
installed (``crc32c`` and ``google-crc32c``; google's ``value`` is the reference), the faster
engine is the one used, and the large-buffer CRC-32C runs without the GIL (so several worker
threads checksum in parallel)."""

import importlib
import importlib.util
import sys
import threading
import zlib

import numpy as np
import pytest

from hicache_jax.storage import integrity

gcrc = pytest.importorskip("google_crc32c")


def _ref(algo, key, data: bytes) -> int:
    if algo == integrity.ALGO_CRC32C:
        return int(gcrc.value(key + data))
    return zlib.crc32(key + data) & 0xFFFFFFFF


@pytest.fixture(params=sorted(integrity.ENGINES) or [None])
def engine(request, monkeypatch):
    """Each installed CRC-32C engine in turn, as the one every entry point goes through."""
    if request.param is not None:
        monkeypatch.setattr(integrity, "CRC32C_ENGINE", request.param)
        monkeypatch.setattr(integrity, "_extend", integrity.ENGINES[request.param])
    return request.param


def test_the_faster_engine_is_used_where_installed():
    assert "google-crc32c" in integrity.ENGINES  # gcrc imported above
    hw = importlib.util.find_spec("crc32c") is not None and importlib.import_module("crc32c").hardware_based
    want = "crc32c" if hw else "google-crc32c"  # crc32c's software mode is no faster than google's
    assert integrity.CRC32C_ENGINE == want and integrity.HAVE_CRC32C and integrity.NOGIL_CRC32C


@pytest.mark.parametrize("algo", [integrity.ALGO_CRC32C, integrity.ALGO_ZLIB_CRC32])
def test_every_entry_point_matches_the_reference(algo, engine):
    rng = np.random.default_rng(0)
    t = integrity.NOGIL_MIN_BYTES
    for n in (0, 1, 100, t - 1, t, t + 1, 3 * t + 17, 1 << 20):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        key = rng.integers(0, 256, 32, dtype=np.uint8).tobytes()
        want = _ref(algo, key, data.tobytes())
        assert integrity.checksum(data, algo, key) == want
        cuts = sorted({0, n // 3, n // 2, n})
        parts = [data[a:b] for a, b in zip(cuts, cuts[1:])]
        assert integrity.checksum_parts(parts, algo, key) == want
        assert integrity.checksum_at([(p.ctypes.data, p.nbytes) for p in parts if p.nbytes], algo, key) == want
        if algo == integrity.ALGO_CRC32C:
            assert integrity.crc32c(data, key) == want == integrity.crc32c(data, key, release_gil=False)
            assert integrity.crc32c_extend(int(gcrc.value(key)), data) == want
            assert integrity.crc32c_extend(int(gcrc.value(key)), data, release_gil=False) == want
            assert integrity.crc32c_value(key + data.tobytes()) == want
            assert integrity.crc32c(data.view(np.uint8)[::-1].copy()[::-1], key) == want  # non-contiguous input
    with pytest.raises(integrity.ChecksumUnavailable):
        integrity.checksum_at([], 99)


def test_large_crc32c_releases_the_gil(engine):
    """With a 10 s switch interval a thread holding the GIL keeps it; the main thread, woken
    while the worker is inside its CRC loop, can only run then if the CRC released it."""
    if engine == "google-crc32c" and integrity._nogil_extend is None:
        pytest.skip("google_crc32c's C library symbol is not reachable here (pure-Python build)")
    buf = np.random.default_rng(1).integers(0, 256, 32 << 20, dtype=np.uint8)
    started, state = threading.Event(), {"done": False}

    def worker():
        started.set()
        for _ in range(16):  # ~0.1 s or more of CRC in total
            integrity.crc32c(buf)
        state["done"] = True

    old = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        t = threading.Thread(target=worker)
        t.start()
        started.wait()
        ran_during = not state["done"]
        t.join()
    finally:
        sys.setswitchinterval(old)
    assert ran_during, "the main thread could not run while the CRC ran: it held the GIL"
