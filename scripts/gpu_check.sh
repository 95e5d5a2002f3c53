#!/usr/bin/env bash
# gpu_check.sh - the single prepared command for a GPU machine (ARCHITECTURE section 9).
#
#   scripts/gpu_check.sh RESULTS_DIR             NVIDIA GPU: GPU tests, benchmark of the
#                                                SmolLM2-135M, Qwen3-0.6B, Llama-3.2-1B; a trace
#   scripts/gpu_check.sh --emulator RESULTS_DIR  the same steps on the CPU emulator, tiny shape (CI)
#
# No pip, no network: it uses `python3` from PATH (or $PYTHON) with PYTHONPATH at this repository,
# so the machine needs only numpy, ml_dtypes, regex, safetensors, tokenizers (and cupy; torch and
# transformers for the hf rows; matplotlib for the PNGs). The environment step lists what is
# missing and which step it breaks. Synthetic checkpoints are written on the spot into a scratch
# folder shared by the tests and the benchmark. Every step's output goes to RESULTS_DIR/<step>.log
# and its exit code to RESULTS_DIR/summary.txt; a failed step does not stop the later ones, and
# the script exits non-zero if any failed. Steps are bounded by `timeout` as a last resort: the
# kernel's watchdog and the host's bounded wait already turn a hang into an error.
set -u -o pipefail

MODE=gpu
if [ "${1:-}" = "--emulator" ]; then MODE=emulator; shift; fi
if [ $# -ne 1 ]; then
  echo "usage: $0 [--emulator] RESULTS_DIR" >&2
  exit 2
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1"
RESULTS=$(cd "$1" && pwd)
PY=${PYTHON:-python3}
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/monokernel-check.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export MONOKERNEL_CACHE="$SCRATCH/cache"       # synthetic checkpoints for the bench and trace
export MONOKERNEL_TEST_CACHE="$SCRATCH/cache"  # ... and for the tests (conftest.py)
export CUPY_CACHE_DIR="$SCRATCH/cupy"          # NVRTC cubins, shared by tests, bench and trace
export MPLBACKEND=Agg
cd "$REPO"

SUMMARY="$RESULTS/summary.txt"
: > "$SUMMARY"
FAILED=0

# step NAME TIMEOUT_S CMD...: run CMD, tee its output to RESULTS/NAME.log, record its exit code.
step() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name: $* (limit ${limit} s)" | tee -a "$SUMMARY"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "$name: timed out after $limit s" | tee -a "$RESULTS/$name.log"
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
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
      --format=csv
  else
    echo "nvidia-smi: not found"
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

if [ "$MODE" = gpu ]; then
  step gpu_tests 200 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests
  # bench: monokernel/tools/bench.py + tools/commands.py (flags as documented there)
  step bench 270 "$PY" -m monokernel bench \
    --shape smollm2-135m,qwen3-0.6b,llama-3.2-1b \
    --backends cuda,cuda-noprefetch,cuda-multi,cuda-multi-graph,hf \
    --context 16,512,1024 --steps 200 --out "$RESULTS"
  step trace 90 "$PY" -m monokernel trace --shape smollm2-135m --backend cuda --out "$RESULTS"
else
  # the cuda backend's CPU side (GPU tests skip) and a few emulator runs of the tiny shape
  E=tests/test_kernel_emulator.py
  step emulator_tests 240 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_backend.py \
    "$E::test_logits_every_step_match_reference[tiny-b3-sdefault-emulator]" \
    "$E::test_logits_every_step_match_reference[tiny-b8-s3-emulator-multi]" \
    "$E::test_greedy_on_device_is_argmax"
  step bench 240 "$PY" -m monokernel bench --shape tiny --backends emulator,emulator-multi \
    --context 4,16 --steps 3 --out "$RESULTS"
  step trace 120 "$PY" -m monokernel trace --shape tiny --backend emulator --out "$RESULTS"
fi

echo "results in $RESULTS:" | tee -a "$SUMMARY"
ls -l "$RESULTS" | tee -a "$SUMMARY"
if [ "$FAILED" -ne 0 ]; then
  echo "gpu_check ($MODE): FAILED (see $SUMMARY)" | tee -a "$SUMMARY"
  exit 1
fi
echo "gpu_check ($MODE): all steps passed" | tee -a "$SUMMARY"
