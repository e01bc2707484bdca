"""Several ranks: the window slides of components with their own page ids, agreed.

Pure Python, owner thread only (``prepare`` / ``report`` / ``apply`` run inside the cache's
``StepAgreement.step``). A ``StepAgreement`` participant, registered only when the cache has
a component with its own page ids (e.g. ``swa``) and a collective agreement.

Why: ``slide_window(req)`` frees the request's own SWA pages that fell out of the window and
releases its lock's hold on the tree's window pages, which changes the tree (what a later
insert keeps, what SWA eviction may take). How far a request may slide is what this rank's
forward pass has written (``slide_window(req, written=)``), a per-rank outcome: a rank whose
step finishes later may slide later. So with ranks ``slide_window`` only records this rank's
length (``note``), and each step agrees on it:

* ``note(req, n)`` (every rank calls ``slide_window`` at the same point, so which requests
  are tracked and *dirty*, i.e. noted since they last agreed, is the same on every rank);
* ``prepare`` picks up to ``budget`` dirty requests: first those noted since their last
  exchange (*unsent*), then the others, each group in the tracking order; a picked request
  then moves to the end of that order. So with more decoding requests than the budget every
  one is reported in turn (at least every ``ceil(n / budget)`` steps), and requests a rank
  keeps noting shorter (dirty for good) never hold a newly noted one back (``flush`` waits for
  every noted length to be sent). Dirty and unsent flags and the order change only on
  ``note`` / ``apply`` / ``forget``, alike on every rank, so every rank picks the same;
* ``report`` appends two values per picked request: this rank's noted length and its
  negation (MIN and MAX over ranks);
* ``apply`` slides every component to the agreed MIN (never backwards), and a request whose
  MIN equals its MAX (every rank noted the same length) is clean again. A request that
  finishes or is aborted is forgotten (``forget``): its pages are then handled by the
  insert or the abort, on every rank alike; so is one abandoned the raw way, by
  ``dec_lock_ref(req.last_node)`` (``lock_released``).

Sliding to a length at most the current one only frees what a slide to the current one
frees too, so a late slide keeps pages longer, never frees one a rank still reads.
Vector cost: ``2 * budget`` slots at most (32 with the default 16).
"""

from __future__ import annotations

BUDGET = 16  # requests reported per step (two values each)


class _Tracked:
    __slots__ = ("req", "noted", "applied", "dirty", "unsent")

    def __init__(self, req) -> None:
        self.req = req
        self.noted = 0  # this rank's length (tokens whose KV its forward pass wrote)
        self.applied = 0  # the agreed length slid to
        self.dirty = False  # noted since the ranks last agreed on every rank's value
        self.unsent = False  # noted since its last exchange (``flush`` waits for it)


class ComponentSteps:
    """See the module docstring. ``components``: those with their own page ids."""

    def __init__(self, components: tuple, budget: int = BUDGET) -> None:
        self.components = components
        self.budget = budget
        self.tracked: dict[int, _Tracked] = {}  # id(req) -> entry, in the order first noted
        self._step: list[_Tracked] = []
        self.slides = 0  # agreed slides applied (counted once per request and step)

    def note(self, req, length: int) -> None:
        """``slide_window(req)`` with ranks: this rank's forward pass wrote ``length`` tokens."""
        e = self.tracked.get(id(req))
        if e is None:
            e = self.tracked[id(req)] = _Tracked(req)
        e.noted = length  # the latest call says what this rank has written
        e.dirty = e.unsent = True

    def forget(self, req) -> None:
        """The request finished or was aborted (or the cache was reset)."""
        self.tracked.pop(id(req), None)

    def lock_released(self, node, locks_left: int) -> None:
        """A caller lock on ``node`` was released (``dec_lock_ref``), ``locks_left`` caller locks
        remain on it. A request abandoned the raw way (its own pages freed, then
        ``dec_lock_ref(req.last_node)``) must not be slid again: its pages may be another
        request's by the next step. Locks on one node are interchangeable, so when fewer are
        left than tracked requests locked there, which one went is unknown: every tracked
        request at ``node`` is forgotten (alike on every rank; a live one is noted again by its
        next ``slide_window``, its slide only later)."""
        at = [k for k, e in self.tracked.items() if e.req.last_node is node]
        if len(at) > locks_left:
            for k in at:
                del self.tracked[k]

    def clear(self) -> None:
        self.tracked.clear()
        self._step = []

    # ------------------------------------------------------------------ StepAgreement participant
    def prepare(self) -> None:
        unsent = [e for e in self.tracked.values() if e.unsent]
        step = unsent[: self.budget]
        if len(step) < self.budget:
            step += [e for e in self.tracked.values() if e.dirty and not e.unsent][: self.budget - len(step)]
        self._step = step

    def report(self, out: list[int]) -> None:
        for e in self._step:
            out.extend((e.noted, -e.noted))

    def apply(self, agreed) -> None:
        step, self._step = self._step, []
        for i, e in enumerate(step):
            lo, hi = int(agreed[2 * i]), -int(agreed[2 * i + 1])
            if lo > e.applied:
                e.applied = lo
                for comp in self.components:
                    comp.slide_request(e.req, lo)
                self.slides += 1
            e.unsent = False
            if lo == hi:
                e.dirty = False
            k = id(e.req)
            if self.tracked.get(k) is e:  # to the end of the order: the others go first next time
                del self.tracked[k]
                self.tracked[k] = e

    def abandon(self) -> None:
        self._step = []

    @property
    def idle(self) -> bool:
        """Every noted length went through an exchange (its agreed slide is applied): what
        ``flush`` waits for. A request some rank noted shorter stays dirty (reported again at
        later steps) but idle: waiting for that rank's next note would not end."""
        return not any(e.unsent for e in self.tracked.values())
