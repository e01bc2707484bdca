"""The differential benchmark (issue 21 point 17): ours vs upstream sglang's HiRadixCache.

Its upstream side needs ``.venv-upstream`` (Python 3.11, torch CPU, sglang 0.5.18;
``scripts/upstream_baseline_env.sh`` builds it, which needs the package index). CI does not
build it, so there the bounded paired run below is skipped (the reason is printed) and only
our side and the reporting run; where the venv exists (``UPSTREAM_VENV`` or
``<repo>/.venv-upstream``) the paired run runs too. The smoke test of our side alone is
``test_cache_bench_smoke.test_bench_tree_differential_our_side_replays``.
"""

import copy
import importlib.util
import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UPSTREAM_PY = os.path.join(os.environ.get("UPSTREAM_VENV", os.path.join(ROOT, ".venv-upstream")), "bin", "python")


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_tree_differential", os.path.join(ROOT, "benchmarks", "bench_tree_differential.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _result(bench, page, ratio, policy, eviction, ours, upstream):
    """One configuration's result as ``main`` writes it (two seeds, hit rates given per tier)."""
    o = {"L1": ours[0], "L2": ours[1], "total": ours[0] + ours[1]}
    u = {"L1": upstream[0], "L2": upstream[1], "total": upstream[0] + upstream[1]}
    return {
        "page_size": page,
        "host_ratio": ratio,
        "write_policy": policy,
        "eviction": eviction,
        "hit_rate_ours": o,
        "hit_rate_upstream": u,
        "ours_ge_upstream": {t: o[t] >= u[t] - bench.TOL for t in ("L1", "L2", "total")},
        "first_divergence": [30, None],
        "diverging_requests": 5,
        "evicting_requests": {"ours": 9, "upstream": 8},
        "per_seed": [
            {
                "seed": s,
                "ours": {"L1": o["L1"], "L2": o["L2"]},
                "upstream": {"L1": u["L1"], "L2": u["L2"]},
                "prompt_tokens": 100,
            }
            for s in (0, 1)
        ],
        "requests": 20,
    }


def _doc(results):
    return {
        "benchmark": "tree_differential",
        "sglang": "0.5.18",
        "quick": False,
        "seconds": 3.0,
        "config": {
            "device_tokens": 6000,
            "requests_per_trace": 10,
            "seeds": [0, 1],
            "tree_decisions": "auto",
            "host_ratios": [0.5],
            "evictions": ["lru"],
        },
        "all_ge": True,
        "results": results,
    }


def test_render_merges_split_runs_and_flags_a_lower_tier(tmp_path, capsys):
    """Runs split with ``--only`` merge into one table, JSON and PNG; a configuration where
    ours is lower on one tier is named in the verdict and makes ``all_ge`` false."""
    bench = _bench()
    a = _doc([_result(bench, 16, 0.5, "write_back", "lru", (0.5, 0.1), (0.49, 0.1))])
    b = _doc(
        [
            _result(bench, 1, 4.0, "write_through", "lfu", (0.5, 0.2), (0.5, 0.21)),
            _result(bench, 1, 0.5, "write_through", "lru", (0.4, 0.02), (0.4, 0.001)),
        ]
    )
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    out = tmp_path / "all.json"
    doc = bench.main(["--render", str(pa), str(pb), "--out", str(out)])
    text = capsys.readouterr().out
    assert (
        "2/3 configurations: ours >= upstream on both tiers; lower on some tier: p1 r4 write_through lfu (L2)" in text
    )
    saved = json.loads(out.read_text())
    assert saved["all_ge"] is False and doc["all_ge"] is False
    assert [(r["page_size"], r["host_ratio"]) for r in saved["results"]] == [(1, 0.5), (1, 4.0), (16, 0.5)]
    assert saved["seconds"] == 6.0 and len(saved["merged_from"]) == 2
    if importlib.util.find_spec("matplotlib") is None:  # the torch env has no plotting: no PNG, said so
        assert saved["png"] is None
        return
    png = out.with_suffix(".png")
    assert saved["png"] == str(png) and png.stat().st_size > 10_000


def test_render_rejects_mismatched_or_overlapping_runs(tmp_path):
    bench = _bench()
    a = _doc([_result(bench, 16, 0.5, "write_back", "lru", (0.5, 0.1), (0.49, 0.1))])
    other_seeds = copy.deepcopy(a)
    other_seeds["config"]["seeds"] = [0]
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    for doc, msg in ((a, "appears twice"), (other_seeds, "differs .* in seeds")):
        pb.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=msg):
            bench.main(["--render", str(pa), str(pb), "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(
    not os.path.exists(UPSTREAM_PY),
    reason="no .venv-upstream (upstream sglang 0.5.18 + torch CPU; scripts/upstream_baseline_env.sh "
    "builds it from the package index, which CI does not): the paired run is not possible "
    "here; our side is covered by test_cache_bench_smoke",
)
def test_paired_run_bounded(tmp_path):
    """A bounded run of both trees on one trace: 150 requests, page 16, host ratio 0.5 (where
    upstream's host fills with copies of on-device nodes and serves almost nothing, issue 21
    point 5) and 4, every write policy. Ours must not be lower on either tier, and both
    trees must have been fed the same requests."""
    out = tmp_path / "diff.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [
            UPSTREAM_PY,
            os.path.join(ROOT, "benchmarks", "bench_tree_differential.py"),
            "--requests",
            "150",
            "--seeds",
            "0",
            "--only",
            "p16/+/lru",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert len(doc["results"]) == 9  # 3 ratios x 3 write policies
    for r in doc["results"]:
        name = f"{r['write_policy']} r{r['host_ratio']:g}"
        assert r["evicting_requests"]["ours"] > 50 and r["evicting_requests"]["upstream"] > 50, name
        for tier in ("L1", "L2"):
            assert r["hit_rate_ours"][tier] >= r["hit_rate_upstream"][tier] - 1e-9, (name, tier, r)
        assert 0 < r["hit_rate_upstream"]["L1"] < 1 and r["per_seed"][0]["prompt_tokens"] > 150 * 200
    small = [r for r in doc["results"] if r["host_ratio"] == 0.5 and r["write_policy"] == "write_through"][0]
    assert small["hit_rate_ours"]["L2"] > 2 * small["hit_rate_upstream"]["L2"]
    assert doc["all_ge"] is True
