"""Start and stop a local Mooncake Store: a master, its HTTP metadata server and a store node.

Used by the tests (pytest fixtures wrap it), the benchmarks and anyone who wants a local
Mooncake Store without writing a launch script::

    with MooncakeMaster() as m:
        cfg = m.storage_config()  # StorageConfig(backend="mooncake", ...) for this store

or from a shell (runs until Ctrl-C, or ``--max-lifetime-s``; prints the settings to use)::

    hicache-jax mooncake-server [--store-node-bytes 1073741824] [--log-level info]
    python -m hicache_jax.storage.mooncake.server ...        (the same)

Three processes, all on ``host`` (loopback by default) and free ports:

* the wheel's ``mooncake_master`` binary: the object index (RPC and admin/metrics ports);
* ``_metadata_server.py``: the transfer engine's HTTP metadata store (the master's built-in
  one binds every interface whatever it is told, so it is not used);
* the store node (``store_node_bytes`` > 0, the default): the wheel's ``mooncake_client``
  binary, a long-lived Mooncake client that lends ``store_node_bytes`` of its memory to the
  store (its "global segment") and does nothing else.

Why a store node. A Mooncake object lives in the memory of one client's global segment,
and the master drops a segment's objects when its client goes away: pages an engine's own
client lends memory for vanish when that engine exits (measured). With a store node, engines
lend nothing (``mooncake_global_segment_bytes=0``, which ``storage_config()`` sets): every
put lands in the node's segment (the only one mounted), so the pages outlive the engine that
wrote them, a restarted engine hits them and a second engine (another process, its own L1/L2)
is served from them. Mooncake evicts from the node's segment by itself (lease, watermark).
``store_node_bytes=0`` starts no node; clients must then lend memory themselves.

Processes die with their parent: all three start through ``_launch.py`` (a fresh interpreter
that sets ``PR_SET_PDEATHSIG``, SIGKILL when the thread that started them exits: start them from
a long-lived thread, e.g. the main one, then execs the command), so the parent never forks
itself (no ``preexec_fn``: a JAX process is never forked), and the metadata server also exits
when its parent does (polled every 0.2 s); ``stop()`` (and the
context manager, and an ``atexit`` hook) stop them in the normal case. ``kill_master()`` /
``restart_master()`` / ``kill_store_node()`` / ``start_store_node()`` are for fault tests: a
restarted master comes back on the same ports, empty, and the node re-mounts its segment with
it by itself (its old objects are gone: the master forgot them); a killed node's objects stay
listed until the master gives up on it (``client_ttl_s``), and reads of them miss.

Network exposure, stated plainly: master, metadata server and the node's own service port
listen on ``host`` only, but every Mooncake client's transfer engine (the node's and each
engine's) listens on all interfaces: its handshake port (0.0.0.0) and its TCP data port
(``[::]``, dual stack). The TCP data port serves reads and writes of any address its peer
names in the process that owns it, unauthenticated. Tried, with
mooncake-transfer-engine-non-cuda 0.3.13.post1 (``ss -ltnp`` after ``setup``):
``MC_TCP_BIND_ADDRESS=127.0.0.1`` (changes only the address announced in the metadata),
``MC_USE_IPV6=0`` (no change), ``MC_LEGACY_RPC_PORT_BINDING=1`` (binds the handshake on the
``local_hostname`` port, still on every interface, and ``setup`` then failed: port in use),
``local_hostname="127.0.0.1"`` (announced address only) and ``mooncake_client --host=127.0.0.1``
(binds its own service port only). Upstream's sources bind those two sockets to
``INADDR_ANY`` / ``tcp::v6()`` with no setting. What does work is choosing where those two
ports come from: ``MC_MIN_RPC_PORT`` / ``MC_MAX_RPC_PORT`` (with 20000 / 20100 both landed in
that range), so a firewall rule can cover them. On a shared network, firewall that range or run
the engines in a network namespace; the tests and benchmarks here do neither (a machine whose
other users are trusted).

Logging: Mooncake's binaries and client log through glog, ~20 lines per process at its default
level. ``log_level`` (``--log-level``; default ``warning``: ~3 benign lines per process) sets
``MC_LOG_LEVEL`` (Mooncake's client and store node) and ``GLOG_minloglevel`` (the master) for
the processes started here; ``quiet_client_logs()`` (the backend calls it before the client
library loads) sets the same default for the engine's own client unless they are already set.

``unavailable_reason()`` says why no store can start here (package not installed, Debian
libraries missing) or None; tests skip with it.

Threading: one ``MooncakeMaster`` belongs to one thread at a time.
"""

