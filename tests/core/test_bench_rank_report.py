"""What a bench rank reports to its parent (``hicache_jax.bench.ranks``): the agreement counts
of every engine the rank ran, not only the first one's (``bench spec`` restarts engines)."""

from __future__ import annotations

from types import SimpleNamespace

from hicache_jax.bench.ranks import agreement_totals


def _cache(steps: int, exchanges: int, seconds: float, participants: list[str]):
    stats = {"steps": steps, "exchanges": exchanges, "seconds": seconds, "participants": participants}
    return SimpleNamespace(step_agreement=SimpleNamespace(stats=lambda: dict(stats)))


def test_agreement_totals_sum_every_cache_of_the_rank():
    caches = [_cache(5, 5, 0.5, ["Full"]), _cache(3, 3, 0.25, ["Full", "Draft"]), _cache(0, 0, 0.0, [])]
    got = agreement_totals(caches)
    assert got == {"caches": 3, "steps": 8, "exchanges": 8, "seconds": 0.75, "participants": ["Draft", "Full"]}


def test_agreement_totals_of_one_cache():
    assert agreement_totals(_cache(2, 2, 0.125, ["Full"]))["exchanges"] == 2
