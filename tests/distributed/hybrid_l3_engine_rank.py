"""One rank of the two-process hybrid (sliding-window) engine test with L3 storage
(``test_engine_ranks_hybrid_l3``), or the single-process run.

usage: hybrid_l3_engine_rank.py OUT_DIR STORAGE_DIR AGREEMENT DIVERGE [CONTROLS]  (launched: HICACHE_RANK set)
       hybrid_l3_engine_rank.py OUT_DIR STORAGE_DIR single -                      (one process, the reference)

CONTROLS (comma-separated DIVERGE values, e.g. ``swa,calm``): after the run, each rank also
runs the agreement-off control (below) for each, in the same process, over a fresh store
OUT_DIR/<control>/l3, writing OUT_DIR/<control>/rank<r>.json (one launch instead of three).

AGREEMENT: ``kv`` (the coordination service's store) or ``none`` (the same protocol with the
exchange switched off: ``NoExchangeAgreement``, every rank acts on its own values).

The reference engine with a tiny hybrid model (``HYBRID_TINY``: one SWA layer of window 24, one
full layer; both pools sharded on the KV heads) serves a multi-turn workload with L3 (file) in
four rounds: the first computes everything, the second hits the device (L1), the device tier is
dropped before the third (L2: full pages and the windows' SWA pages come back from the host),
and device and host are dropped before the fourth, so its prefixes (windows included) come
back from storage (L3).

With DIVERGE=all, rank 1 alone: fails every third SWA host allocation and every fourth full
host allocation in the first two rounds (its backups: host tombstones and rolled-back backups
the agreement must make every rank's, so the L2 round is served less from the host), reports
each decode step's window slide with the length of the step before (its slides lag rank 0's by
a step; the agreed slide is the minimum, so nothing may differ),
finishes its D2H copies of both pools ``SLOW`` steps late, and in the last round: sees the
first storage query's pages from ``MISSING_AFTER`` on missing, reads the first full-pool read
(the same request's) one page short, and reads the second SWA window read one page short (all
of that request's prefetch is dropped); the third request comes back whole. Each injection
counts its firings. With DIVERGE=swa (the agreement-off control) only the SWA
host allocations fail, and only ``CONTROL_ROUNDS`` rounds run (no tier is read back: with
trees that differ the ranks would step different programs); DIVERGE=calm runs those rounds
without any injection.

A participant of the step agreement records the tree's digest after every step (SWA state
included), and ``check_digest`` makes every exchange compare them too (not with ``none``).
Writes OUT_DIR/<rank or single>.json: tokens per request, digests, tiers served, what fired,
the L3 counters.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import numpy as np

KV_HEADS_ENV = "HYBRID_RANK_KV_HEADS"  # the model's KV heads, if not HYBRID_TINY's

from engine_rank import LateHandle, fail_every  # noqa: E402 - this script's directory is on sys.path
from hybrid_engine_rank import AfterStepRecorder

from hicache_jax.cache import RadixKey
from hicache_jax.engine import Engine, EngineCacheConfig
from hicache_jax.host_pool import HostPoolConfig
from hicache_jax.reference_model import HYBRID_TINY, swa_first_needed_page
from hicache_jax.storage import StorageConfig

MODEL = HYBRID_TINY  # window 24: 6 SWA pages of 4 tokens before a hit's end
if os.environ.get(KV_HEADS_ENV):  # fewer KV heads than ranks: both pools replicated on every rank
    MODEL = replace(MODEL, num_kv_heads=int(os.environ[KV_HEADS_ENV]))
PAGE = 4
FIRSTS, ROUNDS, TURN, ANSWER = (44, 36, 36, 40), 4, 8, 4
CONTROL_ROUNDS = 1
MISSING_AFTER = 8  # storage queries on rank 1 see at most this many pages (a hit still spans a window)
FIRED = (
    "swa_host_alloc_fail",
    "host_alloc_fail",
    "late_slide",
    "slow_d2h",
    "short_read",
    "short_window_read",
    "missing_page",
)


class Round:
    """The workload's round (the injections fire in some rounds only)."""

    index = 0


