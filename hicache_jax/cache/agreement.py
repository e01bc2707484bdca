"""Agreement across processes on per-rank outcomes that change the tree.

Pure Python + numpy. In multi-process serving (tensor-parallel ranks) every rank runs its own
copy of the tree over its shard of every page, and the trees must make the same decisions:
otherwise ranks issue different collectives (deadlock) or serve different KV. The rule: every
tree mutation is a function of values identical on all ranks. Whatever a rank observes on its
own (a D2H copy finished, a host allocation succeeded, N pages read from storage, a prefetch
past its deadline) is only an *input* to an agreement; the tree acts on the agreed value.

An ``Agreement`` reduces a fixed-shape int64 vector elementwise with MIN over ranks
(``agree_min``); a MAX is the MIN of the negated values. Every rank must call it the same
number of times, in the same order, with vectors of the same shape, which the cache's
``StepAgreement`` (``step_agreement``) guarantees: one vector per scheduler step, built from
state every rank shares, exchanged unconditionally even when nothing changed.

Implementations:

* ``SingleProcessAgreement`` (the default): one process, the identity; ``collective`` is
  False, so the cache keeps its direct single-process paths (no per-step exchange, backups
  allocated at once).
* ``NoExchangeAgreement``: the multi-rank protocol with the exchange switched off (every
  rank acts on its own values). Only for tests that show what the exchange prevents.
* Over ``jax.distributed`` (``hicache_jax.distributed``): ``DeviceAgreement``
  (``multihost_utils.process_allgather`` then MIN, on the thread that dispatches device
  work) and ``KVStoreAgreement`` (the coordination service's key-value store and a barrier
  bounded by a timeout; usable from worker threads, one instance per thread).

Threading: an instance is used by one thread (its calls are numbered).
"""

from __future__ import annotations

import numpy as np


class AgreementError(RuntimeError):
    """The ranks could not agree: a barrier timed out, or they exchanged different shapes."""


class RankDivergenceError(AgreementError):
    """The ranks' states differ where they must be equal (the layout of a step's vector, or,
    when checked, the trees' digests): a rank mutated its tree from a value of its own."""


class Agreement:
    """Interface: the elementwise MIN over ranks of a fixed-shape int64 vector.

    ``rank`` / ``num_processes``: this process's place in the group. ``collective``: True when
    the ranks exchange values (or, for ``NoExchangeAgreement``, pretend to), so the cache must
    run its agreed protocol; False for the single-process identity.
    """

    rank: int = 0
    num_processes: int = 1
    collective: bool = False

    def agree_min(self, values: np.ndarray) -> np.ndarray:  # pragma: no cover - interface
        """``values``: 1-D int64, the same shape on every rank. Returns its MIN over ranks."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the implementation holds (nothing by default)."""


def check_rank(rank: object, num_processes: object) -> tuple[int, int]:
    """(rank, num_processes) as ints after checks: ``num_processes >= 1``, ``0 <= rank < num_processes``."""
    for name, v in (("rank", rank), ("num_processes", num_processes)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if num_processes < 1:
        raise ValueError(f"num_processes: expected >= 1, got {num_processes}")
    if not 0 <= rank < num_processes:
        raise ValueError(f"rank: expected 0 <= rank < num_processes ({num_processes}), got {rank}")
    return int(rank), int(num_processes)


def check_values(values: object) -> np.ndarray:
    """``agree_min``'s argument as a 1-D int64 vector; TypeError / ValueError naming it."""
    arr = np.asarray(values)
    if arr.dtype.kind not in "iub":
        raise TypeError(f"values: expected a 1-D integer vector, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"values: expected a 1-D vector (one value per slot), got shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


class SingleProcessAgreement(Agreement):
    """One process: every local value is already agreed."""

    def agree_min(self, values: np.ndarray) -> np.ndarray:
        return check_values(values)

    def __repr__(self) -> str:
        return "SingleProcessAgreement()"


class NoExchangeAgreement(Agreement):
    """The multi-rank protocol without the exchange: ``agree_min`` returns the rank's own
    values. For tests only: with per-rank divergence injected, the trees must then differ,
    which shows the divergence test can see what the real exchange prevents."""

    collective = True

    def __init__(self, rank: int = 0, num_processes: int = 1) -> None:
        self.rank, self.num_processes = check_rank(rank, num_processes)

    def agree_min(self, values: np.ndarray) -> np.ndarray:
        return check_values(values)

    def __repr__(self) -> str:
        return f"NoExchangeAgreement(rank={self.rank}, num_processes={self.num_processes})"
