"""``hicache_jax.CacheStack``: one close() for cache, L3 controller and transfer engines, in the
order that loses nothing; idempotent; a context manager; clear errors after close."""

from __future__ import annotations

import numpy as np
import pytest

from cache_harness import KVOracle, make_cache, numpy_backend_factory, prefill_insert
from hicache_jax import CacheStack, StackClosedError
from hicache_jax.cache import RadixKey
from hicache_jax.l3 import StorageController, exit_flush
from hicache_jax.storage import StorageConfig

P = 2
KEY = RadixKey(np.arange(24, dtype=np.int64))


class Recorder:
    """A transfer engine stand-in: records when it is closed and what the controller was then."""

    def __init__(self, log, name, ctl=None, fail=False):
        self.log, self.name, self.ctl, self.fail = log, name, ctl, fail

    def close(self):
        self.log.append((self.name, None if self.ctl is None else self.ctl.closed))
        if self.fail:
            raise OSError(f"{self.name} failed")


def build(path, backend="file", deferred=False):
    cache, be = make_cache(numpy_backend_factory, page_size=P, device_pages=64, host_pages=64, deferred=deferred)
    ctl = StorageController(
        cache,
        StorageConfig(backend=backend, path=str(path), prefetch_threshold_tokens=P, prefetch_policy="wait_complete"),
        model="m",
    )
    return cache, be, ctl


def storage_hit(path):
    cache, be, ctl = build(path)
    with CacheStack(cache, ctl) as stack:
        got = stack.storage.finish_prefetch(stack.storage.prefetch(KEY))
        if got:
            req, _ = cache.begin_request(KEY)
            cache.flush()
            KVOracle(be).check_device(KEY, req.device_pages)
            cache.dec_lock_ref(req.last_node)
    return got


def test_close_flushes_an_unacknowledged_backup_to_storage_then_closes_the_transfers(tmp_path):
    cache, be, ctl = build(tmp_path, deferred=True)
    order = []
    stack = CacheStack(cache, ctl, [Recorder(order, "transfer", ctl)], closers=[Recorder(order, "spec", ctl)])
    prefill_insert(cache, KVOracle(be), KEY)
    be.complete_all()  # the copy is done, its acknowledgement (and so its L3 write) is not
    assert cache.in_flight[0] >= 1 and ctl.pending_writes()["l3_pages"] == 0
    stack.close()
    assert order == [("transfer", True), ("spec", True)]  # after the controller closed
    assert ctl.closed and cache.storage_hook is None and ctl not in exit_flush.open_controllers()
    assert storage_hit(tmp_path) == len(KEY)


def test_close_twice_is_fine_and_every_use_after_close_raises(tmp_path):
    cache, _be, ctl = build(tmp_path)
    stack = CacheStack(cache, ctl)
    assert repr(stack) == "CacheStack(open, storage=yes, transfers=0, closers=0)"
    stack.close()
    stack.close()
    assert stack.closed and repr(stack) == "CacheStack(closed, storage=yes, transfers=0, closers=0)"
    for use in (
        lambda: stack.cache,
        lambda: stack.storage,
        lambda: stack.transfers,
        stack.check_events,
        lambda: stack.__enter__(),
    ):
        with pytest.raises(StackClosedError, match="the stack is closed"):
            use()
    assert ctl.prefetch(KEY).status == "closed"  # the controller admits nothing either


def test_the_with_block_closes_even_when_it_raises(tmp_path):
    cache, be, ctl = build(tmp_path)
    with pytest.raises(KeyError):
        with CacheStack(cache, ctl) as stack:
            prefill_insert(cache, KVOracle(be), KEY)
            raise KeyError("the scheduler crashed")
    assert stack.closed and ctl.closed
    assert storage_hit(tmp_path) == len(KEY)


def test_a_failing_step_does_not_stop_the_later_ones(tmp_path):
    cache, _be, ctl = build(tmp_path)
    order = []
    stack = CacheStack(cache, ctl, [Recorder(order, "a", fail=True), Recorder(order, "b")])
    with pytest.raises(OSError, match="a failed"):
        stack.close()
    assert order == [("a", None), ("b", None)] and ctl.closed and stack.closed
    stack.close()  # still idempotent


