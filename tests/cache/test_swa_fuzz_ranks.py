"""SWA (and draft + SWA) caches across two thread-ranks (pure numpy; both environments).

The rank-trace pair over the hybrid caches (``rank_trace.run_swa_trace``): with the
agreement, every rank's digest (tree, residency, SWA state) is equal after every step under
each divergence injected on rank 1 (a failed full or SWA host allocation, late copies, a
window that slides a step late), each asserted to have fired, with one exchange per step;
with the exchange switched off the same divergence splits the digests (the test can see).
Then the SWA fuzz (``test_swa_fuzz``'s random operations) with an agreement across two
thread-ranks: bounded here, larger under ``-m slow``.
"""

from __future__ import annotations

import pytest
from rank_threads import ThreadGroup, run_ranks
from rank_trace import divergences, rank_cache, run_swa_trace

from hicache_jax.cache import NoExchangeAgreement

SWA_KINDS = divergences("swa", l3=False)
CASES = [(c, d) for c in ("swa", "draft+swa") for d in SWA_KINDS + ("all",)]


def _pair(make_agreement, components, divergence, steps=30):
    group = ThreadGroup(2, timeout=60)

    def rank(r):
        cache, be, _ = rank_cache(make_agreement(group, r), components=components)
        div = (set(SWA_KINDS) if divergence == "all" else {divergence}) if r == 1 else set()
        out = run_swa_trace(cache, be, divergence=div, steps=steps)
        out["agreement_steps"] = cache.step_agreement.steps
        return out

    return run_ranks(group, rank, timeout=300)


@pytest.mark.parametrize("components,divergence", CASES)
def test_swa_ranks_stay_identical_under_divergence(components, divergence):
    r0, r1 = _pair(lambda g, r: g.agreement(r), components, divergence)
    assert r0["digests"] == r1["digests"]  # after every step
    assert r0["served"] == r1["served"] and sum(r0["served"]) > 0
    kinds = SWA_KINDS if divergence == "all" else (divergence,)
    for k in kinds:
        assert r1["fired"][k] > 0, f"{k} never fired: the trace does not exercise it"
    assert r0["exchanges"] == r1["exchanges"] == r0["steps"]  # one exchange per step, no more
    assert r0["swa"]["backup_tokens"] > 0


@pytest.mark.parametrize("components,divergence", CASES)
def test_without_the_exchange_the_same_divergence_splits_the_swa_trees(components, divergence):
    r0, r1 = _pair(lambda g, r: NoExchangeAgreement(r, 2), components, divergence)
    first = next((i for i, (a, b) in enumerate(zip(r0["digests"], r1["digests"])) if a != b), None)
    assert first is not None, "the divergence left no trace in the digests"


# ---------------------------------------------------------------------------------------------- the fuzz
# ``test_swa_fuzz``'s operations, each run on both thread-ranks at once (``rank_pool``), the
# arguments drawn once on the main thread. Rank 1 diverges all the time: every third host
# allocation of each pool fails, its forward pass lags a step (``slide_window(written=)``),
# and the copies ``complete_one`` finishes on rank 0 stay unfinished there; half the caches
# carry a draft sidecar (its bytes checked like the target's). After every
# operation both trees must pass ``sanity_check`` and have equal digests.
import numpy as np  # noqa: E402
from hypothesis import HealthCheck, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)  # noqa: E402
from rank_pool import RankPool  # noqa: E402
from cache_harness import KVOracle, numpy_backend_factory, small_geom  # noqa: E402
from rank_trace import DRAFT_SALT, _TraceDriver, inject  # noqa: E402
from swa_harness import make_swa_cache  # noqa: E402

from hicache_jax.cache import RadixKey  # noqa: E402

_DOCS = np.random.default_rng(1).integers(0, 40, size=(3, 28))
FUZZ = {"steps": 0, "exchanges": 0, "events": {}}


