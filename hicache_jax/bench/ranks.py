"""``--num-processes N`` for a serving benchmark: run it as N tensor-parallel ranks on this machine.

Pure Python (JAX is imported by the ranks, never by the parent).

The parent (``launch(args, name)``) starts N copies of the same ``hicache-jax bench <name>``
command line (every option explicit, ``--num-processes`` dropped) with
``hicache_jax.distributed.launch_local``: ``jax.distributed`` on the CPU with gloo
collectives, one CPU device per rank, every rank killed at a failure or at the deadline
(``--rank-timeout``). L3 is prepared once by the parent (a temporary directory or a local
Mooncake Store, ``serving._StorageDir``) and shared: each rank writes its own shard of every
page, rank 0 the commit markers; ``orbax`` (the default backend) is replaced by ``file``, with a
note, since orbax cannot save a log per process under ``jax.distributed``. Rank 0's output is
echoed as it runs.

Each rank (``in_rank()``) builds its engines as one of N (``rank_context``:
``hicache_jax.engine.multiprocess``), serves the same workload, and hands the parent its
tokens and agreement counts (``report_rank``); rank 0 alone writes ``--out`` and the plot
(``rank_out`` sends the others' files to a scratch directory). The parent checks that every
rank produced rank 0's tokens and returns rank 0's payload with a ``ranks`` section.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

RANK_ENV = "HICACHE_RANK"  # set by launch_local in every rank
RANK_OUT_ENV = "HICACHE_RANK_OUT"  # the parent's scratch directory for the ranks' reports
_NOT_PASSED = ("num_processes", "rank_timeout", "quick")  # quick: already applied by the parent


def in_rank() -> bool:
    """Whether this process is a launched rank."""
    return RANK_ENV in os.environ


def wants_ranks(args) -> bool:
    """The parent of ``--num-processes N > 1`` (not one of its ranks)."""
    return getattr(args, "num_processes", 1) > 1 and not in_rank()


def rank_context(args):
    """In a launched rank: its ``RankContext`` (joins the others once); None otherwise."""
    if not in_rank():
        return None
    from ..engine.multiprocess import rank_context as join

    return join(getattr(args, "agreement", "kv"))


def launch(args, name: str) -> dict:
    """Run ``hicache-jax bench <name>`` in ``args.num_processes`` ranks (see the module
    docstring). Returns rank 0's payload plus ``ranks``."""
    from ..distributed import launch_local

    n = args.num_processes
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"--num-processes: expected an int >= 1, got {n!r}")
    if args.storage_backend == "orbax":  # it refuses several jax.distributed processes (storage.orbax.store)
        args.storage_backend = "file"
        print(
            f"[{name}] note: --num-processes {n}: L3 on the file backend (orbax writes host arrays from JAX "
            f"process 0 only)",
            file=sys.stderr,
            flush=True,
        )
    tmp = tempfile.mkdtemp(prefix="hicache-ranks-")
    try:
        argv = [sys.executable, "-m", "hicache_jax.cli", "bench", name, *_argv_of(args)]
        env = {**os.environ, RANK_OUT_ENV: tmp}
        print(
            f"[{name}] starting {n} ranks (jax.distributed on the CPU, gloo; agreement {args.agreement}); "
            f"rank 0's output follows",
            file=sys.stderr,
            flush=True,
        )
        launch_local(argv, n, args.rank_timeout, env=env, echo=sys.stdout)
        reports = []
        for r in range(n):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                reports.append(json.load(f))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    payload = reports[0]["payload"]
    same = [rep["tokens"] == reports[0]["tokens"] for rep in reports]
    steps = [rep["agreement"] for rep in reports]
    payload["ranks"] = {
        "num_processes": n,
        "agreement": args.agreement,
        "same_tokens_as_rank0": same,
        "agreement_steps": steps,
    }
    per_step = steps[0]["seconds"] / max(steps[0]["exchanges"], 1)
    print(
        f"{n} ranks: tokens identical on every rank: {all(same)}; agreement {args.agreement}: "
        f"{steps[0]['exchanges']} exchanges on rank 0 over {steps[0]['caches']} engine(s), "
        f"{per_step * 1e6:,.0f} us each on average"
    )
    if not all(same):
        raise RuntimeError(f"ranks produced different tokens (same as rank 0: {same})")
    return payload


def _argv_of(args) -> list[str]:
    out = []
    for k, v in vars(args).items():
        if k in _NOT_PASSED or v is None or v is False:
            continue
        flag = f"--{k.replace('_', '-')}"
        if v is True:
            out.append(flag)
        elif isinstance(v, (list, tuple)):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out


def rank_out(args) -> None:
    """In a launched rank other than 0: write reports and plots to the parent's scratch
    directory, not over rank 0's ``--out``."""
    if in_rank() and int(os.environ[RANK_ENV]) != 0 and os.environ.get(RANK_OUT_ENV):
        args.out = os.path.join(os.environ[RANK_OUT_ENV], f"rank{os.environ[RANK_ENV]}-report.json")


def report_rank(caches, payload: dict, tokens) -> None:
    """In a launched rank: hand the parent this rank's payload (rank 0's is the report), its
    tokens (any JSON value the parent compares with rank 0's) and the agreement counts summed
    over ``caches`` (one cache, or every engine's cache the bench ran on this rank)."""
    out = os.environ.get(RANK_OUT_ENV)
    if not out or not in_rank():
        return
    rank = int(os.environ[RANK_ENV])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {"payload": payload if rank == 0 else None, "tokens": tokens, "agreement": agreement_totals(caches)},
            f,
            default=str,
        )


def agreement_totals(caches) -> dict:
    """Steps, exchanges and exchange seconds summed over the caches' step agreements (a bench
    that restarts engines runs several caches per rank; each counts only its own steps)."""
    if not isinstance(caches, (list, tuple)):
        caches = [caches]
    stats = [c.step_agreement.stats() for c in caches]
    return {
        "caches": len(stats),
        "steps": sum(s["steps"] for s in stats),
        "exchanges": sum(s["exchanges"] for s in stats),
        "seconds": sum(s["seconds"] for s in stats),
        "participants": sorted({p for s in stats for p in s["participants"]}),
    }
