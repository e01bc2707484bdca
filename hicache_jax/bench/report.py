"""Shared benchmark plumbing: timing, progress, the printed table, where results go, the JSON file.

Pure Python (JAX is imported only by ``machine_info``, when it is already loaded).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import threading
import time
from typing import Callable, Sequence

# Where every benchmark writes by default: this folder of the current directory.
RESULTS_DIR = "hicache-results"


def results_path(name: str) -> str:
    """The default ``--out`` of a benchmark: ``./hicache-results/<name>.json``."""
    return os.path.join(RESULTS_DIR, f"{name}.json")


class Progress:
    """Progress lines on stderr, at least every ``interval`` seconds while a benchmark runs.

    ``phase(text, total)`` starts a phase (printed at once); ``advance(n)`` counts its steps; a
    heartbeat thread repeats the current phase with its count and elapsed time whenever
    nothing was printed for ``interval`` seconds (so a long compile or a slow round is never
    silent). ``note(text)`` prints a line. Use as a context manager (stops the heartbeat).
    """

    def __init__(self, name: str, interval: float = 4.0, stream=None) -> None:
        self.name, self.interval = name, interval
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()
        self._text, self._done, self._total = "starting", 0, None
        self._last = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hicache-bench-progress", daemon=True)
        self._thread.start()

    def _line(self, text: str) -> None:
        with self._lock:
            self.stream.write(f"[{self.name} {time.perf_counter() - self.t0:6.1f}s] {text}\n")
            self.stream.flush()
            self._last = time.perf_counter()

    def _status(self) -> str:
        if self._total:
            return f"{self._text}: {self._done}/{self._total}"
        return self._text

    def phase(self, text: str, total: int | None = None) -> None:
        self._text, self._done, self._total = text, 0, total
        self._line(self._status())

    def advance(self, n: int = 1, detail: str = "") -> None:
        self._done += n
        self._line(self._status() + (f" ({detail})" if detail else ""))

    def note(self, text: str) -> None:
        self._line(text)

    def _beat(self) -> None:
        while not self._stop.wait(0.5):
            if time.perf_counter() - self._last >= self.interval:
                self._line(f"... {self._status()}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100, linear interpolation between order statistics, numpy's
    default) of ``values``; NaN when there are none."""
    import numpy as np  # here: the CLI's --help imports this module

    return float(np.percentile(values, q)) if len(values) else float("nan")


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
    info = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "node": platform.node(),
    }
    try:
        info["load_average_1_5_15"] = list(os.getloadavg())
    except OSError:  # pragma: no cover
        pass
    if "jax" not in sys.modules:
        return info
    try:
        import jax

        info.update(
            jax=jax.__version__, backend=jax.default_backend(), devices=[str(d.device_kind) for d in jax.devices()][:8]
        )
    except ImportError:
        pass
    return info


def write_json(path: str, payload: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return os.path.abspath(path)