class _Rank:
    """One rank's cache, driver and requests (built and used on that rank's thread only)."""

    def __init__(self, r: int, agreement, params: dict, draft: bool) -> None:
        self.r = r
        self.draft_be = self.draft = None
        sidecars = None
        if draft:  # a draft model's KV on the full page ids (a sidecar), its own bytes
            self.draft_be = numpy_backend_factory(
                small_geom(params["page_size"]),
                params["device_pages"],
                params["host_pages"],
                "page_first",
                params["deferred"],
            )
            self.draft = KVOracle(self.draft_be, DRAFT_SALT)
            sidecars = {"draft": self.draft_be.engine}
        self.cache, self.full_be, self.swa_be, self.swa = make_swa_cache(
            agreement=agreement, sidecars=sidecars, **params
        )
        self.bes = [b for b in (self.full_be, self.swa_be, self.draft_be) if b is not None]
        self.drv = _TraceDriver(self.cache, self.full_be, self.swa_be, self.swa)
        self.p = self.cache.page_size
        self.reqs: list = []  # [req, target tokens, namespace]
        self.done: list = []
        self.fired = inject(self.cache, None, {"alloc_fail", "swa_alloc_fail"} if r == 1 else set())

    def key(self, toks, ns):
        return RadixKey(np.asarray(toks, np.int64), ns)

    def check_prefix(self, req) -> None:
        self.drv.check_prefix(req)
        if self.draft is not None:
            self.draft.check_device(req.key, req.device_pages[: req.cached_pages])

    def extend(self, entry, key) -> bool:
        req = entry[0]
        before = len(req.key)
        if not self.drv.extend(req, key):
            self.reqs.remove(entry)
            self.drv.abort(req)
            return False
        if self.draft is not None:
            start = before // self.p
            self.draft.write(key, req.device_pages[start:], start)
        if self.r == 1:
            self.cache.slide_window(req, written=before)  # rank 1's forward pass lags a step
        return True

    def externals(self):
        full = sw = 0
        for req, _t, _ns in self.reqs:
            a, b = _TraceDriver.own_pages(req)
            full, sw = full + a, sw + b
        return full, sw


class SWARanksMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        page_size=st.sampled_from([1, 2, 3]),
        window=st.integers(1, 9),
        device_pages=st.integers(12, 32),
        host_pages=st.integers(4, 48),
        swa_device_pages=st.integers(6, 20),
        swa_host_pages=st.integers(3, 40),
        deferred=st.booleans(),
        threshold=st.sampled_from([0, 1, 3]),
        draft=st.booleans(),
    )
    def setup(
        self,
        policy,
        page_size,
        window,
        device_pages,
        host_pages,
        swa_device_pages,
        swa_host_pages,
        deferred,
        threshold,
        draft,
    ):
        swa_device_pages = max(swa_device_pages, -(-window // page_size) + 3)
        params = dict(
            page_size=page_size,
            window=window,
            device_pages=device_pages,
            host_pages=host_pages,
            swa_device_pages=swa_device_pages,
            swa_host_pages=swa_host_pages,
            deferred=deferred,
            write_policy=policy,
            load_back_threshold=threshold,
        )
        self.pool = RankPool(2, timeout=30)
        group = self.pool.group
        self.ranks = self.pool.run(lambda r: _Rank(r, group.agreement(r), params, draft))

    def both(self, fn):
        ranks = self.ranks
        return self.pool.run(lambda r: fn(ranks[r]))

    tokens = st.builds(
        lambda d, n, tail: list(_DOCS[d, :n]) + tail,
        st.integers(0, 2),
        st.integers(2, 24),
        st.lists(st.integers(40, 43), max_size=4),
    )
    ns = st.sampled_from([None, "b"])
    pick = st.integers(0, 1 << 20)

    # ------------------------------------------------------------------ requests
    @precondition(lambda self: len(self.ranks[0].reqs) < 3)
    @rule(toks=tokens, ns=ns, load=st.booleans())
    def begin(self, toks, ns, load):
        def op(k):
            req, _lb = k.drv.admit(k.key(toks, ns), load)
            k.check_prefix(req)
            k.reqs.append([req, list(toks), ns])

        self.both(op)

    @rule(
        toks=tokens, ns=ns, chunk=st.integers(1, 9), out=st.lists(st.integers(40, 45), max_size=6), poll=st.booleans()
    )
    def serve(self, toks, ns, chunk, out, poll):
        """A whole request in one operation: admit, chunked prefill, decode, finish (one
        agreement step after each pass when ``poll``, as a scheduler's loop would run)."""

        def op(k):
            req, _lb = k.drv.admit(k.key(toks, ns))
            k.check_prefix(req)
            entry = [req, list(toks), ns]
            k.reqs.append(entry)
            pos = len(req.key)
            while pos < len(toks):
                pos = min(len(toks), pos + chunk)
                if not k.extend(entry, k.key(toks[:pos], ns)):
                    return
                k.cache.cache_unfinished_req(req, chunked=True)
                k.check_prefix(req)
                if poll:
                    k.cache.check_events()
            for t in out:
                if not k.extend(entry, k.key(list(req.key.token_ids) + [t], ns)):
                    return
                if poll:
                    k.cache.check_events()
            k.reqs.remove(entry)
            key = req.key
            k.cache.cache_finished_req(req)
            k.done.append(key)

        self.both(op)

    @precondition(lambda self: self.ranks[0].reqs)
    @rule(i=pick, chunk=st.integers(1, 9), mid=st.booleans())
    def prefill(self, i, chunk, mid):
        def op(k):
            entry = k.reqs[i % len(k.reqs)]
            req, target, ns = entry
            have = len(req.key)
            if have >= len(target):
                return
            if k.extend(entry, k.key(target[: min(len(target), have + chunk)], ns)) and mid:
                k.cache.cache_unfinished_req(req, chunked=True)
                k.check_prefix(req)

        self.both(op)

    @precondition(lambda self: self.ranks[0].reqs)
    @rule(i=pick, out=st.lists(st.integers(40, 45), min_size=1, max_size=4))
    def decode(self, i, out):
        def op(k):
            entry = k.reqs[i % len(k.reqs)]
            if len(entry[0].key) < len(entry[1]):
                return
            for t in out:
                toks = list(entry[0].key.token_ids) + [t]
                if not k.extend(entry, k.key(toks, entry[2])):
                    return
                entry[1] = toks

        self.both(op)

    @precondition(lambda self: self.ranks[0].reqs)
    @rule(i=pick, abort=st.booleans())
    def finish(self, i, abort):
        def op(k):
            entry = k.reqs.pop(i % len(k.reqs))
            req = entry[0]
            if abort:
                k.drv.abort(req)
                return
            key = req.key
            k.cache.cache_finished_req(req)
            if len(key):
                k.done.append(key)

        self.both(op)

    # ------------------------------------------------------------------ raw calls
    @rule(toks=tokens, ns=ns)
    def match(self, toks, ns):
        self.both(lambda k: k.cache.match_prefix(k.key(toks, ns)))

    @rule(n=st.integers(0, 12), host=st.booleans())
    def evict(self, n, host):
        self.both(lambda k: k.cache.evict_host(n) if host else k.cache.evict(n))

    @rule(n=st.integers(1, 8))
    def swa_pressure(self, n):
        def op(k):
            got = k.cache.alloc_component("swa", n)
            if got is not None:
                k.swa.device_allocator.free(got)

        self.both(op)

    @rule()
    def drop_device(self):
        def op(k):
            k.cache.flush()
            k.cache.evict(k.cache.evictable_tokens)

        self.both(op)

    @precondition(lambda self: self.ranks[0].done)
    @rule(i=pick, n=pick, quota=st.sampled_from([None, 3, 100]))
    def load_back(self, i, n, quota):
        def op(k):
            done = k.done[i % len(k.done)]
            key = RadixKey(done.token_ids[: 1 + n % len(done)], done.extra_key)
            m = k.cache.match_prefix(key)
            if m.host_hit_length:
                lb = k.cache.load_back(m.last_host_node, quota)
                if lb is not None:
                    lb.handle.wait()

        self.both(op)

    @rule(i=pick)
    def complete_one(self, i):
        def op(k):
            if k.r == 1:
                return  # rank 1's copies finish later
            for be in k.bes:
                if be.pending:
                    be.complete(be.pending[i % len(be.pending)])

        self.both(op)

    @rule()
    def complete_all(self):
        def op(k):
            for be in k.bes:
                be.complete_all()

        self.both(op)

    @rule(block=st.booleans())
    def poll(self, block):
        self.both(lambda k: k.cache.flush() if block else k.cache.check_events())

    @precondition(lambda self: not self.ranks[0].reqs)
    @rule(go=st.integers(0, 7))
    def reset(self, go):
        if not go:

            def op(k):
                k.cache.reset()
                k.done = []

            self.both(op)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def ranks_agree(self):
        if not hasattr(self, "ranks"):
            return

        def op(k):
            full, sw = k.externals()
            k.cache.sanity_check(full, {"swa": sw})
            return k.cache.debug_view().digest()

        d0, d1 = self.both(op)
        assert d0 == d1, "the ranks' trees differ"
        FUZZ["steps"] += 1

    def teardown(self):
        if not hasattr(self, "ranks"):
            return
        try:

            def op(k):
                for entry in list(k.reqs):
                    k.cache.cache_finished_req(entry[0])
                k.reqs = []
                for be in k.bes:
                    be.complete_all()
                k.cache.flush()
                k.cache.sanity_check(0, {"swa": 0})
                st_ = k.cache.stats()
                out = dict(
                    st_["components"]["swa"]["metrics"],
                    rolled_back=st_["agreement"]["rolled_back_backups"],
                    slides=st_["agreement"]["agreed_slides"],
                    exchanges=st_["agreement"]["exchanges"],
                    alloc_fail=k.fired["alloc_fail"],
                    swa_alloc_fail=k.fired["swa_alloc_fail"],
                    digest=k.cache.debug_view().digest(),
                )
                k.cache.reset()
                return out

            s0, s1 = self.both(op)
            assert s0["digest"] == s1["digest"]
            for name, v in s1.items():
                if name != "digest":
                    FUZZ["events"][name] = FUZZ["events"].get(name, 0) + v
        finally:
            self.pool.close()


# What every run must have produced (on rank 1): both injected failures, agreed slides, SWA
# backups and SWA backup parts given up (host tombstones), SWA eviction, early window releases.
FUZZ_EVENTS = (
    "alloc_fail",
    "swa_alloc_fail",
    "slides",
    "backup_tokens",
    "backup_failed_tokens",
    "tombstoned_tokens",
    "released_windows",
)


def _fuzz(examples, steps, min_steps, fixed_seed=None):
    FUZZ.update(steps=0, events={})
    machine = SWARanksMachine if fixed_seed is None else seed(fixed_seed)(type("M", (SWARanksMachine,), {}))
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
    print(f"\nSWA fuzz over two ranks: {FUZZ['steps']} checked steps, {FUZZ['events']}")
    assert FUZZ["steps"] >= min_steps
    for e in FUZZ_EVENTS:
        assert FUZZ["events"].get(e, 0) > 0, f"the fuzz never produced {e}: {FUZZ['events']}"


def test_swa_fuzz_across_two_thread_ranks():
    _fuzz(examples=100, steps=30, min_steps=2000, fixed_seed=3)


@pytest.mark.slow
def test_swa_fuzz_across_two_thread_ranks_slow():
    _fuzz(examples=500, steps=60, min_steps=20_000)
