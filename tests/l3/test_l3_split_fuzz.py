"""Stateful fuzz, L3 leg (issue 28): conversations go to L3 through a file store; caches are
replaced by new ones (a new controller on the same directory), prefixes are restored from
storage, later inserts split the restored nodes, the tiers are evicted in part; then a prompt
is prefetched through the current controller and the result compared with a *fresh* cache and
controller on the same directory: the tokens usable after the prefetch must cover what the
fresh cache gets from storage, and every byte served must be the oracle's.

Two kinds of extra pools, chosen per example: a draft sidecar (``draft`` pool, every page
stored) and an SWA component (``swa`` pool, the trailing-pages policy). Two SWA cases are
documented limits, not bugs, and are left out of the comparison: a tree whose full-KV match
is not SWA-usable (tombstones) and a mid-tree continuation shorter than the window (a prefetch
from a mid-tree anchor reads the whole window from storage: ``l3.controller``). Left out for
both kinds: a prefetch skipped as ``not_backed_up`` (now only a key the tree holds whole on
the device: a match ending on device-only nodes reads from the backed-up end, SWA included).
Bounded in CI
(a few examples, a fixed seed: CI is reproducible); ``-m slow`` runs more from a fresh seed,
printed (``L3_SPLIT_FUZZ_SEED=<n>`` replays it). The failures the fuzz found are replayed as
plain tests at the end.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile

import numpy as np
import pytest
from cache_harness import Backend, KVOracle, numpy_backend_factory, small_geom
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from swa_harness import SWADriver, make_swa_cache

from hicache_jax.backends.numpy_backend import NumpyTransferEngine
from hicache_jax.cache import HiCacheConfig, HiRadixCache, RadixKey
from hicache_jax.l3 import StorageController
from hicache_jax.storage import StorageConfig

_DOCS = np.random.default_rng(5).integers(0, 50, size=(3, 40))
COMPARED = {"n": 0, "storage": 0}


class _Draft:
    """A cache with a draft sidecar; oracles for both pools."""

    def __init__(self, p: int) -> None:
        target = numpy_backend_factory(small_geom(p, "mha", layers=2), 64, 256, "page_first", False)
        d = numpy_backend_factory(small_geom(p, "mla", layers=1), 64, 256, "layer_first", False)
        eng = NumpyTransferEngine(d.device, d.host)
        self.cache = HiRadixCache(
            HiCacheConfig(page_size=p, load_back_threshold=0),
            target.engine,
            target.device.allocator,
            sidecars={"draft": eng},
        )
        self.oracles = [KVOracle(target), KVOracle(Backend(d.geom, d.device, d.host, eng))]
        self.p = p

    def serve(self, key: RadixKey) -> RadixKey | None:
        n = len(key) // self.p
        pages = self.cache.alloc_device(n)
        if pages is None:
            return None
        for o in self.oracles:
            o.write(key, pages)
        self.cache.insert(RadixKey(key.token_ids[: n * self.p]), pages)
        return RadixKey(key.token_ids[: n * self.p])

    def check_served(self, key: RadixKey) -> int:
        req, lb = self.cache.begin_request(key)
        if lb is not None:
            lb.handle.wait()
        self.cache.flush()
        n = req.cached_pages  # the tree's whole pages
        for o in self.oracles:
            o.check_device(RadixKey(key.token_ids[: n * self.p]), req.device_pages[:n])
        if req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)
        return n * self.p


class _SWA:
    def __init__(self, p: int, window: int) -> None:
        self.cache, full, swa_be, self.swa = make_swa_cache(
            page_size=p, window=window, device_pages=64, host_pages=256, swa_device_pages=40, swa_host_pages=256
        )
        self.drv = SWADriver(self.cache, full, swa_be, self.swa)
        self.p = p

    def serve(self, key: RadixKey) -> RadixKey | None:
        return self.drv.serve(key, chunk=5, out=[])

    def check_served(self, key: RadixKey) -> int:
        req, _lb = self.drv.admit(RadixKey(np.r_[key.token_ids, 1]))
        self.drv.check_prefix(req)
        got = req.cached_pages * self.p
        self.drv.abort(req)
        return got

    def externals(self):
        return 0, {"swa": 0}


class L3SplitMachine(RuleBasedStateMachine):
    @initialize(kind=st.sampled_from(["draft", "swa"]), p=st.sampled_from([1, 2, 3]), window=st.integers(2, 9))
    def setup(self, kind, p, window):
        self.kind, self.p, self.window = kind, p, window
        self.dir = tempfile.mkdtemp(prefix="l3fuzz")
        self.done: list[RadixKey] = []
        self.side = self.ctl = None
        self.restart()

    def build(self):
        side = _Draft(self.p) if self.kind == "draft" else _SWA(self.p, self.window)
        cfg = StorageConfig(
            backend="file",
            path=self.dir,
            prefetch_threshold_tokens=self.p,
            prefetch_policy="wait_complete",
            worker_nice=0,
        )
        return side, StorageController(side.cache, cfg, model="m")

    def sane(self, side):
        side.cache.sanity_check(0, {"swa": 0} if self.kind == "swa" else None)

    def store(self):
        self.side.cache.flush()
        assert self.ctl.flush(60)

    # ------------------------------------------------------------------ rules
    @rule()
    def restart(self):
        """A new cache and controller on the same directory (an empty tree)."""
        if self.ctl is not None:
            self.store()
            self.ctl.close()
        self.side, self.ctl = self.build()

    @rule(d=st.integers(0, 2), n=st.integers(2, 40), tail=st.lists(st.integers(60, 63), max_size=5))
    def serve(self, d, n, tail):
        final = self.side.serve(RadixKey(np.r_[_DOCS[d, :n], tail].astype(np.int64)))
        if final is not None and len(final):
            self.done.append(final)
        self.store()

    @precondition(lambda self: self.done)
    @rule(data=st.data(), tail=st.lists(st.integers(60, 63), min_size=1, max_size=6))
    def diverge(self, data, tail):
        """A prompt sharing part of a served one, then new tokens: splits the node it ends in."""
        done = data.draw(st.sampled_from(self.done))
        cut = data.draw(st.integers(1, len(done)))
        final = self.side.serve(RadixKey(np.r_[done.token_ids[:cut], tail].astype(np.int64)))
        if final is not None and len(final):
            self.done.append(final)
        self.store()

    @precondition(lambda self: self.done)
    @rule(data=st.data())
    def restore(self, data):
        """Prefetch a served prompt (or a prefix of it) from storage, and serve it: bytes checked."""
        done = data.draw(st.sampled_from(self.done))
        cut = data.draw(st.integers(1, len(done)))
        key = RadixKey(np.r_[done.token_ids[:cut], 99].astype(np.int64))
        op = self.ctl.prefetch(key)
        self.ctl.finish_prefetch(op)
        self.side.check_served(key)

    @rule(n=st.integers(0, 30))
    def evict(self, n):
        self.side.cache.flush()
        self.side.cache.evict(n)

    @rule(n=st.integers(0, 30))
    def evict_host(self, n):
        self.store()
        self.side.cache.evict_host(n)

    @precondition(lambda self: any(len(d) >= 3 * self.p for d in self.done))
    @rule(data=st.data(), tail=st.lists(st.integers(60, 63), min_size=1, max_size=4), drop=st.booleans())
    def restore_split_continue(self, data, tail, drop):
        """The issue's scenario: a new cache restores a prefix of a stored prompt (one leaf with
        the keys it was read under), a prompt sharing less of it splits that leaf, and the
        stored prompt then continues from the split's lower half into storage."""
        done = data.draw(st.sampled_from([d for d in self.done if len(d) >= 3 * self.p]))
        pages = len(done) // self.p
        c0 = data.draw(st.integers(2, pages - 1)) * self.p
        self.restart()
        op = self.ctl.prefetch(RadixKey(np.r_[done.token_ids[:c0], 99].astype(np.int64)))
        self.ctl.finish_prefetch(op)
        c1 = data.draw(st.integers(1, c0 - 1))
        final = self.side.serve(RadixKey(np.r_[done.token_ids[:c1], tail].astype(np.int64)))
        if final is not None and len(final):
            self.done.append(final)
        if drop:
            self.side.cache.flush()
            self.side.cache.evict(self.side.cache.evictable_tokens)
        self.compare(RadixKey(np.r_[done.token_ids, 70].astype(np.int64)))

    @precondition(lambda self: self.done)
    @rule(data=st.data(), tail=st.lists(st.integers(70, 73), min_size=1, max_size=3))
    def compare_with_a_fresh_cache(self, data, tail):
        done = data.draw(st.sampled_from(self.done))
        cut = data.draw(st.integers(1, len(done)))
        self.compare(RadixKey(np.r_[done.token_ids[:cut], tail].astype(np.int64)))

    def compare(self, key: RadixKey) -> None:
        self.store()
        cache = self.side.cache
        anchor, matched, _m = cache.backed_up_prefix(key)
        usable_before = sum(cache.peek_prefix(key))
        op = self.ctl.prefetch(key)
        self.ctl.finish_prefetch(op)
        got = self.side.check_served(key)
        fresh, fctl = self.build()
        try:
            fop = fctl.prefetch(key)
            fresh_got = fctl.finish_prefetch(fop)
            assert fresh.check_served(key) == fresh_got
            self.sane(fresh)
        finally:
            fctl.close()
        if op.reason_code == "not_backed_up":
            COMPARED["not_backed_up"] = COMPARED.get("not_backed_up", 0) + 1
            return  # the tree's match ends on a node whose host copy was evicted: no anchor to pin
        if self.kind == "swa":
            wp = self.side.swa.window_pages * self.p
            if usable_before < matched:
                return  # the tree's full-KV match is not SWA-usable: a prefetch continues after it
            if matched and matched < fresh_got < matched + wp:
                return  # a mid-tree continuation shorter than the window: read whole from storage
        COMPARED["n"] += 1
        COMPARED["storage"] += fresh_got
        assert got >= fresh_got, (got, fresh_got, op, op.reason, fop)

    @invariant()
    def check(self):
        if self.side is not None:
            self.sane(self.side)

    def teardown(self):
        if self.ctl is not None:
            self.ctl.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _run(examples, steps, fixed_seed):
    COMPARED["n"] = COMPARED["storage"] = 0
    # An explicit seed, not derandomize (that one follows the class's source: any edit picks
    # another run); printed, so a failure names the run that replays it.
    print(f"\nL3 split fuzz: seed {fixed_seed} (L3_SPLIT_FUZZ_SEED={fixed_seed} replays it with -m slow)")
    machine = seed(fixed_seed)(type("L3SplitMachine", (L3SplitMachine,), {}))
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],  # shrinking a file-store machine takes minutes
            suppress_health_check=list(HealthCheck),
        ),
    )
    print(f"L3 split fuzz: {COMPARED}")
    assert COMPARED["n"] and COMPARED["storage"], COMPARED  # the comparison ran, with storage hits


