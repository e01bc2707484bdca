"""The README's L3 figures are the committed benchmark results, not numbers typed from memory.

``benchmarks/results/readme/`` holds the ``python -m benchmarks.bench_l3`` runs the README and
``docs/data-plane.md`` quote (their JSON as written, every run in full). Each quoted figure is a
goal ratio's median and range over the runs, written ``0.80x (0.78-0.83)``; this test reads the
numbers out of the results file and looks for that text, so a figure edited by hand, a rerun
not copied into the pages, or a results file from a ``--quick`` run fails it.
"""

from __future__ import annotations

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "readme"
PAGES = [ROOT / "README.md", ROOT / "docs" / "data-plane.md"]


def _load(name: str) -> dict:
    path = RESULTS / name
    assert path.is_file(), f"{path} is missing: the README quotes it"
    return json.loads(path.read_text())


def _fig(summary: dict, goal: str) -> str:
    s = summary[goal]
    return f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def _full_size(data: dict, backend: str) -> None:
    """The committed results are the benchmark's defaults (not ``--quick``), 3 runs or more."""
    assert data["backend"] == backend and data["runs"] >= 3
    for c in data["configs"].values():
        assert len(c["runs"]) == data["runs"]
        for run in c["runs"]:
            cfg = run["config"]
            assert (cfg["pages"], cfg["page_bytes"], cfg["rounds"]) == (256, 2 << 20, 5), cfg
        for goal, s in c["summary"].items():  # the summary is the runs' own ratios
            assert s["runs"] == [r["goal_ratios"][goal] for r in c["runs"]]
            assert s["min"] == min(s["runs"]) and s["max"] == max(s["runs"])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_mooncake_figures_are_the_committed_results(page):
    data = _load("l3_mooncake.json")
    _full_size(data, "mooncake")
    text = " ".join(page.read_text().split())  # line breaks do not matter
    for placement, where in (("node", "pages in a store node"), ("local", "in the client's own segment")):
        s = data["configs"][placement]["summary"]
        want = (
            f"{where} write {_fig(s, 'write, one batch')}, read {_fig(s, 'read, one batch')}, "
            f"one page per call {_fig(s, 'read, one page per call')}"
        )
        assert want in text, f"{page.name} should say: {want!r}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_orbax_figures_are_the_committed_results(page):
    data = _load("l3_orbax.json")
    _full_size(data, "orbax")
    s = data["configs"]["orbax"]["summary"]
    text = " ".join(page.read_text().split())
    want = (
        f"orbax writes at {_fig(s, 'write / orbax segments')} the fastest raw writer and reads cold at "
        f"{_fig(s, 'cold read, 1 at a time / orbax + CRC')} one page at a time, "
        f"{_fig(s, 'cold read, 16 in flight / orbax + CRC')} 16 in flight"
    )
    assert want in text, f"{page.name} should say: {want!r}"
