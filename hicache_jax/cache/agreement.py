"""Agreement across processes on per-rank outcomes that change the tree.

Pure Python. In multi-process serving every rank runs its own copy of the tree over its
shard of every page, and the trees must make the same decisions. Whatever a rank observes on
its own (how many queued copies its engine finished, how many pages it read from storage)
passes through an ``Agreement`` before the tree acts on it; the agreed value is the MIN over
ranks, so every rank acts on what every rank has.

``SingleProcessAgreement`` (the default) is the identity. The transfer ledger asks one
question today: ``min_count(topic, n)``, the number of finished copies at the head of a
queue (``topic``: ``"backup"`` or ``"load"``). An implementation over ``jax.distributed`` or a
coordination-service key-value store plugs in here (see the open multi-process issue); it
must be called by every rank at the same points with the same topics, which the ledger does:
one call per acknowledgement pass, even when ``n`` is zero.

For the multi-process issue (next step): ``HiRadixCache.check_events`` runs an
acknowledgement pass only for a non-empty queue today; with several ranks it must run both
passes unconditionally every scheduler step (a rank with an empty queue must still take part
in the collective), and a blocking pass (``flush``) must agree too. Host-page allocation for
backups and prefetches (``backup``, ``reserve_host_pages``) does not go through the
agreement yet: it needs reserve -> agree -> commit or roll back.
"""

from __future__ import annotations


class Agreement:
    """Interface: turn a per-rank count into the count every rank agrees on."""

    def min_count(self, topic: str, n: int) -> int:  # pragma: no cover - interface
        raise NotImplementedError


class SingleProcessAgreement(Agreement):
    """One process: every local count is already agreed."""

    def min_count(self, topic: str, n: int) -> int:
        return n

    def __repr__(self) -> str:
        return "SingleProcessAgreement()"
