"""Shared benchmark plumbing: timing, the printed table and the JSON file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable, Sequence


def median_seconds(run: Callable[[], object], reps: int, warmup: int = 1) -> float:
    """Median wall time of ``run()`` (which must block until its work is done)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _fmt(c: object) -> str:
    if c is None:
        return "N/A"
    if isinstance(c, float):
        return f"{c:,.0f}" if abs(c) >= 1000 else f"{c:.3g}"
    return str(c)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A readable table: rich when installed, aligned plain text otherwise."""
    cells = [[_fmt(c) for c in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(columns)]
        print(title)
        print("  ".join(str(h).rjust(w) for h, w in zip(columns, widths)))
        for r in cells:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        return
    table = Table(title=title)
    for h in columns:
        table.add_column(str(h), justify="right")
    for r in cells:
        table.add_row(*r)
    Console(width=200).print(table)


def machine_info() -> dict:
    info = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "node": platform.node()}
    try:
        import jax
        info.update(jax=jax.__version__, backend=jax.default_backend(),
                    devices=[str(d.device_kind) for d in jax.devices()][:8])
    except ImportError:
        pass
    return info


def write_json(path: str, payload: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return os.path.abspath(path)
