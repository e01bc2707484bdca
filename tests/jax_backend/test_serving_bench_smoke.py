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


def test_spec_benchmark_smoke(tmp_path, capsys):
    """``bench spec --quick`` on the trained toy pair: four cases, each served from the tier it
    names, progress lines, a table, JSON and a PNG."""
    out = tmp_path / "results" / "spec.json"
    assert cli.main(["bench", "spec", "--quick", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "spec"
    cases = payload["cases"]
    assert list(cases) == ["cold", "L1", "L3 + draft", "L3, no draft"]
    hit = (192 - 1) // 16 * 16  # the --quick prompt's matchable pairs, page-aligned
    assert cases["cold"]["cached_tokens"] == {"device": 0, "host": 0, "storage": 0}
    assert cases["L1"]["cached_tokens"] == {"device": hit, "host": 0, "storage": 0}
    for case in ("L3 + draft", "L3, no draft"):
        assert cases[case]["cached_tokens"] == {"device": 0, "host": 0, "storage": hit}
    assert all(c["same_tokens_as_cold"] for c in cases.values())
    assert payload["ratios"]["restored_over_l1"] == pytest.approx(
        cases["L3 + draft"]["accept_length"] / cases["L1"]["accept_length"])
    assert (tmp_path / "results" / "spec.png").stat().st_size > 1000
    captured = capsys.readouterr()
    assert "accept length restored" in captured.out and f"JSON written to {out}" in captured.out
    assert "[spec" in captured.err
