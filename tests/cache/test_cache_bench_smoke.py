"""The multi-turn benchmark must keep running: a --quick run with byte verification."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_tree_multiturn_quick(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_tree_multiturn", os.path.join(ROOT, "benchmarks", "bench_tree_multiturn.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "tree.json"
    results = bench.main(
        ["--quick", "--verify", "--check-every", "4", "--no-progress", "--real-layers", "1", "--out", str(out)]
    )
    doc = json.loads(out.read_text())
    assert len(doc["results"]) == len(results) == 6  # 2 modes x 3 policies
    for r in doc["results"]:
        assert r["requests"] == 24 and r["req_per_s"] > 0
        assert 0 < r["hit_rate"]["L1"] < 1 and r["hit_rate"]["total"] <= 1
        assert r["ops"]["match"]["count"] == 24 and r["ops"]["insert"]["count"] == 48
    # The quick trace still exercises the host tier (loads happen) under every policy.
    assert all(r["hit_rate"]["L2"] > 0 and r["bytes"]["loaded"] > 0 for r in doc["results"])
    # The trace generator is the multiturn-64x10 trace's (benchmarks/bench_tree_multiturn.make_trace): round r prompts are 1280 + 384 r tokens.
    trace = bench.make_trace(clients=2, rounds=2)
    assert [len(t["prompt"]) for t in trace] == [1280, 1280, 1664, 1664]


def test_bench_tree_multiturn_geometry_override_keeps_hits():
    """bench_tree_vs_upstream gives our replay upstream's KV geometry: the tree's decisions (hit
    rates per tier) must not depend on it, and the bytes must still verify."""
    spec = importlib.util.spec_from_file_location(
        "bench_tree_multiturn", os.path.join(ROOT, "benchmarks", "bench_tree_multiturn.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from hicache_jax import KVGeometry

    trace = bench.make_trace(clients=8, rounds=3)
    runs = [
        bench.run(trace, "write_through", "manager", 6_000, 4.0, 1, True, 8, False, geom=g)
        for g in (None, KVGeometry.mha(2, 1, 1, 8, "bfloat16"))
    ]
    assert runs[1]["kv_bytes_per_token"] == 4 * runs[0]["kv_bytes_per_token"] == 64
    assert runs[0]["hit_rate"] == runs[1]["hit_rate"] and runs[0]["hit_rate"]["L2"] > 0


def test_bench_tree_differential_our_side_replays():
    """The differential benchmark's side of our tree (the upstream side needs .venv-upstream and
    is not run here): short branchy traces under every write policy evict on both tiers, load
    back, and leave every invariant intact (``OursReplay.close`` runs ``sanity_check``)."""
    spec = importlib.util.spec_from_file_location(
        "bench_tree_differential", os.path.join(ROOT, "benchmarks", "bench_tree_differential.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    trace = bench.make_branchy_trace(60, 0)
    assert [len(r["prompt"]) for r in trace] == [len(r["prompt"]) for r in bench.make_branchy_trace(60, 0)]
    assert bench.config_name(16, 1.0, "write_through", "lfu") == "p16/r1/write_through/lfu"
    for policy in bench.POLICIES:
        r = bench.run_ours(trace, policy, "lfu", 16, 6000, 0.5)
        assert r["evicting_requests"] > 10 and r["L2"] > 0 and 0 < r["L1"] < 1, (policy, r["L1"], r["L2"])
        assert len(r["per_req"]) == 60
