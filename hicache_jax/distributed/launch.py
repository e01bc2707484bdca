"""Run N processes of one program on this machine, joined by ``jax.distributed`` on the CPU.

``launch_local(argv, num_processes, timeout_s)`` starts ``num_processes`` copies of ``argv``
(rank ``i`` gets ``HICACHE_RANK=i``, ``HICACHE_NUM_PROCESSES``, ``HICACHE_COORDINATOR`` with a
free local port), each on the CPU platform with one CPU device (``JAX_PLATFORMS=cpu``, any
forced host device count removed from ``XLA_FLAGS``), waits for all of them, and returns
each rank's exit code and output. When one rank fails, or the deadline passes, every rank
still running is killed (by its own pid), so a hang never outlives ``timeout_s``; the caller
gets ``RanksFailed`` with every rank's output tail. ``echo`` (a text stream) receives rank 0's
output as it is written (its Python output unbuffered), so a long run shows its progress.

``initialize_from_env()`` is the child's side: gloo CPU collectives, then
``jax.distributed.initialize`` with what the launcher set. Returns ``(rank, num_processes)``.
``run_rank(main)`` runs a rank's body and ends the process at once when it raises.

Same program, same executable on every rank: jaxlib seeds each execution's launch id (XLA's
``RunId``) from the executable's fingerprint, and jaxlib >= 0.12 derives the gloo tags of a
program's collectives from the ``RunId`` (``GlooCommunicator::NextTag``; 0.11 used tag 0), so
ranks whose executables of one program have different fingerprints wait, for good, each for a
message on a tag the other never sends on. ``initialize_from_env`` removes the two ways the
ranks' fingerprints came apart:

* full Python tracebacks in the IR's locations (``jax_include_full_tracebacks_in_locations``
  off): with them a program that one rank first traced through another call stack (a wrapper
  only that rank has) compiles to another fingerprint. Each op keeps its innermost user frame
  (the traced code's own line), the same on every rank.
* the persistent compilation cache (``jax_enable_compilation_cache`` off): only process 0
  writes it, under keys that only process 0 reads, and an executable loaded from it has
  another fingerprint than the same program compiled, so rank 0 hitting an entry an earlier
  launch wrote (pytest's session cache, ``conftest.py``) while rank 1 compiles hangs too.

No orphans: a rank must not outlive its launcher (a killed pytest left ranks blocked in a
collective for good). ``initialize_from_env`` calls ``exit_with_launcher()``: the rank is
SIGKILLed when the launcher dies (Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere, and as a
backstop, a daemon thread that polls the launcher's pid, ``HICACHE_LAUNCHER_PID``, every
``LAUNCHER_POLL_S``), and SIGTERM ends it at once again (``jax.distributed.initialize``
installs a SIGTERM handler, for its preemption notices, that a rank blocked in a collective
never acts on; the default action is restored after it).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TextIO


class RanksFailed(RuntimeError):
    """A rank exited non-zero or the launch outlived its deadline (every rank was killed)."""

    def __init__(self, message: str, results: list["RankResult"]) -> None:
        super().__init__(message)
        self.results = results


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the deadline
    output: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, num_processes: int, coordinator: str, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    env["HICACHE_RANK"], env["HICACHE_NUM_PROCESSES"] = str(rank), str(num_processes)
    env["HICACHE_COORDINATOR"] = coordinator
    env["HICACHE_LAUNCHER_PID"] = str(os.getpid())  # the rank exits when this process dies
    return env


def launch_local(
    argv: list[str],
    num_processes: int,
    timeout_s: float,
    *,
    cwd: str | None = None,
    env: dict | None = None,
    echo: TextIO | None = None,
) -> list[RankResult]:
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes: expected an int >= 1, got {num_processes!r}")
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory(prefix="hicache-ranks-") as logdir:
        paths = [os.path.join(logdir, f"rank{r}.log") for r in range(num_processes)]
        tail = None
        try:
            for r in range(num_processes):
                renv = rank_env(r, num_processes, coordinator, env)
                if echo is not None and r == 0:
                    renv["PYTHONUNBUFFERED"] = "1"
                with open(paths[r], "w") as log:  # the child keeps its own descriptor
                    procs.append(
                        subprocess.Popen(
                            argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=renv, start_new_session=True
                        )
                    )
            if echo is not None:
                tail = open(paths[0])  # a second description: its offset is not the child's
            failed = False
            while True:
                if tail is not None:
                    _forward(tail, echo)
                codes = [p.poll() for p in procs]
                if any(c not in (None, 0) for c in codes):
                    failed = True
                    break
                if all(c == 0 for c in codes) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            timed_out = any(p.poll() is None for p in procs) and not failed
            if failed:  # give the others a moment to fail on their own (their error is the clue)
                end = time.monotonic() + 5
                while time.monotonic() < end and any(p.poll() is None for p in procs):
                    time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)  # its own session: the rank and its children
                    p.wait()
            if tail is not None:
                _forward(tail, echo)
                tail.close()
        results = []
        for r, p in enumerate(procs):
            with open(paths[r], errors="replace") as f:
                results.append(RankResult(r, p.returncode, f.read()))
    if failed or timed_out:
        why = f"the launch outlived {timeout_s:g} s (a hang)" if timed_out else "a rank failed"
        tails = "\n".join(f"--- rank {x.rank} (exit {x.returncode}) ---\n{x.output[-3000:]}" for x in results)
        raise RanksFailed(f"{why}; every rank still running was killed\n{tails}", results)
    return results


def _forward(log: TextIO, echo: TextIO) -> None:
    text = log.read()
    if text:
        echo.write(text)
        echo.flush()


def initialize_from_env(initialization_timeout: int = 120, shutdown_timeout: int = 10) -> tuple[int, int]:
    """In a launched rank: gloo CPU collectives, then ``jax.distributed.initialize``.
    ``shutdown_timeout`` bounds the shutdown barrier JAX runs at exit, so a rank whose peer
    is gone (or stuck) still exits."""
    import jax

    rank, n = int(os.environ["HICACHE_RANK"]), int(os.environ["HICACHE_NUM_PROCESSES"])
    exit_with_launcher()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Same program, same executable fingerprint on every rank (module docstring): one that
    # differs gives the ranks' collectives different gloo tags on jaxlib >= 0.12, a hang.
    jax.config.update("jax_include_full_tracebacks_in_locations", False)  # whatever called the trace
    jax.config.update("jax_enable_compilation_cache", False)  # compiled on every rank, none loaded
    jax.distributed.initialize(
        os.environ["HICACHE_COORDINATOR"],
        n,
        rank,
        initialization_timeout=initialization_timeout,
        shutdown_timeout_seconds=shutdown_timeout,
    )
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # over jax's handler: SIGTERM ends the rank
    return rank, n


LAUNCHER_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1
_watching = False


def exit_with_launcher() -> None:
    """In a launched rank: end this process (SIGKILL, or ``os._exit(1)`` from the watchdog)
    when the launcher (``HICACHE_LAUNCHER_PID``) dies; see the module docstring. A no-op
    outside a launched rank and on a second call. The launcher may be the parent (the usual
    case: the parent-death signal and a ``getppid()`` poll) or an ancestor (a wrapper between
    them: its pid is polled)."""
    global _watching
    pid = os.environ.get("HICACHE_LAUNCHER_PID")
    if _watching or not pid or not pid.isdigit():
        return
    _watching = True
    launcher = int(pid)
    direct = os.getppid() == launcher
    if direct and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the watchdog alone
            pass

    def gone() -> bool:
        if direct:
            return os.getppid() != launcher  # re-parented: the launcher died
        try:
            os.kill(launcher, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    if gone():  # it died before the death signal was armed
        os._exit(1)

    def watch() -> None:
        while not gone():
            time.sleep(LAUNCHER_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="hicache-launcher-watchdog", daemon=True).start()


def run_rank(main) -> None:
    """Run ``main()`` in a launched rank; on an exception print it and exit at once with status
    1 (without the interpreter's exit handlers, which would wait for the peers)."""
    import sys
    import traceback

    try:
        main()
    except BaseException:  # noqa: BLE001 - reported, then the process ends
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
