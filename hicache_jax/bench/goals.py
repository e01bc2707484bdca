"""The serving benchmarks' goals (issue 25's GPU acceptance) and the verdict on a run.

Pure Python, no state, no JAX: ``ttft_goals`` / ``multiturn_goals`` turn a run's measured
ratios into ``Goal`` records, ``comparability`` says why a run cannot be judged against them
(``--quick`` sizes, a CPU backend, a model that is not the GPU preset: fixed per-request costs
then dominate and the ratios measure overheads, not the cache), and ``judge`` gives every goal
its status and the run its verdict. ``lines`` is what the benchmarks print; the same records go
into the JSON (``goals``, ``verdict``) and the verdict onto the PNG.

A goal's status: ``met`` / ``missed`` where the run is comparable; ``not comparable`` (with what
the value would give, ``would_meet``) where it is not; ``not measured`` where the run has no
value (no L3 tier, no decode step that overlapped a backup).
"""

from __future__ import annotations

import operator
from dataclasses import asdict, dataclass
from typing import Sequence

from .options import GPU_MODEL

_OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge}
MET, MISSED, NOT_COMPARABLE, NOT_MEASURED = "met", "missed", "not comparable", "not measured"
# The statement for runs that cannot be judged (printed, in the JSON, on the PNG).
NOT_COMPARABLE_TEXT = "not comparable at these sizes"
OVERHEAD_NOTE = (
    "the goals are GPU figures for the GPU preset; here fixed per-request overheads weigh more, so the "
    "ratios do not measure the cache's effect"
)


@dataclass(frozen=True)
class Goal:
    """One goal: ``value op threshold`` must hold (``value`` None: the run did not measure it).
    ``shown`` replaces the value in the printed line where a count reads better (``3/5``)."""

    name: str
    label: str
    value: float | None
    op: str
    threshold: float
    shown: str | None = None

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"op: expected one of {sorted(_OPS)}, got {self.op!r}")

    def holds(self) -> bool | None:
        """Whether the value meets the threshold (None when not measured)."""
        return None if self.value is None else bool(_OPS[self.op](self.value, self.threshold))


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den <= 0 else num / den


def ttft_goals(
    median_ttft_s: dict[str, float], held_rounds: int, rounds: int, order: Sequence[str], decode_ratio: float | None
) -> list[Goal]:
    """``bench ttft``: an L2 hit within 1.25x an L1 hit's TTFT, L3 within 2x, every tier under
    0.3x a cold prefill, the tiers ordered (``order``, fastest first, cold last) in every
    round, and decode steps with write-through backups running within 1.05x of steps without."""
    med = median_ttft_s
    cold = med.get("cold")
    goals = [
        Goal("l2_over_l1", "L2 hit TTFT / L1 hit TTFT", _ratio(med.get("host"), med.get("device")), "<=", 1.25),
        Goal("l3_over_l1", "L3 hit TTFT / L1 hit TTFT", _ratio(med.get("storage"), med.get("device")), "<=", 2.0),
    ]
    for tier, name in (("device", "l1"), ("host", "l2"), ("storage", "l3")):
        goals.append(
            Goal(f"{name}_over_cold", f"{name.upper()} hit TTFT / cold TTFT", _ratio(med.get(tier), cold), "<", 0.3)
        )
    goals.append(
        Goal(
            "ordered_rounds",
            f"rounds with {' < '.join(order)}",
            held_rounds / rounds if rounds else None,
            ">=",
            1.0,
            shown=f"{held_rounds}/{rounds}",
        )
    )
    goals.append(Goal("decode_ratio", "decode step with backups running / without", decode_ratio, "<=", 1.05))
    return goals


def multiturn_goals(input_throughput_ratio: float, ttft_mean_ratio: float) -> list[Goal]:
    """``bench multiturn``: input throughput at least 1.5x the no-cache run's, mean TTFT at
    most 0.6x its."""
    return [
        Goal("input_throughput", "input throughput, hicache / no cache", input_throughput_ratio, ">=", 1.5),
        Goal("ttft_mean", "TTFT mean, hicache / no cache", ttft_mean_ratio, "<=", 0.6),
    ]


