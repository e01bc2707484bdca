"""The writer-directory claim: which ``w####`` directory of the log this process may save into.

Each process claims one writer directory by ``flock`` on its ``LOCK`` file, reusing the
directory of an owner that died (the kernel drops a dead process's flock) before creating the
next one, and saves steps only there: two processes never write the same step number, so
no save ever needs a cross-process lock. Every claim draws a new generation
(``segment.new_generation``), the prefix of the steps it saves: segment names are never
reused, even when the directory is (see ``segment``).

A candidate that is not usable is skipped, never repaired: an entry named like a writer
directory that is not a real directory (a file, a symlink, dangling or not), or whose ``LOCK``
is not a regular file (a directory, a symlink, a FIFO), or that cannot be opened. The claim
follows no symlink (``O_NOFOLLOW``), deletes nothing it does not hold, and goes on to the
next candidate, creating a new directory after the highest name when none is free.

Only the claim's holder may delete anything in its directory: ``clear_uncommitted`` removes
the temp steps a killed owner left half-written.

Ownership and threading: a ``WriterClaim`` belongs to the store that took it; ``release``
(idempotent) closes the descriptor, which drops the flock. The directory stays claimed for as
long as the descriptor is open, whichever thread uses it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat

from .segment import WRITER_DIR_RE, is_committed_step, new_generation

log = logging.getLogger("hicache_jax.storage")

_LOCK_FILE = "LOCK"
_CLAIM_ATTEMPTS = 64  # another process may create and lock the next directory under us: retry


class WriterClaim:
    """A writer directory flock'ed by this process, and the generation its steps are saved under."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.generation = new_generation()
        self._fd = fd

    def clear_uncommitted(self) -> None:
        """Remove everything but the lock file and committed steps (temp steps a killed owner,
        or a failed save of ours, left). Safe only because we hold the flock: no live process
        writes here. ``rmtree`` removes no symlink and no file (only directories)."""
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


def _lock(root: str, name: str) -> WriterClaim | None:
    """flock ``root/name/LOCK`` (a real directory and a regular file, no symlink followed);
    None if it is held by another process or the candidate is unusable."""
    d = os.path.join(root, name)
    dfd = fd = -1
    try:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fd = os.open(
            _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644, dir_fd=dfd
        )
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "LOCK is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # not merely held by a live owner
            log.warning("L3 orbax: skipping writer directory candidate %s: %r", d, e)
        return None
    finally:
        if dfd >= 0:
            os.close(dfd)
    return WriterClaim(d, fd)


def claim_writer_dir(root: str) -> WriterClaim | None:
    """flock a writer directory under ``root``: a dead owner's, else a new one, skipping
    unusable candidates. None if every attempt lost its race; raises ``OSError`` where a new
    directory cannot be created in ``root`` (not writable)."""
    for _ in range(_CLAIM_ATTEMPTS):
        names = sorted((d for d in os.listdir(root) if WRITER_DIR_RE.fullmatch(d)), key=lambda n: (int(n[1:]), n))
        for name in names:
            claim = _lock(root, name)
            if claim is not None:
                return claim
        nxt = f"w{(max((int(n[1:]) for n in names), default=-1) + 1):04d}"
        try:
            os.mkdir(os.path.join(root, nxt), 0o755)
        except FileExistsError:
            continue  # another process created it first: list again
        claim = _lock(root, nxt)
        if claim is not None:
            return claim
    return None
