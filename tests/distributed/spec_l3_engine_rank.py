"""One rank of the two-process speculative-decoding engine test WITH L3 storage
(``test_engine_ranks_spec_l3``), or the single-process run.

usage: spec_l3_engine_rank.py OUT_DIR STORAGE_DIR AGREEMENT DIVERGE [CONTROLS]  (launched: HICACHE_RANK set)
       spec_l3_engine_rank.py OUT_DIR STORAGE_DIR single -                      (one process, the reference)

CONTROLS (comma-separated DIVERGE values, e.g. ``alloc,calm``): after the run, each rank also
runs the agreement-off control (below) for each, in the same process, over a fresh store
OUT_DIR/<control>/l3, writing OUT_DIR/<control>/rank<r>.json (one launch instead of three).

AGREEMENT: ``kv`` (the coordination service's store) or ``none`` (the same protocol with the
exchange switched off: ``NoExchangeAgreement``, every rank acts on its own values).

The reference engine with speculative decoding (the tiny model of ``engine_rank``; its draft
pool, sharded as the target's, is the cache's ``draft`` sidecar) serves a multi-turn workload
with L3 (file) in four rounds: the first computes everything, the second hits the device (L1),
the device tier is dropped before the third (L2), and device and host are dropped before the
fourth, so its prefixes come back from storage (L3), draft pages read with the target's.

With DIVERGE=all, rank 1 alone (``engine_rank.diverge``): fails every third host allocation
(until the L3 round, so that whether its reservations fail does not depend on how the earlier
rounds' copies were timed), finishes its target D2H copies ``SLOW`` steps late and its draft D2H
copies one step later still (``late_draft_backups``: a backup is done when both halves are), reads one page short of every storage
read (the unread page zeroed: ``zero_short_read_pages``), sees every storage query's seventh
page missing, and starts every round ``LATE_S`` after rank 0. Each injection counts its
firings. With DIVERGE=alloc (the agreement-off control) only the host allocations fail, and
only ``CONTROL_ROUNDS`` rounds run (no tier is read back: with trees that differ the ranks
would step different programs); DIVERGE=calm runs those rounds without any injection.

What the L3 round was served, on this rank: ``DraftBytes`` remembers, before the tiers are
dropped, this rank's shard of every cached page of the target and of the draft pool under the
page's prefix (the tree key up to its end), and compares every page the L3 round is served
with it once its load-back (both pools) has landed; every rank also counts the draft pages its
storage reads returned (``draft_read_pages``). A participant of the step agreement records the
tree's digest after every step (``AfterStepRecorder``), and ``check_digest`` makes every
exchange compare them too (not with ``none``). Writes OUT_DIR/<rank or single>.json.
"""

from __future__ import annotations

import os
import time

import numpy as np
from engine_rank import LATE_S, MODEL, LateHandle, diverge, fail_every  # noqa: E402 - this script's directory is on sys.path
from hybrid_engine_rank import AfterStepRecorder  # noqa: E402
from hybrid_l3_engine_rank import (  # noqa: E402
    local_pages,
    run_l3_script,
)

from hicache_jax.engine import Engine, EngineCacheConfig, SpecConfig
from hicache_jax.host_pool import HostPoolConfig
from hicache_jax.storage import StorageConfig

PAGE, K = 4, 3
CLIENTS, ROUNDS, FIRST, TURN, ANSWER = 3, 4, 24, 8, 6
CONTROL_ROUNDS = 1
FIRED = ("alloc_fail", "slow_d2h", "slow_draft_d2h", "short_read", "short_read_zeroed", "missing_page", "late_start")


