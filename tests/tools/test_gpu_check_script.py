"""scripts/gpu_check.sh, the GPU machine's prepared command, proven without a GPU:

- ``--emulator``: every step on the CPU emulator with the tiny shape, end to end;
- ``--fake-cupy``: the GPU mode itself (same steps, shapes, commands and kernel builds) on the
  project's fake CuPy, whose launches do nothing but whose NVRTC compiles are real (cuda-bindings,
  a test extra), so its *host-side* time, compiles included, is measured here and cannot creep
  past its budget. Its numeric checks fail by design (nothing ran); what is asserted is that
  every step ran to its end within its own limit (scaled to this host), the prepare step
  passed, and the whole host side stayed within HOST_USER_UNITS of user CPU (and
  HOST_CPU_UNITS with the kernel's sys time, which follows this VM's memory reclaim), in units
  of this host's speed (calibration_cpu_s).

Both leave in the results folder only what the GPU machine returns (at most 8 files, at most 2
folders down, names of letters, digits, '.', '_', '-', 16 MiB each): a summary and an archive.
"""

import os
import re
import resource
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The GPU mode's host work (synthetic checkpoints, NVRTC compiles of every kernel variant,
# proofs of the 132-block programs, reference runs, executors) is held to a budget in units of
# this host's speed: CALIBRATION, a fixed NVRTC compile and a fixed Python and NumPy workload that
# no change to the project alters, timed in the same test. A fixed budget in CPU-s failed the
# day CI moved to a slower machine (benchmarks/NOTES.md, "verify() by vector clocks; the GPU
# check's host budget in units of the host's speed"): 320-380 user CPU-s for work that took
# 224-228 on the earlier one.
# History of the absolute figures (earlier machine): 238 CPU-s with 9 NVRTC compiles on
# 2026-12-01; 224-228 user + 215-227 sys at 92c5bcc. The sys part follows this VM's free-page
# reporting, not the check's work (NOTES, "first touches of memory": the same commit measured 96
# and 346 s of sys), so the work is held to HOST_USER_UNITS (user CPU) and user + sys to
# HOST_CPU_UNITS, a ceiling for the VM's variance.
# Measured on the AMD EPYC 2-core CI machine (2026-12-06, a CI run beside it), after verify()'s
# vector clocks and with the token-group picks kept on disk: 285 user CPU-s, 324 with sys, a unit
# of 4.30 CPU-s: 66 units of user CPU, 75 with sys. The budget is that plus ~35 %, and for sys
# the old ceiling's ratio to the user budget (700 / 300).
# The units do not carry across machines: on the 2-core CI machine of 2026-12-07 (a unit of
# 1.62 CPU-s) the same work at 9ce3a63 measured 89.6 units of user CPU, at the 90 budget, and
# the thirty-fourth session's kernel (cache_keys, finish_rows: longer NVRTC compiles) 91.6. The
# budget is that machine's measurement plus ~35 %, the same rule.
HOST_USER_UNITS = 120
HOST_CPU_UNITS = 210
WALL_CEILING_S = 1200
# The steps' limits are the 16-core GPU machine's; this host has 2 cores (and NVRTC compiles in
# parallel there, here two at a time).
LIMIT_SCALE = 5
GPU_STEPS = ("prepare", "smoke", "gpu_tests", "bench_smollm2-135m", "bench_qwen3-0.6b",
             "bench_llama-3.2-1b", "trace", "bench_batch", "bench_batch_tc")
RETURNED_NAME = re.compile(r"[A-Za-z0-9._-]+\Z")
STEP_LINE = re.compile(r"^=== (?P<step>\S+): exit (?P<rc>\d+) in (?P<s>\d+) s "
                       r"\(limit (?P<lim>\d+) s; (?P<cpu>\d+) CPU-s, (?P<sys>\d+) sys\)$", re.M)


