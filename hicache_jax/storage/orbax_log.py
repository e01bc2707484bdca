"""Where the orbax backend used to live; it is the ``orbax`` subpackage now.

Kept so ``from hicache_jax.storage.orbax_log import OrbaxSegmentStorage`` keeps working.
"""

from .orbax import OrbaxSegmentStorage

__all__ = ["OrbaxSegmentStorage"]
