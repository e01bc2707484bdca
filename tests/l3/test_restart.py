"""Warm restart in a new process (the upstream reproduction): process 1 serves requests with
a file-backed L3 and exits; process 2, a fresh cache pointed at the same directory, re-sends
them and must get storage hits with bit-exact KV.

Run as a script, this file is the child: ``python test_restart.py write|read DIR``.
The writer saves the KV it computed (``expected.npz``); the reader compares its device pages
with that, so the check does not depend on anything process-specific (e.g. ``hash``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CACHE_TESTS = os.path.join(REPO, "tests", "cache")  # the cache harness
P = 4


def _keys():
    from hicache_jax.cache import RadixKey

    rng = np.random.default_rng(7)
    system = rng.integers(0, 32000, 40)
    return [RadixKey(np.concatenate([system, rng.integers(0, 32000, n)])) for n in (24, 13, 57)] + [
        RadixKey(rng.integers(0, 32000, 33), cache_salt="user-7")
    ]


def _setup(path):
    from cache_harness import make_cache, numpy_backend_factory
    from hicache_jax.l3 import StorageController
    from hicache_jax.storage import StorageConfig

    cache, be = make_cache(numpy_backend_factory, page_size=P, device_pages=64, host_pages=128)
    cfg = StorageConfig(backend="file", path=path, prefetch_policy="wait_complete", prefetch_threshold_tokens=8)
    return cache, be, StorageController(cache, cfg, model="tiny", weights_revision="r1")


def child(mode: str, path: str) -> dict:
    sys.path.insert(0, CACHE_TESTS)
    from cache_harness import KVOracle, prefill_insert

    cache, be, ctl = _setup(path)
    keys = _keys()
    out = {"pid": os.getpid()}
    if mode == "write":
        oracle = KVOracle(be)
        expected = {}
        for i, key in enumerate(keys):
            prefill_insert(cache, oracle, key)
            cache.flush()
            pages = cache.match_prefix(key).device_indices
            for c in be.geom.components:
                expected[f"{i}_{c}"] = be.device.read(c, pages)
        np.savez(os.path.join(path, "expected.npz"), **expected)
        ctl.close()  # flushes pending L3 writes
        out["backup_tokens"] = cache.metrics.storage_backup_tokens
    else:
        expected = np.load(os.path.join(path, "expected.npz"))
        served = []
        for i, key in enumerate(keys):
            op = ctl.prefetch(key)
            storage = ctl.finish_prefetch(op)
            device = cache.match_prefix(key).device_hit_length
            req, _ = cache.begin_request(key)
            cache.flush()
            for c in be.geom.components:
                if not np.array_equal(be.device.read(c, req.device_pages), expected[f"{i}_{c}"]):
                    raise SystemExit(f"request {i}: device KV differs from what the first process computed")
            cache.dec_lock_ref(req.last_node)
            served.append({"device": device, "storage": storage})
        cache.sanity_check(0)
        ctl.close()
        out["served"] = served
    return out


def _run_child(mode, path):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + HERE + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), mode, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_warm_restart_in_a_new_process_hits_storage(tmp_path):
    w = _run_child("write", tmp_path)
    assert w["backup_tokens"] == 40 + 24 + 12 + 56 + 32  # page-aligned, the shared prefix once
    r = _run_child("read", tmp_path)
    assert r["pid"] != w["pid"]
    # First request: all 64 tokens from storage. The next two share its 40-token system prompt,
    # which is on the device by then, and continue from storage; the salted one is all storage.
    assert [s["storage"] for s in r["served"]] == [64, 12, 56, 32]
    assert [s["device"] for s in r["served"]] == [0, 40, 40, 0]


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], sys.argv[2])))
