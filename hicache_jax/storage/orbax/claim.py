"""The writer-directory claim: which ``w####`` directory of the log this process may save into.

Each process claims one writer directory by ``flock`` on its ``LOCK`` file, reusing the
directory of an owner that died (the kernel drops a dead process's flock) before creating the
next one, and saves steps only there: two processes never write the same step number, so
no save ever needs a cross-process lock. Only the claim's holder may delete anything in the
directory: ``clear_uncommitted`` removes the temp steps a killed owner left half-written.

Ownership and threading: a ``WriterClaim`` belongs to the store that took it; ``release``
(idempotent) closes the descriptor, which drops the flock. The directory stays claimed for as
long as the descriptor is open, whichever thread uses it.
"""

from __future__ import annotations

import fcntl
import os
import shutil

from .segment import WRITER_DIR_RE, is_committed_step

_LOCK_FILE = "LOCK"
_CLAIM_ATTEMPTS = 64  # another process may create and lock the next directory under us: retry


class WriterClaim:
    """A writer directory flock'ed by this process."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self._fd = fd

    def clear_uncommitted(self) -> None:
        """Remove everything but the lock file and committed steps (temp steps a killed owner,
        or a failed save of ours, left). Safe only because we hold the flock: no live process
        writes here."""
        for n in os.listdir(self.path):
            if n != _LOCK_FILE and not is_committed_step(n):
                shutil.rmtree(os.path.join(self.path, n), ignore_errors=True)

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops the flock
            self._fd = -1


def claim_writer_dir(root: str) -> WriterClaim | None:
    """flock a writer directory under ``root``: a dead owner's, else a new one. None if every
    attempt lost its race; raises ``OSError`` where ``root`` is not writable."""
    for _ in range(_CLAIM_ATTEMPTS):
        names = sorted(d for d in os.listdir(root) if WRITER_DIR_RE.fullmatch(d))
        nxt = f"w{(max((int(n[1:]) for n in names), default=-1) + 1):04d}"
        for name in names + [nxt]:
            d = os.path.join(root, name)
            os.makedirs(d, exist_ok=True)
            fd = os.open(os.path.join(d, _LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            return WriterClaim(d, fd)
    return None
