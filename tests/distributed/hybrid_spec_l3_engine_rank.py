"""One rank of the two-process test of speculative decoding of a hybrid (sliding-window) target
WITH L3 storage (``test_engine_ranks_hybrid_spec_l3``), or the single-process run.

usage: hybrid_spec_l3_engine_rank.py OUT_DIR STORAGE_DIR AGREEMENT DIVERGE   (launched: HICACHE_RANK set)
       hybrid_spec_l3_engine_rank.py OUT_DIR STORAGE_DIR single -           (one process, the reference)

The trained toy pair with a sliding-window layer (``hybrid_spec_engine_rank.hybrid_pair``: its
verify steps accept every proposal) serves the repetitive multi-turn workload of
``hybrid_spec_engine_rank`` in four rounds with L3 (file): the first computes everything, the
second hits the device (L1), the device tier is dropped before the third (L2), and device and
host before the fourth, so its prefixes come back from storage (L3): full pages, the windows'
SWA pages and the draft pages.

With DIVERGE=all, rank 1 alone: everything ``engine_rank.diverge`` does (fails every third
host allocation, but only until the L3 round, so that whether its reservations fail does not
depend on how the earlier rounds' copies were timed; finishes its target D2H copies late, reads
a page short of every storage read, sees the seventh page missing: here in the first storage
query it cuts only, ``missing_once``), fails
every other SWA host allocation in the first two rounds, and reports every window slide of a decode round a step late
(``LateSlides``). Each injection counts its firings. ``spec_l3_engine_rank.DraftBytes`` checks
this rank's shard of the full and draft pages the L3 round is served against what the tree
held for their prefixes before the tiers were dropped (the SWA pages are not compared here).
The single process also serves every prompt with plain greedy decoding (no cache, no
speculation). Writes OUT_DIR/<rank or single>.json.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import numpy as np
from engine_rank import diverge, fail_every  # noqa: E402 - this script's directory is on sys.path
from hybrid_engine_rank import AfterStepRecorder  # noqa: E402
from hybrid_spec_engine_rank import (  # noqa: E402
    ANSWER,
    CLIENTS,
    FIRSTS,
    K,
    PAGE,
    PERIOD,
    TURN,
    LateSlides,
    hybrid_pair,
)
from spec_l3_engine_rank import DraftBytes, count_draft_reads  # noqa: E402

from hicache_jax.engine import Engine, EngineCacheConfig, SpecConfig
from hicache_jax.host_pool import HostPoolConfig
from hicache_jax.storage import StorageConfig

ROUNDS = 4
FIRED = ("alloc_fail", "slow_d2h", "short_read", "missing_page", "swa_host_alloc_fail", "late_slide")


class Round:
    """The workload's round (the SWA allocation failures fire in the first two only) and what
    runs before the L3 round (``before_l3``)."""

    index = 0
    before_l3 = None


def missing_once(engine: Engine, exists_multi, fired: dict) -> None:
    """``diverge``'s missing page only on the first storage query it cuts (one request of the L3
    round): on every query it caps each hit at 6 pages, where these prompts (40+ tokens) have
    no stored window, so nothing attached on either rank and the test saw no L3 hit at all."""
    store = engine.storage.storage
    missing = store.exists_multi

    def first_only(transfers):
        return missing(transfers) if not fired["missing_page"] else exists_multi(transfers)

    store.exists_multi = first_only


def fail_swa_early(engine: Engine, fired: dict, now: Round) -> None:
    """Every other SWA host allocation fails in the first two rounds (backups of SWA pages)."""
    fail_every(engine.swa.host_allocator, 2, fired, "swa_host_alloc_fail", lambda: now.index < 2)


def workload(engine: Engine, now: Round) -> tuple[list, list, list, list, DraftBytes]:
    """Returns (prompts, tokens, cached tokens by tier, accept lengths) per request, and the
    byte check of the full and draft pages the L3 round was served (``DraftBytes``)."""
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(3)
    patterns = [rng.integers(0, vocab, PERIOD) for _ in range(CLIENTS)]
    hist = [np.resize(p, n).tolist() for p, n in zip(patterns, FIRSTS)]
    prompts, tokens, tiers, accepts = [], [], [], []
    audit = DraftBytes(engine)
    for r in range(ROUNDS):
        now.index = r
        if r == 3:
            if now.before_l3 is not None:
                now.before_l3()
            engine.flush()
            for h in hist:  # what the tree holds: the last prompt and its answer
                audit.remember(h)
            audit.check_served()
        if r:  # the next turn continues the client's pattern
            for h, p in zip(hist, patterns):
                h.extend(p[(len(h) + i) % PERIOD] for i in range(TURN))
        if r == 2:
            engine.evict_device_cache()
        if r == 3:
            engine.evict_host_cache()
        batch = [[int(t) for t in h] for h in hist]
        res = engine.generate(batch, ANSWER)
        for h, prompt, x in zip(hist, batch, res):
            h.extend(x.tokens)
            prompts.append(prompt)
            tokens.append(x.tokens)
            tiers.append(x.cached_tokens)
            accepts.append(x.accept_lengths)
    return prompts, tokens, tiers, accepts, audit


def main() -> None:
    out_dir, storage_dir, agreement, div = sys.argv[1:5]
    ranks, name = None, "single"
    if agreement != "single":
        from hicache_jax.engine.multiprocess import rank_context

        ranks = rank_context(agreement, timeout_s=60)
        name = f"rank{ranks.rank}"
    pair = hybrid_pair()
    spec = SpecConfig(num_draft_tokens=K)
    cfg = EngineCacheConfig(
        page_size=PAGE,
        device_pages=256,
        host=HostPoolConfig(ratio=2.0),
        max_batch=CLIENTS,
        prefill_chunk=16,
        max_context=256,
        storage=StorageConfig(
            backend="file", path=storage_dir, prefetch_threshold_tokens=PAGE, prefetch_timeout_base_s=30.0
        ),
    )  # no 1 s deadline on a loaded box
    cfg = replace(cfg, swa_device_pages=Engine.swa_pages_needed(pair.config, cfg, spec, ranks=ranks is not None))
    engine = Engine(pair.config, cfg, spec=spec, weights=pair, ranks=ranks)
    rec = AfterStepRecorder(engine.cache)
    fired = dict.fromkeys(FIRED, 0)
    now = Round()
    if ranks is not None:
        engine.cache.step_agreement.add(rec)
        engine.cache.step_agreement.check_digest = True
        if div == "all" and ranks.rank == 1:
            host_alloc = engine.cache.host_allocator.alloc
            exists_multi = engine.storage.storage.exists_multi
            diverge(engine, rec, fired)
            missing_once(engine, exists_multi, fired)

            def calm_host_alloc() -> None:  # the L3 round's host reservations all succeed: its reads run
                engine.cache.host_allocator.alloc = host_alloc

            now.before_l3 = calm_host_alloc
            fail_swa_early(engine, fired, now)
            LateSlides(engine, fired)
    reads = {"draft_read_pages": 0, "target_read_pages": 0}
    count_draft_reads(engine, reads)
    prompts, tokens, tiers, accepts, audit = workload(engine, now)
    engine.flush()
    rec.prepare()
    rec.apply(None)
    metrics = {k: v for k, v in engine.cache.metrics.as_dict().items() if "prefetch" in k or "storage" in k}
    metrics["prefetch_skipped_by_reason"] = dict(engine.cache.metrics.prefetch_skipped_by_reason)
    out = {
        "tokens": tokens,
        "tiers": tiers,
        "accept_lengths": accepts,
        "digests": rec.digests,
        "fired": fired,
        "reads": reads,
        "metrics": metrics,
        "swa_loaded_tokens": engine.swa.metrics.loaded_tokens,
        "bytes_remembered": len(audit.want),
        "bytes_checked": audit.checked,
        "bytes_unknown": audit.unknown,
        "bytes_mismatched": audit.mismatched,
    }
    engine.close()
    if ranks is None:  # plain greedy decoding of the same prompts: what speculation must reproduce
        plain = Engine(pair.config, replace(cfg, swa_device_pages=None, storage=None), weights=pair)
        out["plain_tokens"] = [r.tokens for r in plain.generate(prompts, ANSWER, use_cache=False)]
        plain.close()
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if "HICACHE_RANK" in os.environ:
        from hicache_jax.distributed import run_rank

        run_rank(main)
    else:
        main()
