"""The local store's command line and process hygiene: ``hicache-jax mooncake-server`` and
``python -m hicache_jax.storage.mooncake.server`` start cleanly (no runpy warning), every flag
has help, a JAX process starting a store never forks itself, and Mooncake's logs are quiet by
default (a few lines per process) with ``log_level`` / ``--log-level`` bringing them back."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import pytest

from storage_helpers import child_env

from hicache_jax.storage.mooncake import server

GLOG_LINE = re.compile(r"^(WARNING: Logging before InitGoogleLogging|[IWEF]\d{4} )", re.M)


def _need_store():
    reason = server.unavailable_reason()
    if reason is not None:
        pytest.skip(f"no Mooncake master here: {reason}")


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "always", *args],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=timeout,
        cwd="/",
    )


def test_every_flag_has_help():
    ap = argparse.ArgumentParser()
    server.add_arguments(ap)
    flags = [a for a in ap._actions if not isinstance(a, argparse._HelpAction)]
    assert len(flags) >= 7
    missing = [a.option_strings for a in flags if not a.help]
    assert not missing, f"flags without help: {missing}"
    r = _run(["-m", "hicache_jax.cli", "mooncake-server", "-h"])
    assert r.returncode == 0, r.stderr
    for a in flags:  # each flag listed with (the start of) its own help
        assert a.option_strings[0] in r.stdout and a.help.split()[0] in r.stdout


@pytest.mark.parametrize(
    "entry",
    [["-m", "hicache_jax.storage.mooncake.server"], ["-m", "hicache_jax.cli", "mooncake-server"]],
    ids=["python_m", "console"],
)
def test_server_starts_without_warnings(entry):
    _need_store()
    r = _run([*entry, "--max-lifetime-s", "0.5", "--store-node-bytes", str(64 << 20)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "StorageConfig(backend='mooncake'" in r.stdout
    assert "Warning" not in r.stderr and "runpy" not in r.stderr, r.stderr[-3000:]


_FORK_CHILD = """
import os, sys
import jax, jax.numpy as jnp
jnp.ones(8).block_until_ready()  # JAX's threads are running
os.register_at_fork(before=lambda: print("FORKED", file=sys.stderr, flush=True))
from hicache_jax.storage.mooncake import MooncakeMaster
with MooncakeMaster(store_node_bytes=64 << 20) as m:
    assert m.master_alive() and m.store_node_alive() and m.metadata_pid
print("OK")
"""


def test_store_processes_start_without_forking_a_jax_process():
    """``register_at_fork`` hooks run on every fork of this process (os.fork, and subprocess
    with a ``preexec_fn``), and are skipped by vfork/posix_spawn, which copy no Python state."""
    _need_store()
    r = _run(["-c", _FORK_CHILD])
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
    assert "FORKED" not in r.stderr and "fork" not in r.stderr.lower(), r.stderr[-3000:]


_LOG_CLIENT = """
import sys
from hicache_jax import HostKVPool, KVGeometry
from hicache_jax.storage import create_storage
from hicache_jax.storage.mooncake import MooncakeMaster
cfg = MooncakeMaster(rpc_port=int(sys.argv[1]), metadata_port=int(sys.argv[2])).storage_config()
create_storage(cfg, {"target": HostKVPool(KVGeometry.mha(2, 4, 2, 32, "bfloat16"), 4)}).close()
"""

_LOG_CHILD = """
import json, re, subprocess, sys
from hicache_jax.storage.mooncake import MooncakeMaster
pattern, client, kw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
pat = re.compile(pattern, re.M)
with MooncakeMaster(store_node_bytes=64 << 20, **kw) as m:
    r = subprocess.run([sys.executable, "-c", client, str(m.rpc_port), str(m.metadata_port)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    counts = {"client": len(pat.findall(r.stderr))}
    for name, path in (("master", m.master_log), ("store_node", m.store_node_log)):
        counts[name] = len(pat.findall(open(path).read()))
print(json.dumps(counts))
"""


def _log_lines(env_extra: dict | None = None, **kw) -> dict:
    """glog lines per process (client in an engine process, master, store node) at start-up."""
    env = child_env()
    for k in ("MC_LOG_LEVEL", "GLOG_minloglevel"):
        env.pop(k, None)
    env.update(env_extra or {})
    r = subprocess.run(
        [sys.executable, "-c", _LOG_CHILD, GLOG_LINE.pattern, _LOG_CLIENT, json.dumps(kw)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_logs_are_quiet_by_default_and_verbose_on_request():
    _need_store()
    quiet = _log_lines()
    assert all(n <= 3 for n in quiet.values()), quiet  # ~3 benign lines each (Mooncake's default: 9-21)
    loud = _log_lines({"MC_LOG_LEVEL": "INFO"}, log_level="info")  # the user's env wins in the client
    assert loud["master"] > quiet["master"] and loud["store_node"] >= 10 and loud["client"] >= 10, (quiet, loud)


def test_log_level_is_checked():
    with pytest.raises(ValueError, match="log_level: expected one of"):
        server.MooncakeMaster(log_level="verbose")
