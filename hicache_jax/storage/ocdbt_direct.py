"""Direct page reads from an orbax segment's OCDBT files (the ``read_path="direct"`` fast path).

An orbax segment stores ``{pool}.data`` as a zarr3 array over OCDBT with one chunk per page.
With orbax's chunking (``chunk_byte_size=page_bytes, shard_axes=(0,)``) each chunk is a
``sharding_indexed`` shard holding one uncompressed inner chunk, stored as one OCDBT value::

    [page bytes][inner-chunk offset u64 LE][inner-chunk nbytes u64 LE][CRC-32C of those 16 bytes u32 LE]

and the OCDBT B-tree maps the chunk key ``{pool}.data/c/{slot}/0`` to (data file, offset,
length). Tensorstore's Python API dumps the manifest and B-tree (``ts.ocdbt.dump``), so a
reader can resolve every page's byte range once per segment and then ``preadv`` the page
straight into its destination (in ``CHUNK_BYTES`` pieces, the CRC of each overlapping the
device's work on the next) with no intermediate copies, where a
tensorstore read goes through its cache, decodes the shard into a new buffer and copies it
out again (measured on the project VM, cold 2 MiB pages one at a time: 0.50 GB/s through
tensorstore, 0.70 GB/s direct, raw files 0.75 GB/s).

The fast path is used only when everything matches that layout exactly (zarr.json codecs,
shape, a height-0 B-tree, plain value locations); anything else returns ``None`` from
``load_locations`` and the caller reads through tensorstore. Every direct read also checks
the shard index trailer (offset 0, nbytes = page bytes, its CRC-32C): a value that is not a
single full inner chunk is an error, never bytes served. Page integrity stays with the
caller's per-page CRC (key || page bytes).

Files are opened per read (no descriptor cache): a deleted or quarantined segment is a miss
at once, as through tensorstore, and descriptors are never reused under a reader.

Threading: pure functions; safe from any thread (``os.preadv`` and CRC-32C release the GIL).
"""

from __future__ import annotations

import json
import os
import re

import google_crc32c as _gcrc
import numpy as np
import tensorstore as ts

from . import integrity

SHARD_TAIL = 20  # 16-byte shard index (offset, nbytes) + its CRC-32C
_LOC_RE = re.compile(r"value:([A-Za-z0-9._/-]*):([A-Za-z0-9._/-]+):(\d+):(\d+)\Z")
_MISSING = 0xFFFFFFFFFFFFFFFF
_FADV_RANDOM = getattr(os, "POSIX_FADV_RANDOM", None) if hasattr(os, "posix_fadvise") else None
_FADV_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None) if hasattr(os, "posix_fadvise") else None


class DirectReadError(IOError):
    """A page's bytes could not be read or do not have the expected shard layout."""


def _zarr_ok(meta: dict, page_bytes: int, count: int) -> bool:
    """True if ``meta`` (a zarr.json) is exactly the one-uncompressed-chunk-per-page layout."""
    try:
        if (meta.get("zarr_format") != 3 or meta.get("data_type") != "uint8"
                or list(meta.get("shape", ())) != [count, page_bytes]):
            return False
        grid = meta["chunk_grid"]
        if grid.get("name") != "regular" or list(grid["configuration"]["chunk_shape"]) != [1, page_bytes]:
            return False
        enc = meta.get("chunk_key_encoding", {})
        if enc.get("name") != "default" or enc.get("configuration", {}).get("separator", "/") != "/":
            return False
        codecs = meta["codecs"]
        if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed":
            return False
        cfg = codecs[0]["configuration"]
        if list(cfg["chunk_shape"]) != [1, page_bytes] or cfg.get("index_location", "end") != "end":
            return False
        inner = cfg["codecs"]
        if len(inner) != 1 or inner[0].get("name") != "bytes":
            return False
        idx = cfg["index_codecs"]
        if ([c.get("name") for c in idx] != ["bytes", "crc32c"]
                or idx[0].get("configuration", {}).get("endian", "little") != "little"):
            return False
        return True
    except (KeyError, TypeError, AttributeError):
        return False


