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

``hicache-jax bench multiturn --num-processes N`` runs the benchmark this way
(``hicache_jax.bench.ranks``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..cache import Agreement, HiRadixCache


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