# The calibration's workload: fixed, never the project's code (a slower kernel or verifier must
# show as more units, not as a slower unit). A C++ template unrolled by NVRTC, as the
# megakernel's compiles are (most of the check's host CPU), then interpreted Python and small
# NumPy products, as the proofs, references and executors are.
CALIBRATION_CUDA = r"""
template <int N> struct Poly {
  __device__ static float at(float x) { return Poly<N - 1>::at(x) * x + (float)N; }
};
template <> struct Poly<0> { __device__ static float at(float) { return 1.0f; } };
extern "C" __global__ void calibrate(const float* a, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < 256; ++j) acc += Poly<32>::at(a[(i * 7 + j) % n]) * (j & 3 ? 1.0f : -0.5f);
  out[i] = acc;
}
"""
CALIBRATION = """
import os, resource, sys, tempfile
import numpy as np
sys.path.insert(0, sys.argv[1])
from helpers.fake_cupy import nvrtc_compile_cached
os.environ["CUPY_CACHE_DIR"] = tempfile.mkdtemp()
t0 = resource.getrusage(resource.RUSAGE_SELF).ru_utime
assert nvrtc_compile_cached(sys.stdin.read(), ()) is not None
d, acc = {}, 0
for i in range(1_500_000):
    d[i % 997] = d.get(i % 997, 0) + i
    acc ^= hash((i, acc & 0xffff))
rng = np.random.default_rng(0)
w = rng.standard_normal((576, 1536), dtype=np.float32)
x = rng.standard_normal((8, 1536), dtype=np.float32)
for _ in range(300):
    x[:, :576] = np.tanh(x @ w.T)
print(resource.getrusage(resource.RUSAGE_SELF).ru_utime - t0)
"""


