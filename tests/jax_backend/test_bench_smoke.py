"""The transfer benchmark runs end to end and writes its JSON with the ratios (smoke, --quick)."""

import json

from hicache_jax.bench import transfer as bench_transfer


def test_transfer_benchmark_quick_writes_ratios(tmp_path, capsys):
    out = tmp_path / "transfer.json"
    assert bench_transfer.main(["--quick", "--reps", "1", "--page-sizes", "16", "--page-counts", "8",
                                "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = payload["results"]
    assert len(rows) == 3  # one per host layout
    for r in rows:
        for key in ("gather_vs_raw", "scatter_vs_raw", "d2h_vs_raw", "d2h_vs_memcpy", "h2d_vs_raw"):
            assert r[key] > 0
    assert "KV page transfers" in capsys.readouterr().out
