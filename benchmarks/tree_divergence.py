"""Where do our tree and upstream's first decide differently? A request-by-request trace.

The differential benchmark (``bench_tree_differential.py``) reports per configuration the first
request whose hit differs between the trees. The trees' *contents* usually part earlier: one
keeps a page on a tier that the other dropped, and a hit shows it only when a later request
asks for that page. This tool replays one configuration's trace through both trees in
lockstep (the benchmark's own ``OursReplay`` / ``UpstreamReplay``) and after every request
compares what each tree holds, page by page, on each tier. A page is named by its whole
prefix (``page_ids``), so the comparison does not depend on how either tree split its nodes;
a differing page is shown as the trace request that first carried it and its token range.

    scripts/upstream_baseline_env.sh benchmarks/tree_divergence.py --page 1 --ratio 4 \\
        --policy write_through_selective --eviction lru [--seed 0] [--requests 300] \\
        [--context 3] [--all] [--tree-decisions auto]

Prints, for the first request after which the trees' contents differ (or every such request
with ``--all``, up to ``--requests``) and ``--context`` requests before it: each tree's hit
(device, loaded-back tokens), whether it evicted, its device / host token counts, and the
pages on each tier that only one tree holds. Diagnostic output only (no JSON, no timing).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from benchmarks import bench_tree_differential as diff  # noqa: E402
from benchmarks import upstream_tree_replay as upstream  # noqa: E402


class PageNames:
    """Page id -> (trace request that first carried it, its first token): grown as the trace is
    replayed, so a differing page can be shown as "request r, tokens a-b"."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.names: dict[int, tuple[int, int]] = {}

    def add(self, i: int, rec: dict) -> None:
        import numpy as np

        toks = np.concatenate([rec["prompt"], rec["output"]]).astype(np.int64)
        n = len(toks) - len(toks) % self.page
        ids = diff.page_ids(toks[:n].tobytes(), self.page, 0)
        for k, pid in enumerate(ids):
            self.names.setdefault(pid, (i, k * self.page))

    def describe(self, pids: set) -> str:
        """Contiguous runs of pages, "r<request>[a-b]", the largest first."""
        if not pids:
            return "-"
        by_req: dict[int, list[int]] = {}
        for pid in pids:
            r, off = self.names.get(pid, (-1, 0))
            by_req.setdefault(r, []).append(off)
        runs = []
        for r, offs in by_req.items():
            offs.sort()
            a = prev = offs[0]
            for o in offs[1:] + [None]:
                if o is not None and o == prev + self.page:
                    prev = o
                    continue
                runs.append((prev + self.page - a, r, a, prev + self.page))
                if o is not None:
                    a = prev = o
        runs.sort(reverse=True)
        shown = ", ".join(f"r{r}[{a}-{b}]" for _n, r, a, b in runs[:6])
        more = f" (+{len(runs) - 6} runs)" if len(runs) > 6 else ""
        return f"{len(pids) * self.page} tok: {shown}{more}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--page", type=int, default=1)
    ap.add_argument("--ratio", type=float, default=4.0)
    ap.add_argument("--policy", default="write_through", choices=diff.POLICIES)
    ap.add_argument("--eviction", default="lru", choices=("lru", "lfu"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=300, help="replay at most this many requests")
    ap.add_argument("--device-tokens", type=int, default=6000)
    ap.add_argument("--context", type=int, default=3, help="requests shown before the first divergence")
    ap.add_argument("--all", action="store_true", help="show every request after which the contents differ")
    ap.add_argument("--tree-decisions", default="auto", choices=("auto", "upstream", "own"))
    args = ap.parse_args(argv)

    upstream.quiet_logs()
    up = upstream.import_upstream()
    up.torch.set_num_threads(1)
    upstream.init_process_group(up.torch)
    import logging

    logging.getLogger("sglang.srt.mem_cache.pool_host").setLevel(logging.ERROR)
    logging.getLogger("sglang.srt.mem_cache.hiradix_cache").setLevel(logging.ERROR)

    trace = diff.make_branchy_trace(2000, args.seed)[: args.requests]
    page = args.page
    ours = diff.OursReplay(args.policy, args.eviction, page, args.device_tokens, args.ratio, args.tree_decisions)
    ups = diff.UpstreamReplay(
        up, args.policy, args.eviction, page, args.device_tokens, args.ratio, diff.max_context_for(trace, page)
    )
    names = PageNames(page)
    print(
        f"{args.policy} {args.eviction} page {page} host ratio {args.ratio:g} seed {args.seed}: "
        f"host pool {ups.host_size} tokens (both)"
    )
    history: list[str] = []
    first_state = first_hit = None
    for i, rec in enumerate(trace):
        names.add(i, rec)
        ho, hu = ours.step(rec), ups.step(rec)
        (do, so), (du, su) = ours.residency(), ups.residency()
        same = do == du and so == su
        line = (
            f"req {i:4d} prompt {rec['prompt'].shape[0]:5d} tenant {rec['tenant']}: "
            f"hit ours {ho[0]:5d}+{ho[1]:<5d} upstream {hu[0]:5d}+{hu[1]:<5d}"
            f"{'' if ho == hu else '  HIT DIFFERS'} | evicted ours {'y' if ours.evicted else 'n'} "
            f"up {'y' if ups.evicted else 'n'} | device {len(do) * page}/{len(du) * page} "
            f"host {len(so) * page}/{len(su) * page} (ours/up)"
        )
        if ho != hu and first_hit is None:
            first_hit = i
        if same:
            history.append(line)
            continue
        if first_state is None:
            first_state = i
            print("\n".join(history[-args.context :]))
        elif not args.all:
            break
        print(line)
        print(f"    device only ours:     {names.describe(do - du)}")
        print(f"    device only upstream: {names.describe(du - do)}")
        print(f"    host only ours:       {names.describe(so - su)}")
        print(f"    host only upstream:   {names.describe(su - so)}")
        history.append(line)
    print(f"first request after which the contents differ: {first_state}; first differing hit: {first_hit}")
    ours.close()
    ups.close()


if __name__ == "__main__":
    main()
