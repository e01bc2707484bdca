"""The ``hicache-jax`` CLI: --help is fast (imports no JAX, no flax), shows defaults, every
benchmark has --quick and writes under ./hicache-results by default."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    return {**os.environ, "PYTHONPATH": ROOT}


def test_help_imports_no_jax_and_shows_defaults():
    code = ("import sys, contextlib, io\n"
            "from hicache_jax import cli\n"
            "for b in cli.BENCHMARKS:\n"
            "    buf = io.StringIO()\n"
            "    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):\n"
            "        cli.main(['bench', b.name, '--help'])\n"
            "    text = buf.getvalue()\n"
            "    flat = ''.join(text.split())\n"
            "    assert '--quick' in flat and '(default:hicache-results/' in flat, (b.name, text)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'jaxlib', 'orbax'))\n"
            "print('heavy:', bad)\n")
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "heavy: []" in r.stdout, r.stdout


def test_every_benchmark_has_quick_values_that_name_real_options():
    import argparse

    from hicache_jax import cli
    from hicache_jax.bench import options

    for b in cli.BENCHMARKS:
        p = argparse.ArgumentParser()
        b.arguments(p)
        assert b.name in options.QUICK, f"{b.name}: no --quick sizes"
        for k in options.QUICK[b.name]:
            assert p.get_default(k) is not None or k == "page_counts", f"{b.name}: --quick sets unknown {k}"
        args = p.parse_args(["--quick"])
        options.apply_quick(p, args, b.name)
        for k, v in options.QUICK[b.name].items():
            assert getattr(args, k) == v
    # an option given on the command line wins over --quick
    p = argparse.ArgumentParser()
    options.multiturn_arguments(p)
    args = p.parse_args(["--quick", "--clients", "5"])
    options.apply_quick(p, args, "multiturn")
    assert args.clients == 5 and args.rounds == options.QUICK["multiturn"]["rounds"]


def test_copy_impls_match_the_dispatcher():
    pytest.importorskip("jax")
    from hicache_jax.bench.options import COPY_IMPLS
    from pallas_kernels.page_copy.dispatch import IMPLS

    assert tuple(COPY_IMPLS) == tuple(IMPLS)
