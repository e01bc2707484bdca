"""Typed, validated L3 storage configuration.

Pure Python. ``StorageConfig`` is immutable and validated in ``__post_init__`` (TypeError for
a wrong type, ValueError for a wrong value, each naming the field).

Prefetch fields are read by the controller (not by the backends):

* ``prefetch_policy``:
    - ``best_effort``: the prefetch stops whenever the scheduler asks; whatever is loaded is used.
    - ``wait_complete``: the request waits until every hit page has been read.
    - ``timeout`` (default): like ``wait_complete`` but gives up after ``prefetch_timeout(tokens)``.
* ``prefetch_threshold_tokens``: a continuation shorter than this is not prefetched (skipped,
  with ``reason_code="below_threshold"``), and a storage hit shorter than it is revoked
  (upstream: ``max(256, page_size)``; the controller applies the max with the page size).
* Timeout formula (seconds) for a prefetch of ``tokens`` tokens::

      timeout = base_s + per_ki_token_s * tokens / 1024,   capped at max_s when max_s is not None

  The defaults ``1.0 + 0.25 * tokens/1024`` with no cap are upstream's unified-tree values;
  upstream's HiRadix tree uses ``base_s=2.0, per_ki_token_s=0.1, max_s=30``.

``prepare_store_dir`` is the one function here that touches the filesystem: the disk backends
call it at construction to fail fast on a ``path`` that cannot hold their store.

Threading: immutable; share freely.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import os
import tempfile
from dataclasses import dataclass
from urllib.parse import urlsplit

from .._checks import check_int
from ..workers import DEFAULT_WORKER_NICE, check_nice

BACKENDS = ("orbax", "file", "memory", "mooncake")
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
INTEGRITY_MODES = ("full", "sampled", "off")
READ_PATHS = ("direct", "tensorstore")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# segment_pages=None: a segment holds about this many bytes of a pool's pages, within these bounds.
AUTO_SEGMENT_BYTES = 64 << 20
AUTO_SEGMENT_PAGES = (64, 256)


class StorageSetupError(ValueError):
    """The settings name a store that cannot be used (raised at construction when ``strict``).
    The message starts with the setting's name (``path: ...``)."""


def prepare_store_dir(config: "StorageConfig", subdir: str) -> bool:
    """Create ``config.path/subdir`` and check it can be written (a file is created and removed).

    Returns True when it is writable. Raises ``StorageSetupError`` naming ``path`` when it cannot
    be a store directory (a file, under a file, not creatable) and, when ``config.strict``, also
    when it is a directory that cannot be written; not strict, that last case returns False (the
    caller serves reads only). Runs as root too: ``os.access`` says yes to root for any mode bits,
    so writability is tried, not asked."""
    root = os.path.abspath(config.path)
    anc = root
    while not os.path.exists(anc):  # the nearest existing ancestor must be a directory
        anc = os.path.dirname(anc)
    if not os.path.isdir(anc):
        what = "is a file" if anc == root else f"is under {anc!r}, which is a file"
        raise StorageSetupError(
            f"path: {config.path!r} {what}; expected a directory (or a path one can be "
            f"created at) for the {config.backend!r} store"
        )
    target = os.path.join(root, subdir)
    try:
        os.makedirs(target, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".hicache-write-probe-", dir=target)
        os.close(fd)
        os.unlink(probe)
        return True
    except OSError as e:
        denied = e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
        if denied and not config.strict and os.path.isdir(target):
            return False  # a read-only store: its pages can still be served
        if denied:
            raise StorageSetupError(
                f"path: store directory {target!r} is not writable ({e.strerror or e!r}); "
                "fix its permissions or point path elsewhere (strict=False serves a "
                "read-only store's pages and stores nothing)"
            ) from e
        raise StorageSetupError(f"path: store directory {target!r} cannot be created ({e.strerror or e!r})") from e


def split_host_port(name: str, addr: str) -> tuple[str, int]:
    """``host:port`` (IPv6 as ``[addr]:port``) -> (host, port); ValueError naming ``name``."""
    host, sep, port = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}: expected 'host:port' with a port in [1, 65535], got {addr!r}")
    return host, int(port)


