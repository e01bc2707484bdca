"""Every option of every ``hicache-jax`` command refuses bad values as an argparse usage error
(exit 2, the option named, what it expects), before any engine, JAX or output work: numbers
must be finite and within bounds (the bounds come from each option's type), choices one of the
listed, paths writable (checked before the run, so a run is never lost to a bad ``--out``),
sizes that cannot fit the machine refused up front. The table is built from the parsers
themselves, so an option added without a check fails ``test_every_option_has_bad_values``."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time

import pytest

from hicache_jax import chat, cli
from hicache_jax.storage.mooncake import server


def commands() -> list[tuple[list[str], argparse.ArgumentParser]]:
    """(argv prefix, parser) of every command."""
    out = []
    for action in cli.parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
                if nested:
                    out += [([name, b], bp) for b, bp in nested[0].choices.items()]
                else:
                    out.append(([name], sub))
    return out


def _fmt(kind, x) -> str:
    return str(int(x)) if kind is int else repr(float(x))


def bounded_bad_values(bounds) -> list[str]:
    kind, lo, hi, lo_open = bounds
    vals = ["x", "", _fmt(kind, lo) if lo_open else _fmt(kind, lo - 1), _fmt(kind, hi + 1 if kind is int else hi * 2)]
    if kind is int:
        return vals + ["1.5", "nan", "1e3"]
    return vals + ["nan", "inf", "-inf", "1e400"]


# Options whose type has no bounds and no choices: their bad values (extra argv to reach the check).
EXPLICIT: dict[str, list[tuple[str, list[str]]]] = {
    "--out": [("/dev/null/x.json", []), ("/proc/hicache-no-such-dir/x.json", []), (".", [])],
    "--storage-dir": [("/dev/null", []), ("/dev/null/l3", [])],
    "--mooncake-master": [("h", []), ("h:0", []), ("h:70000", []), (":80", []), ("h:x", [])],
    "--mooncake-metadata": [
        ("http://h:2/metadata", []),  # without --mooncake-master
        ("ftp://x", ["--storage-backend", "mooncake", "--mooncake-master", "h:1"]),
        ("http://h:99999/m", ["--storage-backend", "mooncake", "--mooncake-master", "h:1"]),
    ],
    "--mooncake-node-bytes": [("1", []), ("-1", []), ("nan", []), (str(1 << 51), [])],
    "--dtype": [("int3", []), ("", []), ("float64", [])],
    "--weights": [("/nonexistent/pair.npz", [])],
    "--host": [("", []), ("127.0.0.1 ", [])],
    "--store-node-bytes": [("1", []), ("-1", []), ("nan", []), (str(1 << 51), [])],
    "--context": [("/nonexistent/doc.txt", []), ("/", [])],
}
# Options with nothing to refuse (flags).
FREE = {
    "--help",
    "--quick",
    "--deterministic",
    "--compare-impls",
    "--version",
    "--no-storage",
    "--no-reuse",
    "--turns",
}  # --turns: any text is a turn
# Sizes each within bounds whose product cannot fit any machine: refused up front too.
MEMORY = [
    (["bench", "transfer"], ["--heads", "1024", "--head-dim", "8192", "--layers", "1024"], "--heads"),
    (["bench", "transfer"], ["--page-sizes", "4096", "--page-counts", str(1 << 24)], "--page-counts"),
    (
        ["bench", "multiturn"],
        ["--device-pages", str(1 << 24), "--page-size", "4096", "--host-ratio", "1024", "--engines", "256"],
        "--device-pages",
    ),
]


# The commands whose runners ``no_run`` blocks (a value not refused must not start a run); a new
# command joins once its runner is blocked there too (test_every_option_has_bad_values covers
# every command's options already).
SWEPT = {"bench", "mooncake-server", "chat"}


def cases() -> list[tuple[str, list[str], str]]:
    """(id, argv, the option the error names)."""
    out = []
    for prefix, p in commands():
        if prefix[0] not in SWEPT:
            continue
        for a in p._actions:
            if not a.option_strings or a.option_strings[-1] in FREE or a.option_strings[0] in FREE:
                continue
            opt = a.option_strings[-1]
            bounds = getattr(a.type, "bounds", None)
            if opt in EXPLICIT:
                vals = EXPLICIT[opt]
            elif bounds is not None:
                vals = [(v, []) for v in bounded_bad_values(bounds)]
            elif a.choices is not None:
                vals = [("bogus", [])]
            else:
                continue  # test_every_option_has_bad_values reports it
            out += [(f"{' '.join(prefix)} {opt} {v!r}", [*prefix, *extra, opt, v], opt) for v, extra in vals]
    out += [(f"{' '.join(prefix)} {' '.join(argv)}", [*prefix, *argv], opt) for prefix, argv, opt in MEMORY]
    return out


CASES = cases()


def test_every_option_has_bad_values():
    missing = []
    for prefix, p in commands():
        for a in p._actions:
            if not a.option_strings or set(a.option_strings) & FREE:
                continue
            opt = a.option_strings[-1]
            if opt not in EXPLICIT and getattr(a.type, "bounds", None) is None and a.choices is None:
                missing.append(f"{' '.join(prefix)} {opt}")
    assert not missing, f"options accepting any value (add a checked type, choices or EXPLICIT values): {missing}"


@pytest.fixture
def no_run(monkeypatch, tmp_path):
    """Nothing may run: a benchmark or the server starting is a failure; the cwd is an empty
    directory that must stay empty (no output written)."""

    def refuse(*a, **k):
        raise AssertionError("a bad option was not refused: the command started")

    monkeypatch.setattr(cli, "run_benchmark", refuse)
    monkeypatch.setattr(server, "run", refuse)
    monkeypatch.setattr(chat, "run", refuse)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    assert not list(tmp_path.iterdir()), "a refused command wrote output"


@pytest.mark.parametrize("argv,option", [(a, o) for _i, a, o in CASES], ids=[i for i, _a, _o in CASES])
def test_bad_option_value_is_a_usage_error_naming_it(argv, option, no_run, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "usage:" in err and f"argument {option}" in err.replace("/", " argument ") or f"argument {option}" in err, (
        err
    )
    assert "usage:" in err and ("expected" in err or "invalid choice" in err), err


def test_good_values_at_the_bounds_pass(no_run):
    """The bounds are inclusive where they say so: each command's parser takes them."""
    for _prefix, p in commands():
        for a in p._actions:
            bounds = getattr(a.type, "bounds", None)
            if bounds is None:
                continue
            kind, lo, hi, lo_open = bounds
            for v in ([] if lo_open else [lo]) + [hi]:
                assert a.type(_fmt(kind, v)) == v


