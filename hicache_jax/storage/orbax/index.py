"""The orbax log's index: key -> (segment, slot) per pool, and the table of live segments.

Rebuilt at start-up from every committed segment's ``keys`` and ``crc`` arrays (all writer
directories), and refreshed (``refresh``) to pick up segments other processes wrote and to
forget segments that vanished. Pages are content-addressed, so the same key in two segments is
harmless: either copy is right. Such a key (two writers that each stored it before seeing the
other's segment) is mapped to the segment indexed last, and the other copies are remembered
(``_more``): forgetting the segment the map names moves the key to a copy that is left, and the
key leaves the index (a ``removed`` event) only with its last copy. A segment whose metadata
cannot be read, or that fails a check when read (``segment_failed``), is quarantined: moved to ``quarantine/`` (in-process
only on a read-only store) and never indexed again by this process, so all its pages are
misses from then on. A segment that vanished (evicted by any process) is simply forgotten.
Quarantine is only for data proven corrupt (inconsistent with itself); a pool whose pages have
another size than this process's (a reader configured otherwise than the writer) is not
indexed: its keys miss (counted once per segment as a read error), and the segment stays on
disk for the processes that can read it. A segment none of whose pools this process can read
is remembered as foreign: never indexed, never counted against the capacity bound (so this
process never evicts it), forgotten once it vanishes.
Segment names are never reused (``segment``: a generation per claim), so a name the index
holds always denotes the bytes it was indexed from, or nothing (evicted since: a miss).

Contents listeners (``notify``, set by the store; ``HiCacheStorage.add_listener``): ``removed``
for the keys a forgotten segment takes out of the key maps (evicted by any process, quarantined,
vanished), ``stored`` for the keys a refresh indexes from segments other processes wrote (the
writer's own segments were announced when their pages became pending); both under the lock.

Threading and locking: every method may be called from any thread. One lock guards the key
maps, the segment table, the sets of segments never to index again and of foreign segments,
and the byte count; it is
a leaf (nothing else is locked while it is held) and never held across I/O: ``refresh`` lists
and loads segments without it and publishes them under it. ``on_forget(name)`` runs after the
lock is released. ``Segment`` objects handed out stay valid after their segment is forgotten
(their reads then fail or miss); ``is_live`` says whether one still is.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from typing import Callable, Mapping

import numpy as np
import tensorstore as ts

from ..keys import KEY_BYTES
from ..metrics import StorageMetrics
from .segment import QUARANTINE_DIR, WRITER_DIR_RE, Segment, array_spec, is_committed_step

log = logging.getLogger("hicache_jax.storage")


class SegmentIndex:
    """Which segment and slot holds each stored key, per pool, and the live segments."""

    def __init__(
        self,
        root: str,
        page_bytes: Mapping[str, int],
        metrics: StorageMetrics,
        ts_context: ts.Context,
        on_forget: Callable[[str], None] = lambda name: None,
    ) -> None:
        self.root = root
        self._page_bytes = dict(page_bytes)
        self._metrics = metrics
        self._ts_ctx = ts_context
        self._on_forget = on_forget
        self.notify: Callable[[str, str, list[bytes]], None] | None = None  # the store's listeners
        self._lock = threading.Lock()
        # pool -> key -> (segment name, slot)
        self._slot_of: dict[str, dict[bytes, tuple[str, int]]] = {p: {} for p in self._page_bytes}
        # pool -> key -> the key's other copies, (segment name, slot), oldest first: only keys
        # held by more than one live segment are here (rare: see the module docstring)
        self._more: dict[str, dict[bytes, list[tuple[str, int]]]] = {p: {} for p in self._page_bytes}
        self._segments: dict[str, Segment] = {}
        self._bad: set[str] = set()  # segment names never to index again in this process
        self._foreign: set[str] = set()  # on disk, but no pool this process can read
        self._bytes = 0
        self._last_refresh = 0.0

    # ---- lookups ---------------------------------------------------------------------------
    def contains(self, pool: str, keys: list[bytes]) -> list[bool]:
        with self._lock:
            idx = self._slot_of[pool]
            return [k in idx for k in keys]

    def locate(self, pool: str, keys: list[bytes], skip: set[int]) -> list[tuple[int, Segment, int, int]]:
        """``(i, segment, slot, crc)`` for every indexed ``keys[i]`` with ``i`` not in ``skip``."""
        plan = []
        with self._lock:
            idx = self._slot_of[pool]
            for i, k in enumerate(keys):
                if i in skip:
                    continue
                loc = idx.get(k)
                if loc is not None:
                    seg = self._segments[loc[0]]
                    plan.append((i, seg, loc[1], seg.crcs[pool].item(loc[1])))
        return plan

    def location(self, pool: str, key: bytes) -> tuple[str, int] | None:
        """``(segment name, slot)`` of ``key`` in ``pool``, or None."""
        with self._lock:
            return self._slot_of[pool].get(key)

    def is_live(self, seg: Segment) -> bool:
        """Whether ``seg`` is still indexed (not quarantined, evicted or vanished)."""
        with self._lock:
            return seg.name in self._segments

    @property
    def segments(self) -> dict[str, Segment]:
        """A copy of the segment table (name -> segment)."""
        with self._lock:
            return dict(self._segments)

    def segment_names(self) -> list[str]:
        """Live segments, oldest commit first (the eviction order)."""
        with self._lock:
            return sorted(self._segments, key=lambda n: self._segments[n].order)

    def oldest(self) -> Segment | None:
        with self._lock:
            return min(self._segments.values(), key=lambda s: s.order) if self._segments else None

    @property
    def stored_bytes(self) -> int:
        with self._lock:
            return self._bytes

    # ---- changes -----------------------------------------------------------------------------
    def add(self, seg: Segment) -> None:
        """Publish a complete segment (a no-op if one of that name is indexed)."""
        with self._lock:
            self._add(seg)

    def _add(self, seg: Segment, announce: bool = False) -> None:  # under _lock
        if seg.name in self._segments:
            return
        self._segments[seg.name] = seg
        self._bytes += seg.nbytes
        notify = self.notify if announce else None
        for p, keys in seg.keys.items():
            idx = self._slot_of[p]
            more = self._more[p]
            new = [k for k in keys if k not in idx] if notify is not None else None
            for slot, k in enumerate(keys):
                old = idx.get(k)
                if old is not None and old[0] != seg.name:  # another segment holds it too
                    more.setdefault(k, []).append(old)
                idx[k] = (seg.name, slot)
            if new:
                notify("stored", p, new)

    def forget(self, name: str) -> Segment | None:
        """Drop a segment and its keys (keys another segment also holds stay with that one)."""
        with self._lock:
            seg = self._segments.pop(name, None)
            if seg is None:
                return None
            self._bytes -= seg.nbytes
            notify = self.notify
            for p, keys in seg.keys.items():
                idx = self._slot_of[p]
                more = self._more[p]
                gone = [] if notify is not None else None
                for k in keys:
                    copies = more.get(k)
                    if idx.get(k, (None,))[0] == name:
                        if copies:  # another live segment holds it: the key moves there
                            idx[k] = copies.pop()
                        else:
                            del idx[k]
                            if gone is not None:
                                gone.append(k)
                    elif copies:  # the map names another segment: drop this copy from the rest
                        copies[:] = [c for c in copies if c[0] != name]
                    if copies is not None and not copies:
                        del more[k]
                if gone:
                    notify("removed", p, gone)
        self._on_forget(name)
        return seg

    def never_index(self, name: str) -> None:
        """Keep ``name`` out of every later refresh (a segment we could not delete)."""
        with self._lock:
            self._bad.add(name)

    def quarantine(self, name: str, path: str, why: str) -> None:
        """Forget the segment for good and move its directory to ``quarantine/``."""
        log.warning("L3 orbax: segment %s: %s; quarantined", name, why)
        with self._lock:
            if name in self._bad:
                return
            self._bad.add(name)
        self.forget(name)
        self._metrics.add(quarantined=1)
        try:
            qdir = os.path.join(self.root, QUARANTINE_DIR)
            os.makedirs(qdir, exist_ok=True)
            os.rename(path, os.path.join(qdir, f"{name.replace('/', '-')}-{uuid.uuid4().hex[:8]}"))
        except FileNotFoundError:
            pass
        except OSError as e:  # read-only store: remembered in-process only
            log.warning("L3 orbax: cannot move %s to quarantine: %r", path, e)

    def segment_failed(self, name: str, why: str) -> None:
        """A read of segment ``name`` failed a check: quarantine it (counted as corrupt), unless
        its directory is gone, which is a plain eviction (forgotten, not counted)."""
        with self._lock:
            seg = self._segments.get(name)
        if seg is None:
            return
        if not os.path.isdir(seg.path):  # evicted (by us or another process): a plain miss
            self.forget(name)
            return
        self._metrics.add(corrupt=1)
        self.quarantine(name, seg.path, why)

    # ---- scanning ----------------------------------------------------------------------------
    def refresh_due(self, interval_s: float) -> bool:
        return bool(interval_s) and time.monotonic() - self._last_refresh > interval_s

    def refresh(self) -> None:
        """Index segments written since the last scan (by any process); forget vanished ones."""
        self._last_refresh = time.monotonic()
        on_disk = self._list_committed()
        with self._lock:
            gone = [n for n in self._segments if n not in on_disk]
            self._foreign &= on_disk.keys()
            new = [n for n in on_disk if n not in self._segments and n not in self._bad and n not in self._foreign]
        for n in gone:
            self.forget(n)
        # Issue every segment's key/CRC reads before waiting on any (start-up over many
        # segments is bounded by I/O latency, not by one segment after another).
        started = [(n, self._start_load(n, on_disk[n])) for n in new]
        loaded = [seg for n, st in started if (seg := self._finish_load(n, on_disk[n], st)) is not None]
        loaded.sort(key=lambda s: s.order)
        with self._lock:
            for seg in loaded:
                if seg.counts:
                    self._add(seg, announce=True)
                else:  # nothing here this process can read: leave it alone
                    self._foreign.add(seg.name)

    def _list_committed(self) -> dict[str, str]:
        """name -> path of every committed segment on disk."""
        out = {}
        try:
            writers = [d for d in os.listdir(self.root) if WRITER_DIR_RE.fullmatch(d)]
        except OSError:
            return out
        for w in writers:
            try:
                steps = os.listdir(os.path.join(self.root, w))
            except OSError:
                continue
            for s in steps:
                if is_committed_step(s):
                    out[f"{w}/{s}"] = os.path.join(self.root, w, s)
        return out

    def _start_load(self, name: str, path: str):
        try:
            with open(os.path.join(path, "default", "_METADATA")) as f:
                meta = json.load(f)
            pools = {v["key_metadata"][0]["key"] for v in meta["tree_metadata"].values()}
            seg = Segment(name, path, (os.stat(path).st_mtime, name), {})
            futs = {}
            for p in sorted(pools & set(self._page_bytes)):
                futs[p] = [
                    ts.open(array_spec(path, f"{p}.{a}"), open=True, read=True, context=self._ts_ctx)
                    for a in ("keys", "crc", "data")
                ]
            return seg, futs
        except Exception as e:
            return e

    def _finish_load(self, name: str, path: str, started) -> Segment | None:
        try:
            if isinstance(started, Exception):
                raise started
            seg, futs = started
            opened = {p: [f.result() for f in fs] for p, fs in futs.items()}
            reads = {p: (hk.read(), hc.read(), hd) for p, (hk, hc, hd) in opened.items()}
            for p, (fk, fc, data) in reads.items():
                keys, crcs = fk.result(), fc.result()
                n = keys.shape[0]
                if keys.shape != (n, KEY_BYTES) or keys.dtype != np.uint8 or crcs.shape != (n,):
                    raise ValueError(f"pool {p}: keys {keys.shape} / crc {crcs.shape} do not match")
                if data.rank != 2 or data.dtype != ts.uint8 or data.shape[0] != n:
                    raise ValueError(f"pool {p}: data {tuple(data.shape)} {data.dtype} for {n} keys")
                if data.shape[1] != self._page_bytes[p]:  # written with other settings: not ours to judge
                    log.warning(
                        "L3 orbax: segment %s: pool %s has %d-byte pages, this store %d; not indexed (left in place)",
                        name,
                        p,
                        data.shape[1],
                        self._page_bytes[p],
                    )
                    self._metrics.add(read_errors=1)
                    continue
                seg.counts[p] = n
                seg.keys[p] = [bytes(k) for k in keys]
                seg.crcs[p] = np.asarray(crcs, np.uint32)
                seg.nbytes += n * self._page_bytes[p]
            return seg
        except FileNotFoundError:
            return None  # evicted between listing and loading
        except Exception as e:
            if not os.path.isdir(path):
                return None
            self.quarantine(name, path, f"unreadable segment metadata: {e!r}")
            return None
