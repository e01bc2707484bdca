"""The router benchmark must keep running: a tiny run, same tokens under both policies."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_router_tiny(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_router", os.path.join(ROOT, "benchmarks", "bench_router.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "router.json"
    bench.main(
        [
            "--engines",
            "2",
            "--conversations",
            "6",
            "--turns",
            "2",
            "--system-len",
            "64",
            "--user-len",
            "32",
            "--answer-len",
            "16",
            "--device-tokens",
            "2048",
            "--out",
            str(out),
        ]
    )
    doc = json.loads(out.read_text())
    rr, px = doc["results"]
    assert rr["policy"] == "round_robin" and px["policy"] == "prefix"
    assert rr["prompt_tokens"] == px["prompt_tokens"] > 0
    # Round robin sends a conversation's second turn to the other engine: only the shared L3
    # (or a shared system prompt) serves it there; the router keeps it where its pages are.
    assert px["served_tokens"]["device"] > rr["served_tokens"]["device"]
    assert px["hit_rate"] >= rr["hit_rate"]
    assert sum(px["router_decisions"].values()) == 12
