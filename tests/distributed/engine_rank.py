"""One rank of the two-process engine test (``test_engine_ranks``), or the single-process run.

usage: engine_rank.py OUT_DIR STORAGE_DIR AGREEMENT DIVERGE   (launched: HICACHE_RANK set)
       engine_rank.py OUT_DIR STORAGE_DIR single -           (one process, the reference)

The reference engine (tiny model, KV heads sharded over the ranks) serves a multi-turn
workload with L3 (file) between rounds: the host and device tiers are dropped before the last
round, so its prefixes come back from storage. With DIVERGE=all, rank 1 alone: fails every
third host allocation, finishes its D2H copies ``SLOW`` steps late, reads one page short of
every storage read, sees every query's seventh page missing (mild enough that the last
round still hits L3 on every rank), and starts every round ``LATE_S`` after rank 0: rank 0
then waits at its first exchange, so its own clock runs ``LATE_S`` ahead of rank 1's and,
read directly, would admit the staggered arrivals (``ARRIVALS``) steps before rank 1 does. A participant of the step
agreement records the tree's digest at every step (and ``check_digest`` makes every exchange
compare the ranks' digests). Writes OUT_DIR/<rank or single>.json: tokens per request,
digests, tiers served, what fired.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace

import numpy as np

from hicache_jax.engine import Engine, EngineCacheConfig
from hicache_jax.host_pool import HostPoolConfig
from hicache_jax.reference_model import ModelConfig
from hicache_jax.storage import StorageConfig

MODEL = ModelConfig(vocab_size=256, num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn=64)
# MODEL's variants (engine_rank.py's optional 5th argument): KV heads sharded (``mha``, each rank
# its head), one KV head for two ranks (``one_kv_head``: the pool replicated on every rank) and
# MLA's one latent (``mla``: replicated).
MODELS = {
    "mha": MODEL,
    "one_kv_head": replace(MODEL, num_kv_heads=1),
    "mla": replace(MODEL, attention="mla", kv_lora_rank=16, qk_rope_head_dim=8),
}
PAGE = 4
CLIENTS, ROUNDS, FIRST, TURN, ANSWER = 3, 3, 24, 8, 4
SLOW = 3
LATE_S = 0.6
ARRIVALS = [0.0, 0.3, 0.6]  # seconds; a prefill step of this model takes a few ms


class Recorder:
    """Step-agreement participant: the tree's digest at every step, and the step count."""

    def __init__(self, cache) -> None:
        self.cache, self.digests, self.step = cache, [], 0

    def prepare(self) -> None:
        self.digests.append(self.cache.debug_view().digest())
        self.step += 1

    def report(self, out) -> None:
        pass

    def apply(self, agreed) -> None:
        pass


class LateHandle:
    """A D2H copy that reports itself done only ``SLOW`` steps after it was issued (waiting
    for it still waits for the copy)."""

    def __init__(self, inner, recorder: Recorder) -> None:
        self.inner, self.rec, self.ready_at = inner, recorder, recorder.step + SLOW

    def done(self) -> bool:
        return self.rec.step >= self.ready_at and self.inner.done()

    def wait(self, timeout=None) -> None:
        self.inner.wait()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def fail_every(allocator, every: int, fired: dict, key: str, active=lambda: True) -> None:
    """Make every ``every``-th non-empty ``allocator.alloc`` fail (None) while ``active()``,
    counted in ``fired[key]`` (this rank only: the divergence the agreement must absorb)."""
    alloc = allocator.alloc
    calls = [0]

    def failing(n):
        calls[0] += 1
        if n and calls[0] % every == 0 and active():
            fired[key] += 1
            return None
        return alloc(n)

    allocator.alloc = failing


def multiturn(engine, firsts, rounds: int, turn: int, answer: int, seed: int) -> tuple[list, list]:
    """Conversations whose first prompts have lengths ``firsts``, ``turn`` new tokens per round
    after the answers; the device tier is dropped before the last round, so its prefixes come
    back from the host. Returns (tokens, cached tokens by tier) per request."""
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(seed)
    hist = [rng.integers(0, vocab, n).tolist() for n in firsts]
    tokens, tiers = [], []
    for r in range(rounds):
        if r:
            for h in hist:
                h.extend(rng.integers(0, vocab, turn).tolist())
        if r == rounds - 1:
            engine.evict_device_cache()
        res = engine.generate([list(h) for h in hist], answer)
        for h, x in zip(hist, res):
            h.extend(x.tokens)
            tokens.append(x.tokens)
            tiers.append(x.cached_tokens)
    return tokens, tiers


