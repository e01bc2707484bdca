"""The reference engine as N processes on one machine: tensor-parallel ranks, one cache state.

Each process is a rank (``jax.distributed`` on the CPU with gloo collectives, one CPU device
per process; ``hicache_jax.distributed.launch_local`` starts them). ``RankContext`` is what
the engine needs to be one rank of N:

* ``mesh``: every process's device on one axis ``tp``. The device pool is sharded over it on
  the KV-head axis, so each process holds its own heads of every page (an MLA latent pool is
  replicated); the host pool holds the same share (``JaxDevicePool.local_geom``). The model's
  weights are replicated on the mesh and its step is one program over every rank's shards
  (XLA inserts the collectives), so every rank computes the same logits and tokens.
* ``agreement``: the cache's ``Agreement`` (``"kv"``: the coordination service's key-value
  store; ``"device"``: ``process_allgather``). The cache, its L3 controller and the engine's
  clock agree once per scheduler step (``HiRadixCache.check_events``); the scheduler's own
  decisions use only agreed state, so every rank admits, evicts and backs up alike.
* ``AgreedClock``: arrivals are admitted by the MIN over ranks of the time since ``generate``
  started, agreed at each step (a rank's own clock would admit a request one step earlier
  than another's).

Rank divergence the engine itself would cause is removed at the source: a load-back that
fails on one rank is acknowledged by every rank (``loading_check(block=True)`` after each
waited load-back), so a retry or a latched failure happens on all of them at the same step.

``launch_bench(args, fn_name)`` runs a serving benchmark in ``args.num_processes`` ranks
(``hicache-jax bench multiturn --num-processes 2``): every rank runs the same workload; rank 0
prints and writes the report; the parent checks that every rank produced the same tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from ..cache import Agreement, HiRadixCache

RANK_ENV = "HICACHE_RANK"
RANK_OUT_ENV = "HICACHE_RANK_OUT"


@dataclass
class RankContext:
    """One rank's place among the processes (see the module docstring)."""

    rank: int
    num_processes: int
    mesh: object  # jax.sharding.Mesh over every process's device, axis "tp"
    agreement: Agreement

    def replicate(self, tree):
        """Put ``tree`` (a model's weights) on every rank's device, replicated."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))


def rank_context(agreement: str = "kv", timeout_s: float = 120.0) -> RankContext:
    """In a launched rank: join the others (``initialize_from_env``) once, then build the
    mesh and the agreement (``"kv"`` or ``"device"``)."""
    global _CONTEXT
    if _CONTEXT is not None:
        return _CONTEXT
    import jax
    from jax.sharding import Mesh

    from ..distributed import initialize_from_env, make_agreement

    rank, n = initialize_from_env()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("tp",))
    kw = {"timeout_s": timeout_s} if agreement == "kv" else {"arrival_timeout_s": timeout_s}
    _CONTEXT = RankContext(rank, n, mesh, make_agreement(agreement, **kw))
    return _CONTEXT


_CONTEXT: RankContext | None = None


class AgreedClock:
    """A ``StepAgreement`` participant: the MIN over ranks of the seconds since ``start``.

    ``now()`` is ``start`` plus the agreed seconds: a time in this rank's ``perf_counter``
    frame that every rank reads alike (it advances only at agreement steps)."""

    def __init__(self, cache: HiRadixCache) -> None:
        self.start = time.perf_counter()
        self.elapsed = 0.0
        cache.step_agreement.add(self)

    def restart(self) -> float:
        self.start, self.elapsed = time.perf_counter(), 0.0
        return self.start

    def now(self) -> float:
        return self.start + self.elapsed

    def prepare(self) -> None:
        pass

    def report(self, out: list[int]) -> None:
        out.append(int((time.perf_counter() - self.start) * 1e6))

    def apply(self, agreed) -> None:
        self.elapsed = max(self.elapsed, int(agreed[0]) / 1e6)


# ---------------------------------------------------------------------------------------------- the benchmark
def launch_bench(args, fn_name: str, timeout_s: float = 3600.0) -> dict:
    """Run ``hicache_jax.bench.serving.<fn_name>`` in ``args.num_processes`` ranks (see the
    module docstring). Returns rank 0's report plus ``ranks``: per rank whether its tokens
    equal rank 0's."""
    from ..distributed import launch_local

    n = args.num_processes
    tmp = tempfile.mkdtemp(prefix="hicache-ranks-")
    storage_dir = args.storage_dir
    made_storage = False
    if args.storage_backend != "none" and not storage_dir:
        storage_dir = os.path.join(tmp, "l3")  # every rank shares one store
        made_storage = True
    try:
        argv = [sys.executable, "-m", "hicache_jax.cli", "bench", fn_name.replace("_", "-"),
                *_argv_of(args, storage_dir)]
        env = {**os.environ, RANK_OUT_ENV: tmp}
        print(f"starting {n} ranks (jax.distributed on the CPU, agreement {args.agreement})", file=sys.stderr)
        results = launch_local(argv, n, timeout_s, env=env)
        print(results[0].output, end="")
        reports = []
        for r in range(n):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                reports.append(json.load(f))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if made_storage:
            args.storage_dir = None
    payload = reports[0]["payload"]
    same = [rep["tokens"] == reports[0]["tokens"] for rep in reports]
    payload["ranks"] = {"num_processes": n, "agreement": args.agreement, "same_tokens_as_rank0": same,
                        "agreement_steps": [rep["agreement"] for rep in reports]}
    print(f"{n} ranks: tokens identical on every rank: {all(same)}; agreement "
          f"{args.agreement}: {reports[0]['agreement']['exchanges']} exchanges, "
          f"{reports[0]['agreement']['seconds'] * 1e3:.0f} ms in all on rank 0")
    return payload


def _argv_of(args, storage_dir: str | None) -> list[str]:
    out = []
    for k, v in vars(args).items():
        if k in ("num_processes", "storage_dir") or v is None:
            continue
        out += [f"--{k.replace('_', '-')}", str(v)]
    if storage_dir:
        out += ["--storage-dir", storage_dir]
    return out


def in_rank() -> bool:
    """Whether this process is a launched rank."""
    return RANK_ENV in os.environ


def rank_out(args) -> None:
    """In a launched rank other than 0: write reports and plots beside the parent's files,
    not over rank 0's ``--out``."""
    if in_rank() and int(os.environ[RANK_ENV]) != 0 and os.environ.get(RANK_OUT_ENV):
        args.out = os.path.join(os.environ[RANK_OUT_ENV], f"rank{os.environ[RANK_ENV]}-report.json")


def report_rank(engine, payload: dict, tokens: list) -> None:
    """In a launched rank: hand the parent this rank's report, its tokens and its agreement
    counts (``HICACHE_RANK_OUT``)."""
    out = os.environ.get(RANK_OUT_ENV)
    if not out or not in_rank():
        return
    rank = int(os.environ[RANK_ENV])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"payload": payload if rank == 0 else None, "tokens": tokens,
                   "agreement": engine.cache.step_agreement.stats()}, f, default=str)