def diverge(engine, rec: AfterStepRecorder, fired: dict, now: Round) -> None:
    """Rank 1's own faults (see the module docstring); each counts in ``fired``."""
    early = lambda: now.index < 2  # noqa: E731 - the first two rounds (their backups)
    fail_every(engine.swa.host_allocator, 3, fired, "swa_host_alloc_fail", early)
    fail_every(engine.cache.host_allocator, 4, fired, "host_alloc_fail", early)
    slide_window, reported = engine.cache.slide_window, {}

    def late_slide(req, written=None):  # a decode step's slide reports the length of the step before
        n = len(req.key) if written is None else written
        last = reported.get(id(req))
        report = n
        if last is not None and last[0] is req and n - last[1] == 1:  # one token more: a decode step
            report = last[1]
            fired["late_slide"] += 1
        reported[id(req)] = (req, n)
        slide_window(req, written=report)

    engine.cache.slide_window = late_slide
    for transfer in (engine.transfer, engine.swa_transfer):
        backup = transfer.backup

        def late(d, h, backup=backup):
            fired["slow_d2h"] += 1
            return LateHandle(backup(d, h), rec)

        transfer.backup = transfer.backup_owned = late
    store = engine.storage.storage
    get_multi, exists_multi, batch_get = store.get_multi, store.exists_multi, store.batch_get
    window_reads = [0]

    def missing(transfers):  # the round's first storage query sees page MISSING_AFTER missing
        r = exists_multi(transfers)
        if now.index == 3 and r.hit_pages > MISSING_AFTER and not fired["missing_page"]:
            fired["missing_page"] += 1
            return type(r)(MISSING_AFTER, {k: min(v, MISSING_AFTER) for k, v in r.pool_hits.items()})
        return r

    def short(transfers):  # the round's first full-pool read (the same request's) stops a page short
        r = get_multi(transfers)
        if now.index == 3 and r.hit_pages > 1 and not fired["short_read"]:
            fired["short_read"] += 1
            return type(r)(r.hit_pages - 1, {k: max(0, v - 1) for k, v in r.pool_hits.items()})
        return r

    def short_window(keys, ids, pool=None):  # the round's second SWA window read misses its last page
        flags = list(batch_get(keys, ids, pool))
        if now.index == 3 and pool == "swa" and len(flags) > 1:
            window_reads[0] += 1
            if window_reads[0] == 2:
                fired["short_window_read"] += 1
                flags[-1] = False
        return flags

    store.get_multi, store.exists_multi, store.batch_get = short, missing, short_window


def local_pages(pool, ids) -> bytes:
    """This rank's shard (its KV heads) of pages ``ids`` of every component and layer of ``pool``."""
    ids = np.asarray(ids, np.int64)
    return b"".join(
        np.asarray(a.addressable_data(0))[ids].tobytes() for c in pool.geom.components for a in pool.layers(c)
    )


