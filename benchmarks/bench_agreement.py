"""Cost of one agreement per scheduler step, per implementation, with N local processes.

    python -m benchmarks.bench_agreement [--processes 2] [--rounds 7] [--calls 200] [--quick]
        [--out hicache-results/agreement.json]

The parent starts ``--processes`` ranks on this machine (``jax.distributed`` on the CPU, gloo
collectives; ``hicache_jax.distributed.launch_local``). Every rank then measures, in
alternating rounds (so the machine's speed swings hit every implementation alike):

* ``single``: ``SingleProcessAgreement.agree_min`` (the identity; what one process pays);
* ``kv``: ``KVStoreAgreement`` (key-value set, a barrier bounded by a timeout, a directory
  read, a delete: the coordination service's gRPC round trips);
* ``device``: ``DeviceAgreement`` (``process_allgather`` over gloo) behind its bounded
  arrival barrier (the default);
* ``device-unguarded``: the same without the barrier (``arrival_timeout_s=None``: faster,
  but a rank that never arrives hangs the others);
* ``step(kv)``: a whole ``HiRadixCache.check_events`` with several ranks (an empty cache over
  the numpy engine): building the vector from the participants, the ``kv`` exchange, the
  layout check and the apply; what the scheduler pays per step on top of its own work.

Each call exchanges the cache's fixed-shape vector (``StepAgreement.width`` int64s). A call's
time is taken on every rank (a rank waits for the slowest one, so these are the step's
cost, not one rank's CPU time); the table reports rank 0's median, 10th and 90th percentile
per call over every round, and the median of the per-round medians' ratio to ``kv``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hicache_jax.bench.report import machine_info, print_table, results_path, write_json  # noqa: E402

IMPLS = ("single", "kv", "device", "device-unguarded", "step(kv)")


def _rank_main(args) -> None:
    from hicache_jax.backends.numpy_backend import make_numpy_backend
    from hicache_jax.cache import HiCacheConfig, HiRadixCache, SingleProcessAgreement
    from hicache_jax.cache.step_agreement import DEFAULT_WIDTH
    from hicache_jax.distributed import DeviceAgreement, KVStoreAgreement, initialize_from_env
    from hicache_jax.kv_geometry import KVGeometry

    rank, n = initialize_from_env()
    width = args.width or DEFAULT_WIDTH
    vec = np.arange(width, dtype=np.int64) + rank
    geom = KVGeometry.mha(1, 1, 1, 2, "float32")
    _, _, engine = make_numpy_backend(geom, 64, 64)
    impls = {
        "single": SingleProcessAgreement().agree_min,
        "kv": KVStoreAgreement("bench-kv").agree_min,
        "device": DeviceAgreement("bench-dev").agree_min,
        "device-unguarded": DeviceAgreement("bench-dev-u", arrival_timeout_s=None).agree_min,
    }
    cache = HiRadixCache(
        HiCacheConfig(page_size=1), engine, engine.device_pool.allocator, agreement=KVStoreAgreement("bench-step")
    )
    impls["step(kv)"] = lambda _v: cache.check_events()
    for fn in impls.values():  # warm-up: compiles the device collective, opens channels
        for _ in range(5):
            fn(vec)
    per_round: dict[str, list[list[float]]] = {k: [] for k in impls}
    for r in range(args.rounds):
        order = list(impls) if r % 2 == 0 else list(reversed(impls))
        for name in order:
            fn = impls[name]
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                fn(vec)
                times.append(time.perf_counter() - t0)
            per_round[name].append(times)
        if rank == 0:
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    out = os.environ["BENCH_AGREEMENT_OUT"]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "num_processes": n, "width": width, "per_round": per_round}, f)


def _summarize(rank0: dict, impls) -> dict:
    res = {}
    kv_meds = [statistics.median(t) for t in rank0["per_round"]["kv"]]
    for name in impls:
        rounds = rank0["per_round"][name]
        allt = np.array([x for t in rounds for x in t]) * 1e6
        meds = [statistics.median(t) for t in rounds]
        res[name] = {
            "median_us": float(np.median(allt)),
            "p10_us": float(np.percentile(allt, 10)),
            "p90_us": float(np.percentile(allt, 90)),
            "mean_us": float(allt.mean()),
            "round_medians_us": [m * 1e6 for m in meds],
            "ratio_to_kv": statistics.median(m / k for m, k in zip(meds, kv_meds)),
        }
    return res


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=200, help="agreements per implementation per round")
    p.add_argument("--width", type=int, default=0, help="int64s per vector (0: the cache's StepAgreement width)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--quick", action="store_true", help="3 rounds x 50 calls (seconds), for a first look")
    p.add_argument("--out", default=results_path("agreement"), help="JSON result (under the current directory)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.calls = min(args.rounds, 3), min(args.calls, 50)
    if "HICACHE_RANK" in os.environ:
        from hicache_jax.distributed import run_rank

        run_rank(lambda: _rank_main(args))
        return {}
    import tempfile

    from hicache_jax.distributed import launch_local

    with tempfile.TemporaryDirectory(prefix="bench-agreement-") as tmp:
        env = {**os.environ, "BENCH_AGREEMENT_OUT": tmp}
        print(
            f"{args.processes} ranks x {len(IMPLS)} implementations x {args.rounds} rounds x {args.calls} calls",
            file=sys.stderr,
        )
        launch_local(
            [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])],
            args.processes,
            args.timeout,
            env=env,
        )
        ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(args.processes)]
    res = _summarize(ranks[0], IMPLS)
    rows = [[name, r["median_us"], r["p10_us"], r["p90_us"], r["ratio_to_kv"]] for name, r in res.items()]
    print_table(
        f"one agreement of {ranks[0]['width']} int64s, {args.processes} processes on this machine "
        f"(rank 0; {args.rounds} alternating rounds x {args.calls} calls)",
        ["implementation", "median us", "p10 us", "p90 us", "x kv (paired)"],
        rows,
    )
    payload = {"benchmark": "agreement", "machine": machine_info(), "config": vars(args), "results": res}
    path = write_json(args.out, payload)
    print(f"JSON written to {path}")
    return payload


if __name__ == "__main__":
    main()
