"""What the residency-watch hooks (KV events, retention) cost the tree: paired replays.

Replays a multiturn trace (``bench_tree_multiturn``, manager mode) in fresh processes, three
variants per round in an order that rotates per round:

* ``base``: the tree at ``--base`` (a commit before the hooks; checked out with
  ``git archive`` into a temporary directory);
* ``zero``: this tree, no watch attached (the hooks' ``None`` tests only: the claim is that
  this costs nothing measurable);
* ``events``: this tree with a ``KVEventSource`` attached and one subscriber that discards
  its batches (the cost of keying and queueing every stored / removed node).

Each process runs ``--warmup`` untimed replays, then one timed; the figure is
``manager_req_per_cpu_s`` (process CPU time, the simulated model's KV writes subtracted).
Reported: per-variant medians and the median over rounds of the per-round ratio to ``base``
(paired: a drift of the shared machine's speed cancels). Hit rates are checked equal.

    python benchmarks/bench_events_overhead.py [--rounds 7] [--clients 32] [--turns 6] [--base REV]

Writes ``hicache-results/events_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import io

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import gc, json, sys
sys.path.insert(0, sys.argv[1])
import benchmarks.bench_tree_multiturn as b
variant, clients, turns, warmup = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
if variant == "events":
    from hicache_jax.cache.event_source import KVEventSource
    base_cls = b.HiRadixCache

    class Watched(base_cls):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.events_source = KVEventSource(self, model="bench")
            self.events_source.subscribe(lambda batch: None)

    b.HiRadixCache = Watched
trace = b.make_trace(clients=clients, rounds=turns)
out = None
for i in range(warmup + 1):
    gc.collect()
    out = b.run(trace, "write_through", "manager", 60_000 if clients >= 64 else 12_000, 4.0, 1, False, 0, False)
import hicache_jax
print(json.dumps({"file": hicache_jax.__file__, "rps": out["manager_req_per_cpu_s"], "hit": out["hit_rate"]}))
"""


def default_base() -> str:
    """The commit before the one that added the residency-watch hooks."""
    added = subprocess.run(
        ["git", "-C", ROOT, "log", "--format=%H", "--diff-filter=A", "--", "hicache_jax/cache/residency_watch.py"],
        capture_output=True,
        text=True,
        check=True,
    )
    first = added.stdout.split()[-1]
    return f"{first}^"


def export(rev: str, dest: str) -> None:
    data = subprocess.run(
        ["git", "-C", ROOT, "archive", rev, "hicache_jax", "benchmarks"], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def replay(tree: str, variant: str, args) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, tree, variant, str(args.clients), str(args.turns), str(args.warmup)],
        capture_output=True,
        text=True,
        cwd=tree,
    )
    if r.returncode:
        raise RuntimeError(f"{variant} replay failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if not out["file"].startswith(tree):
        raise RuntimeError(f"{variant}: imported {out['file']}, not the tree under {tree}")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--base", default=None, help="git revision of the tree before the hooks")
    ap.add_argument("--out", default=os.path.join("hicache-results", "events_overhead.json"))
    args = ap.parse_args(argv)
    base = args.base or default_base()
    variants = ["base", "zero", "events"]
    rps = {v: [] for v in variants}
    hits = {}
    with tempfile.TemporaryDirectory() as tmp:
        export(base, tmp)
        for rnd in range(args.rounds):
            order = variants[rnd % 3 :] + variants[: rnd % 3]
            for v in order:
                out = replay(tmp if v == "base" else ROOT, v, args)
                rps[v].append(out["rps"])
                hits.setdefault(v, out["hit"])
            print(f"round {rnd}: " + "  ".join(f"{v} {rps[v][-1]:.0f}" for v in variants), flush=True)
    if len({json.dumps(h, sort_keys=True) for h in hits.values()}) != 1:
        raise RuntimeError(f"hit rates differ between variants: {hits}")
    ratios = {v: statistics.median(a / b for a, b in zip(rps[v], rps["base"])) for v in variants}
    print(f"{'variant':8} {'median req/cpu-s':>17} {'median ratio to base':>21}")
    for v in variants:
        print(f"{v:8} {statistics.median(rps[v]):17.0f} {ratios[v]:21.3f}")
    load = os.getloadavg()
    doc = {
        "benchmark": "events_overhead",
        "base": base,
        "clients": args.clients,
        "turns": args.turns,
        "rounds": args.rounds,
        "loadavg": load,
        "req_per_cpu_s": rps,
        "median_ratio_to_base": ratios,
        "hit_rate": hits["base"],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"loadavg {load[0]:.1f}; wrote {os.path.abspath(args.out)}")
    return doc


if __name__ == "__main__":
    main()
