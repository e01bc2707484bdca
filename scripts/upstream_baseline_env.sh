#!/usr/bin/env bash
# Creates (or reuses) .venv-upstream: Python 3.11 + torch 2.13.0 (CPU) + sglang 0.5.18 without its
# dependency tree, for benchmarks/upstream_tree_replay.py (upstream's HiRadixCache as a same-run
# baseline; see that file's docstring) and benchmarks/bench_tree_vs_upstream.py (both trees paired). Pins: benchmarks/upstream_requirements.txt, installed with
# --no-deps; the venv is rebuilt when that file changes (its hash is stamped inside the venv).
# With arguments, runs that venv's python with them afterwards (from the repository root), e.g.
#     scripts/upstream_baseline_env.sh benchmarks/bench_tree_vs_upstream.py --rounds 7
#     scripts/upstream_baseline_env.sh benchmarks/upstream_tree_replay.py --repeats 3
# UPSTREAM_VENV overrides the location (default: <repo>/.venv-upstream).
source "$(dirname "$0")/_env.sh"  # ROOT, _find_python
REQS="$ROOT/benchmarks/upstream_requirements.txt"
VENV="${UPSTREAM_VENV:-$ROOT/.venv-upstream}"
want="$(sha256sum "$REQS" | cut -c1-16)"
if ! [ -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.hicache-stamp" 2>/dev/null)" != "$want" ]; then
  py="$(_find_python 3.11)"
  if [ -z "$py" ]; then echo "error: Python 3.11 not found (torch 2.13.0+cpu and the sglang wheel are cp311)" >&2; exit 1; fi
  echo ">> creating $VENV with $py ($("$py" --version)) ..." >&2
  start=$SECONDS
  rm -rf "$VENV"
  "$py" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$VENV/bin/python" -m pip install -q --no-deps -r "$REQS"
  "$VENV/bin/python" -c 'import torch, sys; sys.exit("error: torch is not the CPU build" if torch.version.cuda else 0)'
  echo "$want" > "$VENV/.hicache-stamp"
  echo ">> $VENV ready in $((SECONDS - start)) s" >&2
fi
if [ "$#" -gt 0 ]; then
  cd "$ROOT"
  exec "$VENV/bin/python" "$@"
fi
