"""Shared helpers for the storage tests (imported by the tests and by storage_child.py).

Page contents are a pure function of the page key (``page_bytes_for``), so any process can
write or verify a page knowing only its key: restart, two-writer and SIGKILL tests rely on it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

import numpy as np

from hicache_jax import HostKVPool, KVGeometry
from hicache_jax.storage import Namespace, PoolSpec, StorageConfig, create_storage, page_keys

HAVE_ORBAX = (
    all(importlib.util.find_spec(m) is not None for m in ("orbax.checkpoint", "tensorstore", "google_crc32c"))
    if importlib.util.find_spec("orbax") is not None
    else False
)
BACKENDS = ["memory", "file"] + (["orbax"] if HAVE_ORBAX else [])
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# 2 layers x 4 tokens x 2 heads x 32 dims x 2 bytes x (K, V) = 2 KiB per page: above OCDBT's
# 1 KiB inline threshold, so page bytes land in data files where fault tests can reach them.
GEOM = KVGeometry.mha(2, 4, 2, 32, "bfloat16")


def fill_random(pool: HostKVPool, seed: int) -> None:
    """Random non-zero raw bits in every page of ``pool``."""
    rng = np.random.default_rng(seed)
    hi = np.iinfo(pool.geom.container_dtype).max
    pool.array[...] = rng.integers(1, hi, pool.array.shape, dtype=pool.geom.container_dtype, endpoint=True)


def snapshot(pool: HostKVPool, ids) -> dict:
    return {c: pool.read_pages(c, np.asarray(ids)) for c in pool.geom.components}


def assert_pages_equal(a: HostKVPool, a_ids, b: HostKVPool, b_ids) -> None:
    for c in a.geom.components:
        np.testing.assert_array_equal(a.read_pages(c, np.asarray(a_ids)), b.read_pages(c, np.asarray(b_ids)))


def namespace(geom=GEOM, layout="page_first", **kw) -> Namespace:
    kw.setdefault("model", "tiny-test-model")
    kw.setdefault("weights_revision", "r1")
    return Namespace.from_geometry(geom, layout, **kw)


def keys_for(n_pages: int, seed: int = 0, ns: Namespace | None = None, page_size: int = GEOM.page_size) -> list[bytes]:
    ns = ns or namespace()
    tokens = np.random.default_rng(seed).integers(0, 150_000, n_pages * page_size)
    return page_keys(ns, tokens)


def page_bytes_for(key: bytes, nbytes: int) -> np.ndarray:
    """Deterministic, key-derived, never-all-zero page bytes."""
    seed = int.from_bytes(hashlib.sha256(b"page-content" + key).digest()[:8], "little")
    out = np.random.default_rng(seed).integers(1, 256, nbytes, dtype=np.uint8)
    return out


def put_keyed_pages(store, pool_name: str, keys, ids) -> None:
    """Write key-derived bytes into host pages ``ids`` of ``pool_name`` (via the codec)."""
    codec = store.codecs[pool_name]
    pages = np.stack([page_bytes_for(k, codec.page_bytes) for k in keys])
    codec.unpack(np.asarray(ids), pages)


def check_keyed_pages(store, pool_name: str, keys, ids) -> None:
    codec = store.codecs[pool_name]
    got = codec.pack(np.asarray(ids))
    for k, row in zip(keys, got):
        np.testing.assert_array_equal(row, page_bytes_for(k, codec.page_bytes))


def make_store(backend: str, path, pools: dict, specs=None, **cfg):
    cfg.setdefault("segment_pages", 8)
    cfg.setdefault("flush_interval_s", 0.2)
    path = None if backend == "memory" else str(path)
    return create_storage(StorageConfig(backend=backend, path=path, **cfg), pools, specs)


def segment_dirs(path) -> list[str]:
    """Committed orbax segment directories under store ``path``: by writer directory, then by
    step number (``w####/{generation}_{step}``, or a bare step in old logs)."""
    import glob
    import re

    out = []
    for d in glob.glob(os.path.join(str(path), "segments-v1", "w*", "*")):
        m = re.fullmatch(r"(?:g[0-9a-f]{16}_)?([0-9]+)", os.path.basename(d))
        if m:
            out.append((os.path.basename(os.path.dirname(d)), int(m.group(1)), d))
    return [d for *_, d in sorted(out)]


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = (
        REPO + os.pathsep + os.path.dirname(os.path.abspath(__file__)) + os.pathsep + env.get("PYTHONPATH", "")
    )
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def child_cmd(*args: str) -> list[str]:
    return [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "storage_child.py"), *args]


__all__ = ["PoolSpec", "HostKVPool", "KVGeometry"]
