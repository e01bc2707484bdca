"""``hicache-jax bench step-cost``: a --quick run writes its JSON, and the requests it says it
admitted and finished are what the cache saw (counted here by wrapping the cache's methods and
from the cache's own metrics, not from the benchmark's counters). No JAX needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hicache_jax import cli
from hicache_jax.bench import options, step_cost
from hicache_jax.cache import HiRadixCache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_run_writes_its_figures_and_counts_what_the_cache_saw(tmp_path, monkeypatch, capsys):
    calls = {"begin_request": 0, "cache_finished_req": 0, "check_events": 0}
    for name in calls:
        original = getattr(HiRadixCache, name)

        def counted(self, *a, _original=original, _name=name, **kw):
            calls[_name] += 1
            return _original(self, *a, **kw)

        monkeypatch.setattr(HiRadixCache, name, counted)
    out = tmp_path / "r" / "step_cost.json"
    assert cli.main(["bench", "step-cost", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "CPU ms / step" in printed and "goal: scheduler step CPU <= 1 ms per 64 finishes" in printed
    assert "profile: top 15 by own time" in printed
    d = json.loads(out.read_text())
    q = options.QUICK["step-cost"]
    assert d["config"]["steps"] == q["steps"] and d["config"]["prompt_len"] == q["prompt_len"]
    for k in ("cpu_ms_per_step", "wall_ms_per_step", "cpu_ms_per_step_per_64_finishes", "cpu_us_per_finish"):
        assert set(d[k]) >= {"median", "p90", "p99"} and 0 < d[k]["median"] <= d[k]["p99"], (k, d[k])
    assert set(d["cpu_ms_per_step_by_phase"]) == {"admit", "decode", "finish", "events"}
    assert len(d["cpu_ms_per_step_samples"]) == q["steps"]
    assert d["machine"]["cpus"] and d["machine"]["platform"]
    assert d["goal"]["status"] == "not comparable" and d["goal"]["threshold_ms"] == 1.0
    assert len(d["profile"]["by_own_time"]) == len(d["profile"]["by_cumulative_time"]) == step_cost.TOP
    assert any("hiradix_cache.py" in r["function"] for r in d["profile"]["by_cumulative_time"])
    # What the benchmark claims, against what the cache was asked to do.
    n, f = d["config"]["in_flight"], d["config"]["finishes_per_step"]
    assert (n, f) == (512, 64)
    t = d["totals"]
    assert calls["begin_request"] == t["admitted"] and calls["cache_finished_req"] == t["finished"]
    assert calls["check_events"] == t["steps"]  # once per scheduler step
    assert calls["begin_request"] - calls["cache_finished_req"] == t["running_at_end"] == n - f
    m = d["measured"]
    assert m["finished"] == m["admitted"] == q["steps"] * f
    assert d["cache_during_measurement"]["match_calls"] == m["admitted"]  # the cache's own counter
    # the tree was busy: prefixes hit, pages backed up (write_through), events delivered
    c = d["cache_during_measurement"]
    assert c["device_hit_tokens"] > 0 and c["backup_tokens"] > 0 and c["evicted_device_tokens"] > 0
    assert d["events_during_measurement"]["stored"] > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--finishes-per-step", "65", "--in-flight", "64"],
        ["--in-flight", "0"],
        ["--prompt-len", "nan"],
        ["--events", "maybe"],
    ],
)
def test_bad_sizes_are_usage_errors(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "step-cost", *argv])
    assert e.value.code == 2 and "usage:" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_run_imports_no_jax(tmp_path):
    """The benchmark needs the cache manager only: a whole (short) run loads no JAX or flax."""
    code = (
        "import sys\n"
        "from hicache_jax import cli\n"
        f"cli.main(['bench', 'step-cost', '--quick', '--in-flight', '32', '--finishes-per-step', '8', "
        f"'--profile-steps', '0', '--out', {str(tmp_path / 'r.json')!r}])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'jaxlib', 'orbax')))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "[]", (r.stdout, r.stderr)
