"""The README's set-up lines are the ones CI runs: the Quickstart's commands exist and are what
``.ci/run`` and the benchmark script execute, the install line names the package's version
and the extras the wheel test installs (``tests/jax_backend/test_wheel_example.py`` reads them
from here), every relative link points at a file, and the user-facing pages carry no
development-tracker references a reader cannot follow."""

from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path

import hicache_jax
from hicache_jax.bench import options

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, re.S | re.M)
    assert m, f"README has no '## {title}' section"
    return m.group(1)


def _bash_lines(text: str) -> list[list[str]]:
    """The commands of the ```bash blocks in ``text``, comments dropped, split like a shell."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                cmds.append(shlex.split(line))
    return cmds


def install_extras() -> str:
    """The extras of the README's ``pip install "...whl[extras]"`` line (the wheel test installs these)."""
    for cmd in _bash_lines(_section("Install into your own project")):
        if cmd[:2] == ["pip", "install"]:
            m = re.fullmatch(r"dist/hicache_jax-(.+)-py3-none-any\.whl\[([a-z,]+)\]", cmd[2])
            assert m, cmd
            return m.group(2)
    raise AssertionError("the README's install section has no pip install line")


def test_quickstart_is_near_the_top_and_runs_the_scripts_ci_runs():
    assert README.index("## Quickstart") < README.index("## Install"), "the Quickstart comes first"
    cmds = _bash_lines(_section("Quickstart"))
    scripts = [c[0] for c in cmds]
    assert scripts[:1] == ["./scripts/test"] and "./scripts/bench" in scripts, cmds
    for s in set(scripts):
        path = ROOT / s
        assert path.is_file() and os.access(path, os.X_OK), f"{s} is not an executable file"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^\./scripts/test\b", ci, re.M), "CI does not run the Quickstart's test command"
    bench = (ROOT / "scripts" / "bench").read_text()
    assert 'bench multiturn "$@"' in bench
    # Every option the Quickstart passes to ./scripts/bench is one `bench multiturn` accepts.
    p = argparse.ArgumentParser()
    options.multiturn_arguments(p)
    for c in cmds:
        if c[0] == "./scripts/bench":
            p.parse_args(c[1:])
    # ... and every one it passes to ./scripts/chat, one `hicache-jax chat` accepts (files relative
    # to the clone's root, where the Quickstart runs).
    assert 'hicache-jax" chat "$@"' in (ROOT / "scripts" / "chat").read_text()
    from hicache_jax import chat

    cp = argparse.ArgumentParser()
    chat.add_arguments(cp, "chat")
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        for c in cmds:
            if c[0] == "./scripts/chat":
                chat.check(cp, cp.parse_args(c[1:]))
    finally:
        os.chdir(cwd)


def test_install_line_names_this_version_and_the_extras_the_wheel_test_installs():
    cmds = _bash_lines(_section("Install into your own project"))
    wheel_line = next(c for c in cmds if c[:2] == ["pip", "wheel"])
    install_line = next(c for c in cmds if c[:2] == ["pip", "install"])
    assert f"hicache_jax-{hicache_jax.__version__}-py3-none-any.whl" in install_line[2], install_line
    assert "--no-deps" in wheel_line and "-w" in wheel_line, wheel_line
    extras = set(install_extras().split(","))
    import tomllib

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert extras <= declared, f"README installs extras the package lacks: {extras - declared}"
    wheel_test = (ROOT / "tests" / "jax_backend" / "test_wheel_example.py").read_text()
    assert "install_extras()" in wheel_test, "the wheel test must install the README's extras"


def test_relative_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 1, "docs/ pages are missing"
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"


def test_no_tracker_references_in_user_pages():
    bad = re.compile(r"\b[Ii]ssue \d+|\bpoint \d+\b|`issues`|issue notes")
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        hits = [l for l in page.read_text().splitlines() if bad.search(l)]
        assert not hits, f"{page.relative_to(ROOT)}: {hits[:3]}"
