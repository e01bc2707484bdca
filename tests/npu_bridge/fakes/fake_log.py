"""Shared record of what the fakes saw (MOCKED tier only)."""

EVENTS: list = []


def record(kind: str, **info) -> None:
    EVENTS.append({"kind": kind, **info})
