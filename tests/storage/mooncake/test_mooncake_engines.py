"""Two reference engines in two processes sharing one Mooncake Store (master + store node).

Engine A (process 1) serves prompts cold, writes their KV through L1/L2 to Mooncake and
exits. Engine B (process 2: its own L1 and L2, empty) sends the same prompts and must be
served the prefixes from Mooncake: same tokens, every prefix page from storage, only the
uncached tokens computed (counted at the model, not from the cache's numbers) and the prefix
pages its model reads byte-identical to the ones A computed. The probes are those of
``tests/jax_backend/test_engine_served.py`` (``StepSpy``).

Run as a script, this file is the child: ``python test_mooncake_engines.py write|read DIR
MASTER METADATA``. Both start at once (importing JAX and building an engine is most of the
time); the writer leaves the pages it computed in ``DIR/expected.npz`` and exits, and only
then does the test let the reader (its engine built, waiting for ``DIR/written``) send the
prompts: the writer's client is gone by then, as after a restart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
ENGINE_TESTS = os.path.join(REPO, "tests", "jax_backend")


def child(mode: str, path: str, master: str, metadata: str) -> dict:
    sys.path.insert(0, ENGINE_TESTS)
    import numpy as np
    import test_engine_served as served

    from hicache_jax.engine import Engine, EngineCacheConfig
    from hicache_jax.reference_model import ModelConfig
    from hicache_jax.storage.config import StorageConfig

    storage = StorageConfig(
        backend="mooncake",
        mooncake_master=master,
        mooncake_metadata=metadata,
        mooncake_global_segment_bytes=0,  # the store node holds the pages
        mooncake_op_timeout_s=20.0,
        prefetch_policy="wait_complete",
        prefetch_threshold_tokens=8,
    )
    engine = Engine(
        ModelConfig(num_layers=2, hidden=32, ffn=64),
        EngineCacheConfig(
            page_size=served.PAGE, device_pages=64, max_batch=2, prefill_chunk=16, max_context=64, storage=storage
        ),
    )
    spy = served.StepSpy(engine)
    prompts = served._prompts(11)
    marker = os.path.join(path, "written")
    if mode == "read":
        deadline = time.monotonic() + 120
        while not os.path.exists(marker):
            if time.monotonic() > deadline:
                raise SystemExit("the writer never finished")
            time.sleep(0.05)
    res = served._run(engine, spy, prompts)
    l3 = engine.storage.storage
    out = {
        "pid": os.getpid(),
        "tokens": [r.tokens for r in res],
        "prefill": spy.last[0],
        "cached": [r.cached_tokens for r in res],
    }
    if mode == "write":
        engine.close()  # every L3 write done
        np.savez(
            os.path.join(path, "expected.npz"),
            **{f"{i}_{c}": pages[c] for i, pages in enumerate(spy.last[2]) for c in pages},
        )
    else:
        expected = np.load(os.path.join(path, "expected.npz"))
        want = [{c: expected[f"{i}_{c}"] for c in spy.last[2][i]} for i in range(len(prompts))]
        out["served_mismatches"] = served._check_served(spy.last[2], want)
        engine.close()
    out["l3"] = l3.metrics.snapshot()
    return out


def _start_child(mode: str, path, master) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), mode, str(path), master.rpc_address, master.metadata_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _result(p: subprocess.Popen) -> dict:
    try:
        out, err = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, out[-3000:] + err[-5000:]
    return json.loads(out.strip().splitlines()[-1])


def test_two_engines_in_two_processes_share_the_store(master, tmp_path):
    pytest.importorskip("jax")
    sys.path.insert(0, ENGINE_TESTS)
    import test_engine_served as served

    procs = {mode: _start_child(mode, tmp_path, master) for mode in ("write", "read")}
    try:
        a = _result(procs["write"])  # A has exited: its client (and any memory it lent) is gone
    except BaseException:
        procs["read"].kill()
        procs["read"].communicate()
        raise
    n = len(a["tokens"])
    assert a["prefill"] == [served.PROMPT] * n  # A computed everything
    assert all(sum(c.values()) == 0 for c in a["cached"])
    assert a["l3"]["pages_written"] >= n * served.PREFIX_PAGES and a["l3"]["write_errors"] == 0
    assert master.store_node_alive()
    open(os.path.join(tmp_path, "written"), "w").close()
    b = _result(procs["read"])

    assert b["pid"] != a["pid"]
    assert b["tokens"] == a["tokens"]
    assert all(c == {"device": 0, "host": 0, "storage": served.CACHED} for c in b["cached"]), b["cached"]
    assert b["prefill"] == [served.PROMPT - served.CACHED] * n  # only the uncached tail computed
    assert b["served_mismatches"] == []  # the prefix pages B's model read are A's, byte for byte
    assert b["l3"]["hits"] == n * served.PREFIX_PAGES and b["l3"]["corrupt"] == 0


if __name__ == "__main__":
    print(json.dumps(child(*sys.argv[1:5])))
