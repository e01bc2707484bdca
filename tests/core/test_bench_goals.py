"""The serving benchmarks' goals and verdict (``hicache_jax.bench.goals``) on constructed numbers:
every threshold met and missed, runs that cannot be judged, values that were not measured; and
the model options (``--model auto``, ``--quick``'s tiny presets, ``--layers``). Pure Python."""

from __future__ import annotations

import argparse

import pytest

from hicache_jax.bench import goals, options

ORDER = ("device", "host", "storage", "cold")


def _ttft(device=1.0, host=1.2, storage=1.9, cold=10.0, held=5, rounds=5, decode=1.0):
    med = {"device": device, "host": host, "cold": cold}
    if storage is not None:
        med["storage"] = storage
    return goals.ttft_goals(med, held, rounds, ORDER, decode)


def _status(gs, reasons=()):
    records, verdict = goals.judge(gs, list(reasons))
    return {r["name"]: r["status"] for r in records}, verdict


def test_ttft_goals_all_met():
    status, verdict = _status(_ttft())
    assert set(status.values()) == {"met"}, status
    assert len(status) == 7
    assert verdict["status"] == "met" and verdict["text"] == "met: all 7 goals"


@pytest.mark.parametrize(
    "name, met_kw, missed_kw",
    [
        # L2 hit <= 1.25x the L1 hit's TTFT (the bound itself meets it)
        ("l2_over_l1", dict(host=1.25), dict(host=1.2501)),
        # L3 hit <= 2x the L1 hit's
        ("l3_over_l1", dict(storage=2.0), dict(storage=2.001)),
        # every tier < 0.3x cold (strict: 0.3 itself misses)
        ("l1_over_cold", dict(device=2.99, host=3.0, storage=3.0), dict(device=3.0, host=3.0, storage=3.0)),
        ("l2_over_cold", dict(host=2.99), dict(device=2.5, host=3.0)),
        ("l3_over_cold", dict(storage=1.99), dict(device=2.0, storage=3.0)),
        # ordered in every round
        ("ordered_rounds", dict(held=5), dict(held=4)),
        # decode step with backups running <= 1.05x
        ("decode_ratio", dict(decode=1.05), dict(decode=1.0501)),
    ],
)
def test_ttft_each_threshold_both_ways(name, met_kw, missed_kw):
    met, _ = _status(_ttft(**met_kw))
    assert met[name] == "met", met
    missed, verdict = _status(_ttft(**missed_kw))
    assert missed[name] == "missed", missed
    assert verdict["status"] == "missed" and name in verdict["text"]


@pytest.mark.parametrize(
    "name, met_args, missed_args",
    [
        ("input_throughput", (1.5, 0.5), (1.49, 0.5)),  # input throughput >= 1.5x no cache
        ("ttft_mean", (2.0, 0.6), (2.0, 0.601)),  # TTFT mean <= 0.6x no cache
    ],
)
def test_multiturn_each_threshold_both_ways(name, met_args, missed_args):
    met, verdict = _status(goals.multiturn_goals(*met_args))
    assert met == {"input_throughput": "met", "ttft_mean": "met"} and verdict["status"] == "met"
    missed, verdict = _status(goals.multiturn_goals(*missed_args))
    assert missed[name] == "missed" and verdict["status"] == "missed"
    assert verdict["text"] == f"missed: 1 of 2 goals ({name})"


def test_the_numbers_of_issue_29_are_missed_when_comparable_and_not_comparable_at_quick_sizes():
    """``bench multiturn --model hybrid --quick``: TTFT x4.76, throughput x0.31."""
    gs = goals.multiturn_goals(0.31, 4.76)
    status, verdict = _status(gs)
    assert set(status.values()) == {"missed"}
    assert verdict["text"] == "missed: 2 of 2 goals (input_throughput, ttft_mean)"
    reasons = goals.comparability(quick=True, backend="cpu", model="hybrid-tiny")
    records, verdict = goals.judge(gs, reasons)
    assert [r["status"] for r in records] == ["not comparable"] * 2
    assert [r["would_meet"] for r in records] == [False, False]
    assert verdict["status"] == "not comparable"
    assert verdict["not_comparable_because"] == reasons
    assert verdict["text"].startswith("not comparable at these sizes (--quick sizes; CPU backend; model hybrid-tiny")
    assert "0 of 2 goals would be met" in verdict["text"]


