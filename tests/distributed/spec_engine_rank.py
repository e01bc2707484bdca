"""One rank of the two-process speculative-decoding engine test (``test_engine_ranks_spec``),
or the single-process run.

usage: spec_engine_rank.py OUT_DIR AGREEMENT DIVERGE   (launched: HICACHE_RANK set)
       spec_engine_rank.py OUT_DIR single -            (one process, the reference)

The reference engine with speculative decoding (the tiny model of ``engine_rank``, its draft
pool sharded as the target's) serves a multi-turn workload without L3: the second round from
the device (L1), the last, after a device eviction, from the host (L2), draft pages with the
target's. With DIVERGE=alloc, rank 1 alone fails every third host allocation. Digests are
recorded after every agreement step (``AfterStepRecorder``). Writes OUT_DIR/<rank or
single>.json: tokens per request, digests, tiers served, what fired.
"""

from __future__ import annotations

import json
import os
import sys

from engine_rank import MODEL, fail_every, multiturn  # noqa: E402 - this script's directory is on sys.path
from hybrid_engine_rank import AfterStepRecorder  # noqa: E402
from hicache_jax.engine import Engine, EngineCacheConfig, SpecConfig
from hicache_jax.host_pool import HostPoolConfig

PAGE = 4
CLIENTS, ROUNDS, FIRST, TURN, ANSWER = 3, 3, 24, 8, 6


def diverge(engine, fired: dict) -> None:
    fail_every(engine.cache.host_allocator, 3, fired, "alloc_fail")


def workload(engine) -> tuple[list, list]:
    return multiturn(engine, [FIRST] * CLIENTS, ROUNDS, TURN, ANSWER, seed=5)


def main() -> None:
    out_dir, agreement, div = sys.argv[1:4]
    ranks, name = None, "single"
    if agreement != "single":
        from hicache_jax.engine.multiprocess import rank_context

        ranks = rank_context(agreement, timeout_s=60)
        name = f"rank{ranks.rank}"
    cfg = EngineCacheConfig(
        page_size=PAGE, device_pages=64, host=HostPoolConfig(ratio=2.0), max_batch=3, prefill_chunk=16, max_context=96
    )
    engine = Engine(MODEL, cfg, spec=SpecConfig(num_draft_tokens=3), ranks=ranks)
    rec = AfterStepRecorder(engine.cache)
    fired = {"alloc_fail": 0}
    if ranks is not None:
        engine.cache.step_agreement.add(rec)
        engine.cache.step_agreement.check_digest = True
        if div == "alloc" and ranks.rank == 1:
            diverge(engine, fired)
    tokens, tiers = workload(engine)
    engine.close()
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"tokens": tokens, "tiers": tiers, "digests": rec.digests, "fired": fired}, f)


if __name__ == "__main__":
    if "HICACHE_RANK" in os.environ:
        from hicache_jax.distributed import run_rank

        run_rank(main)
    else:
        main()
