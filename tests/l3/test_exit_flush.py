"""L3 writes survive a normal exit without ``close()`` (``hicache_jax.l3.exit_flush``).

A real child process builds a cache and a storage controller on a file/orbax directory,
serves a prompt and exits normally without closing anything; this process then builds a
fresh cache on the same directory and must get the prompt back from storage, bit-exact.
The warning path: when the exit cannot flush (the cache belongs to another thread), the
child's stderr names the number of writes lost.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, numpy_backend_factory
from hicache_jax.cache import RadixKey
from hicache_jax.l3 import StorageController, exit_flush
from hicache_jax.storage import StorageConfig

ROOT = Path(__file__).resolve().parents[2]
HAVE_ORBAX = (
    all(importlib.util.find_spec(m) is not None for m in ("orbax", "tensorstore", "google_crc32c"))
    and importlib.util.find_spec("orbax.checkpoint") is not None
)
BACKENDS = ["file"] + (["orbax"] if HAVE_ORBAX else [])
P = 2
TOKENS = 40

CHILD = """
import sys, threading
sys.path.insert(0, {cache_tests!r})
import numpy as np
from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert
from hicache_jax.cache import RadixKey
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig

def serve():
    cache, be = make_cache(numpy_backend_factory, page_size={page}, device_pages=64, host_pages=64,
                           deferred=not {ack})
    cfg = StorageConfig(backend={backend!r}, path={path!r}, prefetch_threshold_tokens={page},
                        **({{"flush_interval_s": 3600.0}} if {backend!r} == "orbax" else {{}}))
    ctl = StorageController(cache, cfg, model="m")
    key = RadixKey(np.arange({tokens}, dtype=np.int64))
    oracle = KVOracle(be)
    prefill_insert(cache, oracle, key)
    # The bytes written, for the reader (the oracle hashes the namespace: per process before 3.12).
    np.savez({path!r} + ".expected.npz", **oracle.pages(key, 0, {tokens} // {page}))
    if {ack}:
        cache.check_events()  # the backup is acknowledged: its L3 write is queued
    else:
        be.complete_all()  # the copy is done; its acknowledgement (and so its L3 write) is not
    return cache, ctl  # kept alive until exit; never closed

if {other_thread}:
    held = []
    t = threading.Thread(target=lambda: held.append(serve()), name="scheduler")
    t.start(); t.join()
else:
    held = serve()
print("served", flush=True)

def serving_loop_dies():
    raise RuntimeError("the serving loop died")

if {sys_exit}:
    sys.exit(0)
if {crash}:
    serving_loop_dies()
"""


def run_child(path, backend, *, ack=True, other_thread=False, sys_exit=False, crash=False):
    code = textwrap.dedent(CHILD).format(
        cache_tests=str(ROOT / "tests" / "cache"),
        page=P,
        backend=backend,
        path=str(path),
        tokens=TOKENS,
        ack=ack,
        other_thread=other_thread,
        sys_exit=sys_exit,
        crash=crash,
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == (1 if crash else 0) and "served" in r.stdout, r.stderr[-3000:]
    if crash:
        assert "RuntimeError: the serving loop died" in r.stderr  # the traceback is still printed
    return r


def storage_hit(path, backend):
    """A fresh cache on ``path``: tokens served from storage, checked against the bytes the
    child wrote."""
    cache, be = make_cache(numpy_backend_factory, page_size=P, device_pages=64, host_pages=64)
    with StorageController(
        cache,
        StorageConfig(backend=backend, path=str(path), prefetch_threshold_tokens=P, prefetch_policy="wait_complete"),
        model="m",
    ) as ctl:
        key = RadixKey(np.arange(TOKENS, dtype=np.int64))
        got = ctl.finish_prefetch(ctl.prefetch(key))
        if got:
            req, _ = cache.begin_request(key)
            cache.flush()
            expected = np.load(str(path) + ".expected.npz")
            for c in be.geom.components:
                want = expected[c][:, : got // P]
                assert np.array_equal(be.device.read(c, req.device_pages[: got // P]), want), c
            cache.dec_lock_ref(req.last_node)
    return got


@pytest.mark.parametrize("ack", [True, False], ids=["acknowledged", "copy-in-flight"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_process_that_exits_without_close_loses_no_l3_write(tmp_path, backend, ack):
    r = run_child(tmp_path / "l3", backend, ack=ack)
    assert "LOST" not in r.stderr, r.stderr[-3000:]
    assert "flushed its pending writes at exit" in r.stderr  # it says close() was missing
    assert storage_hit(tmp_path / "l3", backend) == TOKENS


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_exit_that_cannot_flush_says_how_many_writes_it_loses(tmp_path, backend):
    # The cache belongs to a thread that has finished; its backup copy is done, not acknowledged.
    r = run_child(tmp_path / "l3", backend, ack=False, other_thread=True)
    assert "L3 writes LOST at exit (0 page(s) in L3 backup jobs, 1 host backup(s) not yet acknowledged" in r.stderr, (
        r.stderr[-3000:]
    )
    assert "does not own the cache" in r.stderr
    assert storage_hit(tmp_path / "l3", backend) == 0  # what the error says: lost


@pytest.mark.parametrize("ack", [True, False], ids=["acknowledged", "copy-in-flight"])
@pytest.mark.parametrize("exit_kind", ["sys_exit", "exception"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_serving_loop_that_dies_loses_no_l3_write(tmp_path, backend, exit_kind, ack):
    """``sys.exit`` or an uncaught exception ends the main script by unwinding it: the flush
    runs then, before interpreter shutdown (where CPython 3.12 lets no store start a thread,
    and orbax starts one per save), so every store keeps every acknowledged write, as on a
    normal return."""
    r = run_child(tmp_path / "l3", backend, ack=ack, sys_exit=exit_kind == "sys_exit", crash=exit_kind == "exception")
    assert "LOST" not in r.stderr, r.stderr[-3000:]
    assert "flushed its pending writes at exit" in r.stderr, r.stderr[-3000:]
    assert storage_hit(tmp_path / "l3", backend) == TOKENS, r.stderr[-3000:]


def test_a_closed_controller_leaves_the_exit_registry():
    cache, _ = make_cache(numpy_backend_factory, page_size=P)
    ctl = StorageController(cache, StorageConfig(backend="memory"), model="m")
    assert ctl in exit_flush.open_controllers()
    ctl.close()
    assert ctl not in exit_flush.open_controllers()
    assert ctl.pending_writes()["total"] == 0


def test_flush_one_closes_only_what_has_pending_writes_and_only_on_the_owner_thread(caplog):
    import threading

    from cache_harness import prefill_insert

    cache, be = make_cache(numpy_backend_factory, page_size=P, deferred=True)
    ctl = StorageController(cache, StorageConfig(backend="memory"), model="m")
    assert exit_flush.flush_one(ctl) and not ctl.closed  # nothing pending: left alone
    exit_flush.track(ctl)
    prefill_insert(cache, KVOracle(be), RadixKey(np.arange(8, dtype=np.int64)))
    be.complete_all()
    assert ctl.pending_writes()["unacknowledged_backups"] == 1
    out = []
    t = threading.Thread(target=lambda: out.append(exit_flush.flush_one(ctl)))
    with caplog.at_level("ERROR", "hicache_jax.cache.storage"):
        t.start()
        t.join()
    assert out == [False] and not ctl.closed and "1 host backup(s) not yet acknowledged" in caplog.text
    assert ctl not in exit_flush.open_controllers()  # reported once, not again at exit
    caplog.clear()
    with caplog.at_level("WARNING", "hicache_jax.cache.storage"):
        assert exit_flush.flush_one(ctl) and ctl.closed
    assert "flushed its pending writes at exit" in caplog.text
    assert ctl.storage.metrics.snapshot()["pages_written"] == 4