from __future__ import annotations

import atexit
import importlib.util
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref

__all__ = [
    "DEFAULT_LOG_LEVEL",
    "DEFAULT_STORE_NODE_BYTES",
    "LOG_LEVELS",
    "MooncakeMaster",
    "MasterStartError",
    "free_port",
    "master_binary",
    "quiet_client_logs",
    "store_node_binary",
    "unavailable_reason",
]

_METADATA_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_metadata_server.py")
_LAUNCH_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_launch.py")
# Log levels by name: (glog's GLOG_minloglevel, which mooncake_master reads; Mooncake's MC_LOG_LEVEL,
# which its client library and mooncake_client read and which overrides glog's own setting there).
LOG_LEVELS = {"info": ("0", "INFO"), "warning": ("1", "WARNING"), "error": ("2", "ERROR")}
DEFAULT_LOG_LEVEL = "warning"  # ~3 lines per process at start (benign ones), against 9-21 at info


def _log_env(level: str) -> dict[str, str]:
    glog, mc = LOG_LEVELS[level]
    return {"GLOG_minloglevel": glog, "MC_LOG_LEVEL": mc}


_reason_cache: list = []
_live: "weakref.WeakSet[MooncakeMaster]" = weakref.WeakSet()


class MasterStartError(RuntimeError):
    """The master (or its metadata server) did not come up; the message has its log's tail."""


def _mooncake_spec():
    """The installed ``mooncake`` package's spec, or None (a directory named ``mooncake`` on
    ``sys.path``, such as ``tests/storage/mooncake``, is a namespace package: not it)."""
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin in (None, "namespace") or not spec.submodule_search_locations:
        return None
    return spec


def _wheel_binary(name: str) -> str | None:
    spec = _mooncake_spec()
    if spec is None:
        return None
    for d in spec.submodule_search_locations:
        path = os.path.join(d, name)
        if os.path.isfile(path):
            return path
    return None


def master_binary() -> str | None:
    """Path of the ``mooncake_master`` binary shipped in the ``mooncake`` wheel, or None."""
    return _wheel_binary("mooncake_master")


def store_node_binary() -> str | None:
    """Path of the ``mooncake_client`` binary (the store node) shipped in the wheel, or None."""
    return _wheel_binary("mooncake_client")


def quiet_client_logs(level: str = DEFAULT_LOG_LEVEL) -> None:
    """Set the log level of a Mooncake client loaded later in this process (``MC_LOG_LEVEL``,
    ``GLOG_minloglevel``), each unless already set (the user's choice wins: ``MC_LOG_LEVEL=INFO``
    brings Mooncake's own logs back). Read when the client library loads: call this before
    ``import mooncake.store``."""
    if level not in LOG_LEVELS:
        raise ValueError(f"level: expected one of {list(LOG_LEVELS)}, got {level!r}")
    for k, v in _log_env(level).items():
        os.environ.setdefault(k, v)


def _ensure_executable(path: str) -> None:
    if not os.access(path, os.X_OK):
        os.chmod(path, os.stat(path).st_mode | 0o111)


def unavailable_reason() -> str | None:
    """Why a Mooncake master cannot run here (None: it can). Cached per process."""
    if _reason_cache:
        return _reason_cache[0]
    reason = None
    binary = master_binary()
    if _mooncake_spec() is None:
        reason = (
            "the 'mooncake' extra is not installed in this environment "
            "(pip install 'hicache-jax[mooncake]'; wheels: mooncake-transfer-engine-non-cuda)"
        )
    elif binary is None:
        reason = "the mooncake package has no mooncake_master binary"
    else:
        try:
            _ensure_executable(binary)
            r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=20)
            if r.returncode != 0:
                tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [f"exit status {r.returncode}"]
                reason = (
                    f"mooncake_master does not run: {tail[0]} (Debian: apt-get install libibverbs1 librdmacm1 libnuma1)"
                )
        except (OSError, subprocess.SubprocessError) as e:
            reason = f"mooncake_master does not run: {e!r}"
        if reason is None:
            try:  # the client library needs the same shared libraries
                quiet_client_logs()
                import mooncake.store  # noqa: F401
            except Exception as e:  # ImportError, OSError from the dynamic loader
                reason = (
                    f"mooncake.store does not import: {e} (Debian: apt-get install libibverbs1 librdmacm1 libnuma1)"
                )
    _reason_cache.append(reason)
    return reason


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the usual bind-to-0 probe; callers retry on a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _launched(cmd: list[str]) -> list[str]:
    """``cmd`` run through ``_launch.py``: it dies with the thread starting it (see the module
    docstring) and no ``preexec_fn`` makes ``subprocess`` fork this process."""
    return [sys.executable, "-I", "-S", _LAUNCH_SCRIPT, str(os.getpid()), *cmd]


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _tail(path: str, n: int = 15) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


