"""Stateful fuzzing of HiRadixCache over a small pool, so eviction happens all the time.

Random requests (begin / unfinished / finished / abort), raw match / lock / unlock /
evict / evict_host / load_back / reset, and transfers completed in random order on a
deferred engine, with injected copy failures (garbage in the destination; retried, or the
cache stops and is reset). After every step: ``sanity_check`` (with the request-held page count, so a
leak is caught). The shadow model: KV at a position is a function of (namespace, prefix),
so every device hit and every settled host copy must hold exactly those bytes.

Half the machines register a draft sidecar (another geometry, its own oracle with other
bytes, upstream's SIDECAR draft KV): every check covers the draft pool too, so a draft page
that stays behind, lands at another id or is skipped by one transfer fails the step where
it shows. The draft engine is never deferred and never injected with failures: its copies
land when issued, the target's when the machine completes them, so the acknowledgement must
wait for the slower one.
"""

import functools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cache_harness import KVOracle, numpy_backend_factory, small_geom
from shadow_component import ShadowComponent
from hicache_jax.cache import CacheFailedError, HiCacheConfig, HiRadixCache, RadixKey

STEPS = {"n": 0}
EVENTS: dict = {}  # cache metrics summed over all runs: proves the machine reaches every path

# Keys are prefixes of a few base documents plus a short random tail, so requests share
# prefixes (and split nodes) the way multi-turn traffic does.
_DOCS = np.random.default_rng(0).integers(0, 50, size=(3, 24))


def _survives_failure(rule_fn):
    """A copy that failed for good stops the cache (``CacheFailedError``) at whatever call
    acknowledged it: a machine that injects failures then checks the stop, resets and goes
    on. Without injected failures the error is a test failure."""

    @functools.wraps(rule_fn)
    def run(self, *args, **kwargs):
        try:
            return rule_fn(self, *args, **kwargs)
        except CacheFailedError:
            if not self.injects_failures:
                raise
            self.after_failure()

    return run