class DraftBytes:
    """This rank's shard of the target's and the draft's bytes of every cached page, under the
    page's prefix. ``remember`` takes them from the tree (the prefix on the device);
    ``check_served`` wraps the cache's ``begin_request`` so every admission compares each
    served page whose prefix was remembered, once its load-back (both pools) has landed."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.page = engine, engine.page_size
        self.want: dict[tuple, tuple[bytes, bytes]] = {}
        self.checked, self.unknown, self.mismatched = 0, 0, {"target": 0, "draft": 0}

    def _pages(self, ids) -> tuple[bytes, bytes]:
        e = self.engine
        return local_pages(e.device_pool, ids), local_pages(e.spec.device_pool, ids)

    def remember(self, tokens: list) -> None:
        cache, p = self.engine.cache, self.page
        key = self.engine.spec.key(np.asarray(tokens, np.int64), len(tokens) - 1)
        req, _lb = cache.begin_request(key, load_back=False)
        try:
            ids = key.token_ids
            for i, page in enumerate(req.device_pages.tolist()):
                self.want[tuple(ids[: (i + 1) * p].tolist())] = self._pages([page])
        finally:
            if req.last_node is not None:
                cache.dec_lock_ref(req.last_node)

    def check_served(self) -> None:
        e, p = self.engine, self.page
        begin = e.cache.begin_request

        def begin_checked(key, *a, **kw):
            req, lb = begin(key, *a, **kw)
            if lb is not None:  # landed: every layer of the target's pool, and the draft's
                for i in range(e.geom.num_layers):
                    lb.wait_layer(i)
                e.spec.wait_load(lb)
            ids = key.token_ids
            for i, page in enumerate(req.device_pages.tolist()):
                want = self.want.get(tuple(ids[: (i + 1) * p].tolist()))
                if want is None:
                    self.unknown += 1
                    continue
                self.checked += 1
                for name, got, w in zip(("target", "draft"), self._pages([page]), want):
                    self.mismatched[name] += got != w
            return req, lb

        e.cache.begin_request = begin_checked


def late_draft_backups(engine: Engine, rec, fired: dict) -> None:
    """Rank 1: the draft pool's D2H copies report done one step after the target's late ones,
    so a page's backup is complete on this rank only when its draft half is."""
    transfer = engine.spec.transfer
    backup = transfer.backup

    def late(d, h):
        fired["slow_draft_d2h"] += 1
        handle = LateHandle(backup(d, h), rec)
        handle.ready_at += 1
        return handle

    transfer.backup = late
    transfer.backup_owned = late


def zero_short_read_pages(engine: Engine, fired: dict) -> None:
    """Rank 1: a read ``engine_rank.diverge`` cut short leaves the first page past the reported
    hit zeroed in every pool's host page (the injection read it whole and only reported less),
    so a page attached past the agreed hit would serve wrong bytes, not the right ones."""
    store = engine.storage.storage
    get_multi = store.get_multi

    def zeroing(transfers):
        before = fired["short_read"]
        r = get_multi(transfers)
        if fired["short_read"] > before:
            for t in transfers:
                ids = np.asarray(t.host_page_ids)
                if r.hit_pages < ids.size and ids[r.hit_pages] >= 0:
                    store.codecs[t.pool].runs().zero(int(ids[r.hit_pages]))
                    fired["short_read_zeroed"] += 1
        return r

    store.get_multi = zeroing


def count_draft_reads(engine: Engine, counts: dict) -> None:
    """Count the pages of the ``draft`` pool every storage read of this rank returned."""
    store = engine.storage.storage
    get_multi = store.get_multi

    def counted(transfers):
        r = get_multi(transfers)
        counts["draft_read_pages"] += r.pool_hits.get("draft", 0)
        counts["target_read_pages"] += r.pool_hits.get("target", 0)
        return r

    store.get_multi = counted