def load_locations(step_dir: str, counts: dict[str, int], page_bytes: dict[str, int],
                   context: ts.Context | None = None) -> dict[str, list | None]:
    """Per pool: a list (one entry per slot) of ``(path, offset, length)`` or ``bytes`` (an
    inline value) or ``None`` (no such chunk); or ``None`` for the whole pool when the layout
    is not the expected one (read through tensorstore instead). Raises ``OSError`` (a
    vanished segment) or ``DirectReadError`` (an unreadable manifest or B-tree node)."""
    root = os.path.join(step_dir, "default")
    if not os.path.isdir(root):
        raise FileNotFoundError(root)
    try:
        kv = ts.KvStore.open({"driver": "file", "path": root + "/"}, context=context).result()
        manifest = ts.ocdbt.dump(kv, context=context).result()
    except Exception as e:  # missing or malformed manifest
        raise DirectReadError(f"cannot read the OCDBT manifest of {root}: {e!r}") from e
    versions = manifest.get("versions") or []
    out: dict[str, list | None] = {p: None for p in counts}
    if not versions or manifest.get("version_tree_nodes"):
        return out
    latest = max(versions, key=lambda v: v["generation_number"])
    if latest.get("root_height", 0) != 0 or "location" not in latest.get("root", {}):
        return out
    try:
        node = ts.ocdbt.dump(kv, latest["root"]["location"], context=context).result()
    except Exception as e:
        raise DirectReadError(f"cannot read the OCDBT B-tree of {root}: {e!r}") from e
    if node.get("height", 0) != 0:
        return out
    prefix = node.get("key_prefix", b"") or b""
    entries = {}
    for e in node.get("entries", ()):
        entries[prefix + e["key"]] = e
    for pool, n in counts.items():
        pb = page_bytes[pool]
        meta = entries.get(f"{pool}.data/zarr.json".encode())
        if meta is None or "inline_value" not in meta:
            continue
        try:
            if not _zarr_ok(json.loads(meta["inline_value"]), pb, n):
                continue
        except ValueError:
            continue
        locs: list = []
        ok = True
        for slot in range(n):
            e = entries.get(f"{pool}.data/c/{slot}/0".encode())
            if e is None:
                locs.append(None)
            elif "inline_value" in e:
                locs.append(bytes(e["inline_value"]))
            else:
                m = _LOC_RE.fullmatch(e.get("indirect_value", ""))
                rel = (m.group(1) + m.group(2)) if m else ""
                if not m or rel.startswith("/") or ".." in rel.split("/"):
                    ok = False
                    break
                locs.append((os.path.join(root, rel), int(m.group(3)), int(m.group(4))))
        if ok:
            out[pool] = locs
    return out


def _check_tail(tail, page_bytes: int) -> None:
    t = bytes(tail)
    off = int.from_bytes(t[0:8], "little")
    nbytes = int.from_bytes(t[8:16], "little")
    crc = int.from_bytes(t[16:20], "little")
    if off == _MISSING and nbytes == _MISSING:
        raise DirectReadError("shard holds no chunk (missing page)")
    if integrity.crc32c(t[:16]) != crc:
        raise DirectReadError("shard index CRC mismatch")
    if off != 0 or nbytes != page_bytes:
        raise DirectReadError(f"unexpected shard layout (chunk at {off}, {nbytes} bytes)")


