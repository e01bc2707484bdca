"""The ``orbax`` L3 backend: a segment log saved by orbax, read page by page.

Needs the ``storage`` extra (orbax-checkpoint, tensorstore, crc32c or google-crc32c); ``create_storage``
imports it only when that backend is asked for. ``store`` composes the other modules and
describes how they fit together; each module states its own threading and locking contract.
"""

from .store import OrbaxSegmentStorage

__all__ = ["OrbaxSegmentStorage"]
