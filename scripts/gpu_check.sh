#!/usr/bin/env bash
# GPU checks for the page-copy kernels (Mosaic GPU and Triton) on a CUDA machine.
#
# Runs, logging each step under $OUT (default ./gpu_check_out):
#   1. versions (jax, jaxlib, device kind, nvidia-smi);
#   2. the gpu-marked kernel tests (pytest -m gpu pallas_kernels), junit XML beside the log;
#   3. the implementation comparison (xla / mgpu / Triton gpu: gather and scatter GB/s with the
#      ratio to a raw device copy of the same bytes), JSON lines;
#   4. `hicache-jax bench transfer` with the Mosaic GPU kernels (--quick unless FULL=1).
# Usage: scripts/gpu_check.sh   (PYTHON=... to pick the interpreter; STEPS="1 2 3 4" to select)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-./gpu_check_out}
STEPS=${STEPS:-"1 2 3 4"}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
step() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }
if step 1; then
  { $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())
print([d.device_kind for d in jax.devices()])
from jax.experimental.pallas import mosaic_gpu as plgpu
print('new_ref', hasattr(jax, 'new_ref'), 'freeze', hasattr(jax, 'freeze'), 'kernel_name', 'kernel_name' in plgpu.Mesh.__dataclass_fields__)"; nvidia-smi || true; } > "$OUT/versions.txt" 2>&1
  cat "$OUT/versions.txt"
fi
if step 2; then
  timeout ${T_TEST:-280} $PY -m pytest pallas_kernels -m gpu -v -rA -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml" \
    > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest -m gpu: rc=$?"; tail -25 "$OUT/pytest_gpu.log"
fi
if step 3; then
  timeout ${T_COMPARE:-200} $PY -m pallas_kernels.page_copy.bench_page_copy --impls xla mgpu gpu --page-sizes 1 16 64 \
    --page-counts 16 256 1024 --reps 5 > "$OUT/compare_impls.jsonl" 2> "$OUT/compare_impls.err"
  echo "compare impls: rc=$?"; cat "$OUT/compare_impls.jsonl"; tail -5 "$OUT/compare_impls.err"
fi
if step 4; then
  Q=--quick; [ "${FULL:-0}" = 1 ] && Q=
  timeout ${T_BENCH:-100} $PY -m hicache_jax.cli bench transfer $Q --impl mgpu --out "$OUT/transfer_mgpu.json" \
    > "$OUT/bench_transfer.log" 2>&1
  echo "bench transfer: rc=$?"; tail -30 "$OUT/bench_transfer.log"
fi
