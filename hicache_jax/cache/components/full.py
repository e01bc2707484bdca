"""The target model's KV (``full``): the component whose page ids the tree stores.

Its residency is the tree's own (``TreeNode.value`` / ``host_value``, kept by ``residency``
and ``locks`` on the inlined fast paths), so it needs no hooks: it only moves its pages.
Its device allocator is the one the scheduler allocates from; its host allocator is the one
the cache allocates backups from.
"""

from __future__ import annotations

from .base import KVComponent

FULL = "full"


class FullComponent(KVComponent):
    def __init__(self, engine) -> None:
        super().__init__(FULL, engine)