class CacheMachine(RuleBasedStateMachine):
    backend_factory = staticmethod(numpy_backend_factory)
    injects_failures = False

    @initialize(
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        eviction=st.sampled_from(["lru", "lfu", "fifo", "mru", "priority"]),
        page_size=st.sampled_from([1, 2, 3]),
        device_pages=st.integers(6, 20),
        host_pages=st.integers(3, 40),  # often smaller than the device pool
        layout=st.sampled_from(["page_first", "layer_first", "page_first_direct"]),
        deferred=st.booleans(),
        threshold=st.sampled_from([0, 1, 3, 10]),
        host_reclaim=st.booleans(),
        kind=st.sampled_from(["mha", "mla"]),
        shadow=st.booleans(),  # a stateful plug-in component mirroring residency through its hooks
        draft=st.booleans(),  # a draft-KV sidecar following the target's page ids
    )
    def setup(
        self,
        policy,
        eviction,
        page_size,
        device_pages,
        host_pages,
        layout,
        deferred,
        threshold,
        host_reclaim,
        kind,
        shadow,
        draft,
    ):
        self.p = page_size
        self.be = self.backend_factory(small_geom(page_size, kind), device_pages, host_pages, layout, deferred)
        cfg = HiCacheConfig(
            page_size=page_size,
            write_policy=policy,
            eviction_policy=eviction,
            load_back_threshold=threshold,
            host_reclaim=host_reclaim,
        )
        plugins = []
        if shadow:
            side = numpy_backend_factory(small_geom(page_size, kind), device_pages, host_pages, layout)
            plugins.append(ShadowComponent(side.engine))
        sidecars, self.oracles = None, []
        if draft:
            # One layer of the other attention kind: a draft page at a target offset cannot fit.
            side = numpy_backend_factory(
                small_geom(page_size, "mla" if kind == "mha" else "mha", layers=1), device_pages, host_pages, layout
            )
            sidecars = {"draft": side.engine}
            self.oracles.append(KVOracle(side, salt=0x5A5A5A5A))
            EVENTS["draft_machines"] = EVENTS.get("draft_machines", 0) + 1
        self.cache = HiRadixCache(cfg, self.be.engine, self.be.device.allocator, sidecars, components=plugins)
        self.oracle = KVOracle(self.be)
        self.oracles.insert(0, self.oracle)
        self.reqs = []  # active CacheRequests
        self.locks = []  # nodes locked through the raw API
        self.loads = []  # (handle, device pages) of load-backs, to skip bytes still in flight

    # ------------------------------------------------------------------ helpers
    def key(self, toks, ns):
        return RadixKey(np.array(toks, dtype=np.int64), ns)

    def loading_pages(self):
        # A failed load's pages hold garbage until the cache acknowledges it (and copies them
        # again): its reader learns of it through the handle, as a forward pass would.
        acking = {id(h) for h in self.cache.debug_view().pending_load_handles()}
        self.loads = [
            (h, pg)
            for h, pg in self.loads
            if not h.done() or (getattr(h, "error", None) is not None and id(h) in acking)
        ]
        return set(np.concatenate([pg for _, pg in self.loads]).tolist()) if self.loads else set()

    def write(self, key, pages, first_page=0):
        """A prefill: the target's KV and the draft's, into the same page ids."""
        for oracle in self.oracles:
            oracle.write(key, pages, first_page)

    def check_device(self, key, pages, first_page=0):
        busy = self.loading_pages()
        for i, pg in enumerate(np.asarray(pages).tolist()):
            if pg not in busy:
                for oracle in self.oracles:
                    oracle.check_device(key, np.array([pg]), first_page + i)

    def check_path(self, key, m):
        """Device pages of a match, and host copies that are settled (evicted or host-unlocked)."""
        self.check_device(key, m.device_indices)
        node, nodes = m.last_host_node, []
        while node is not self.cache.root:
            nodes.append(node)
            node = node.parent
        off = 0
        for node in reversed(nodes):
            k = len(node) // self.p
            if node.host_value is not None and (node.value is None or node.host_lock_ref == 0):
                for oracle in self.oracles:
                    oracle.check_host(key, node.host_value, off)
            off += k

    def after_failure(self):
        EVENTS["fail_stops"] = EVENTS.get("fail_stops", 0) + 1
        with pytest.raises(CacheFailedError):
            self.cache.match_prefix(self.key([0], None))
        for req in self.reqs:  # the requests are abandoned: their own pages go back
            own = req.device_pages[req.cached_pages :]
            if own.size:
                self.be.device.allocator.free(own)
        self.reqs, self.locks, self.loads = [], [], []
        self.no_more_failures()
        self.cache.reset()

    def no_more_failures(self):
        if self.injects_failures:
            self.be.engine.inject_failures(0, "backup")
            self.be.engine.inject_failures(0, "load")

    def own_pages(self):
        return sum(r.device_pages.shape[0] - r.cached_pages for r in self.reqs)

    def track(self, lb):
        if lb is not None:
            self.loads.append((lb.handle, lb.device_pages))

    # ------------------------------------------------------------------ rules
    tokens = st.builds(
        lambda d, n, tail: list(_DOCS[d, :n]) + tail,
        st.integers(0, 2),
        st.integers(0, 16),
        st.lists(st.integers(0, 2), max_size=3),
    ).filter(bool)
    ns = st.sampled_from([None, "b"])

    @rule(toks=tokens, ns=ns, load=st.booleans(), quota=st.sampled_from([None, 4, 100]), prio=st.integers(0, 3))
    @_survives_failure
    def begin(self, toks, ns, load, quota, prio=0):
        key = self.key(toks, ns)
        req, lb = self.cache.begin_request(key, mem_quota=quota, load_back=load, priority=prio)
        self.track(lb)
        self.check_device(key, req.device_pages)
        need = -(-len(key) // self.p) - req.device_pages.shape[0]
        pages = self.cache.alloc_device(need)
        if pages is None:  # no room: give the request up
            if req.last_node is not None:
                self.cache.dec_lock_ref(req.last_node)
            return
        req.extend(key, pages)
        self.write(key, pages, req.cached_pages)
        self.reqs.append(req)

    @rule(toks=tokens, ns=ns, load=st.booleans(), out=st.lists(st.integers(0, 2), max_size=4), mid=st.booleans())
    @_survives_failure
    def serve(self, toks, ns, load, out, mid):
        """A whole request in one step: begin, prefill, (unfinished), decode, finished."""
        self.begin(toks, ns, load, None)
        if not self.reqs or self.reqs[-1].key.token_ids.tolist() != list(toks):
            return  # no room
        req = self.reqs[-1]
        if mid:
            self.cache.cache_unfinished_req(req)
        self._finish(req, out)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunked=st.booleans())
    @_survives_failure
    def unfinished(self, data, chunked):
        req = data.draw(st.sampled_from(self.reqs))
        self.cache.cache_unfinished_req(req, chunked=chunked)
        self.check_device(req.key, req.device_pages[: req.cached_pages])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), max_size=5))
    @_survives_failure
    def finish(self, data, more):
        self._finish(data.draw(st.sampled_from(self.reqs)), more)

    def _finish(self, req, more):
        if more:
            full = self.key(list(req.key.token_ids) + more, req.key.extra_key)
            need = -(-len(full) // self.p) - req.device_pages.shape[0]
            # The request's pages are locked or its own, so allocation can only evict others.
            pages = self.cache.alloc_device(need)
            if pages is not None:
                # A partial last page is rewritten with the new tokens (decode fills it).
                start = len(req.key) // self.p
                req.extend(full, pages)
                self.write(full, req.device_pages[start:], start)
        self.reqs.remove(req)
        key = req.key
        self.cache.cache_finished_req(req)
        m = self.cache.match_prefix(key)
        assert m.device_hit_length == len(key) - len(key) % self.p
        self.check_path(key, m)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    @_survives_failure
    def abort(self, data):
        req = data.draw(st.sampled_from(self.reqs))
        self.reqs.remove(req)
        self.cache.device_allocator.free(req.device_pages[req.cached_pages :])
        if req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)

    @rule(toks=tokens, ns=ns)
    @_survives_failure
    def match(self, toks, ns):
        key = self.key(toks, ns)
        self.check_path(key, self.cache.match_prefix(key))

    @rule(toks=tokens, ns=ns)
    @_survives_failure
    def lock(self, toks, ns):
        m = self.cache.match_prefix(self.key(toks, ns))
        self.cache.inc_lock_ref(m.last_device_node)
        self.locks.append(m.last_device_node)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    @_survives_failure
    def unlock(self, data):
        node = data.draw(st.sampled_from(self.locks))
        self.locks.remove(node)
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 12))
    @_survives_failure
    def evict(self, n):
        before = self.cache.evictable_tokens
        freed = self.cache.evict(n)
        assert freed >= min(n, before)  # every unlocked device token is reachable by cascade

    @rule(n=st.integers(0, 12))
    @_survives_failure
    def evict_host(self, n):
        self.cache.evict_host(n)

    @rule(toks=tokens, ns=ns, quota=st.sampled_from([None, 3, 100]))
    @_survives_failure
    def load_back(self, toks, ns, quota):
        key = self.key(toks, ns)
        m = self.cache.match_prefix(key)
        if m.host_hit_length:
            lb = self.cache.load_back(m.last_host_node, quota)
            self.track(lb)
            if lb is not None:
                self.check_path(key, self.cache.match_prefix(key))

    @precondition(lambda self: self.be.pending)
    @rule(data=st.data())
    def complete_one(self, data):
        self.be.complete(data.draw(st.sampled_from(self.be.pending)))

    @rule()
    def complete_all(self):
        self.be.complete_all()

    @rule(block=st.booleans())
    @_survives_failure
    def poll(self, block):
        if block:
            self.cache.flush()
        else:
            self.cache.check_events()

    @precondition(lambda self: not self.reqs and not self.locks)
    @rule(go=st.integers(0, 7))
    @_survives_failure
    def reset(self, go):
        if go:  # rarely: a reset throws away the state the other rules build up
            return
        self.cache.reset()
        self.loads = []

    @rule(toks=tokens, bad=st.sampled_from(["short", "owned", "unlock"]))
    @_survives_failure
    def bad_input_changes_nothing(self, toks, bad):
        key = self.key(toks, None)
        m = self.cache.match_prefix(key)
        n, have = len(key) // self.p, len(m.device_indices)
        alloc = self.be.device.allocator
        if bad == "short":
            call = lambda: self.cache.insert(key, m.device_indices[:0] if n else [0])  # noqa: E731
        elif bad == "owned":
            others = np.setdiff1d(np.flatnonzero(self.cache.debug_view().device_owned), m.device_indices)
            unalloc = np.flatnonzero(~alloc.is_allocated(np.arange(alloc.num_pages)))
            if n == have or others.size == 0 or unalloc.size < n - have - 1:
                return
            # A tree page reused at a position it does not own (plus pages nobody allocated).
            pages = np.concatenate([m.device_indices, others[:1], unalloc[: n - have - 1]])
            call = lambda: self.cache.insert(key, pages)  # noqa: E731
        else:
            node = m.last_device_node
            if node is self.cache.root or node.lock_ref:
                return
            call = lambda: self.cache.dec_lock_ref(node)  # noqa: E731
        before = [
            (x.id, x.lock_ref, x.host_lock_ref, x.hit_count, x.value is None, x.host_value is None)
            for x in self.cache.all_nodes()
        ]
        counts = (
            self.cache.evictable_tokens,
            self.cache.protected_tokens,
            self.cache.host_tokens,
            alloc.available,
            self.be.host.allocator.available,
        )
        with pytest.raises((ValueError, TypeError)):
            call()
        after = [
            (x.id, x.lock_ref, x.host_lock_ref, x.hit_count, x.value is None, x.host_value is None)
            for x in self.cache.all_nodes()
        ]
        assert before == after
        assert counts == (
            self.cache.evictable_tokens,
            self.cache.protected_tokens,
            self.cache.host_tokens,
            alloc.available,
            self.be.host.allocator.available,
        )

    # ------------------------------------------------------------------ invariants
    @invariant()
    def sane(self):
        STEPS["n"] += 1
        self.cache.sanity_check(external_device_pages=self.own_pages())

    def teardown(self):
        for k, v in self.cache.metrics.as_dict().items():
            EVENTS[k] = EVENTS.get(k, 0) + v
        # Drain: everything must come back to the pools.
        self.no_more_failures()
        try:
            for req in list(self.reqs):
                self.cache.cache_finished_req(req)
                self.reqs.remove(req)
            for node in self.locks:
                self.cache.dec_lock_ref(node)
            self.be.complete_all()
            self.cache.flush()
        except CacheFailedError:  # a copy that failed earlier is acknowledged here
            if not self.injects_failures:
                raise
            self.after_failure()
        self.cache.sanity_check(0)
        self.cache.reset()
        assert self.be.device.allocator.available == self.be.device.allocator.num_pages
        assert self.be.host.allocator.available == self.be.host.allocator.num_pages


