"""Sliding-window arithmetic shared by the model step and whoever frees SWA pages (pure Python).

Window convention (as HF ``sliding_window`` / gpt-oss): a sliding-window layer with window
``W`` lets the query at position ``p`` attend to the ``W`` positions ``[p - W + 1, p]``, the
current one included (fewer near the start of the sequence).

A step that computes the tokens at positions ``[start, end)`` (a prefill chunk, or one decode
token with ``end = start + 1``) reads the SWA KV of positions ``[start - W + 1, end)`` (clamped
at 0): its first query needs ``W - 1`` positions before ``start``. The lower bound depends only
on ``start``, so a request that has computed ``[0, n)`` keeps the SWA KV of ``[n - W + 1, n)``
for its next step, whatever that step's length: with pages of ``page_size`` tokens that is
logical pages ``swa_first_needed_page(n, W, page_size)`` onwards. Every SWA page below it may be
freed (or given to another request) before the next step; the step never reads it.
"""

from __future__ import annotations

from .._checks import check_int


def swa_first_needed_page(start: int, window: int, page_size: int) -> int:
    """The lowest logical page (index ``position // page_size``) that a step starting at
    position ``start`` reads in a sliding-window layer with window ``window``: the page of
    position ``max(0, start - window + 1)``. Every page below it is never read again by the
    request (its later steps start later)."""
    check_int("start", start, 0)
    check_int("window", window, 1)
    check_int("page_size", page_size, 1)
    return max(0, start - window + 1) // page_size


def swa_pages_needed(start: int, end: int, window: int, page_size: int) -> range:
    """Logical pages whose SWA KV a step computing positions ``[start, end)`` reads or writes:
    from the page of ``max(0, start - window + 1)`` to the page of ``end - 1``, inclusive.

    Those are the entries of the request's SWA page table that must hold valid SWA pool pages
    for that step; the entries below ``range.start`` are ignored (may be any value)."""
    first = swa_first_needed_page(start, window, page_size)
    check_int("end", end, start + 1)
    return range(first, (end - 1) // page_size + 1)


def swa_table_width(window: int, max_new_tokens: int, page_size: int) -> int:
    """The most pages ``swa_pages_needed`` returns for a step of at most ``max_new_tokens``
    tokens: ``W - 1 + T`` consecutive positions span at most this many pages."""
    check_int("window", window, 1)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("page_size", page_size, 1)
    span = window - 1 + max_new_tokens
    return (span + page_size - 2) // page_size + 1
