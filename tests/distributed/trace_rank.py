"""One rank of the two-process divergence trace (``test_two_processes``), started by
``hicache_jax.distributed.launch_local``.

usage: trace_rank.py AGREEMENT DIVERGENCE STORAGE_DIR OUT_DIR STEPS [COMPONENTS]
  AGREEMENT   kv | device | none (``NoExchangeAgreement``: the protocol without the exchange);
              ``kv+none``: the kv run, then in the same processes the none run (the agreement-off
              control; a fresh cache, over STORAGE_DIR/none, written to OUT_DIR/none): one launch
  DIVERGENCE  one of rank_trace.divergences(), ``all``, or ``-``; injected on rank 1 only; ``stall``:
              rank 1 never takes part (sleeps), so rank 0's bounded barrier must time out
  COMPONENTS  full (default: the full pool with an L3 controller on STORAGE_DIR), swa or draft+swa
              (a hybrid cache, and a draft sidecar: ``rank_trace.run_swa_trace``, no L3)
  HICACHE_AGREEMENT_TIMEOUT (env): the agreement's barrier timeout in seconds (default 60)
Writes OUT_DIR/rank{R}.json: the trace's digests after every step, served prefixes, what fired.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache"))

from rank_trace import divergences, rank_cache, run_swa_trace, run_trace  # noqa: E402

from hicache_jax.cache import NoExchangeAgreement  # noqa: E402
from hicache_jax.distributed import initialize_from_env, make_agreement, run_rank  # noqa: E402


def main() -> None:
    kinds, divergence, storage_dir, out_dir, steps = sys.argv[1:6]
    components = sys.argv[6] if len(sys.argv) > 6 else "full"
    rank, n = initialize_from_env()
    first, *then = kinds.split("+")
    run(first, rank, n, divergence, storage_dir, out_dir, steps, components)
    for kind in then:  # the controls after the first run, each on a fresh cache (and store)
        sub_store, sub_out = os.path.join(storage_dir, kind), os.path.join(out_dir, kind)
        os.makedirs(sub_store, exist_ok=True)
        os.makedirs(sub_out, exist_ok=True)
        run(kind, rank, n, divergence, sub_store, sub_out, steps, components)


def run(
    kind: str, rank: int, n: int, divergence: str, storage_dir: str, out_dir: str, steps: str, components: str
) -> None:
    timeout = float(os.environ.get("HICACHE_AGREEMENT_TIMEOUT", "60"))
    if kind == "none":
        agreement = NoExchangeAgreement(rank, n)
    elif kind == "kv":
        agreement = make_agreement(kind, timeout_s=timeout)
    else:
        agreement = make_agreement(kind, arrival_timeout_s=timeout)
    if divergence == "stall" and rank == 1:
        time.sleep(600)  # never reaches its first exchange
    div = set()
    if rank == 1 and divergence not in ("-", "stall"):
        div = set(divergences(components, l3=components == "full")) if divergence == "all" else {divergence}
    if components == "full":
        cache, be, ctl = rank_cache(agreement, storage_dir=storage_dir)
        try:
            result = run_trace(cache, be, ctl, divergence=div, steps=int(steps))
        finally:
            ctl.close()
    else:
        cache, be, _ = rank_cache(agreement, components=components)
        result = run_swa_trace(cache, be, divergence=div, steps=int(steps))
    result.setdefault("exchanges", cache.step_agreement.exchanges)  # the SWA trace counts its steps' own
    result["agreement"] = repr(agreement)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    run_rank(main)