class FailingCacheMachine(CacheMachine):
    """``CacheMachine`` plus injected copy failures (the numpy engine's ``inject_failures``).

    A subclass, so the torch run keeps the base machine's rule set and draws."""

    injects_failures = True

    @rule(kind=st.sampled_from(["backup", "load"]), count=st.integers(1, 3))
    def inject_failure(self, kind, count):
        """The next copies of ``kind`` write garbage and fail. The default 2 retries absorb
        up to 2 in a row; more stop the cache. Every byte served must still be right."""
        self.be.engine.inject_failures(count, kind)


def _run(examples, steps, min_total, fixed_seed=None, failures=True):
    STEPS["n"] = 0
    EVENTS.clear()
    machine = FailingCacheMachine if failures else CacheMachine
    if fixed_seed is not None:
        # An explicit seed, not derandomize: hypothesis derives that one from the machine
        # class's source, so any edit of the class (a comment) picked another run.
        machine = seed(fixed_seed)(type(machine.__name__, (machine,), {}))
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert STEPS["n"] >= min_total, f"only {STEPS['n']} steps ran"
    # The fuzz must actually exercise every tier transition, not just pass trivially.
    for event in (
        "draft_machines",
        "device_hit_tokens",
        "loaded_tokens",
        "backup_tokens",
        "demoted_tokens",
        "deleted_device_tokens",
        "evicted_host_tokens",
        "reclaimed_host_tokens",
        "dropped_tokens",
        "load_back_skipped",
        "backup_failed_tokens",
        *(("transfer_retries", "transfer_failures") if failures else ()),
    ):
        assert EVENTS.get(event, 0) > 0, f"fuzz never produced {event}: {EVENTS}"


# CI: >= 2,000 checked steps (about 20,000; ~12 s). A fixed seed, in a fresh interpreter: CI
# is reproducible and the event-coverage check cannot flake. 500 examples: with 250, 1 seed in
# 6 missed an event. The fresh interpreter because the run's sequence also moved with what the
# process had done before it (2026-12-07: with hicache_jax.bench.options imported first, or
# only its first 210 lines executed, seed 0 ran 21,960 or 20,809 steps instead of 22,209 and
# produced 0 or 24 dropped_tokens instead of 138; the same run twice in one process is
# identical; the cause inside hypothesis or the harness is not found). Under pytest-xdist every
# worker collects the whole suite first, so the event check passed or failed with the suite's
# imports.
CI_RUN = dict(examples=500, steps=50, min_total=2000, fixed_seed=0)


def test_fuzz_ci():
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]\n"
        "import test_cache_fuzz as t\n"
        "t._run(**t.CI_RUN)\n"
        "print('fuzz ok', t.STEPS['n'], 'steps', dict(t.EVENTS))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "fuzz ok" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


@pytest.mark.slow
def test_fuzz_slow():
    """>= 100,000 checked steps (run with -m slow)."""
    _run(examples=1500, steps=100, min_total=100_000)
