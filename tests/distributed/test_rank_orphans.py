"""No orphaned ranks: a rank started by ``hicache_jax.distributed.launch`` exits when its
launcher dies (killed for real here: SIGKILL, so none of its own cleanup runs) and on SIGTERM,
even while it is blocked in a collective whose peer never comes.

Each test runs a real launcher process (``launch_local`` over two ranks), waits for both ranks
to be up (each writes its pid), then kills the launcher or signals a rank, and checks that
every rank process is gone within seconds. Whatever is left at the end is SIGKILLed by pid
(only the processes this test started).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("jax")

ROOT = Path(__file__).resolve().parents[2]

RANK = """
import os, sys, time
from hicache_jax.distributed.launch import initialize_from_env, run_rank

def main():
    rank, n = initialize_from_env()
    path = os.path.join({dir!r}, f"rank{{rank}}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    if rank == 0:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("rank 1 never comes")  # blocked in a collective
    time.sleep(3600)

run_rank(main)
"""

LAUNCHER = """
import sys
from hicache_jax.distributed.launch import launch_local
launch_local([sys.executable, {rank!r}], 2, 600, cwd={root!r})
"""


def alive(pid: int) -> bool:
    """Running (a zombie left unreaped by its new parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.fixture
def launched(tmp_path):
    """A launcher running two ranks, both up: ``(launcher Popen, [rank pids])``."""
    rank = tmp_path / "rank.py"
    rank.write_text(textwrap.dedent(RANK).format(dir=str(tmp_path)))
    code = textwrap.dedent(LAUNCHER).format(rank=str(rank), root=str(ROOT))
    launcher = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        end = time.monotonic() + 180
        files = [tmp_path / f"rank{r}.pid" for r in range(2)]
        while not all(f.exists() for f in files):
            assert launcher.poll() is None, f"the launcher exited early ({launcher.returncode})"
            assert time.monotonic() < end, "the ranks did not come up"
            time.sleep(0.1)
        pids = [int(f.read_text()) for f in files]
        time.sleep(1.0)  # rank 0 is in its collective now
        assert all(alive(p) for p in pids)
        yield launcher, pids
    finally:
        for pid in pids:  # never leave one behind, whatever the test saw
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(30)


def test_ranks_exit_when_their_launcher_is_killed(launched):
    launcher, pids = launched
    launcher.send_signal(signal.SIGKILL)  # no finally, no atexit: the launcher just vanishes
    launcher.wait(30)
    assert wait_gone(pids, 15) == [], "ranks outlived their launcher"


def test_a_rank_blocked_in_a_collective_exits_on_sigterm(launched):
    launcher, pids = launched
    os.kill(pids[0], signal.SIGTERM)
    assert wait_gone(pids[:1], 15) == [], "rank 0 ignored SIGTERM"
    # The launcher sees a failed rank, kills the other one and exits non-zero.
    assert launcher.wait(60) != 0
    assert wait_gone(pids, 15) == []
