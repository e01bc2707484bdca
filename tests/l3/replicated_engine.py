"""Test helper: make an engine report ``replicated`` (every rank holds the whole of every
page), as a draft with fewer KV heads than ranks does, whether ``replicated`` is a plain
attribute or a read-only property of the engine's class."""

from __future__ import annotations


def mark_replicated(engine) -> None:
    """Give ``engine`` a subclass of its class whose ``replicated`` is True."""
    cls = type(engine)
    engine.__class__ = type(f"Replicated{cls.__name__}", (cls,), {"replicated": True})