def test_bad_parts_are_refused_by_name(tmp_path):
    cache, _be, ctl = build(tmp_path)
    other, _ = make_cache(numpy_backend_factory, page_size=P)
    with pytest.raises(TypeError, match="cache: expected a HiRadixCache"):
        CacheStack(object())
    with pytest.raises(TypeError, match="storage: expected a StorageController"):
        CacheStack(cache, storage=object())
    with pytest.raises(ValueError, match="storage: this controller is attached to another cache"):
        CacheStack(other, storage=ctl)
    with pytest.raises(TypeError, match=r"transfers\[0\]: expected an object with close\(\)"):
        CacheStack(cache, ctl, [object()])
    with pytest.raises(TypeError, match=r"closers\[0\]"):
        CacheStack(cache, ctl, closers=[1])
    ctl.close()


def test_a_latched_copy_failure_is_reset_before_the_rest_closes(tmp_path):
    from hicache_jax.cache import CacheFailedError

    cache, be, ctl = build(tmp_path)
    order = []
    stack = CacheStack(cache, ctl, [Recorder(order, "transfer", ctl)])
    be.engine.inject_failures(100, "backup")  # every retry fails: the cache latches the failure
    with pytest.raises(CacheFailedError):
        prefill_insert(cache, KVOracle(be), KEY)
        cache.flush()
    assert cache.failure is not None
    stack.close()  # no error: the failed copies' bytes are dropped, not written to L3
    assert cache.failure is None and ctl.closed and order == [("transfer", True)]
    assert storage_hit(tmp_path) == 0


# ---------------------------------------------------------------------------------------------- closed means closed
def on_thread(fn):
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    import threading

    t = threading.Thread(target=run, name="not-the-owner")
    t.start()
    t.join(30)
    return out.get("error", out.get("value"))


def test_close_from_a_thread_that_does_not_own_the_cache_changes_nothing(tmp_path):
    from hicache_jax.cache import OwnerThreadError

    cache, be, ctl = build(tmp_path)
    stack = CacheStack(cache, ctl)
    prefill_insert(cache, KVOracle(be), KEY)  # this thread owns the cache
    err = on_thread(stack.close)
    assert isinstance(err, OwnerThreadError) and "CacheStack.close" in str(err), err
    assert not stack.closed and "open" in repr(stack) and not ctl.closed and not cache.closed
    assert stack.cache is cache and stack.storage is ctl  # still serving
    stack.check_events()
    assert cache.match_prefix(KEY).device_hit_length == len(KEY)
    stack.close()  # the owner closes it, losing nothing
    assert stack.closed and ctl.closed and cache.closed
    assert storage_hit(tmp_path) == len(KEY)


def test_after_close_the_raw_cache_refuses_to_serve_too(tmp_path):
    from hicache_jax.cache import CacheClosedError
    from hicache_jax.cache.call_gate import REFUSED_WHEN_CLOSED

    cache, be, ctl = build(tmp_path)
    with CacheStack(cache, ctl):
        prefill_insert(cache, KVOracle(be), KEY)
    assert cache.closed
    n_args = {"insert": 2, "insert_host": 3, "begin_request": 1, "match_prefix": 1, "alloc_device": 1}
    for name in REFUSED_WHEN_CLOSED:
        with pytest.raises(CacheClosedError, match=f"{name}: the cache is closed"):
            getattr(cache, name)(*([KEY] * n_args.get(name, 0)))
    # read-only views still answer, and what was cached is intact
    assert cache.stats()["device_used_tokens"] == len(KEY) and cache.in_flight == (0, 0)
    cache.sanity_check(0)
    cache.close()  # idempotent


def test_a_cache_closed_by_hand_refuses_and_close_from_another_thread_is_refused():
    from hicache_jax.cache import CacheClosedError, OwnerThreadError

    cache, be = make_cache(numpy_backend_factory, page_size=P, deferred=True)
    prefill_insert(cache, KVOracle(be), KEY)
    err = on_thread(cache.close)
    assert isinstance(err, OwnerThreadError) and not cache.closed
    be.complete_all()
    cache.close()  # finishes the copies in flight first
    assert cache.closed and cache.in_flight == (0, 0) and cache.metrics.backup_tokens == len(KEY)
    with pytest.raises(CacheClosedError):
        cache.begin_request(KEY)


def test_a_stack_without_a_controller_still_acknowledges_every_copy():
    cache, be = make_cache(numpy_backend_factory, page_size=P, deferred=True)
    stack = CacheStack(cache)
    assert repr(stack) == "CacheStack(open, storage=no, transfers=0, closers=0)"
    prefill_insert(cache, KVOracle(be), KEY)
    be.complete_all()  # the backup copy is done, its acknowledgement is not
    assert cache.in_flight == (1, 0)
    stack.close()
    assert cache.in_flight == (0, 0) and cache.metrics.backup_tokens == len(KEY)