def no_reuse_goals(input_throughput_ratio: float, ttft_mean_ratio: float) -> list[Goal]:
    """``bench multiturn --no-reuse`` (nothing can hit): the cache costs at most 3% of input
    throughput and of mean TTFT. An overhead, so judged on any backend and model at full sizes."""
    return [
        Goal("input_throughput", "input throughput, hicache / no cache", input_throughput_ratio, ">=", 0.97),
        Goal("ttft_mean", "TTFT mean, hicache / no cache", ttft_mean_ratio, "<=", 1.03),
    ]


def comparability(*, quick: bool, backend: str, model: str) -> list[str]:
    """Why a run cannot be judged against the goals (empty: it can). The goals are GPU figures,
    for the GPU preset (``options.GPU_MODEL``, any layer count) on an accelerator at full sizes."""
    reasons = []
    if quick:
        reasons.append("--quick sizes")
    if backend == "cpu":
        reasons.append("CPU backend")
    if model != GPU_MODEL:
        reasons.append(f"model {model}, not {GPU_MODEL}")
    return reasons


def judge(goals: Sequence[Goal], reasons: Sequence[str], note: str = OVERHEAD_NOTE) -> tuple[list[dict], dict]:
    """Each goal as a JSON record with its ``status`` and ``would_meet``, and the verdict:
    ``{"status", "text", "not_comparable_because"}``. Not comparable when ``reasons`` is not
    empty (its text gives the reasons and ``note``: why such a run does not measure the goals);
    else met when every measured goal is met (and at least one was measured)."""
    records = []
    for g in goals:
        would = g.holds()
        if would is None:
            status = NOT_MEASURED
        elif reasons:
            status = NOT_COMPARABLE
        else:
            status = MET if would else MISSED
        records.append({**asdict(g), "status": status, "would_meet": would})
    measured = [r for r in records if r["would_meet"] is not None]
    unmeasured = len(records) - len(measured)
    tail = f"; {unmeasured} not measured" if unmeasured else ""
    if reasons:
        would = sum(r["would_meet"] for r in measured)
        status = NOT_COMPARABLE
        text = (
            f"{NOT_COMPARABLE_TEXT} ({'; '.join(reasons)}): {note} "
            f"({would} of {len(measured)} goals would be met{tail})"
        )
    elif not measured:
        status, text = NOT_MEASURED, f"{NOT_MEASURED}: no goal had a value"
    else:
        missed = [r["name"] for r in measured if r["status"] == MISSED]
        if missed:
            status = MISSED
            text = f"{MISSED}: {len(missed)} of {len(measured)} goals ({', '.join(missed)}){tail}"
        else:
            status, text = MET, f"{MET}: all {len(measured)} goals{tail}"
    return records, {"status": status, "text": text, "not_comparable_because": list(reasons)}


def _value(r: dict) -> str:
    if r["shown"] is not None:
        return r["shown"]
    return "N/A" if r["value"] is None else f"{r['value']:.3f}"


def lines(records: Sequence[dict], verdict: dict) -> list[str]:
    """The printed goal lines (``goal <name>: ...``) and the ``verdict: ...`` line."""
    out = []
    for r in records:
        status = r["status"]
        if status == NOT_COMPARABLE:
            status += f" (would be {MET if r['would_meet'] else MISSED})"
        out.append(f"goal {r['name']}: {r['label']} = {_value(r)} (goal {r['op']} {r['threshold']:g}): {status}")
    out.append(f"verdict: {verdict['text']}")
    return out


def size_label(reasons: Sequence[str]) -> str:
    """A suffix for table titles from ``comparability``'s reasons: empty when the run is
    comparable."""
    if not reasons:
        return ""
    return f" [{NOT_COMPARABLE_TEXT.upper()}: {'; '.join(reasons)}; overhead-dominated]"


def plot_note(verdict: dict) -> str:
    """The line under the PNG's title: the verdict, short."""
    if verdict["status"] == NOT_COMPARABLE:
        return (
            f"{NOT_COMPARABLE_TEXT.upper()} ({'; '.join(verdict['not_comparable_because'])}): "
            f"overhead-dominated, not the cache's effect"
        )
    return f"goals: {verdict['text']}"
