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
    code = (
        "import sys, contextlib, io\n"
        "from hicache_jax import cli\n"
        "for b in cli.BENCHMARKS:\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):\n"
        "        cli.main(['bench', b.name, '--help'])\n"
        "    text = buf.getvalue()\n"
        "    flat = ''.join(text.split())\n"
        "    assert '--quick' in flat and '(default:hicache-results/' in flat, (b.name, text)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'jaxlib', 'orbax'))\n"
        "print('heavy:', bad)\n"
    )
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


def test_quick_takes_the_tiny_shape_of_a_hybrid_preset():
    import argparse

    from hicache_jax.bench import options

    for given, want in (
        (["--model", "hybrid"], "hybrid-tiny"),
        ([], "tiny"),
        (["--model", "hybrid-tiny"], "hybrid-tiny"),
    ):
        p = argparse.ArgumentParser()
        options.multiturn_arguments(p)
        args = p.parse_args(["--quick", *given])
        options.apply_quick(p, args, "multiturn")
        assert args.model == want, given


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hicache_jax.cli", *argv], env=_env(), capture_output=True, text=True, timeout=120
    )


def test_version_prints_the_package_version():
    import hicache_jax

    r = _cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"hicache-jax {hicache_jax.__version__}"


def test_top_level_help_is_for_users_not_developers():
    r = _cli("-h")
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "hicache-jax bench BENCHMARK" in text and "--version" in text and "own_engine.py" in text
    for dev in ("Adding a benchmark", "BENCHMARKS", "module:function", "import JAX at module level"):
        assert dev not in text, f"developer text {dev!r} in the top-level help"


def test_the_package_is_marked_typed_and_versioned_in_one_place():
    import tomllib

    import hicache_jax

    assert os.path.isfile(os.path.join(ROOT, "hicache_jax", "py.typed"))
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["hicache_jax"]
    assert "version" in meta["project"]["dynamic"] and "version" not in meta["project"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "hicache_jax.version.__version__"}
    from hicache_jax import version

    assert hicache_jax.__version__ == version.__version__ and version.__version__  # the package re-exports it


def test_a_benchmark_without_its_extra_names_the_extra_in_one_line(tmp_path):
    """A venv without the ``bench`` extra (here: flax made unimportable) gets one line naming
    the extra and the install command, no traceback, exit 2, before any benchmark work. In an
    environment without JAX (the torch one) JAX is what is missing first, and it is named."""
    import importlib.util

    blocked, extra = "flax", "bench"
    missing = blocked if importlib.util.find_spec("jax") is not None else "jax"
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] == {blocked!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from hicache_jax import cli\n"
        f"sys.exit(cli.main(['bench', 'ttft', '--quick', '--out', {str(tmp_path / 'r.json')!r}]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    named = [l for l in r.stderr.splitlines() if "hicache-jax[" in l]
    assert len(named) == 1 and f"pip install 'hicache-jax[{extra}]'" in named[0], r.stderr
    assert f"({missing} is not installed)" in named[0], r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "r.json").exists()


def test_a_missing_module_no_extra_installs_is_not_hidden():
    from hicache_jax import cli

    assert cli.missing_extra(ModuleNotFoundError("x", name="hicache_jax.bench.nothing")) is None
    assert "hicache-jax[models]" in cli.missing_extra(ModuleNotFoundError("x", name="gguf.constants"))
