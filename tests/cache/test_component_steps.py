"""``ComponentSteps`` (agreed window slides over ranks) on its own: which noted requests each
step reports, with fake components and an agreement over two simulated ranks.

The vector carries at most ``budget`` requests per step; more requests decode than that in any
busy server (every decoding request notes a slide each step), so the pick must reach every
request in turn and one a rank keeps reporting shorter must not hold the others back."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hicache_jax.cache.component_steps import ComponentSteps


class _Component:
    def __init__(self) -> None:
        self.slides: list[tuple[int, int]] = []  # (request id, length)

    def slide_request(self, req, length: int) -> None:
        self.slides.append((req.rid, length))


def _two_ranks(budget: int):
    comps = [_Component(), _Component()]
    steps = [ComponentSteps((c,), budget=budget) for c in comps]
    return steps, comps


def _step(steps) -> None:
    """One agreement step: every rank reports, the element-wise minimum is applied."""
    outs = []
    for s in steps:
        s.prepare()
        out: list[int] = []
        s.report(out)
        outs.append(out)
    assert len({len(o) for o in outs}) == 1, "ranks must report vectors of one length"
    agreed = np.minimum.reduce([np.asarray(o, dtype=np.int64) for o in outs]) if outs[0] else np.zeros(0)
    for s in steps:
        s.apply(agreed)


def test_every_decoding_request_slides_although_more_decode_than_the_budget():
    steps, comps = _two_ranks(budget=2)
    reqs = [SimpleNamespace(rid=i, last_node=None) for i in range(5)]
    for t in range(1, 7):  # each step every request wrote one more token, on both ranks alike
        for s in steps:
            for r in reqs:
                s.note(r, 10 * t)
        _step(steps)
    slid = {rid for rid, _ in comps[0].slides}
    assert slid == {r.rid for r in reqs}, f"never slid: {sorted({r.rid for r in reqs} - slid)}"
    assert comps[0].slides == comps[1].slides  # the same slides on both ranks, in the same order
    # each request slid at least every ceil(5 / 2) = 3 steps: at least twice in 6 steps
    assert all(sum(1 for rid, _ in comps[0].slides if rid == r.rid) >= 2 for r in reqs)


def test_requests_one_rank_keeps_shorter_do_not_starve_a_new_one():
    steps, comps = _two_ranks(budget=2)
    stuck = [SimpleNamespace(rid=i, last_node=None) for i in range(3)]
    for r in stuck:  # rank 1 noted them shorter: they stay dirty (MIN != MAX) step after step
        steps[0].note(r, 20)
        steps[1].note(r, 10)
    _step(steps)
    _step(steps)
    new = SimpleNamespace(rid=99, last_node=None)
    for s in steps:
        s.note(new, 30)
    _step(steps)
    assert (99, 30) in comps[0].slides and (99, 30) in comps[1].slides
    assert steps[0].idle and steps[1].idle  # what flush waits for: it would loop before
