"""``hicache-jax bench multiturn --engines N``: several reference engines sharing one L3,
routed round robin and by their KV events, on the same prompts (smoke, tiny sizes)."""

import json

from hicache_jax import cli


def test_multiturn_over_two_engines_routed_both_ways(tmp_path, capsys):
    out = tmp_path / "routed.json"
    assert (
        cli.main(
            [
                "bench",
                "multiturn",
                "--quick",
                "--engines",
                "2",
                "--clients",
                "4",
                "--rounds",
                "3",
                "--storage-backend",
                "file",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "prefix / round_robin (same prompts, alternate rounds)" in text
    d = json.loads(out.read_text())
    rr, px = d["policies"]["round_robin"], d["policies"]["prefix"]
    for s in (rr, px):
        assert s["requests"] == 12 and sum(s["requests_per_engine"].values()) == 12
        assert abs(sum(s["hit_rate_by_tier"].values()) - s["cache_hit_rate"]) < 1e-9
        assert s["ttft_mean_s"] > 0
    # Same prompts under both policies (the histories follow the first policy's answers).
    assert [r["prompt_len"] for r in rr["per_request"]] == [r["prompt_len"] for r in px["per_request"]]
    assert isinstance(d["same_tokens"], bool)  # default mode: a tier may round differently
    assert sum(px["router_decisions"].values()) == 12 and px["router_decisions"]["prefix"] > 0
    w = px["router_weights"]  # set from the measured costs after each round (defaults where none)
    assert w["device"] == 1.0 and 0 <= w["storage"] <= w["host"] <= 1 and rr["router_weights"] is None
    # The engines' L3 writes reached the router as storage events (keys as the L3's).
    assert px["storage_events_pages"] > 0
    # Round robin moves a conversation between engines; only the shared L3 (and L2) serve it
    # there. Prefix routing keeps it where its pages are on the device.
    assert rr["hit_rate_by_tier"]["storage"] > 0
    assert px["hit_rate_by_tier"]["device"] > rr["hit_rate_by_tier"]["device"]
    assert px["cache_hit_rate"] >= rr["cache_hit_rate"]


def test_an_engines_event_keys_are_its_l3_keys(tmp_path):
    """The source built as the routed benchmark builds it (``Engine.storage_model_id``) reports
    storage events under the keys the engine's L3 controller wrote, and a request's page keys
    are those keys: a router matches requests against every engine's L3 writes."""
    import argparse

    import numpy as np

    from hicache_jax.bench import options, serving
    from hicache_jax.cache import RadixKey
    from hicache_jax.cache.event_source import KVEventSource

    p = argparse.ArgumentParser()
    options.multiturn_arguments(p)
    args = p.parse_args(["--quick", "--storage-backend", "file", "--storage-dir", str(tmp_path)])
    options.apply_quick(p, args, "multiturn")
    engine = serving.build_engine(args, 256)
    try:
        src = KVEventSource(engine.cache, engine="e0")  # keyed as the engine's L3 controller
        assert (src.model, src.weights_revision) == (engine.storage_model_id, engine.storage_weights_revision)
        src.observe_storage(engine.storage.storage)
        src.drain()
        prompt = list(range(1, 41))  # 5 pages of 8
        engine.generate([prompt], 2)
        engine.flush()
        engine.cache.check_events()
        batch = src.drain()
        stored = [k for e in batch.events if e.tier == "storage" for k in e.keys]
        want = src.request_keys(RadixKey(np.array(prompt[:40], np.int64)))
        assert len(want) == 5 and set(want[:4]) <= set(stored) <= set(want)
        src.close()
    finally:
        engine.close()