def test_not_comparable_reports_what_would_be_met():
    records, verdict = goals.judge(goals.multiturn_goals(1.6, 0.9), ["CPU backend"])
    assert [(r["status"], r["would_meet"]) for r in records] == [("not comparable", True), ("not comparable", False)]
    assert "1 of 2 goals would be met" in verdict["text"]
    text = goals.lines(records, verdict)
    assert text[0] == (
        "goal input_throughput: input throughput, hicache / no cache = 1.600 (goal >= 1.5): "
        "not comparable (would be met)"
    )
    assert text[1].endswith("(goal <= 0.6): not comparable (would be missed)")
    assert text[-1] == f"verdict: {verdict['text']}"


def test_unmeasured_goals_are_neither_met_nor_missed():
    """No L3 tier (no storage median) and no decode step that overlapped a backup."""
    status, verdict = _status(_ttft(storage=None, decode=None))
    assert status["l3_over_l1"] == status["l3_over_cold"] == status["decode_ratio"] == "not measured"
    assert verdict["status"] == "met" and verdict["text"] == "met: all 4 goals; 3 not measured"
    records, _ = goals.judge(_ttft(storage=None), [])
    line = goals.lines(records, _)[1]
    assert line == "goal l3_over_l1: L3 hit TTFT / L1 hit TTFT = N/A (goal <= 2): not measured"
    # nothing measured at all: no verdict of met
    _, verdict = _status([goals.Goal("x", "x", None, "<=", 1.0)])
    assert verdict["status"] == "not measured"


def test_ordering_goal_shows_the_count_of_rounds():
    records, verdict = goals.judge(_ttft(held=3, rounds=5), [])
    line = next(s for s in goals.lines(records, verdict) if s.startswith("goal ordered_rounds"))
    assert line == "goal ordered_rounds: rounds with device < host < storage < cold = 3/5 (goal >= 1): missed"


def test_comparability_names_each_reason():
    assert goals.comparability(quick=False, backend="gpu", model="llama3-8b-shape") == []
    assert goals.comparability(quick=False, backend="tpu", model="llama3-8b-shape") == []
    assert goals.comparability(quick=True, backend="gpu", model="llama3-8b-shape") == ["--quick sizes"]
    assert goals.comparability(quick=False, backend="cpu", model="llama3-8b-shape") == ["CPU backend"]
    assert goals.comparability(quick=False, backend="gpu", model="bench") == ["model bench, not llama3-8b-shape"]
    assert goals.size_label([]) == ""
    assert "NOT COMPARABLE AT THESE SIZES: CPU backend; overhead-dominated" in goals.size_label(["CPU backend"])
    _, verdict = goals.judge(goals.multiturn_goals(2.0, 0.5), ["CPU backend"])
    assert goals.plot_note(verdict).startswith("NOT COMPARABLE AT THESE SIZES (CPU backend)")
    _, verdict = goals.judge(goals.multiturn_goals(2.0, 0.5), [])
    assert goals.plot_note(verdict) == "goals: met: all 2 goals"


def test_goal_rejects_an_unknown_comparison():
    with pytest.raises(ValueError, match="op: expected one of"):
        goals.Goal("x", "x", 1.0, "==", 1.0)


# ---- model options ---------------------------------------------------------------------------
def _parse(argv, name="ttft"):
    p = argparse.ArgumentParser()
    getattr(options, f"{name}_arguments")(p)
    args = p.parse_args(argv)
    options.apply_quick(p, args, name.replace("_", "-"))  # QUICK's keys are the command names
    return args


@pytest.mark.parametrize(
    "given, quick, want",
    [
        ([], False, "auto"),  # resolved by the benchmark once the backend is known
        ([], True, "tiny"),
        (["--model", "bench"], True, "tiny"),
        (["--model", "llama3-8b-shape"], False, "llama3-8b-shape"),
        (["--model", "llama3-8b-shape"], True, "llama3-8b-shape-tiny"),
        (["--model", "hybrid"], True, "hybrid-tiny"),
    ],
)
def test_model_option_and_quick_presets(given, quick, want):
    for name in ("ttft", "multiturn", "two_run", "restart"):
        args = _parse(given + (["--quick"] if quick else []), name)
        assert args.model == want, (name, given)
        assert args.layers is None


def test_layers_option_takes_a_positive_int(capsys):
    assert _parse(["--layers", "3"]).layers == 3
    for bad in ("0", "-2", "x"):
        with pytest.raises(SystemExit):
            _parse(["--layers", bad])
        assert "--layers: expected an int >= 1" in capsys.readouterr().err