def workload(engine: Engine, rounds: int, late_s: float, fired: dict, before_l3=None) -> tuple[list, list, DraftBytes]:
    """Multi-turn conversations; before round 2 the device tier is dropped (L2), before round 3
    the device and host tiers (L3), after ``before_l3()`` (if given). Returns (tokens, cached
    tokens by tier, the byte check)."""
    rng = np.random.default_rng(5)
    hist = [rng.integers(0, MODEL.vocab_size, FIRST).tolist() for _ in range(CLIENTS)]
    tokens, tiers = [], []
    audit = DraftBytes(engine)
    for r in range(rounds):
        if r == 3:
            if before_l3 is not None:
                before_l3()
            engine.flush()
            for h in hist:  # what the tree holds: the last prompt and its answer
                audit.remember(h)
            audit.check_served()
            engine.evict_host_cache()
        if r:
            for h in hist:
                h.extend(rng.integers(0, MODEL.vocab_size, TURN).tolist())
        if r == 2:
            engine.evict_device_cache()
        if late_s:
            time.sleep(late_s)
            fired["late_start"] += 1
        res = engine.generate([list(h) for h in hist], ANSWER)
        for h, x in zip(hist, res):
            h.extend(x.tokens)
            tokens.append(x.tokens)
            tiers.append(x.cached_tokens)
    return tokens, tiers, audit


def main() -> None:
    run_l3_script(serve)


def serve(storage_dir: str, ranks, agreement: str, div: str) -> dict:
    """One run of the workload over ``storage_dir`` (the engine built, served, closed)."""
    cfg = EngineCacheConfig(
        page_size=PAGE,
        device_pages=64,
        host=HostPoolConfig(ratio=2.0),
        max_batch=3,
        prefill_chunk=16,
        max_context=96,
        storage=StorageConfig(
            backend="file", path=storage_dir, prefetch_threshold_tokens=PAGE, prefetch_timeout_base_s=30.0
        ),
    )  # no 1 s deadline on a loaded box
    engine = Engine(MODEL, cfg, spec=SpecConfig(num_draft_tokens=K), ranks=ranks)
    rec = AfterStepRecorder(engine.cache)
    fired = dict.fromkeys(FIRED, 0)
    late = 0.0
    rounds = ROUNDS
    before_l3 = None
    if ranks is not None:
        engine.cache.step_agreement.add(rec)
        engine.cache.step_agreement.check_digest = agreement != "none"
        if ranks.rank == 1 and div == "all":
            host_alloc = engine.cache.host_allocator.alloc
            diverge(engine, rec, fired)
            late_draft_backups(engine, rec, fired)

            def calm_host_alloc() -> None:  # the L3 round's host reservations all succeed: its reads run
                engine.cache.host_allocator.alloc = host_alloc

            before_l3 = calm_host_alloc
            zero_short_read_pages(engine, fired)
            late = LATE_S
        elif ranks.rank == 1 and div == "alloc":
            fail_every(engine.cache.host_allocator, 3, fired, "alloc_fail")
    if div in ("alloc", "calm"):
        rounds = CONTROL_ROUNDS
    reads = {"draft_read_pages": 0, "target_read_pages": 0}
    count_draft_reads(engine, reads)  # after rank 1's short reads: counts what the reads returned
    tokens, tiers, audit = workload(engine, rounds, late, fired, before_l3)
    engine.flush()  # every copy acknowledged: the last digest is the settled state
    rec.prepare()
    rec.apply(None)
    metrics = {k: v for k, v in engine.cache.metrics.as_dict().items() if "prefetch" in k or "storage" in k}
    metrics["prefetch_skipped_by_reason"] = dict(engine.cache.metrics.prefetch_skipped_by_reason)
    stats = engine.cache.step_agreement.stats() if ranks is not None else {}
    engine.close()
    return {
        "tokens": tokens,
        "tiers": tiers,
        "digests": rec.digests,
        "fired": fired,
        "metrics": metrics,
        "stats": stats,
        "reads": reads,
        "bytes_remembered": len(audit.want),
        "bytes_checked": audit.checked,
        "bytes_unknown": audit.unknown,
        "bytes_mismatched": audit.mismatched,
    }


if __name__ == "__main__":
    if "HICACHE_RANK" in os.environ:
        from hicache_jax.distributed import run_rank

        run_rank(main)
    else:
        main()
