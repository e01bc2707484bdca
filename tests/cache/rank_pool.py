"""Two (or more) ranks as persistent worker threads that run the same call in lockstep, for
fuzzing several ranks with one hypothesis state machine (``test_swa_fuzz_ranks``).

``RankPool(n, timeout)`` starts one thread per rank and a ``ThreadGroup`` among them;
``pool.run(fn)`` hands ``fn(rank)`` to every rank's thread at once (so the agreement calls
inside it meet at the group's barrier), waits for all of them and returns their results in
rank order. A rank that raises aborts the barrier (the others fail instead of waiting) and
the first error is re-raised; a call that outlives ``timeout`` fails. Each rank's thread is
the owner thread of whatever it builds (a cache binds the first thread that calls it).
"""

from __future__ import annotations

import queue
import threading

from rank_threads import ThreadGroup

from hicache_jax.cache import AgreementError


class RankPool:
    def __init__(self, n: int, timeout: float = 30.0) -> None:
        self.n = n
        self.timeout = timeout
        self.group = ThreadGroup(n, timeout=timeout)
        self._inbox = [queue.Queue() for _ in range(n)]
        self._outbox: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._loop, args=(r,), daemon=True) for r in range(n)]
        for t in self._threads:
            t.start()

    def _loop(self, rank: int) -> None:
        while True:
            fn = self._inbox[rank].get()
            if fn is None:
                return
            try:
                self._outbox.put((rank, True, fn(rank)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self.group.barrier.abort()
                self._outbox.put((rank, False, e))

    def run(self, fn) -> list:
        for q in self._inbox:
            q.put(fn)
        results: list = [None] * self.n
        errors: list = [None] * self.n
        for _ in range(self.n):
            try:
                rank, ok, value = self._outbox.get(timeout=self.timeout)
            except queue.Empty:
                self.group.barrier.abort()
                raise AssertionError(f"a rank still runs after {self.timeout} s (a hang)") from None
            (results if ok else errors)[rank] = value
        first = next((e for e in errors if e is not None and not isinstance(e, AgreementError)), None)
        if first is None:
            first = next((e for e in errors if e is not None), None)
        if first is not None:
            self.group.barrier.reset()
            raise first
        return results

    def close(self) -> None:
        for q in self._inbox:
            q.put(None)
        for t in self._threads:
            t.join(5)
