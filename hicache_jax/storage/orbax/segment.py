"""One segment of the orbax log: its place on disk and what the index keeps of it.

On disk (``{path}/segments-v1/``)::

    w0000/LOCK            flock'ed by the one live process writing into w0000 (``claim``)
    w0000/{gen}_{step}/default
                          one segment = one orbax checkpoint step (OCDBT + zarr3, no
                          compression); per pool present: ``{pool}.data uint8[S, page_bytes]``
                          (one zarr chunk per page: chunk_byte_size=page_bytes, shard_axes=(0,)),
                          ``{pool}.keys uint8[S, 32]`` and ``{pool}.crc uint32[S]``
                          (CRC-32C of key || page bytes)
    w0000/{gen}_{step}.staged
                          a saved step waiting for its fsync pass and its committed name
    quarantine/           segments that failed a check (moved aside, never read again)
    trash/                evicted segments on their way to deletion

Segment names (``w0000/{gen}_{step}``) are never reused: ``gen`` (``new_generation``: ``g`` and
16 random hex digits) is drawn afresh by every claim of a writer directory and prefixes its step
directories, and steps count up from 0 within one claim. A writer directory is reused by the next
claimer once its owner is gone, and its step numbers restart, but under a new generation; so a
process whose index still lists a segment that was evicted meanwhile finds its directory gone
(a miss; ``refresh`` forgets it) and can never read another segment's bytes under that name.
Bare step numbers (``w0000/{step}``, written before generations existed) are still read.

A step is saved by orbax under a staging name (``{gen}_{step}.staged``, orbax's own temp
directory inside it while it writes), then every file and directory of it is fsync'ed and only
then is it renamed to its committed name (``durable_save.publish_step``): a step directory named
by a step (``is_committed_step``) is complete and on disk; anything else is ignored by readers.
A process killed mid-save leaves only a temp or staged directory.

Threading: a ``Segment`` is built by one thread (the index loading it, or the writer that
saved it) before the index publishes it; after that its fields never change except ``locs``,
which goes once from None to a dict that is never mutated (two racing loads store equal
dicts, so either may win).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

import numpy as np

LOG_DIR = "segments-v1"
QUARANTINE_DIR = "quarantine"
TRASH_DIR = "trash"
STAGED_SUFFIX = ".staged"  # a saved step waiting for its fsync pass and its committed name
WRITER_DIR_RE = re.compile(r"w\d{4,}")
_STEP_RE = re.compile(r"(?:g[0-9a-f]{16}_)?[0-9]+")  # the generation prefix is absent in old logs


def is_committed_step(name: str) -> bool:
    """Whether ``name`` (an entry of a writer directory) is a step orbax finished saving."""
    return _STEP_RE.fullmatch(name) is not None


def new_generation() -> str:
    """A fresh step prefix for one claim of a writer directory (64 random bits)."""
    return "g" + uuid.uuid4().hex[:16]


def step_dir_name(generation: str, step: int) -> str:
    """The directory orbax saves step ``step`` into under the step prefix ``generation``."""
    return f"{generation}_{step}"


def staged_dir_name(generation: str, step: int) -> str:
    """Where step ``step`` is saved before it is synced and published under
    ``step_dir_name``: not a committed name, so readers never look at it and the next claimer
    of the directory removes it (``WriterClaim.clear_uncommitted``)."""
    return f"{step_dir_name(generation, step)}{STAGED_SUFFIX}"


def array_spec(seg_path: str, array: str) -> dict:
    """Tensorstore spec of one array (``{pool}.data`` / ``.keys`` / ``.crc``) of a segment."""
    return {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{seg_path}/default/", "path": array}}


@dataclass
class Segment:
    name: str  # "w0000/g0123456789abcdef_17": writer directory / step dir
    path: str  # absolute step directory
    order: tuple  # (commit time, name): eviction order, oldest first
    counts: dict[str, int]  # pool -> pages
    crcs: dict[str, np.ndarray] = field(default_factory=dict)
    keys: dict[str, list[bytes]] = field(default_factory=dict)
    nbytes: int = 0  # page bytes over all pools (what the capacity bound counts)
    locs: dict | None = None  # pool -> per-slot page locations (direct reads), loaded lazily
