"""Argument checks shared by the typed configs and the cache's public calls (pure Python + numpy)."""

from __future__ import annotations

import os

import numpy as np


def check_int(name: str, value: object, minimum: int, maximum: int | None = None, *, numpy_ints: bool = True) -> int:
    """``value`` as an int in ``[minimum, maximum]`` (no upper bound when ``maximum`` is None);
    TypeError (not an int, a bool, or a numpy integer when ``numpy_ints`` is False) /
    ValueError naming ``name``. Configs that may come from JSON pass ``numpy_ints=False``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer) if numpy_ints else int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum or (maximum is not None and value > maximum):
        want = f">= {minimum}" if maximum is None else f"an int in [{minimum}, {maximum}]"
        raise ValueError(f"{name}: expected {want}, got {value}")
    return int(value)


def physical_memory_bytes() -> int | None:
    """The machine's physical memory, or None where the platform cannot tell (sizes beyond it
    are refused up front instead of dying in an allocation)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