DEFAULT_STORE_NODE_BYTES = 1 << 30


class MooncakeMaster:
    """A local Mooncake Store on ``host`` (loopback by default): master, HTTP metadata server
    and (``store_node_bytes`` > 0) a store node lending that much memory.

    ``lease_ttl_ms``: how long an object is protected from eviction after a put/get
    (``--default_kv_lease_ttl``; Mooncake's default is 10000). ``eviction_high_watermark``:
    fraction of the mounted segments' capacity at which the master evicts. ``client_ttl_s``:
    how long a client that stopped heart-beating keeps its segments. ``extra_args`` go to the
    master verbatim. Ports 0 pick free ones. ``start_timeout_s`` bounds each start.
    ``log_level``: glog's minimum level in the processes started (``LOG_LEVELS``; ``info`` is
    Mooncake's own default, ~20 lines per process at start).
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        rpc_port: int = 0,
        metadata_port: int = 0,
        lease_ttl_ms: int = 10000,
        eviction_high_watermark: float = 0.9,
        client_ttl_s: int = 10,
        store_node_bytes: int = DEFAULT_STORE_NODE_BYTES,
        extra_args: tuple[str, ...] = (),
        start_timeout_s: float = 30.0,
        log_dir: str | None = None,
        max_lifetime_s: float = 0.0,
        log_level: str = DEFAULT_LOG_LEVEL,
    ) -> None:
        if not isinstance(host, str) or not host:
            raise ValueError(f"host: expected an IP address string, got {host!r}")
        for name, v in (
            ("rpc_port", rpc_port),
            ("metadata_port", metadata_port),
            ("lease_ttl_ms", lease_ttl_ms),
            ("client_ttl_s", client_ttl_s),
            ("store_node_bytes", store_node_bytes),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (name.endswith("port") and v > 65535):
                raise ValueError(
                    f"{name}: expected a non-negative int{' <= 65535' if name.endswith('port') else ''}, got {v!r}"
                )
        if 0 < store_node_bytes < (1 << 20):
            raise ValueError(f"store_node_bytes: expected 0 (no store node) or at least 1 MiB, got {store_node_bytes}")
        if log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: expected one of {list(LOG_LEVELS)}, got {log_level!r}")
        if isinstance(eviction_high_watermark, bool) or not (
            isinstance(eviction_high_watermark, (int, float)) and 0 < eviction_high_watermark <= 1
        ):
            raise ValueError(f"eviction_high_watermark: expected a number in (0, 1], got {eviction_high_watermark!r}")
        for name, v, lo in (("start_timeout_s", start_timeout_s, "> 0"), ("max_lifetime_s", max_lifetime_s, ">= 0")):
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < 0
                or (lo == "> 0" and v == 0)
            ):
                raise ValueError(
                    f"{name}: expected finite seconds {lo}{' (0: no limit)' if lo == '>= 0' else ''}, got {v!r}"
                )
        if isinstance(extra_args, (str, bytes)) or any(not isinstance(a, str) for a in extra_args):
            raise TypeError(f"extra_args: expected a sequence of str (arguments for the master), got {extra_args!r}")
        if log_dir is not None and not isinstance(log_dir, str):
            raise TypeError(f"log_dir: expected a str or None, got {type(log_dir).__name__}")
        self.host = host
        self.rpc_port, self.metadata_port, self.admin_port = rpc_port, metadata_port, 0
        self.lease_ttl_ms, self.eviction_high_watermark, self.client_ttl_s = (
            lease_ttl_ms,
            eviction_high_watermark,
            client_ttl_s,
        )
        self.store_node_bytes = store_node_bytes
        self.store_node_port = 0
        self.log_level = log_level
        self._env = {**os.environ, **_log_env(log_level)}
        self.extra_args = tuple(extra_args)
        self.start_timeout_s = float(start_timeout_s)
        self.max_lifetime_s = float(max_lifetime_s)
        self._own_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="hicache-mooncake-")
        self.master_log = os.path.join(self.log_dir, "master.log")
        self.store_node_log = os.path.join(self.log_dir, "store_node.log")
        self._master: subprocess.Popen | None = None
        self._meta: subprocess.Popen | None = None
        self._node: subprocess.Popen | None = None
        self._lock = threading.Lock()

    # ---- addresses ---------------------------------------------------------------------------
    @property
    def rpc_address(self) -> str:
        """``host:port`` of the master's RPC service (``master_server_addr`` of a client)."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """URL of the HTTP metadata server (``metadata_server`` of a client)."""
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def master_pid(self) -> int | None:
        p = self._master
        return p.pid if p is not None and p.poll() is None else None

    def master_alive(self) -> bool:
        return self._master is not None and self._master.poll() is None

    @property
    def metadata_pid(self) -> int | None:
        p = self._meta
        return p.pid if p is not None and p.poll() is None else None

    @property
    def store_node_pid(self) -> int | None:
        p = self._node
        return p.pid if p is not None and p.poll() is None else None

    def store_node_alive(self) -> bool:
        return self._node is not None and self._node.poll() is None

    def storage_config(self, **overrides):
        """A ``StorageConfig(backend="mooncake")`` for this store: its addresses and, with a
        store node, ``mooncake_global_segment_bytes=0`` (the engine lends no memory: its pages
        go to the node and outlive it). ``overrides`` are further ``StorageConfig`` fields."""
        from ..config import StorageConfig

        kw = {"mooncake_master": self.rpc_address, "mooncake_metadata": self.metadata_url}
        if self.store_node_bytes:
            kw["mooncake_global_segment_bytes"] = 0
        kw.update(overrides)
        return StorageConfig(backend="mooncake", **kw)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "MooncakeMaster":
        """Start the metadata server and the master; raises ``MasterStartError`` (with the
        reason) if either is not listening within ``start_timeout_s``."""
        reason = unavailable_reason()
        if reason is not None:
            raise MasterStartError(reason)
        with self._lock:
            _live.add(self)
            if self._meta is None or self._meta.poll() is not None:
                self._start_metadata()
            if not self.master_alive():
                self._start_master()
            if self.store_node_bytes and not self.store_node_alive():
                self._start_node()
        return self

    def _start_metadata(self) -> None:
        fixed = self.metadata_port != 0
        for _ in range(1 if fixed else 3):
            port = self.metadata_port or free_port(self.host)
            cmd = [sys.executable, _METADATA_SCRIPT, "--host", self.host, "--port", str(port)]
            if self.max_lifetime_s > 0:  # counted from the store's start: the others start after it
                cmd += ["--max-lifetime-s", str(self.max_lifetime_s + 3 * self.start_timeout_s)]
            p = subprocess.Popen(
                _launched(cmd),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                close_fds=True,
                env=self._env,
            )
            line = self._read_ready(p)
            if line.startswith("READY"):
                self._meta, self.metadata_port = p, port
                p.stdout.close()
                return
            p.kill()
            p.wait()
            err = line
        raise MasterStartError(f"metadata server did not start on {self.host}: {err.strip()}")

    def _read_ready(self, p: subprocess.Popen) -> str:
        out: list[str] = []
        t = threading.Thread(target=lambda: out.append(p.stdout.readline()), daemon=True)
        t.start()
        t.join(self.start_timeout_s)
        if not out:
            return "no READY line within the start timeout"
        if not out[0].startswith("READY"):
            rest = ""
            try:
                rest = p.communicate(timeout=2)[0] or ""
            except subprocess.TimeoutExpired:
                pass
            return out[0] + rest
        return out[0]

    def _master_cmd(self) -> list[str]:
        return [
            master_binary(),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.admin_port}",
            "--enable_http_metadata_server=false",
            "--enable_metric_reporting=false",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            f"--eviction_high_watermark_ratio={self.eviction_high_watermark}",
            f"--client_ttl={self.client_ttl_s}",
            *self.extra_args,
        ]

    def _start_master(self) -> None:
        fixed = self.rpc_port != 0
        err = ""
        for _ in range(1 if fixed else 3):
            if not fixed:
                self.rpc_port = free_port(self.host)
            if not self.admin_port:
                self.admin_port = free_port(self.host)
            with open(self.master_log, "ab") as log:
                p = subprocess.Popen(
                    _launched(self._master_cmd()),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    close_fds=True,
                    cwd=self.log_dir,
                    env=self._env,
                )
            deadline = time.monotonic() + self.start_timeout_s
            while time.monotonic() < deadline and p.poll() is None:
                if _listening(self.host, self.rpc_port) and _listening(self.host, self.admin_port):
                    self._master = p
                    return
                time.sleep(0.05)
            if p.poll() is None:
                p.kill()
            p.wait()
            err = f"exit status {p.returncode}" if p.returncode is not None else "timed out"
            err += f"; log tail:\n{_tail(self.master_log)}"
            if not fixed:
                self.admin_port = 0
        raise MasterStartError(f"mooncake_master did not start on {self.host}:{self.rpc_port}: {err}")

    def _node_cmd(self) -> list[str]:
        return [
            store_node_binary(),
            f"--host={self.host}",
            f"--port={self.store_node_port}",
            f"--global_segment_size={self.store_node_bytes}",
            "--local_buffer_size=0",
            f"--master_server_address={self.rpc_address}",
            f"--metadata_server={self.metadata_url}",
            "--protocol=tcp",
            "--enable_http_server=false",
        ]

    def _start_node(self) -> None:
        """Start the store node; it listens on its service port once its segment is mounted."""
        binary = store_node_binary()
        if binary is None:
            raise MasterStartError(
                "the mooncake package has no mooncake_client binary (the store node); "
                "use store_node_bytes=0 and let the clients lend memory"
            )
        _ensure_executable(binary)
        err = ""
        for _ in range(3):
            self.store_node_port = free_port(self.host)
            with open(self.store_node_log, "ab") as log:
                p = subprocess.Popen(
                    _launched(self._node_cmd()),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    close_fds=True,
                    cwd=self.log_dir,
                    env=self._env,
                )
            deadline = time.monotonic() + self.start_timeout_s
            while time.monotonic() < deadline and p.poll() is None:
                if _listening(self.host, self.store_node_port):
                    self._node = p
                    return
                time.sleep(0.05)
            if p.poll() is None:
                p.kill()
            p.wait()
            err = f"exit status {p.returncode}" if p.returncode is not None else "timed out"
            err += f"; log tail:\n{_tail(self.store_node_log)}"
        raise MasterStartError(f"the store node (mooncake_client, {self.store_node_bytes} bytes) did not start: {err}")

    def kill_store_node(self, sig: int = signal.SIGKILL) -> None:
        """Kill the store node (fault tests): its segment, and every page in it, goes away."""
        with self._lock:
            p, self._node = self._node, None
        _kill(p, sig)

    def start_store_node(self) -> None:
        """Start a store node again after ``kill_store_node`` (a fresh, empty segment)."""
        with self._lock:
            if self.store_node_bytes and not self.store_node_alive():
                self._start_node()

    def kill_master(self, sig: int = signal.SIGKILL) -> None:
        """Kill the master process only (fault tests); the metadata server keeps running."""
        with self._lock:
            p, self._master = self._master, None
        _kill(p, sig)

    def restart_master(self) -> None:
        """Kill the master (if running) and start a fresh one on the same ports (an empty store;
        the store node, if any, re-mounts its segment with it by itself)."""
        self.kill_master()
        with self._lock:
            deadline = time.monotonic() + self.start_timeout_s
            while True:  # the old sockets may linger for a moment
                try:
                    self._start_master_fixed()
                    return
                except MasterStartError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

    def _start_master_fixed(self) -> None:
        saved = self.rpc_port
        try:
            self._start_master()
        finally:
            self.rpc_port = saved

    def stop(self) -> None:
        """Stop every process (idempotent): the store node first, then the master, then the
        metadata server."""
        with self._lock:
            procs = [p for p in (self._node, self._master, self._meta) if p is not None]
            self._node = self._master = self._meta = None
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._own_dir:
            try:
                for f in os.listdir(self.log_dir):
                    os.unlink(os.path.join(self.log_dir, f))
                os.rmdir(self.log_dir)
            except OSError:
                pass

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (
            f"MooncakeMaster(rpc={self.rpc_address}, metadata={self.metadata_url}, alive={self.master_alive()}, "
            f"store_node_bytes={self.store_node_bytes}, node_alive={self.store_node_alive()})"
        )


