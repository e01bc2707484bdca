"""The multi-turn benchmark must keep running: a --quick run with byte verification."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_tree_multiturn_quick(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_tree_multiturn",
                                                  os.path.join(ROOT, "benchmarks", "bench_tree_multiturn.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "tree.json"
    results = bench.main(["--quick", "--verify", "--check-every", "4", "--no-progress",
                          "--real-layers", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert len(doc["results"]) == len(results) == 6  # 2 modes x 3 policies
    for r in doc["results"]:
        assert r["requests"] == 24 and r["req_per_s"] > 0
        assert 0 < r["hit_rate"]["L1"] < 1 and r["hit_rate"]["total"] <= 1
        assert r["ops"]["match"]["count"] == 24 and r["ops"]["insert"]["count"] == 48
    # The quick trace still exercises the host tier (loads happen) under every policy.
    assert all(r["hit_rate"]["L2"] > 0 and r["bytes"]["loaded"] > 0 for r in doc["results"])
    # The trace generator is the REFERENCE 4.3 one: round r prompts are 1280 + 384 r tokens.
    trace = bench.make_trace(clients=2, rounds=2)
    assert [len(t["prompt"]) for t in trace] == [1280, 1280, 1664, 1664]
