"""Host pages reserved for a caller (an L3 prefetch's destination), from the full component's
host pool or from the host pool of a component with its own page ids (e.g. ``swa``).

Pure Python + numpy; owner thread only (the cache's: ``HiRadixCache`` checks it where its
entry points do, then hands the call here with the component resolved). Every method
validates its numbers before anything changes. The reserved pages belong to the caller until
it hands them to ``insert_host`` (which takes every one) or frees them.

One process: ``reserve`` / ``reserve_component`` evict host leaves (or the component's own
host pages) when the pool is short, then allocate; None when there is no room.

Several ranks (reserve -> agree -> commit, from a ``StepAgreement`` participant's
``prepare``): ``reserve_agreed`` / ``reserve_component_agreed`` evict by the shortfall of the
free count every rank shares (so every rank evicts alike) and allocate; the caller reports
whether this rank got its pages, and after the step's agreement every rank ends the
reservation with ``settle`` / ``settle_component``: kept (the caller owns them) when every
rank got its pages, else freed. One process: the same calls work (there is nobody to
disagree with).
"""

from __future__ import annotations

import numpy as np

from .._checks import check_int
from .arguments import check_flag
from .components import KVComponent
from .evictor import Evictor


class HostReservations:
    """The reservations of one cache (see the module docstring)."""

    def __init__(self, evictor: Evictor) -> None:
        self.evictor = evictor

    # ------------------------------------------------------------------ full component
    def reserve(self, num_pages: object) -> np.ndarray | None:
        """``num_pages`` host pages, evicting host leaves if short; None when there is no
        room (the eviction done)."""
        return self.evictor.alloc_host(check_int("num_pages", num_pages, 0))

    def reserve_agreed(self, num_pages: object, min_pages: object) -> tuple[int, np.ndarray | None]:
        """Evicts host leaves by the shortfall of the free count every rank shares, then takes
        ``min(num_pages, free)`` pages if that is at least ``min_pages``. Returns ``(n, ids)``:
        ``n`` the pages reserved as every rank counts them (0: too few fit, nothing held), and
        this rank's ids, or None when its allocation failed. End it with ``settle(n, ids,
        keep)`` on every rank."""
        num_pages = check_int("num_pages", num_pages, 0)
        min_pages = check_int("min_pages", min_pages, 0)
        ev = self.evictor
        short = num_pages - ev.host_available
        if short > 0:
            ev.evict_host(short)
        n = min(num_pages, ev.host_available)
        if n < max(min_pages, 1):
            return 0, None
        return n, ev.reserve_host(n)

    def settle(self, num_pages: object, ids: np.ndarray | None, keep: object) -> None:
        """End a ``reserve_agreed`` of ``num_pages`` pages: ``keep`` when every rank got its
        pages (the caller owns them), else they are freed."""
        self.evictor.settle_host(check_int("num_pages", num_pages, 0), ids, check_flag("keep", keep))

    # ------------------------------------------------------------------ own-id components
    @staticmethod
    def reserve_component(comp: KVComponent, num_pages: object) -> np.ndarray | None:
        """``reserve`` from ``comp``'s host pool, evicting with its own host eviction if short."""
        return comp.alloc_host(check_int("num_pages", num_pages, 0))

    @staticmethod
    def reserve_component_agreed(comp: KVComponent, num_pages: object) -> np.ndarray | None:
        """All or nothing: evicts ``comp``'s host pages by the shortfall of the free count
        every rank shares (this step's failed reservations counted as taken), then allocates.
        Returns this rank's ids, or None: its allocation failed, or the shared free count is
        short on every rank. The caller reports ``ids is not None``; end it with
        ``settle_component`` on every rank (kept, the pages go e.g. to ``insert_host``'s
        ``component_pages``)."""
        return comp.reserve_host_agreed(check_int("num_pages", num_pages, 0))

    @staticmethod
    def settle_component(comp: KVComponent, num_pages: object, ids: object, keep: object) -> None:
        """End a ``reserve_component_agreed`` of ``num_pages`` pages (``ids``: what it returned)."""
        num_pages = check_int("num_pages", num_pages, 0)
        keep = check_flag("keep", keep)
        if ids is not None:
            ids = np.asarray(ids)
            if ids.ndim != 1 or ids.shape[0] != num_pages:
                raise ValueError(f"ids: expected the {num_pages} ids the reservation returned, got shape {ids.shape}")
        comp.settle_host_agreed(num_pages, ids, keep)
