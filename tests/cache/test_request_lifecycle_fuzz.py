"""Stateful fuzz of the public request lifecycle, as an engine drives it: ``begin_request``
(with and without ``retain``), ``alloc_device`` + ``extend``, decode growth,
``cache_unfinished_req``, ``cache_finished_req``, ``abort_request`` (also of a request whose
pages could not be allocated), evictions, the retention clock, ``check_events`` and, at the
end, ``close``; interleaved with calls that must be refused (a bad ``retain`` / ``priority``,
a tree page passed off as the request's own, too few pages, a finished request, bad
``begin_request`` arguments).

Checked after every step: every lock a request took is released exactly once (the cache's
caller locks are exactly the open requests' nodes, one each; none once they are all done);
a call that raises changed nothing (the cache's snapshot, retention and the request, compared
before and after); ``sanity_check`` with the open requests' own pages as the external pages;
every byte a request is served is the oracle's. After ``close`` every call is refused and
nothing changes.

Bounded in CI (a fixed seed, printed; few examples); ``-m slow`` runs more from a fresh
seed, printed (``LIFECYCLE_FUZZ_SEED=<n>`` replays it).
"""

from __future__ import annotations

import os
import random
from collections import Counter

import numpy as np
import pytest
from cache_harness import KVOracle, make_cache, numpy_backend_factory
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
from test_request_lifecycle import state

from hicache_jax.cache import CacheClosedError, RadixKey
from hicache_jax.cache.retention import RetentionConfig, RetentionHint, enable_retention

P = 2
DOCS = np.random.default_rng(7).integers(0, 20, size=(3, 24))
STATS = Counter()


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def own_pages(req) -> int:
    return 0 if req.released else req.device_pages.shape[0] - req.cached_pages


