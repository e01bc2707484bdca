"""Argument checks shared by the typed configs (pure Python + numpy)."""

from __future__ import annotations

import numpy as np


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum``; TypeError (not an int, or a bool) / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}")
    return int(value)
