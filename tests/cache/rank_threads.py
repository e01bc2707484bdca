"""Several ranks as threads of one process, for the pure-numpy agreement tests (both envs).

``ThreadGroup(n).agreement(rank)`` is a real collective among ``n`` threads: each call posts
the rank's vector, waits at a barrier (bounded by ``timeout``) and takes the elementwise MIN
of every rank's vector. ``run_ranks`` runs one function per rank on its own thread and
returns their results, failing (never hanging) when a rank raises or outlives the timeout.
The process tests (``tests/distributed``) run the same protocol over ``jax.distributed``.
"""

from __future__ import annotations

import threading

import numpy as np

from hicache_jax.cache import Agreement, AgreementError


class ThreadGroup:
    def __init__(self, n: int, timeout: float = 60.0) -> None:
        self.n = n
        self.timeout = timeout
        self.barrier = threading.Barrier(n)
        self.slots: list = [None] * n
        self.calls = [0] * n

    def agreement(self, rank: int) -> "ThreadAgreement":
        return ThreadAgreement(self, rank)


class ThreadAgreement(Agreement):
    collective = True

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.num_processes = group, rank, group.n

    def agree_min(self, values: np.ndarray) -> np.ndarray:
        g = self.group
        g.slots[self.rank] = np.array(values, np.int64)
        g.calls[self.rank] += 1
        try:
            g.barrier.wait(g.timeout)
            shapes = {s.shape for s in g.slots}
            if len(shapes) != 1:
                raise AgreementError(f"ranks exchanged different shapes {sorted(shapes)}")
            out = np.min(np.stack(g.slots), axis=0)
            g.barrier.wait(g.timeout)  # every rank has read the slots before the next call posts
        except threading.BrokenBarrierError:
            raise AgreementError(
                f"rank {self.rank}: a barrier broke or timed out (call {g.calls[self.rank]})"
            ) from None
        return out


def run_ranks(group: ThreadGroup, fn, timeout: float = 120.0) -> list:
    """``fn(rank)`` on one thread per rank of ``group``; their results in rank order. A rank
    that raises aborts the group's barrier (so the others stop too, never hang) and the first
    error is re-raised; a rank still running after ``timeout`` fails the call."""
    n = group.n
    results: list = [None] * n
    errors: list = [None] * n

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[rank] = e
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        group.barrier.abort()
        raise AssertionError(f"ranks still running after {timeout} s (a hang)")
    first = next((e for e in errors if e is not None and not isinstance(e, AgreementError)), None)
    if first is None:
        first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