def calibration_cpu_s(runs: int = 2) -> float:
    """User CPU-s of CALIBRATION on this host, the least of ``runs`` (each in a fresh process,
    one BLAS thread, the CUDA source on stdin): the unit of the GPU check's host budget."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    out = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-c", CALIBRATION, str(REPO / "tests")], env=env,
                              input=CALIBRATION_CUDA, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out.append(float(proc.stdout.split()[-1]))
    return min(out)


def run_check(mode: str, out: Path, timeout: int, **env_extra) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, MONOKERNEL_CHECK_LIMIT_SCALE=str(LIMIT_SCALE),
               **env_extra)
    env.pop("MONOKERNEL_REQUIRE_GPU", None)
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), mode, str(out)],
                          env=env, capture_output=True, text=True, timeout=timeout)


def assert_returnable(out: Path) -> None:
    """What the GPU machine brings back from its results folder: at most 8 files, at most 2
    folders down, names of letters, digits, '.', '_', '-' only, 16 MiB each, 64 MiB together,
    plain files only. The check leaves exactly summary.txt and results.tar.gz."""
    files = []
    for p in out.rglob("*"):
        rel = p.relative_to(out)
        assert all(RETURNED_NAME.match(part) for part in rel.parts), rel
        assert not p.is_symlink(), rel
        if p.is_file():
            assert len(rel.parts) <= 3, f"{rel}: more than 2 folders down"
            assert p.stat().st_size <= 16 << 20, f"{rel}: {p.stat().st_size} bytes"
            files.append(p)
        else:
            assert p.is_dir(), rel
    assert len(files) <= 8, sorted(str(f.relative_to(out)) for f in files)
    assert sum(f.stat().st_size for f in files) <= 64 << 20
    assert sorted(f.name for f in files) == ["results.tar.gz", "summary.txt"], files


def archive(out: Path) -> dict[str, bytes]:
    """name -> bytes of every file in results.tar.gz."""
    with tarfile.open(out / "results.tar.gz") as tar:
        return {Path(m.name).name: tar.extractfile(m).read() for m in tar.getmembers()
                if m.isfile()}


def step_results(summary: str) -> dict[str, tuple[int, int, int, int, int]]:
    """step -> (exit code, seconds, limit, CPU seconds, of them sys) from summary.txt."""
    return {m["step"]: (int(m["rc"]), int(m["s"]), int(m["lim"]), int(m["cpu"]), int(m["sys"]))
            for m in STEP_LINE.finditer(summary)}


@pytest.mark.slow
def test_gpu_check_emulator_mode(tmp_path):
    out = tmp_path / "results"
    proc = run_check("--emulator", out, 600, MONOKERNEL_COMMIT="0123abc")
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "all steps passed" in summary
    assert "commit: 0123abc (from $MONOKERNEL_COMMIT)" in summary
    steps = step_results(summary)
    assert list(steps) == ["smoke", "emulator_tests", "bench_tiny", "trace"], summary
    print(f"gpu_check --emulator: {steps}")
    assert all(rc == 0 and s <= lim for rc, s, lim, *_ in steps.values()), steps
    assert_returnable(out)
    files = archive(out)
    assert any(re.fullmatch(r"bench-.*\.json", n) for n in files), sorted(files)
    assert any(n.endswith(".png") for n in files)
    trace = [n for n in files if re.fullmatch(r"trace-.*\.json", n)]
    assert trace and b'"timer_tick_ns"' in files[trace[0]]
    assert b'"ok": true' in files["smoke.json"]
    bench = next(v for n, v in files.items() if re.fullmatch(r"bench-.*\.json", n))
    assert b'"commit": "0123abc"' in bench and b'"commit_source": "$MONOKERNEL_COMMIT"' in bench
    for step in steps:
        assert f"{step}.log" in files


@pytest.mark.slow
def test_gpu_check_killed_midway_returns_what_it_finished(tmp_path):
    """SIGTERM (the GPU machine's time limit) after the first step: the results folder already
    holds that step's results, and the summary says the run was stopped."""
    out = tmp_path / "results"
    env = dict(os.environ, PYTHON=sys.executable, MONOKERNEL_CHECK_SNAPSHOT_S="2")
    env.pop("MONOKERNEL_REQUIRE_GPU", None)
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--emulator",
                             str(out)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            s = out / "summary.txt"
            if s.is_file() and "=== smoke: exit" in s.read_text():
                break
            time.sleep(0.5)
        else:
            pytest.fail("the smoke step did not finish within 300 s")
        os.killpg(proc.pid, signal.SIGTERM)  # the script and the step it runs
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert_returnable(out)
    summary = (out / "summary.txt").read_text()
    assert step_results(summary)["smoke"][0] == 0, summary
    assert "stopped by a signal" in summary
    files = archive(out)
    assert b'"ok": true' in files["smoke.json"] and "smoke.log" in files


@pytest.mark.slow
@pytest.mark.serial  # CPU seconds against a calibration: alone, so neither shares the cores
def test_gpu_mode_host_side_fits_its_budget(tmp_path):
    out = tmp_path / "results"
    t0 = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run_check("--fake-cupy", out, WALL_CEILING_S)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    took = time.perf_counter() - t0
    user = after.ru_utime - before.ru_utime
    cpu = user + (after.ru_stime - before.ru_stime)
    summary = (out / "summary.txt").read_text()
    steps = step_results(summary)
    print(f"gpu_check --fake-cupy host side: {took:.0f} s wall, {cpu:.0f} CPU-s ({user:.0f} "
          f"user); per step "
          f"(s, CPU-s, sys): { {k: v[1:] for k, v in steps.items()} }")
    assert list(steps) == list(GPU_STEPS), summary
    for step, (rc, seconds, limit, *_) in steps.items():  # every step within its own limit
        assert rc not in (124, 137) and seconds <= limit, (step, rc, seconds, limit, summary)
    assert steps["prepare"][0] == 0, summary
    assert_returnable(out)
    files = archive(out)
    prepare = files["prepare.log"].decode()
    # the NVRTC compiles were real (cuda-bindings is a test extra) and counted here: every
    # kernel variant of the later steps, so no later step compiles
    try:
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError:
        pytest.fail("cuda-bindings (NVRTC, a test extra) is missing: the GPU check's compile "
                    "time cannot be counted")
    assert "NVRTC compiles real" in files["environment.log"].decode()
    assert re.search(r"compiling 10 kernel variant\(s\)", prepare), prepare
    assert "0 failed" in prepare, prepare
    # the steps really ran the GPU mode's host work: the smoke loaded all three shapes ...
    smoke = files["smoke.json"].decode()
    for shape in ("smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"):
        assert f'"check": "load {shape}",\n   "ok": true' in smoke, smoke[:2000]
    # ... and the GPU tests were collected and run, verbosely (they fail: the fake launches do
    # nothing), never skipped
    tests_log = files["gpu_tests.log"].decode()
    assert re.search(r"\b\d+ failed\b", tests_log) and " skipped" not in tests_log.splitlines()[-1]
    assert "test_gpu_matches_reference" in tests_log and "FAILED" in tests_log
    unit = calibration_cpu_s()
    print(f"calibration: {unit:.2f} user CPU-s; the check: {user / unit:.1f} units of user CPU, "
          f"{cpu / unit:.1f} with sys")
    assert user < HOST_USER_UNITS * unit, (
        f"host side of the GPU check used {user:.0f} user CPU-s ({cpu:.0f} with sys, {took:.0f} "
        f"s wall) = {user / unit:.1f} units of {unit:.2f} CPU-s (budget {HOST_USER_UNITS}): "
        f"{steps}")
    assert cpu < HOST_CPU_UNITS * unit, (
        f"host side of the GPU check used {cpu:.0f} CPU-s ({user:.0f} user, {took:.0f} s wall) "
        f"= {cpu / unit:.1f} units of {unit:.2f} CPU-s (budget {HOST_CPU_UNITS}): {steps}")
    assert took < WALL_CEILING_S
