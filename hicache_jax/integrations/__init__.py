"""Adapters that put hicache_jax's host (L2) and storage (L3) tiers behind other serving engines.

Each adapter lives in its own subpackage and imports its engine lazily, so importing
``hicache_jax.integrations`` never needs any engine installed.
"""