def diverge(engine, rec: Recorder, fired: dict) -> None:
    fail_every(engine.cache.host_allocator, 3, fired, "alloc_fail")
    backup = engine.transfer.backup

    def late(d, h):
        fired["slow_d2h"] += 1
        return LateHandle(backup(d, h), rec)

    engine.transfer.backup = late
    engine.transfer.backup_owned = late
    store = engine.storage.storage
    get_multi, exists_multi = store.get_multi, store.exists_multi

    def short(transfers):
        r = get_multi(transfers)
        if r.hit_pages > 1:
            fired["short_read"] += 1
            return type(r)(r.hit_pages - 1, {k: max(0, v - 1) for k, v in r.pool_hits.items()})
        return r

    def missing(transfers):
        r = exists_multi(transfers)
        if r.hit_pages > 6:
            fired["missing_page"] += 1
            return type(r)(6, {k: min(v, 6) for k, v in r.pool_hits.items()})
        return r

    store.get_multi, store.exists_multi = short, missing


def workload(engine, late_s: float = 0.0, fired: dict | None = None) -> tuple[list, list]:
    rng = np.random.default_rng(7)
    hist = [rng.integers(0, MODEL.vocab_size, FIRST).tolist() for _ in range(CLIENTS)]
    tokens, tiers = [], []
    for r in range(ROUNDS):
        if r:
            for h in hist:
                h.extend(rng.integers(0, MODEL.vocab_size, TURN).tolist())
        if r == ROUNDS - 1:
            engine.evict_host_cache()  # the last round's prefixes come back from L3
        if late_s:
            time.sleep(late_s)
            fired["late_start"] += 1
        res = engine.generate([list(h) for h in hist], ANSWER, arrivals=ARRIVALS)
        for h, x in zip(hist, res):
            h.extend(x.tokens)
            tokens.append(x.tokens)
            tiers.append(x.cached_tokens)
    return tokens, tiers


def main() -> None:
    out_dir, storage_dir, agreement, div = sys.argv[1:5]
    model = MODELS[sys.argv[5] if len(sys.argv) > 5 else "mha"]
    ranks, name = None, "single"
    if agreement != "single":
        from hicache_jax.engine.multiprocess import rank_context

        ranks = rank_context(agreement, timeout_s=60)
        name = f"rank{ranks.rank}"
    cfg = EngineCacheConfig(
        page_size=PAGE,
        device_pages=24,
        host=HostPoolConfig(ratio=1.5),
        max_batch=4,
        prefill_chunk=16,
        max_context=96,
        storage=StorageConfig(
            backend="file", path=storage_dir, prefetch_threshold_tokens=PAGE, prefetch_timeout_base_s=30.0
        ),
    )  # no 1 s deadline on a loaded CI box
    engine = Engine(model, cfg, ranks=ranks)
    rec = Recorder(engine.cache)
    fired = {k: 0 for k in ("alloc_fail", "slow_d2h", "short_read", "missing_page", "late_start")}
    late = 0.0
    if ranks is not None:
        engine.cache.step_agreement.add(rec)
        engine.cache.step_agreement.check_digest = True
        if div == "all" and ranks.rank == 1:
            diverge(engine, rec, fired)
            late = LATE_S
    tokens, tiers = workload(engine, late, fired)
    metrics = {k: v for k, v in engine.cache.metrics.as_dict().items() if "prefetch" in k or "storage" in k}
    engine.flush()
    metrics["storage_written_pages"] = engine.storage.stats()["storage_written_pages"]  # by this process
    engine.close()
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(
            {
                "tokens": tokens,
                "tiers": tiers,
                "digests": rec.digests,
                "fired": fired,
                "stats": engine.cache.step_agreement.stats(),
                "metrics": metrics,
            },
            f,
        )


if __name__ == "__main__":
    if "HICACHE_RANK" in os.environ:
        from hicache_jax.distributed import run_rank

        run_rank(main)
    else:
        main()
