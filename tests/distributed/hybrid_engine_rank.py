"""One rank of the two-process hybrid (sliding-window) engine test
(``test_engine_ranks_hybrid``), or the single-process run.

usage: hybrid_engine_rank.py OUT_DIR AGREEMENT DIVERGE   (launched: HICACHE_RANK set)
       hybrid_engine_rank.py OUT_DIR single -            (one process, the reference)

The reference engine with a tiny hybrid model (``HYBRID_TINY``: one SWA layer, one full layer;
KV heads sharded over the ranks, the SWA pool as the full pool) serves a multi-turn workload
without L3: the second round's prefixes come from the device (L1); the device tier is dropped
before the last round, so its prefixes come back from the host (L2), windows included. With
DIVERGE=swa, rank 1 alone fails every other SWA host allocation (its backups of SWA pages):
the agreement must turn that into the same SWA host tombstones on both ranks. A participant
of the step agreement records the tree's digest after every step (``AfterStepRecorder``),
and ``check_digest`` makes every exchange compare them too. Writes OUT_DIR/<rank or single>.json: tokens per request,
digests, tiers served, what fired, SWA slides agreed.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from engine_rank import Recorder, fail_every, multiturn  # noqa: E402 - this script's directory is on sys.path
from hicache_jax.engine import Engine, EngineCacheConfig
from hicache_jax.host_pool import HostPoolConfig
from hicache_jax.reference_model import HYBRID_TINY

MODEL = HYBRID_TINY  # window 24
PAGE = 4
# The first client's prompt is long: its prefill runs chunks back to back with no agreement
# step between them, so its agreed slides lag more than a step and the SWA pool (sized exactly)
# runs short; the engine must then agree (apply the slides) and retry.
CLIENTS, ROUNDS, FIRSTS, TURN, ANSWER = 3, 3, (216, 72, 72), 8, 4


class AfterStepRecorder(Recorder):
    """The tree's digest after every agreement step (its last participant: after every
    other's ``apply``), as well as at the exchange (``check_digest``): the state after the
    agreed outcome is applied is what must match."""

    def prepare(self) -> None:
        self.step += 1

    def apply(self, agreed) -> None:
        self.digests.append(self.cache.debug_view().digest())


def diverge(engine, fired: dict) -> None:
    fail_every(engine.swa.host_allocator, 2, fired, "swa_host_alloc_fail")  # the SWA pool's host allocator


def workload(engine) -> tuple[list, list]:
    return multiturn(engine, FIRSTS, ROUNDS, TURN, ANSWER, seed=11)


def main() -> None:
    out_dir, agreement, div = sys.argv[1:4]
    ranks, name = None, "single"
    if agreement != "single":
        from hicache_jax.engine.multiprocess import rank_context

        ranks = rank_context(agreement, timeout_s=60)
        name = f"rank{ranks.rank}"
    cfg = EngineCacheConfig(
        page_size=PAGE, device_pages=256, host=HostPoolConfig(ratio=2.0), max_batch=3, prefill_chunk=16, max_context=256
    )
    # Exactly what the running requests can hold (with ranks: the slide lag included), so the
    # agreed slides must free pages in time (``_alloc_swa`` runs an agreement step when short).
    cfg = replace(cfg, swa_device_pages=Engine.swa_pages_needed(MODEL, cfg, ranks=ranks is not None))
    engine = Engine(MODEL, cfg, ranks=ranks)
    rec = AfterStepRecorder(engine.cache)
    fired = {"swa_host_alloc_fail": 0}
    if ranks is not None:
        engine.cache.step_agreement.add(rec)
        engine.cache.step_agreement.check_digest = True
        if div == "swa" and ranks.rank == 1:
            diverge(engine, fired)
    tokens, tiers = workload(engine)
    slides = engine.cache.stats().get("agreement", {}).get("agreed_slides", 0)  # the agreed slides, counted
    stats = engine.cache.step_agreement.stats() if ranks is not None else {}
    engine.close()
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(
            {
                "tokens": tokens,
                "tiers": tiers,
                "digests": rec.digests,
                "fired": fired,
                "slides": slides,
                "swa_allocs_after_agreed_slides": engine.metrics.swa_allocs_after_agreed_slides,
                "stats": stats,
            },
            f,
        )


if __name__ == "__main__":
    if "HICACHE_RANK" in os.environ:
        from hicache_jax.distributed import run_rank

        run_rank(main)
    else:
        main()
