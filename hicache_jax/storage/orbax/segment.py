"""One segment of the orbax log: its place on disk and what the index keeps of it.

On disk (``{path}/segments-v1/``)::

    w0000/LOCK            flock'ed by the one live process writing into w0000 (``claim``)
    w0000/{step}/default  one segment = one orbax CheckpointManager step (OCDBT + zarr3, no
                          compression); per pool present: ``{pool}.data uint8[S, page_bytes]``
                          (one zarr chunk per page: chunk_byte_size=page_bytes, shard_axes=(0,)),
                          ``{pool}.keys uint8[S, 32]`` and ``{pool}.crc uint32[S]``
                          (CRC-32C of key || page bytes)
    quarantine/           segments that failed a check (moved aside, never read again)
    trash/                evicted segments on their way to deletion

Orbax publishes a step by renaming its temp directory: a step directory named by a bare step
number is complete (``is_committed_step``); anything else is ignored by readers. A process
killed mid-save leaves only a temp directory.

Threading: a ``Segment`` is built by one thread (the index loading it, or the writer that
saved it) before the index publishes it; after that its fields never change except ``locs``,
which goes once from None to a dict that is never mutated (two racing loads store equal
dicts, so either may win).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

LOG_DIR = "segments-v1"
QUARANTINE_DIR = "quarantine"
TRASH_DIR = "trash"
WRITER_DIR_RE = re.compile(r"w\d{4,}")


def is_committed_step(name: str) -> bool:
    """Whether ``name`` (an entry of a writer directory) is a step orbax finished saving."""
    return name.isdigit()


def array_spec(seg_path: str, array: str) -> dict:
    """Tensorstore spec of one array (``{pool}.data`` / ``.keys`` / ``.crc``) of a segment."""
    return {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{seg_path}/default/", "path": array}}


@dataclass
class Segment:
    name: str                      # "w0000/17": writer directory / step
    path: str                      # absolute step directory
    order: tuple                   # (commit time, name): eviction order, oldest first
    counts: dict[str, int]         # pool -> pages
    crcs: dict[str, np.ndarray] = field(default_factory=dict)
    keys: dict[str, list[bytes]] = field(default_factory=dict)
    nbytes: int = 0                # page bytes over all pools (what the capacity bound counts)
    locs: dict | None = None       # pool -> per-slot page locations (direct reads), loaded lazily