CI_SEED = 0


def test_l3_split_fuzz_ci():
    _run(examples=20, steps=25, fixed_seed=CI_SEED)


@pytest.mark.slow
def test_l3_split_fuzz_slow():
    env = os.environ.get("L3_SPLIT_FUZZ_SEED")
    _run(examples=200, steps=50, fixed_seed=int(env) if env else random.randrange(2**32))


# ---------------------------------------------------------------------------------------------- found by the fuzz
def test_a_device_match_whose_swa_window_is_gone_is_restored_from_storage():
    """Found by the CI fuzz: an SWA tree holds the 5-token prefix of the key on the device only
    (host copies evicted) with its window's SWA pages gone, so it serves none of it; storage
    holds all 5. The threshold counted the read's tokens past the tree's full-KV match (5), so
    the 5-token hit was revoked as "below the threshold" and 0 served, where a fresh cache on the
    same store serves 5. It counts past the *usable* match now (``peek_prefix``)."""
    doc = [int(t) for t in _DOCS[0, :7]]
    key = np.array(doc + [63, 60, 60, 61, 63], np.int64)  # the served prompt (12 tokens)
    m = L3SplitMachine()
    m.setup(kind="swa", p=1, window=4)
    try:
        m.serve(0, 7, [63, 60, 60, 61, 63])
        m.evict(23)
        m.compare(RadixKey(np.r_[key[:11], 72, 73].astype(np.int64)))
        m.check()
        m.evict_host(12)
        m.check()
        probe = RadixKey(np.r_[key[:5], 72].astype(np.int64))
        cache = m.side.cache
        assert cache.tree_match_tokens(probe) == 5 and sum(cache.peek_prefix(probe)) == 0  # the case
        assert cache.backed_up_prefix(probe)[1] == 0
        m.compare(probe)  # got >= what a fresh cache gets from storage (5)
        assert sum(cache.peek_prefix(probe)) == 5
        m.check()
    finally:
        m.teardown()