# The issue's list, end to end in a fresh interpreter: exit 2 within seconds, JAX never imported.
ISSUE_CASES = [
    ["bench", "multiturn", "--host-ratio", "nan"],
    ["bench", "multiturn", "--host-ratio", "inf"],
    ["bench", "ttft", "--reuse", "nan"],
    ["bench", "ttft", "--worker-nice", "100"],
    ["bench", "two-run", "--seed", "-1"],
    ["bench", "spec", "--seed", "-1"],
    ["bench", "transfer", "--dtype", "int3"],
    ["bench", "ttft", "--quick", "--out", "/dev/null/x.json"],
    ["bench", "transfer", "--heads", "1000000"],
    ["mooncake-server", "--max-lifetime-s", "-5"],
]


def test_the_issues_bad_options_fail_fast_without_jax(tmp_path):
    script = textwrap.dedent(f"""
        import json, sys, time
        from hicache_jax import cli
        out = []
        for argv in {ISSUE_CASES!r}:
            t = time.perf_counter()
            try:
                cli.main(argv)
                code = 0
            except SystemExit as e:
                code = e.code
            out.append((code, time.perf_counter() - t))
        print(json.dumps({{"results": out, "jax": "jax" in sys.modules}}))
    """)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert [c for c, _s in got["results"]] == [2] * len(ISSUE_CASES), r.stderr
    assert all(s < 5 for _c, s in got["results"]), got
    assert not got["jax"] and time.perf_counter() - t0 < 60
    assert not list(tmp_path.iterdir())
