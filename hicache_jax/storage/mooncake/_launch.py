"""Launcher for the store's processes: die with the parent, then exec the real command.

usage: python _launch.py PARENT_PID COMMAND [ARGS...]

``MooncakeMaster`` starts every process through this script instead of a ``preexec_fn``: a
``preexec_fn`` makes ``subprocess`` fork the (multi-threaded, often JAX-running) parent and run
Python in the child before ``exec``, which can deadlock and makes JAX warn; without one,
``subprocess`` uses ``vfork``/``posix_spawn`` and runs no Python in the parent's copy. Here, in a
fresh single-threaded interpreter: ``PR_SET_PDEATHSIG`` = SIGKILL (sent when the thread that
started this process exits; it survives ``exec``), exit at once if that parent is already gone,
then ``execv`` the command (same pid, so the parent's ``Popen`` is the command's).

Standard library only; run with ``-I -S`` (nothing from the environment or site-packages).
"""

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.stderr.write("usage: _launch.py PARENT_PID COMMAND [ARGS...]\n")
        return 2
    parent = int(argv[0])
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            sys.stderr.write(f"_launch.py: prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}\n")
    except (OSError, AttributeError):  # not Linux: the parent's stop() / atexit still stop it
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        return 1
    os.execv(argv[1], argv[1:])
    return 127  # not reached: execv raises on failure


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