class PrefixBytes:
    """The bytes a cached prefix is served with, on this rank: its full pages and the SWA pages
    of the window before its end (what a step after it reads). ``remember`` takes them from the
    tree (the prefix on the device); ``check_served`` wraps the cache's ``begin_request`` so
    every admission with a remembered prefix compares what it was served, once its load-back
    (both pools) has landed."""

    def __init__(self, engine) -> None:
        self.engine, self.want, self.checked, self.mismatched = engine, {}, 0, []

    def _read(self, req, hit: int) -> bytes:
        e, p = self.engine, self.engine.page_size
        first = swa_first_needed_page(hit, MODEL.sliding_window, p)
        window = req.component_pages["swa"][first : hit // p]
        if req.device_pages.shape[0] * p < hit or (window < 0).any():
            return b""
        return local_pages(e.device_pool, req.device_pages[: hit // p]) + local_pages(e.swa_pool, window)

    def remember(self, tokens: list) -> None:
        hit = (len(tokens) // self.engine.page_size) * self.engine.page_size
        cache = self.engine.cache
        req, _lb = cache.begin_request(RadixKey(np.asarray(tokens[:hit], np.int64)), load_back=False)
        try:
            got = self._read(req, hit)
            if got:
                self.want[tuple(tokens[:hit])] = got
        finally:
            if req.last_node is not None:
                cache.dec_lock_ref(req.last_node)

    def check_served(self) -> None:
        cache, begin = self.engine.cache, self.engine.cache.begin_request

        def begin_checked(key, *a, **kw):
            req, lb = begin(key, *a, **kw)
            hit = req.device_pages.shape[0] * self.engine.page_size
            want = self.want.get(tuple(req.key.token_ids[:hit].tolist()))
            if want is not None:
                if lb is not None:  # landed: every layer of both pools
                    for i in range(self.engine.geom.num_layers):
                        lb.wait_layer(i)
                    for j in range(self.engine.swa_pool.geom.num_layers):
                        lb.handle.wait_layer(j, component="swa")
                self.checked += 1
                if self._read(req, hit) != want:
                    self.mismatched.append(hit)
            return req, lb

        cache.begin_request = begin_checked


def workload(engine, rounds: int, now: Round) -> tuple[list, list, PrefixBytes]:
    """Multi-turn conversations (``FIRSTS``); before round 2 the device tier is dropped (L2),
    before round 3 the device and host tiers (L3). Returns (tokens, cached tokens by tier, the
    byte check of the prefixes the last round was served)."""
    rng = np.random.default_rng(13)
    hist = [rng.integers(0, MODEL.vocab_size, n).tolist() for n in FIRSTS]
    tokens, tiers = [], []
    audit = PrefixBytes(engine)
    for r in range(rounds):
        now.index = r
        if r == 3:
            engine.flush()
            for h in hist:  # the stored keys: the last prompt and its answer but the last token
                audit.remember(h[:-1])
            audit.check_served()
            engine.evict_host_cache()
        if r:
            for h in hist:
                h.extend(rng.integers(0, MODEL.vocab_size, TURN).tolist())
        if r == 2:
            engine.evict_device_cache()
        res = engine.generate([list(h) for h in hist], ANSWER)
        for h, x in zip(hist, res):
            h.extend(x.tokens)
            tokens.append(x.tokens)
            tiers.append(x.cached_tokens)
    return tokens, tiers, audit


def rank_context_without_exchange():
    """``rank_context``'s mesh with ``NoExchangeAgreement``: the agreed protocol, no exchange."""
    from hicache_jax.cache import NoExchangeAgreement
    from hicache_jax.engine.multiprocess import rank_context

    ranks = rank_context("kv", timeout_s=60)
    ranks.agreement = NoExchangeAgreement(ranks.rank, ranks.num_processes)
    return ranks


def without_exchange(ranks):
    """``ranks`` (an agreed run's context, left as it is) with a fresh ``NoExchangeAgreement``:
    an agreement-off control after the agreed run, in the same process."""
    from hicache_jax.cache import NoExchangeAgreement

    return replace(ranks, agreement=NoExchangeAgreement(ranks.rank, ranks.num_processes))


def open_ranks(agreement: str):
    """``(ranks, name)`` for an AGREEMENT argument: ``single``: ``(None, "single")``; ``none``:
    ``rank_context_without_exchange()``; otherwise ``rank_context(agreement)``; ``name`` is
    ``rank<r>`` for a rank (the JSON's name)."""
    if agreement == "single":
        return None, "single"
    if agreement == "none":
        ranks = rank_context_without_exchange()
    else:
        from hicache_jax.engine.multiprocess import rank_context

        ranks = rank_context(agreement, timeout_s=60)
    return ranks, f"rank{ranks.rank}"


def write_json(path: str, out: dict) -> None:
    with open(path, "w") as f:
        json.dump(out, f)


def write_with_controls(out_dir: str, name: str, first: dict, controls: list[str], serve_control) -> None:
    """Writes ``first`` (the agreed run's result) to OUT_DIR/<name>.json, then runs the
    agreement-off controls in this process, after the agreed run (one launch instead of one per
    control): ``serve_control(control_dir, control)`` for each, written to
    OUT_DIR/<control>/<name>.json."""
    write_json(os.path.join(out_dir, f"{name}.json"), first)
    for control in controls:
        control_dir = os.path.join(out_dir, control)
        os.makedirs(control_dir, exist_ok=True)
        write_json(os.path.join(control_dir, f"{name}.json"), serve_control(control_dir, control))


def control_store(control_dir: str) -> str:
    """A fresh L3 directory for a control run: CONTROL_DIR/l3."""
    path = os.path.join(control_dir, "l3")
    os.makedirs(path, exist_ok=True)
    return path


def run_l3_script(serve) -> None:
    """An L3 rank script's ``main``: ``OUT_DIR STORAGE_DIR AGREEMENT DIVERGE [CONTROLS]`` (the
    usage above), ``serve(storage_dir, ranks, agreement, div)`` for the run and each control
    (over a fresh store, ``control_store``)."""
    out_dir, storage_dir, agreement, div = sys.argv[1:5]
    controls = sys.argv[5].split(",") if len(sys.argv) > 5 else []
    ranks, name = open_ranks(agreement)
    write_with_controls(
        out_dir,
        name,
        serve(storage_dir, ranks, agreement, div),
        controls,
        lambda d, control: serve(control_store(d), without_exchange(ranks), "none", control),
    )


def main() -> None:
    run_l3_script(serve)


def serve(storage_dir: str, ranks, agreement: str, div: str) -> dict:
    """One run of the workload over ``storage_dir`` (the engine built, served, closed)."""
    cfg = EngineCacheConfig(
        page_size=PAGE,
        device_pages=96,
        host=HostPoolConfig(ratio=2.0),
        max_batch=3,
        prefill_chunk=16,
        max_context=128,
        storage=StorageConfig(
            backend="file", path=storage_dir, prefetch_threshold_tokens=PAGE, prefetch_timeout_base_s=30.0
        ),
    )  # no 1 s deadline on a loaded box
    engine = Engine(MODEL, cfg, ranks=ranks)
    rec = AfterStepRecorder(engine.cache)
    fired = dict.fromkeys(FIRED, 0)
    rounds = ROUNDS
    now = Round()
    if ranks is not None:
        engine.cache.step_agreement.add(rec)
        engine.cache.step_agreement.check_digest = agreement != "none"
        if ranks.rank == 1 and div == "all":
            diverge(engine, rec, fired, now)
        elif ranks.rank == 1 and div == "swa":
            fail_every(engine.swa.host_allocator, 3, fired, "swa_host_alloc_fail")
    if div in ("swa", "calm"):
        rounds = CONTROL_ROUNDS
    tokens, tiers, audit = workload(engine, rounds, now)
    engine.flush()  # every copy acknowledged: the last digest is the settled state
    rec.prepare()
    rec.apply(None)
    metrics = {k: v for k, v in engine.cache.metrics.as_dict().items() if "prefetch" in k or "storage" in k}
    stats = engine.cache.step_agreement.stats() if ranks is not None else {}
    swa_loaded = engine.swa.metrics.loaded_tokens
    engine.close()
    return {
        "tokens": tokens,
        "tiers": tiers,
        "digests": rec.digests,
        "fired": fired,
        "metrics": metrics,
        "swa_loaded_tokens": swa_loaded,
        "stats": stats,
        "bytes_remembered": len(audit.want),
        "bytes_checked": audit.checked,
        "bytes_mismatched": audit.mismatched,
    }


if __name__ == "__main__":
    if "HICACHE_RANK" in os.environ:
        from hicache_jax.distributed import run_rank

        run_rank(main)
    else:
        main()