def _kill(p: subprocess.Popen | None, sig: int) -> None:
    if p is not None and p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@atexit.register
def _stop_all() -> None:
    for m in list(_live):
        try:
            m.stop()
        except Exception:
            pass


def _arg_type(kind: type, lo: float, hi: float, want: str):
    """An argparse type: ``kind`` in [lo, hi] (floats finite), a usage error naming ``want`` otherwise."""
    import argparse

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if (kind is float and not math.isfinite(v)) or not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return v

    parse.__name__ = want
    parse.bounds = (kind, lo, hi, False)  # (tests derive the values to refuse from them)
    return parse


def _node_bytes(text: str) -> int:
    import argparse

    v = _arg_type(int, 0, 1 << 50, "bytes in [0, 2**50]")(text)
    if 0 < v < (1 << 20):
        raise argparse.ArgumentTypeError(f"expected 0 (no store node) or at least 1 MiB ({1 << 20}), got {text!r}")
    return v


def _host(text: str) -> str:
    import argparse

    if not text or text != text.strip() or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"expected an IP address, got {text!r}")
    return text


_host.__name__ = "IP address"


def add_arguments(ap) -> None:
    """The server's options (``hicache-jax mooncake-server`` and ``python -m`` share them); a bad
    value is a usage error before anything starts."""
    port = _arg_type(int, 0, 65535, "a port in [0, 65535]")
    ap.add_argument(
        "--host",
        type=_host,
        default="127.0.0.1",
        help="IP address the master, metadata server and store node listen on (every client's "
        "transfer engine still listens on all interfaces: see the README's Mooncake section)",
    )
    ap.add_argument("--rpc-port", type=port, default=0, help="the master's RPC port (0: a free one)")
    ap.add_argument("--metadata-port", type=port, default=0, help="the HTTP metadata server's port (0: a free one)")
    ap.add_argument(
        "--lease-ttl-ms",
        type=_arg_type(int, 0, 1 << 31, "ms in [0, 2**31]"),
        default=10000,
        help="how long an object is protected from eviction after a put or get, in ms",
    )
    ap.add_argument(
        "--store-node-bytes",
        type=_node_bytes,
        default=DEFAULT_STORE_NODE_BYTES,
        help="memory the store node lends the store (0: no store node; engines must lend their own)",
    )
    ap.add_argument(
        "--max-lifetime-s",
        type=_arg_type(float, 0, 365 * 24 * 3600.0, "finite seconds >= 0"),
        default=0.0,
        help="stop after this long (0: until Ctrl-C)",
    )
    ap.add_argument(
        "--log-level",
        choices=list(LOG_LEVELS),
        default=DEFAULT_LOG_LEVEL,
        help="glog's minimum level in the master and store node (info: Mooncake's own default, "
        "~20 lines per process); their logs go to files in the directory printed at start",
    )


def run(args) -> int:
    """Run the store until Ctrl-C, the master's exit or ``--max-lifetime-s``; prints the
    ``StorageConfig`` to use."""
    m = MooncakeMaster(
        host=args.host,
        rpc_port=args.rpc_port,
        metadata_port=args.metadata_port,
        lease_ttl_ms=args.lease_ttl_ms,
        store_node_bytes=args.store_node_bytes,
        max_lifetime_s=args.max_lifetime_s,
        log_level=args.log_level,
    )
    with m:
        seg = 0 if m.store_node_bytes else "<bytes this engine lends>"
        print(
            f"StorageConfig(backend='mooncake', mooncake_master='{m.rpc_address}', "
            f"mooncake_metadata='{m.metadata_url}', mooncake_global_segment_bytes={seg})",
            flush=True,
        )
        print(f"logs: {m.log_dir} (removed at exit)", flush=True)
        deadline = time.monotonic() + args.max_lifetime_s if args.max_lifetime_s > 0 else None
        try:
            while m.master_alive() and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


DESCRIPTION = (
    "Run a local Mooncake Store (master, HTTP metadata server, store node) on loopback until Ctrl-C; "
    "prints the StorageConfig to use."
)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="hicache-jax mooncake-server",
        description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
