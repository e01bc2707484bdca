"""Serving benchmarks behind the ``hicache-jax`` console script (needs JAX); shared report helpers.

``report`` (timing, tables, JSON) is pure Python; ``serving`` runs the reference engine.
"""
