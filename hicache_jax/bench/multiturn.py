"""``hicache-jax bench multiturn``: which benchmark serves the run.

``--engine easydel``: EasyDeL's eSurge with and without the adapter
(``integrations.easydel.bench``); ``--engines N`` (N > 1): N reference engines behind the prefix
router (``bench.routed``); otherwise the reference engine, or ``--num-processes`` ranks of it
(``bench.serving``). A module of its own so that the benchmarks it picks from never import
each other (``routed`` builds on ``serving``).
"""

from __future__ import annotations


def multiturn(args) -> dict:
    if getattr(args, "engine", "reference") == "easydel":
        from ..integrations.easydel.bench import multiturn as esurge_multiturn

        return esurge_multiturn(args)
    if getattr(args, "engines", 1) > 1:
        from .routed import multiturn_routed

        return multiturn_routed(args)
    from .serving import multiturn as reference_multiturn

    return reference_multiturn(args)
