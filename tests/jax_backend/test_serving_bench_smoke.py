"""The serving benchmarks run end to end on the tiny model, print progress and write JSON + PNG
where --out says (smoke)."""

import json
import struct
import zlib

import pytest

from hicache_jax import cli


def png_text(path) -> dict[str, str]:
    """The PNG's tEXt / zTXt chunks (the title and the goals' verdict, plots._save)."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    out, i = {}, 8
    while i < len(data):
        (n,) = struct.unpack(">I", data[i : i + 4])
        kind, body = data[i + 4 : i + 8], data[i + 8 : i + 8 + n]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            out[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        i += 12 + n
    return out


def assert_not_comparable(payload, out_text: str, png, names: list[str]) -> None:
    """A CPU run is judged "not comparable at these sizes": every goal printed with its value
    and threshold, the verdict line, the same in the JSON and on the PNG."""
    assert [g["name"] for g in payload["goals"]] == names
    for g in payload["goals"]:
        assert g["status"] in ("not comparable", "not measured"), g
        assert f"goal {g['name']}: {g['label']} = " in out_text
    verdict = payload["verdict"]
    assert verdict["status"] == "not comparable" and "CPU backend" in verdict["not_comparable_because"]
    assert f"verdict: {verdict['text']}" in out_text
    assert verdict["text"].startswith("not comparable at these sizes")
    assert "NOT COMPARABLE AT THESE SIZES: " in " ".join(out_text.split())  # in the table's title (wrapped)
    assert png_text(png)["Verdict"].startswith("NOT COMPARABLE AT THESE SIZES (")


@pytest.mark.parametrize(
    "argv",
    [
        [
            "bench",
            "multiturn",
            "--model",
            "tiny",
            "--clients",
            "3",
            "--rounds",
            "2",
            "--first-len",
            "40",
            "--turn-len",
            "12",
            "--answer-len",
            "3",
            "--device-pages",
            "24",
            "--page-size",
            "4",
            "--host-ratio",
            "4",
            "--max-batch",
            "2",
        ],
        [
            "bench",
            "multiturn",
            "--model",
            "tiny",
            "--clients",
            "3",
            "--rounds",
            "2",
            "--first-len",
            "40",
            "--turn-len",
            "12",
            "--answer-len",
            "3",
            "--device-pages",
            "24",
            "--page-size",
            "4",
            "--host-ratio",
            "4",
            "--max-batch",
            "2",
            "--deterministic",
        ],
        [
            "bench",
            "two-run",
            "--model",
            "tiny",
            "--num-prompts",
            "2",
            "--prompt-len",
            "48",
            "--page-size",
            "4",
            "--device-pages",
            "64",
        ],
        [
            "bench",
            "ttft",
            "--model",
            "tiny",
            "--prompt-len",
            "64",
            "--reps",
            "2",
            "--decode-steps",
            "3",
            "--decode-reps",
            "1",
            "--page-size",
            "4",
            "--device-pages",
            "128",
            "--max-batch",
            "2",
            "--storage-backend",
            "file",
            "--host-layout",
            "page_first_direct",
        ],
        [
            "bench",
            "restart",
            "--model",
            "tiny",
            "--num-prompts",
            "2",
            "--prompt-len",
            "40",
            "--page-size",
            "4",
            "--device-pages",
            "64",
            "--storage-backend",
            "file",
        ],
    ],
)
def test_serving_benchmarks_smoke(argv, tmp_path, capsys):
    out = tmp_path / "results" / "r.json"  # a directory that does not exist yet, as on a fresh clone
    assert cli.main(argv + ["--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == argv[1]
    assert (tmp_path / "results" / "r.png").stat().st_size > 1000
    captured = capsys.readouterr()
    assert f"JSON written to {out}" in captured.out  # the absolute path
    assert payload["config"]["model"] == "tiny"
    assert f"[{argv[1]}" in captured.err or argv[1] == "restart"  # progress lines (restart: its children's)
    if argv[1] == "multiturn":
        # Round 2 re-sends each 40-token history (+ answer + turn = 55 tokens): 40 tokens hit.
        # The host holds every history (ratio 4), so no hit depends on an L3 prefetch's timing.
        assert payload["hicache"]["cache_hit_rate"] == pytest.approx(3 * 40 / (3 * 40 + 3 * 55)), (
            payload["hicache"]["per_request"],
            payload["cache_stats"],
        )
        assert payload["no_cache"]["cache_hit_rate"] == 0
        # The work saved (comparable at any size): the engines' own per-request prefill counts.
        assert payload["ratios_vs_no_cache"]["prefill_tokens"] == pytest.approx(3 * 55 / (3 * 40 + 3 * 55))
        assert "prefill work: hicache computed 165 of 285 prompt tokens" in captured.out
        for r in payload["hicache"]["per_request"]:
            assert r["queue_s"] >= 0 and r["service_s"] > 0
            assert r["queue_s"] + r["service_s"] == pytest.approx(r["ttft_s"])
        assert_not_comparable(payload, captured.out, tmp_path / "results" / "r.png", ["input_throughput", "ttft_mean"])
        assert payload["goals"][0]["value"] == payload["ratios_vs_no_cache"]["input_throughput"]
    if argv[1] in ("multiturn", "ttft"):  # the exactness report: tokens vs no cache, served page bytes
        mode = "deterministic" if "--deterministic" in argv else "default mode"
        assert payload["deterministic"] == (mode == "deterministic")
        assert payload["token_divergence"]["same"] and payload["token_divergence"]["diverged"] == 0
        assert payload["page_audit"]["byte_identical"] is True, payload["page_audit"]
        assert sum(payload["page_audit"]["pages_checked"].values()) > 0
        assert f"({mode}): identical in all" in captured.out
        assert "served pages: byte-identical to the pages stored" in captured.out
    if argv[1] == "two-run":
        assert payload["runs"][1]["same_tokens_as_run1"]
        assert payload["runs"][1]["requests_by_tier"]["cold"] == 0
    if argv[1] == "ttft":
        assert payload["config"]["host_layout"] == "page_first_direct" and "L2 x4 page_first_direct" in captured.out
        assert set(payload["ratios_vs_cold"]) == {"cold", "device", "host", "storage"}
        assert all(len(v) == 2 for v in payload["ttft_s"].values())
        assert_not_comparable(
            payload,
            captured.out,
            tmp_path / "results" / "r.png",
            [
                "l2_over_l1",
                "l3_over_l1",
                "l1_over_cold",
                "l2_over_cold",
                "l3_over_cold",
                "ordered_rounds",
                "decode_ratio",
            ],
        )
        med = payload["median_ttft_s"]
        assert payload["goals"][0]["value"] == pytest.approx(med["host"] / med["device"])
    if argv[1] == "restart":
        assert payload["same_tokens"] and payload["write"]["pid"] != payload["read"]["pid"]
        assert payload["read"]["cached"]["storage"] == 2 * 36  # each prompt's 39 tokens, page-aligned
        assert payload["write"]["cached"]["storage"] == 0
        # time to the first token from process start: each step from the stamp before it, the
        # first from the parent's spawn, summing to the total (both processes)
        for phase in ("write", "read"):
            ready, child = payload["time_to_first_token"][phase], payload[phase]
            stamps = [child["spawned"]] + [
                child["stamps"][k] for k in ("entered", "engine_built", "warm", "first_token")
            ]
            assert all(b > a for a, b in zip(stamps, stamps[1:])), stamps  # in order, every step takes time
            assert ready["total"] == pytest.approx(stamps[-1] - stamps[0])
            assert ready["first_token"] == pytest.approx(child["stamps"]["first_token"] - child["stamps"]["warm"])
            assert ready["first_token"] >= child["ttft_s"][0]  # its first request's own TTFT is inside it
        assert payload["time_to_first_token_ratio"] == pytest.approx(
            payload["time_to_first_token"]["read"]["total"] / payload["time_to_first_token"]["write"]["total"]
        )
        assert "time to the first token from process start" in captured.out


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
        cases["L3 + draft"]["accept_length"] / cases["L1"]["accept_length"]
    )
    assert (tmp_path / "results" / "spec.png").stat().st_size > 1000
    captured = capsys.readouterr()
    assert "accept length restored" in captured.out and f"JSON written to {out}" in captured.out
    assert "[spec" in captured.err


def test_multiturn_hybrid_quick_smoke(tmp_path, capsys):
    """``bench multiturn --model hybrid --quick``: the tiny hybrid preset with and without the
    cache and with its sliding layers as full ones; peak pages per pool in the JSON."""
    from hicache_jax.engine import Engine, EngineCacheConfig
    from hicache_jax.reference_model import HYBRID_TINY

    out = tmp_path / "r.json"
    argv = [
        "bench",
        "multiturn",
        "--model",
        "hybrid",
        "--quick",
        "--clients",
        "2",
        "--rounds",
        "2",
        "--prefill-chunk",
        "16",
        "--storage-backend",
        "file",
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["config"]["model"] == "hybrid-tiny"
    assert payload["same_tokens"]
    hybrid, as_full, base = payload["hicache"], payload["swa_as_full"], payload["no_cache"]
    cfg = payload["config"]
    need = Engine.swa_pages_needed(
        HYBRID_TINY,
        EngineCacheConfig(page_size=cfg["page_size"], max_batch=cfg["max_batch"], prefill_chunk=16, max_context=10_000),
    )
    for run in (hybrid, base):
        assert 0 < run["peak_device_pages"]["swa"] <= need
        assert run["peak_device_pages"]["full"] > 0
    assert as_full["peak_device_pages"]["swa"] == 0 and as_full["device_pool_pages"]["swa"] == 0
    # Round 2 re-sends the first turn: the hybrid engine hits it, so does the SWA-as-full one.
    assert hybrid["cache_hit_rate"] > 0 and as_full["cache_hit_rate"] > 0 and base["cache_hit_rate"] == 0
    assert payload["hybrid_vs_swa_as_full"]["peak_kv_bytes"] < 1  # the window saves device memory
    assert "peak SWA pages" in capsys.readouterr().out


def test_multiturn_no_reuse_smoke(tmp_path, capsys):
    """``bench multiturn --no-reuse``: every request a new prompt, so the cache serves nothing
    (counted by the engine's admissions, not by the trace), the same tokens with and without
    it, each round's prompts as long as a conversation's would be, and the overhead goals
    (0.97x / 1.03x) judged, here "not comparable" at --quick sizes only (not for the CPU)."""
    out = tmp_path / "r.json"
    argv = [
        "bench",
        "multiturn",
        "--model",
        "tiny",
        "--quick",
        "--no-reuse",
        "--clients",
        "3",
        "--rounds",
        "2",
        "--first-len",
        "40",
        "--turn-len",
        "12",
        "--answer-len",
        "3",
        "--page-size",
        "4",
        "--storage-backend",
        "file",
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["same_tokens"] and payload["config"]["no_reuse"]
    text = capsys.readouterr().out
    for run in ("hicache", "no_cache"):
        assert payload[run]["cache_hit_rate"] == 0 and payload[run]["requests"] == 6
    assert payload["cache_stats"]["backup_tokens"] > 0  # the cache did its work: backups, with nothing to hit
    assert payload["ratios_vs_no_cache"]["prefill_tokens"] == 1.0  # every prompt token computed in both
    moved = payload["bytes_moved"]  # nothing hits: bytes go down the tiers only
    h = payload["hicache"]
    page_bytes = h["peak_kv_bytes"] / h["peak_device_pages"]["full"]  # the engine's geometry
    assert moved["d2h_backup_bytes"] == payload["cache_stats"]["backup_tokens"] // 4 * page_bytes
    assert moved["h2d_load_bytes"] == moved["l3_read_bytes"] == 0 and moved["l3_read_gbps"] is None
    assert moved["l3_written_bytes"] > 0 and moved["l3_written_gbps"] > 0  # (some may still be in flight)
    assert "bytes moved per tier: D2H backups " in text
    assert payload["no_cache"]["prefill_tokens"] == payload["no_cache"]["prompt_tokens"] == 3 * (40 + 55)
    goals = {g["name"]: g for g in payload["goals"]}
    assert (goals["input_throughput"]["threshold"], goals["ttft_mean"]["threshold"]) == (0.97, 1.03)
    assert payload["verdict"]["not_comparable_because"] == ["--quick sizes"]
    assert "no reuse (a new prompt per request)" in " ".join(text.split())


def test_no_reuse_is_refused_where_it_means_nothing(capsys):
    for extra in (["--model", "gemma3-270m"], ["--engines", "2"], ["--num-processes", "2"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", "multiturn", "--no-reuse", *extra])
        assert e.value.code == 2
        assert "--no-reuse" in capsys.readouterr().err


def test_model_preset_names_match_the_presets():
    from hicache_jax.bench.options import MODEL_PRESET_NAMES
    from hicache_jax.bench.serving import MODEL_PRESETS

    assert set(MODEL_PRESET_NAMES) == set(MODEL_PRESETS)
    assert MODEL_PRESETS["hybrid"].is_hybrid and MODEL_PRESETS["hybrid-tiny"].is_hybrid


def test_token_divergence_report():
    from hicache_jax.bench.serving import token_divergence

    ref = [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert token_divergence(ref, ref) == {
        "requests": 3,
        "diverged": 0,
        "same": True,
        "first_divergence": [],
        "earliest_position": None,
    }
    d = token_divergence([[1, 2, 3], [4, 9, 6], [7, 8, 0]], ref)
    assert (d["diverged"], d["same"], d["first_divergence"], d["earliest_position"]) == (2, False, [[1, 1], [2, 2]], 1)