def check_host(name: str, host: str) -> None:
    """An IP address or a plausible DNS name; ValueError naming ``name``."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if (
        not host
        or len(host) > 253
        or not all(
            0 < len(l) < 64 and l[0] != "-" and l[-1] != "-" and all(c.isalnum() or c == "-" for c in l) for l in labels
        )
    ):
        raise ValueError(f"{name}: expected an IP address or a host name, got {host!r}")


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(name: str, v: object, lo: int, hi: int | None = None) -> None:
    check_int(name, v, lo, hi, numpy_ints=False)


def _num(name: str, v: object, lo: float, *, lo_open: bool = False, hi: float | None = None) -> None:
    if not _is_num(v):
        raise TypeError(f"{name}: expected a number, got {type(v).__name__}")
    if not math.isfinite(v) or (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
        bound = f"> {lo}" if lo_open else f">= {lo}"
        raise ValueError(
            f"{name}: expected a finite number {bound}" + (f" and <= {hi}" if hi is not None else "") + f", got {v}"
        )


def _choice(name: str, v: object, choices: tuple[str, ...]) -> None:
    if not isinstance(v, str):
        raise TypeError(f"{name}: expected a str, got {type(v).__name__}")
    if v not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {v!r}")


@dataclass(frozen=True)
class StorageConfig:
    """L3 storage settings.

    backend            ``orbax`` (segment log, default), ``file`` (one file per page), ``memory`` or
                       ``mooncake`` (a Mooncake Store, shared by every engine using the same master).
    path               Store directory; required for ``orbax`` and ``file``.
    capacity_bytes     Bound on stored page bytes; 0 = unbounded. Eviction is oldest-first
                       (whole segments for ``orbax``).
    segment_pages      Pages per orbax segment (64-256 recommended; smaller is allowed for tests).
                       None (default): sized by bytes per pool, ``AUTO_SEGMENT_BYTES`` (64 MiB) of
                       pages within 64..256 pages and at most ``max_pending_pages`` (see
                       ``segment_pages_for``). Every orbax step costs ~25 ms of CPU however small
                       (measured on the project VM), so pools of small pages get 256-page segments.
    read_concurrency   Page reads kept in flight per batch (~16 saturates disks measured so far); also the
                       threads of the ``file`` backend's read and write pools (pages written in parallel:
                       CRC, write, fsync, rename) and of the ``mooncake`` backend's workers.
    integrity          ``full``: CRC-32C of every page checked on read; ``sampled``: checked on a
                       ``integrity_sample_rate`` fraction of reads (deterministic per key);
                       ``off``: never checked (missing chunks in a segment may then read as zeros).
    flush_interval_s   A partial orbax segment is written after at most this long.
    max_pending_pages  Pages accepted but not yet written (orbax); sets beyond are dropped.
    refresh_interval_s How often the orbax index picks up segments other processes wrote (0 = never).
    read_path          orbax page reads: ``direct`` (default: byte ranges resolved once per segment from
                       the OCDBT B-tree, then ``preadv`` straight into the host page; falls back per segment to
                       tensorstore when the layout is not the expected one) or ``tensorstore``
                       (zarr3-over-OCDBT reads through tensorstore handles).
    write_buffer_bytes orbax: memory of reusable segment buffers kept between saves (pages are packed
                       straight into them; freshly allocated memory costs as much as the disk write on
                       some VMs). 0 = allocate every segment afresh.
    mooncake_*         The ``mooncake`` backend (a Mooncake Store client, ``hicache_jax.storage.mooncake``):
                       ``mooncake_master`` the master's RPC ``host:port`` and ``mooncake_metadata`` the
                       transfer engine's HTTP metadata URL (``http://host:port/metadata``), both required;
                       ``mooncake_local_hostname`` the address this client's transfer engine announces
                       (it listens on every interface whatever this says: see ``mooncake.server``);
                       ``mooncake_protocol`` ``tcp`` or ``rdma`` (``mooncake_device``: RDMA devices);
                       ``mooncake_global_segment_bytes`` the memory this client lends the store (its
                       pages live there and vanish with it: 0 lends none, for a client of a store whose
                       memory a long-lived store node lends, as ``MooncakeMaster.storage_config()`` sets);
                       ``mooncake_local_buffer_bytes`` the client's transfer buffer;
                       ``mooncake_op_timeout_s`` the bound on every store call (exceeded: misses / failed
                       sets); ``mooncake_connect_timeout_s`` the bound on connecting at construction;
                       ``mooncake_retry_interval_s`` how long calls miss without touching the store after a
                       fault before it is probed again. ``capacity_bytes`` must stay 0 (the store's capacity
                       is the segments its clients lend; Mooncake evicts by itself).
    prefetch_policy    How long admission waits for a prefetch (module docstring): ``timeout`` (default),
                       ``wait_complete`` or ``best_effort``.
    prefetch_threshold_tokens
                       The shortest L3 read worth doing, in tokens (default 256, upstream's; the controller
                       uses ``max(this, page_size)``). A prefetch whose continuation after what the tree
                       already holds is shorter is skipped before any storage lookup, and a storage hit
                       shorter than it is revoked. Short prompts (a restart with ~100-token prompts)
                       therefore never hit L3 at the default: lower it to a page or two for them. Skips are
                       visible: ``PrefetchOperation.reason`` / ``reason_code`` (``below_threshold``),
                       ``metrics.prefetch_skipped_by_reason`` (Prometheus ``prefetch_skipped_total{reason}``)
                       and a log line (info the first time, then debug).
    prefetch_timeout_* The ``timeout`` policy's formula (module docstring).
    strict             What a store that cannot be used at construction does (``create_storage``): True
                       (default) raises, naming the setting: ``path`` that is a file, lies under a file,
                       cannot be created or cannot be written (``StorageSetupError``, a ValueError), an
                       unreachable ``mooncake_master`` / ``mooncake_metadata`` (ConnectionError). False
                       degrades with one warning: a directory that can be read but not written still
                       serves the pages it holds and stores nothing (``orbax``, ``file``); any other
                       fault gives no L3 (``DisabledStorage``: every lookup misses, every page set is
                       dropped and counted). Faults after construction are counted misses either way.
    worker_nice        How much lower than the scheduler's the OS priority of the L3 threads is (the
                       controller's query / IO / backup threads, the segment writer and the read pool;
                       0..19, ``hicache_jax.workers``): storage work uses idle cores and yields to the
                       thread driving the model.
    """

    backend: str = "orbax"
    path: str | None = None
    capacity_bytes: int = 0
    segment_pages: int | None = None
    read_concurrency: int = 16
    integrity: str = "full"
    integrity_sample_rate: float = 0.125
    flush_interval_s: float = 0.5
    max_pending_pages: int = 1024
    refresh_interval_s: float = 5.0
    read_path: str = "direct"
    write_buffer_bytes: int = 512 << 20
    prefetch_policy: str = "timeout"
    prefetch_threshold_tokens: int = 256
    prefetch_timeout_base_s: float = 1.0
    prefetch_timeout_per_ki_token_s: float = 0.25
    prefetch_timeout_max_s: float | None = None
    worker_nice: int = DEFAULT_WORKER_NICE
    strict: bool = True
    mooncake_master: str | None = None
    mooncake_metadata: str | None = None
    mooncake_local_hostname: str = "127.0.0.1"
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    mooncake_global_segment_bytes: int = 1 << 30
    mooncake_local_buffer_bytes: int = 16 << 20
    mooncake_op_timeout_s: float = 5.0
    mooncake_connect_timeout_s: float = 10.0
    mooncake_retry_interval_s: float = 1.0

    def __post_init__(self) -> None:
        _choice("backend", self.backend, BACKENDS)
        if not isinstance(self.strict, bool):
            raise TypeError(f"strict: expected a bool, got {type(self.strict).__name__}")
        check_nice(self.worker_nice)
        if self.path is not None and not isinstance(self.path, str):
            # os.PathLike is accepted and normalised to str.
            import os

            if isinstance(self.path, os.PathLike):
                object.__setattr__(self, "path", os.fspath(self.path))
            else:
                raise TypeError(f"path: expected a str or os.PathLike, got {type(self.path).__name__}")
        if self.backend in ("orbax", "file") and not self.path:
            raise ValueError(f"path: backend {self.backend!r} needs a store directory")
        _int("capacity_bytes", self.capacity_bytes, 0)
        if self.segment_pages is not None:
            _int("segment_pages", self.segment_pages, 1, 65536)
        _int("read_concurrency", self.read_concurrency, 1, 1024)
        _choice("integrity", self.integrity, INTEGRITY_MODES)
        _num("integrity_sample_rate", self.integrity_sample_rate, 0.0, lo_open=True, hi=1.0)
        _num("flush_interval_s", self.flush_interval_s, 0.0, lo_open=True)
        _int("max_pending_pages", self.max_pending_pages, 1)
        _num("refresh_interval_s", self.refresh_interval_s, 0.0)
        _choice("read_path", self.read_path, READ_PATHS)
        _int("write_buffer_bytes", self.write_buffer_bytes, 0)
        _choice("prefetch_policy", self.prefetch_policy, PREFETCH_POLICIES)
        _int("prefetch_threshold_tokens", self.prefetch_threshold_tokens, 0)
        _num("prefetch_timeout_base_s", self.prefetch_timeout_base_s, 0.0)
        _num("prefetch_timeout_per_ki_token_s", self.prefetch_timeout_per_ki_token_s, 0.0)
        if self.prefetch_timeout_max_s is not None:
            _num("prefetch_timeout_max_s", self.prefetch_timeout_max_s, 0.0, lo_open=True)
        self._check_mooncake()
        if self.segment_pages is not None and self.max_pending_pages < self.segment_pages:
            raise ValueError(
                f"max_pending_pages: expected >= segment_pages={self.segment_pages}, got {self.max_pending_pages}"
            )

    def _check_mooncake(self) -> None:
        for name in ("mooncake_master", "mooncake_metadata"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise TypeError(f"{name}: expected a str or None, got {type(v).__name__}")
        if not isinstance(self.mooncake_local_hostname, str):
            raise TypeError(
                f"mooncake_local_hostname: expected a str, got {type(self.mooncake_local_hostname).__name__}"
            )
        if not isinstance(self.mooncake_device, str):
            raise TypeError(f"mooncake_device: expected a str, got {type(self.mooncake_device).__name__}")
        _choice("mooncake_protocol", self.mooncake_protocol, MOONCAKE_PROTOCOLS)
        _int("mooncake_global_segment_bytes", self.mooncake_global_segment_bytes, 0)
        _int("mooncake_local_buffer_bytes", self.mooncake_local_buffer_bytes, 1 << 20)
        _num("mooncake_op_timeout_s", self.mooncake_op_timeout_s, 0.0, lo_open=True, hi=3600.0)
        _num("mooncake_connect_timeout_s", self.mooncake_connect_timeout_s, 0.0, lo_open=True, hi=3600.0)
        _num("mooncake_retry_interval_s", self.mooncake_retry_interval_s, 0.0, hi=3600.0)
        if self.backend != "mooncake":
            return
        if not self.mooncake_master:
            raise ValueError("mooncake_master: backend 'mooncake' needs the master's RPC address 'host:port'")
        if not self.mooncake_metadata:
            raise ValueError(
                "mooncake_metadata: backend 'mooncake' needs the HTTP metadata server URL 'http://host:port/metadata'"
            )
        host, port = split_host_port("mooncake_master", self.mooncake_master)
        check_host("mooncake_master", host)
        url = urlsplit(self.mooncake_metadata)
        if url.scheme != "http" or not url.hostname or not url.path:
            raise ValueError(f"mooncake_metadata: expected 'http://host:port/path', got {self.mooncake_metadata!r}")
        try:
            _ = url.port  # raises ValueError for a port out of range
        except ValueError:
            raise ValueError(
                f"mooncake_metadata: expected a port in [0, 65535] in the URL, got {self.mooncake_metadata!r}"
            ) from None
        check_host("mooncake_metadata", url.hostname)
        check_host("mooncake_local_hostname", self.mooncake_local_hostname)
        if self.capacity_bytes:
            raise ValueError(
                "capacity_bytes: the 'mooncake' store's capacity is the memory its clients lend "
                "(mooncake_global_segment_bytes) and Mooncake evicts by itself; leave it 0"
            )

    def segment_pages_for(self, page_bytes: int) -> int:
        """Pages per orbax segment for a pool of ``page_bytes``-byte pages (``segment_pages``
        when set, else sized by bytes as described in the class docstring)."""
        _int("page_bytes", page_bytes, 1)
        if self.segment_pages is not None:
            return self.segment_pages
        lo, hi = AUTO_SEGMENT_PAGES
        return min(self.max_pending_pages, max(lo, min(hi, AUTO_SEGMENT_BYTES // page_bytes)))

    def prefetch_timeout(self, tokens: int) -> float:
        """Seconds a ``timeout`` prefetch of ``tokens`` tokens may take (see module docstring)."""
        _int("tokens", tokens, 0)
        t = self.prefetch_timeout_base_s + self.prefetch_timeout_per_ki_token_s * tokens / 1024
        return t if self.prefetch_timeout_max_s is None else min(t, self.prefetch_timeout_max_s)

    @classmethod
    def from_dict(cls, d: dict) -> "StorageConfig":
        """Build from a plain dict (e.g. parsed JSON extra config); unknown keys are an error."""
        if not isinstance(d, dict):
            raise TypeError(f"storage config: expected a dict, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"storage config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**d)