class LifecycleMachine(RuleBasedStateMachine):
    @initialize(device_pages=st.sampled_from([8, 12, 24]), deferred=st.booleans(), retention=st.booleans())
    def setup(self, device_pages, deferred, retention):
        self.cache, self.be = make_cache(
            numpy_backend_factory,
            page_size=P,
            device_pages=device_pages,
            host_pages=48,
            deferred=deferred,
            load_back_threshold=0,
        )
        self.oracle = KVOracle(self.be)
        self.clock = Clock()
        self.retained = retention
        if retention:
            enable_retention(self.cache, RetentionConfig(24, 50, self.clock))
        self.open: list = []  # the requests begun and not yet finished or aborted
        self.closed = False

    # ------------------------------------------------------------------ helpers
    def external(self) -> int:
        return sum(own_pages(r) for r in self.open)

    def refused(self, call, exc, req=None, match=None):
        """``call`` must raise ``exc`` and change nothing."""
        before = state(self.cache, self.be, req)
        with pytest.raises(exc, match=match):
            call()
        assert state(self.cache, self.be, req) == before, "a refused call changed state"
        STATS["refused"] += 1

    def complete(self) -> None:
        self.be.complete_all()

    def pick(self, data, whole=None):
        reqs = [r for r in self.open if whole is None or (r.device_pages.shape[0] == -(-len(r.key) // P)) == whole]
        return data.draw(st.sampled_from(reqs)) if reqs else None

    def hint(self, data):
        if not self.retained or not data.draw(st.booleans()):
            return None
        return RetentionHint(data.draw(st.sampled_from([1.0, 5.0, 50.0])), data.draw(st.sampled_from([0.5, 1.0])))

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: not self.closed and len(self.open) < 4)
    @rule(data=st.data(), doc=st.integers(0, 2), n=st.integers(1, 20), tail=st.lists(st.integers(50, 53), max_size=5))
    def begin(self, data, doc, n, tail):
        tokens = np.r_[DOCS[doc, :n], tail].astype(np.int64)
        if len(tokens) < 2:
            return
        retain = self.hint(data)
        self.complete()
        req, load = self.cache.begin_request(RadixKey(tokens[:-1]), retain=retain)  # the README's key
        if load is not None:
            load.wait_layer(0) if hasattr(load, "wait_layer") else None
            self.cache.flush()
        self.oracle.check_device(RadixKey(tokens[: req.cached_pages * P]), req.device_pages[: req.cached_pages])
        req.full = tokens  # the whole prompt, for the extend
        self.open.append(req)
        STATS["begun"] += 1
        STATS["hit_tokens"] += req.cached_pages * P

    @precondition(lambda self: not self.closed and self.open)
    @rule(data=st.data())
    def alloc_and_extend(self, data):
        """``alloc_device`` for the prompt's pages, then ``extend``; None leaves it short."""
        reqs = [r for r in self.open if len(r.key) < len(r.full)]  # as begin_request left them
        if not reqs:
            return
        req = data.draw(st.sampled_from(reqs))
        key = RadixKey(req.full)
        need = -(-len(key) // P) - req.device_pages.shape[0]
        if need <= 0:
            return
        pages = self.cache.alloc_device(need)
        if pages is None:
            STATS["alloc_failed"] += 1
            return
        first = req.device_pages.shape[0]
        req.extend(key, pages)
        self.oracle.write(key, req.device_pages[first:], first)
        STATS["extended"] += 1

    @precondition(lambda self: not self.closed and self.open)
    @rule(data=st.data(), extra=st.integers(1, 5))
    def decode(self, data, extra):
        """Grow a whole request by generated tokens (new pages where a page starts)."""
        req = self.pick(data, whole=True)
        if req is None:
            return
        n = len(req.key)
        key = RadixKey(np.r_[req.key.token_ids, 60 + np.arange(extra) % 4].astype(np.int64))
        need = -(-len(key) // P) - req.device_pages.shape[0]
        pages = self.cache.alloc_device(need) if need else np.zeros(0, np.int32)
        if pages is None:
            return
        first = n // P  # the partial page (if any) is rewritten with its new tokens
        req.extend(key, pages)
        self.oracle.write(key, req.device_pages[first:], first)
        req.full = key.token_ids
        STATS["decoded"] += 1

    @precondition(lambda self: not self.closed and self.open)
    @rule(data=st.data())
    def unfinished(self, data):
        req = self.pick(data, whole=True)
        if req is None:
            return
        self.cache.cache_unfinished_req(req, chunked=data.draw(st.booleans()))
        self.oracle.check_device(req.key, req.device_pages[: req.cached_pages]) if req.cached_pages else None
        STATS["unfinished"] += 1

    @precondition(lambda self: not self.closed and self.open)
    @rule(data=st.data())
    def finished(self, data):
        req = self.pick(data, whole=True)
        if req is None:
            return
        self.cache.cache_finished_req(req)
        self.open.remove(req)
        assert req.released and req.last_node is None
        STATS["finished"] += 1

    @precondition(lambda self: not self.closed and self.open)
    @rule(data=st.data())
    def abort(self, data):
        req = self.pick(data)
        if req is None:
            return
        whole = req.device_pages.shape[0] == -(-len(req.key) // P)
        self.cache.abort_request(req)
        self.open.remove(req)
        assert req.released and req.last_node is None and req.device_pages.size == 0
        self.cache.abort_request(req)  # a second abort does nothing
        STATS["aborted" if whole else "aborted_short"] += 1

    @precondition(lambda self: not self.closed and self.open)
    @rule(
        data=st.data(),
        how=st.sampled_from(["retain", "priority", "tree_page", "cached_pages", "short"]),
        call=st.sampled_from(["cache_finished_req", "cache_unfinished_req", "abort_request"]),
    )
    def bad_request(self, data, how, call):
        """A request with one bad field: refused, nothing changed (it is restored after)."""
        req = self.pick(data, whole=None if call == "abort_request" else True)
        if req is None or call == "abort_request" and req.last_node is None and not req.device_pages.size:
            return  # (aborting a request that holds nothing is a no-op, whatever its fields)
        saved = (req.retain, req.priority, req.device_pages, req.cached_pages, req.key)
        if how == "retain":
            req.retain, exc, match = data.draw(st.sampled_from([10, 2.5, "1s"])), TypeError, "req.retain"
        elif how == "priority":
            req.priority, exc, match = "high", TypeError, "req.priority"
        elif how == "cached_pages":
            req.cached_pages, exc, match = req.device_pages.shape[0] + 1 + len(req.key), ValueError, "req.cached_pages"
        elif how == "short":
            if call == "abort_request":
                req.key = RadixKey(np.r_[req.full, np.arange(4 * P)].astype(np.int64))  # still fine for abort
                req.cached_pages = req.device_pages.shape[0] + 1  # more than it holds: refused
                exc, match = ValueError, "req.cached_pages"
            else:
                req.key = RadixKey(np.r_[req.key.token_ids, np.arange(3 * P)].astype(np.int64))
                exc, match = ValueError, "device pages, it holds"
        else:  # a tree page passed off as the request's own
            tree = [n for n in self.cache.all_nodes() if n.value is not None and len(n.value)]
            if not tree or call == "cache_unfinished_req":
                return
            page = int(tree[0].value[0])
            req.key = RadixKey(np.r_[req.key.token_ids, 99 + np.arange(P)].astype(np.int64))
            if req.device_pages.shape[0] != -(-(len(req.key) - P) // P):
                req.key = saved[4]
                return
            req.device_pages = np.r_[req.device_pages, page].astype(req.device_pages.dtype)
            # finished: a whole page, inserted (the tree's page under another key: refused);
            # abort: one of its own pages to free (a tree page: refused)
            exc, match = ValueError, "device_pages"  # (the insert names it device_pages)
        try:
            self.refused(lambda: getattr(self.cache, call)(req), exc, req, match)
        finally:
            req.retain, req.priority, req.device_pages, req.cached_pages, req.key = saved

    @precondition(lambda self: not self.closed)
    @rule(which=st.sampled_from(["priority", "retain", "mem_quota", "key", "load_back"]))
    def bad_begin(self, which):
        key = RadixKey(DOCS[0, :6].astype(np.int64))
        kwargs = {
            "priority": {"priority": "x"},
            "retain": {"retain": 10},
            "mem_quota": {"mem_quota": -1},
            "load_back": {"load_back": "yes"},
            "key": {},
        }[which]
        arg = [1.5, "a"] if which == "key" else key
        self.refused(lambda: self.cache.begin_request(arg, **kwargs), (TypeError, ValueError))

    @precondition(lambda self: not self.closed)
    @rule(n=st.integers(0, 16))
    def evict(self, n):
        self.complete()
        self.cache.evict(n)

    @precondition(lambda self: not self.closed)
    @rule(dt=st.sampled_from([0.5, 3.0, 60.0]))
    def tick(self, dt):
        self.clock.t += dt
        self.complete()
        self.cache.check_events()

    @precondition(lambda self: not self.closed)
    @rule(data=st.data())
    def close(self, data):
        """End of the run: whatever is open is aborted first (or left open and refused)."""
        if data.draw(st.integers(0, 5)):
            return  # rarely: the rest of the run only checks refusals
        if self.open and data.draw(st.booleans()):
            for req in list(self.open):
                self.cache.abort_request(req)
                self.open.remove(req)
        self.complete()
        self.cache.close()
        self.closed = True
        STATS["closed"] += 1
        for call in (
            lambda: self.cache.begin_request(RadixKey(DOCS[0, :4].astype(np.int64))),
            lambda: self.cache.alloc_device(1),
            lambda: self.cache.evict(1),
            self.cache.check_events,
            *[(lambda r=r: self.cache.abort_request(r)) for r in self.open],
            *[(lambda r=r: self.cache.cache_finished_req(r)) for r in self.open],
        ):
            self.refused(call, CacheClosedError)

    @precondition(lambda self: self.closed)
    @rule()
    def after_close(self):
        """A closed cache refuses every serving call, changing nothing."""
        self.refused(lambda: self.cache.match_prefix(RadixKey(DOCS[1, :4].astype(np.int64))), CacheClosedError)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def every_lock_released_exactly_once(self):
        if not hasattr(self, "cache"):
            return
        held = Counter(self.cache.debug_view().caller_locks_by_node())
        want = Counter(r.last_node for r in self.open if r.last_node is not None)
        assert held == want, (held, want)
        if not self.open:
            assert self.cache.debug_view().caller_locks == 0
        for r in self.open:  # the tree part of each request is the tree's, on its locked path
            assert r.cached_pages <= r.device_pages.shape[0]

    @invariant()
    def sane(self):
        if hasattr(self, "cache"):
            self.cache.sanity_check(self.external())

    def teardown(self):
        if hasattr(self, "cache") and not self.closed:
            for req in list(self.open):
                self.cache.abort_request(req)
            self.open.clear()
            self.complete()
            self.cache.flush()
            self.every_lock_released_exactly_once()
            self.cache.sanity_check(0)


def _run(examples, steps, fixed_seed):
    STATS.clear()
    print(f"\nrequest lifecycle fuzz: seed {fixed_seed} (LIFECYCLE_FUZZ_SEED={fixed_seed} replays it with -m slow)")
    machine = seed(fixed_seed)(type("LifecycleMachine", (LifecycleMachine,), {}))
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
    print(f"request lifecycle fuzz: {dict(STATS)}")
    for what in ("begun", "extended", "finished", "aborted", "aborted_short", "unfinished", "refused", "closed"):
        assert STATS[what], f"the fuzz never {what}: {dict(STATS)}"


def test_request_lifecycle_fuzz_ci():
    _run(examples=150, steps=40, fixed_seed=0)


@pytest.mark.slow
def test_request_lifecycle_fuzz_slow():
    env = os.environ.get("LIFECYCLE_FUZZ_SEED")
    _run(examples=600, steps=60, fixed_seed=int(env) if env else random.randrange(2**32))