def _preadv_full(fd: int, bufs: list, offset: int, path: str) -> None:
    """``preadv`` until every buffer is full; a short read (EOF) is a truncated file."""
    want = sum(len(b) for b in bufs)
    got = 0
    while bufs:
        n = os.preadv(fd, bufs, offset + got)
        if n <= 0:
            raise DirectReadError(f"short read: {got} of {want} bytes at {offset} in {path} (truncated?)")
        got += n
        while bufs and n >= len(bufs[0]):  # drop the buffers filled, trim a partly filled one
            n -= len(bufs[0])
            bufs = bufs[1:]
        if bufs and n:
            bufs = [bufs[0][n:]] + bufs[1:]


CHUNK_BYTES = 512 << 10  # read/CRC granularity while the rest of a page is still arriving


def _groups(parts: list, chunk: int) -> list:
    """Split ``parts`` (1-D uint8 arrays, the page's bytes in order) into read groups of about
    ``chunk`` bytes: each group a list of sub-arrays read by one ``preadv``."""
    groups, cur, size = [], [], 0
    for p in parts:
        for a in range(0, p.nbytes, chunk):
            piece = p[a:a + chunk]
            cur.append(piece)
            size += piece.nbytes
            if size >= chunk:
                groups.append(cur)
                cur, size = [], 0
    if cur:
        groups.append(cur)
    return groups


def read_page(loc, dst, crc_seed: int | None = None, on_requested=None) -> int | None:
    """Fill ``dst`` with the page at ``loc``; with ``crc_seed`` (the CRC-32C of the key), also
    return the CRC-32C of key || page.

    ``dst``: a C-contiguous ``uint8[page_bytes]`` array, or a list of C-contiguous 1-D uint8
    arrays that take the page's bytes in order (e.g. a host page's component slabs).

    The whole page is requested at once (``POSIX_FADV_WILLNEED``), then ``on_requested()`` runs
    (work that overlaps the device: the caller's backup of its destination), then the page is
    read and checksummed in ``CHUNK_BYTES`` groups, so the CRC of one group overlaps the
    device reading the next (one thread, no handoffs). On an exception ``dst`` may hold part
    of the page."""
    parts = dst if isinstance(dst, list) else [dst]
    pb = sum(p.nbytes for p in parts)
    if loc is None:
        raise DirectReadError("missing chunk")
    crc = crc_seed
    if isinstance(loc, bytes):
        if len(loc) != pb + SHARD_TAIL:
            raise DirectReadError(f"inline value of {len(loc)} bytes, expected {pb + SHARD_TAIL}")
        _check_tail(loc[pb:], pb)
        if on_requested is not None:
            on_requested()
        src = np.frombuffer(loc, np.uint8, pb)
        pos = 0
        for p in parts:
            p[...] = src[pos:pos + p.nbytes]
            pos += p.nbytes
            if crc is not None:
                crc = _gcrc.extend(crc, p)
        return None if crc is None else int(crc)
    path, offset, length = loc
    if length != pb + SHARD_TAIL:
        raise DirectReadError(f"value of {length} bytes, expected {pb + SHARD_TAIL}")
    tail = bytearray(SHARD_TAIL)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        if _FADV_RANDOM is not None:
            # Pages sit at random offsets of a large data file: without this the kernel's
            # readahead (8 MiB on the project VM) may fetch well beyond the page.
            os.posix_fadvise(fd, 0, 0, _FADV_RANDOM)
        groups = _groups(parts, CHUNK_BYTES if (crc is not None or on_requested is not None) else pb)
        if len(groups) > 1 and _FADV_WILLNEED is not None:
            os.posix_fadvise(fd, offset, length, _FADV_WILLNEED)
        if on_requested is not None:
            on_requested()
        pos = offset
        for gi, g in enumerate(groups):
            bufs = [memoryview(x) for x in g] + ([memoryview(tail)] if gi == len(groups) - 1 else [])
            _preadv_full(fd, bufs, pos, path)
            for x in g:
                pos += x.nbytes
                if crc is not None:
                    crc = _gcrc.extend(crc, x)
    finally:
        os.close(fd)
    _check_tail(tail, pb)
    return None if crc is None else int(crc)
