"""The transfer benchmark runs end to end and writes its JSON with the ratios (smoke, --quick)."""

import json

import pytest

from hicache_jax.bench import transfer as bench_transfer


def test_transfer_benchmark_quick_writes_ratios(tmp_path, capsys):
    out = tmp_path / "transfer.json"
    assert (
        bench_transfer.main(["--quick", "--reps", "1", "--page-sizes", "16", "--page-counts", "8", "--out", str(out)])
        == 0
    )
    payload = json.loads(out.read_text())
    rows = payload["results"]
    assert len(rows) == 3  # one per host layout
    for r in rows:
        for key in ("gather_vs_raw", "scatter_vs_raw", "d2h_vs_raw", "d2h_vs_memcpy", "h2d_vs_raw"):
            assert r[key] > 0
    assert "KV page transfers" in capsys.readouterr().out


def test_transfer_benchmark_cut_short_keeps_the_cases_it_finished(tmp_path, monkeypatch):
    """The JSON is rewritten after every case (marked partial), so a run killed by a timeout (the
    GPU check's) keeps what it measured; the finished run's JSON is not marked."""
    out = tmp_path / "transfer.json"
    real, calls = bench_transfer.gather_scatter_seconds, []

    def second_case_dies(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a timeout's signal would do mid-run
        return real(*a, **k)

    monkeypatch.setattr(bench_transfer, "gather_scatter_seconds", second_case_dies)
    argv = [
        "--quick",
        "--reps",
        "1",
        "--page-sizes",
        "16",
        "--page-counts",
        "8",
        "--layouts",
        "page_first",
        "page_first_direct",
        "--no-compare-impls",
        "--out",
        str(out),
    ]
    with pytest.raises(KeyboardInterrupt):
        bench_transfer.main(argv)
    p = json.loads(out.read_text())
    assert p["partial"] is True and [r["layout"] for r in p["results"]] == ["page_first"]
    monkeypatch.setattr(bench_transfer, "gather_scatter_seconds", real)
    assert bench_transfer.main(argv) == 0
    p = json.loads(out.read_text())
    assert "partial" not in p and [r["layout"] for r in p["results"]] == ["page_first", "page_first_direct"]
