"""The serving benchmarks run end to end on the tiny model, print progress and write JSON + PNG
where --out says (smoke)."""

import json

import pytest

from hicache_jax import cli


@pytest.mark.parametrize("argv", [
    ["bench", "multiturn", "--model", "tiny", "--clients", "3", "--rounds", "2", "--first-len", "40",
     "--turn-len", "12", "--answer-len", "3", "--device-pages", "24", "--page-size", "4", "--host-ratio", "4",
     "--max-batch", "2"],
    ["bench", "two-run", "--model", "tiny", "--num-prompts", "2", "--prompt-len", "48", "--page-size", "4",
     "--device-pages", "64"],
    ["bench", "ttft", "--model", "tiny", "--prompt-len", "64", "--reps", "2", "--decode-steps", "3",
     "--decode-reps", "1", "--page-size", "4", "--device-pages", "128", "--max-batch", "2",
     "--storage-backend", "file"],
    ["bench", "restart", "--model", "tiny", "--num-prompts", "2", "--prompt-len", "40", "--page-size", "4",
     "--device-pages", "64", "--storage-backend", "file"],
])
def test_serving_benchmarks_smoke(argv, tmp_path, capsys):
    out = tmp_path / "results" / "r.json"  # a directory that does not exist yet, as on a fresh clone
    assert cli.main(argv + ["--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == argv[1]
    assert (tmp_path / "results" / "r.png").stat().st_size > 1000
    captured = capsys.readouterr()
    assert f"JSON written to {out}" in captured.out  # the absolute path
    assert f"[{argv[1]}" in captured.err or argv[1] == "restart"  # progress lines (restart: its children's)
    if argv[1] == "multiturn":
        # Round 2 re-sends each 40-token history (+ answer + turn = 55 tokens): 40 tokens hit.
        # The host holds every history (ratio 4), so no hit depends on an L3 prefetch's timing.
        assert payload["hicache"]["cache_hit_rate"] == pytest.approx(3 * 40 / (3 * 40 + 3 * 55)), \
            (payload["hicache"]["per_request"], payload["cache_stats"])
        assert payload["no_cache"]["cache_hit_rate"] == 0
        for r in payload["hicache"]["per_request"]:
            assert r["queue_s"] >= 0 and r["service_s"] > 0
            assert r["queue_s"] + r["service_s"] == pytest.approx(r["ttft_s"])
    if argv[1] == "two-run":
        assert payload["runs"][1]["same_tokens_as_run1"]
        assert payload["runs"][1]["requests_by_tier"]["cold"] == 0
    if argv[1] == "ttft":
        assert set(payload["ratios_vs_cold"]) == {"cold", "device", "host", "storage"}
        assert all(len(v) == 2 for v in payload["ttft_s"].values())
    if argv[1] == "restart":
        assert payload["same_tokens"] and payload["write"]["pid"] != payload["read"]["pid"]
        assert payload["read"]["cached"]["storage"] == 2 * 36  # each prompt's 39 tokens, page-aligned
        assert payload["write"]["cached"]["storage"] == 0
