"""One fixed-shape agreement per scheduler step, over every per-rank outcome the tree acts on.

Pure Python + numpy, owner thread only. Used when the cache's ``Agreement`` is
``collective`` (several ranks); a single process never builds a vector.

Participants (the cache's transfer ledger and backup reservations, the L3 controller, the
engine's clock) register in a fixed order. ``step()``:

1. ``prepare()`` of each participant: local work decided from agreed state only (e.g.
   reserving host pages for a backup the tree already decided on: the *reserve* of
   reserve -> agree -> commit);
2. ``report(out)`` of each: append this rank's per-rank values (how many queued copies
   finished, whether a reservation succeeded, pages read from storage...). How many values a
   participant appends must depend on agreed state only (its queues, which change at agreed
   points), so every rank builds the same layout; values are MINs (a MAX is reported negated);
3. one ``Agreement.agree_min`` of the whole vector, zero-padded to ``width`` (a fixed shape,
   so a device implementation compiles once);
4. ``apply(agreed)`` of each, with exactly the values it reported, agreed: the *commit* (or
   roll back) on every rank alike. When the exchange itself fails (``AgreementError``: a
   rank built another layout, the agreement returned another shape) nothing is applied and
   each participant's optional ``abandon()`` gives back what its ``prepare()`` reserved.

The exchange happens every step even when nothing is reported (a rank with nothing to say
still takes part, or the others would wait: sglang #26921). The first two slots carry a
fingerprint of the layout (``h`` and ``-h``): when ranks disagree on it, their MIN differs
from one of them and every rank raises ``RankDivergenceError`` instead of misreading the
vector. With ``check_digest`` two more slots carry the tree's digest the same way
(``debug_view().digest()``; O(nodes) per step, for tests and debugging).

``exchange(values)`` is the same agreement for a few values outside a step (the write_back
backup inside an eviction: reserve, agree, commit), with the same width and fingerprint.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .agreement import Agreement, AgreementError, RankDivergenceError

DEFAULT_WIDTH = 256
_HEADER = 4  # layout fingerprint and -fingerprint, digest and -digest
_MASK = (1 << 62) - 1


def _fingerprint(kind: int, counts: list[int]) -> int:
    h = 1469598103934665603 ^ kind
    for c in counts:
        h = ((h ^ (c + 1)) * 1099511628211) & _MASK
    return h


class StepAgreement:
    """See the module docstring."""

    def __init__(
        self, agreement: Agreement, width: int = DEFAULT_WIDTH, digest: Callable[[], str] | None = None
    ) -> None:
        if not isinstance(agreement, Agreement):
            raise TypeError(f"agreement: expected an Agreement, got {type(agreement).__name__}")
        if isinstance(width, bool) or not isinstance(width, int) or width <= _HEADER:
            raise ValueError(f"width: expected an int > {_HEADER}, got {width!r}")
        self.agreement = agreement
        self.width = width
        self.participants: list = []
        self.check_digest = False
        self._digest = digest
        self.steps = 0  # step() calls
        self.exchanges = 0  # agree_min calls (steps and exchange())
        self.seconds = 0.0  # in agree_min
        self._in_step = False

    def add(self, participant) -> None:
        """Register ``participant`` (``prepare``, ``report``, ``apply``) after the others."""
        for name in ("prepare", "report", "apply"):
            if not callable(getattr(participant, name, None)):
                raise TypeError(f"participant: {type(participant).__name__} has no {name}()")
        if participant in self.participants:
            raise ValueError("participant: already registered")
        self.participants.append(participant)

    def remove(self, participant) -> None:
        if participant in self.participants:
            self.participants.remove(participant)

    # ------------------------------------------------------------------ the exchange
    def _agree(self, kind: int, body: list[int], counts: list[int]) -> np.ndarray:
        if len(body) + _HEADER > self.width:
            raise AgreementError(
                f"a step reports {len(body)} values; the vector holds {self.width - _HEADER} "
                f"(participants must stay within their budgets)"
            )
        vec = np.zeros(self.width, np.int64)
        h = _fingerprint(kind, counts)
        vec[0], vec[1] = h, -h
        d = 0
        if self.check_digest and self._digest is not None:
            d = int(self._digest()[:15], 16)
            vec[2], vec[3] = d, -d
        vec[_HEADER : _HEADER + len(body)] = body
        t0 = time.perf_counter()
        out = np.asarray(self.agreement.agree_min(vec), np.int64)
        self.seconds += time.perf_counter() - t0
        self.exchanges += 1
        if out.shape != vec.shape:
            raise AgreementError(f"agreement returned shape {out.shape}, expected {vec.shape}")
        if out[0] != h or out[1] != -h:
            raise RankDivergenceError(
                f"ranks built different agreement vectors at exchange {self.exchanges} "
                f"(layout {counts}): their queues differ"
            )
        if d and (out[2] != d or out[3] != -d):
            raise RankDivergenceError(f"the trees' digests differ across ranks at exchange {self.exchanges}")
        return out[_HEADER : _HEADER + len(body)]

    def step(self) -> None:
        """One agreement over every participant (see the module docstring)."""
        if self._in_step:
            raise RuntimeError("step: already inside a step (a participant called back into the cache)")
        self._in_step = True
        try:
            parts = list(self.participants)
            for p in parts:
                p.prepare()
            body: list[int] = []
            counts = []
            for p in parts:
                n0 = len(body)
                p.report(body)
                counts.append(len(body) - n0)
            try:
                agreed = self._agree(0, body, counts)
            except AgreementError:
                # Nothing is applied: a participant that reserved in prepare() gives it back
                # (optional ``abandon()``), so no rank holds pages for a step that never was.
                for p in parts:
                    abandon = getattr(p, "abandon", None)
                    if callable(abandon):
                        abandon()
                raise
            self.steps += 1
            off = 0
            for p, n in zip(parts, counts):
                p.apply(agreed[off : off + n])
                off += n
        finally:
            self._in_step = False

    def exchange(self, values: list[int]) -> np.ndarray:
        """Agree on a few values outside a step (MIN each; see the module docstring)."""
        values = [int(v) for v in values]
        return self._agree(1, values, [len(values)])

    def stats(self) -> dict:
        return {
            "steps": self.steps,
            "exchanges": self.exchanges,
            "seconds": self.seconds,
            "participants": [type(p).__name__ for p in self.participants],
        }
