"""scripts/gpu_check.sh, the GPU machine's prepared command, proven without a GPU:

- ``--emulator``: every step on the CPU emulator with the tiny shape, end to end;
- ``--fake-cupy``: the GPU mode itself (same steps, shapes and commands) on the project's fake
  CuPy, whose launches do nothing, so its *host-side* time is measured here and cannot creep
  past its budget. Its numeric checks fail by design (nothing ran); what is asserted is that
  every step ran to its end within its limit and the whole host side within HOST_CPU_BUDGET_S.
"""

import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The GPU mode's host work on this 2-core machine (the GPU machine has 16 cores): synthetic
# checkpoints, schedules, reference runs, executors. The GPU-side time comes on top of it there.
# Measured on this machine (2026-12-01): 183 s wall (user 113 s, sys 96 s) at commit b3062d8;
# 475 s wall, 445 CPU-s (user 100 s, sys 346 s) after the merges that followed. Almost all of
# it is kernel (sys) time spent on first touches of memory: this VM pays ~30 us per fresh 4 KB
# page (~8 s per GB) once the host has taken the pages back (benchmarks/NOTES.md). With the
# weights read through file maps and converted/stacked without temporaries (minor faults
# 2.5 M -> 1.1 M) it measured 569 s wall, 449 CPU-s (user 122 s, sys 328 s), then 537 s wall,
# 481 CPU-s: what remains is
# the peak memory each step touches by design (the reference's float32 copy, the stacked
# kernel copy, the synthetic checkpoints). The budget is the worse run plus ~55 % (a fresh CI
# VM has given its memory back to the host too, and two runs on a shared machine differed by
# 7 %), so another growth of the size seen above (~+260 CPU-s) fails here; CPU seconds (user +
# sys of the check's processes) move less than wall time on a busy VM.
HOST_CPU_BUDGET_S = 750
WALL_CEILING_S = 1500
GPU_STEPS = ("smoke", "gpu_tests", "bench_smollm2-135m", "bench_qwen3-0.6b",
             "bench_llama-3.2-1b", "trace")


def run_check(mode: str, out: Path, timeout: int) -> tuple[subprocess.CompletedProcess, str]:
    # the steps' limits are the 16-core GPU machine's; this machine has 2 cores
    env = dict(os.environ, PYTHON=sys.executable, MONOKERNEL_CHECK_LIMIT_SCALE="5")
    env.pop("MONOKERNEL_REQUIRE_GPU", None)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), mode, str(out)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    return proc, (out / "summary.txt").read_text()


@pytest.mark.slow
def test_gpu_check_emulator_mode(tmp_path):
    out = tmp_path / "results"
    proc, summary = run_check("--emulator", out, 900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "all steps passed" in summary
    for step in ("smoke", "emulator_tests", "bench_tiny", "trace"):
        assert f"=== {step}: exit 0" in summary, summary
    assert list(out.glob("bench-*.json")), sorted(p.name for p in out.iterdir())
    assert list(out.glob("*.png"))
    assert list(out.glob("*trace*.json")), sorted(p.name for p in out.iterdir())
    assert '"ok": true' in (out / "smoke.json").read_text()


@pytest.mark.slow
def test_gpu_mode_host_side_fits_its_budget(tmp_path):
    out = tmp_path / "results"
    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc, summary = run_check("--fake-cupy", out, WALL_CEILING_S)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    took = time.perf_counter() - t0
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    seconds = {}
    for step in GPU_STEPS:
        m = re.search(rf"^=== {re.escape(step)}: exit (\d+) in (\d+) s$", summary, re.M)
        assert m, f"step {step} did not finish:\n{summary}"
        assert f"{step}: timed out" not in summary, summary
        seconds[step] = int(m.group(2))
    print(f"gpu_check --fake-cupy host side: {took:.0f} s wall, {cpu:.0f} CPU-s; per step "
          f"{seconds}")
    # the steps really ran the GPU mode's host work: the smoke loaded all three shapes ...
    smoke = (out / "smoke.json").read_text()
    for shape in ("smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"):
        assert f'"check": "load {shape}",\n   "ok": true' in smoke, smoke[:2000]
    # ... and the GPU tests were collected and run (they fail: the fake launches do nothing)
    tests_log = (out / "gpu_tests.log").read_text()
    assert re.search(r"\b\d+ failed\b", tests_log) and " skipped" not in tests_log.splitlines()[-1]
    assert cpu < HOST_CPU_BUDGET_S, (f"host side of the GPU check used {cpu:.0f} CPU-s "
                                     f"({took:.0f} s wall): {seconds}")
    assert took < WALL_CEILING_S
