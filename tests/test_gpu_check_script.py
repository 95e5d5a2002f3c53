"""scripts/gpu_check.sh --emulator: the GPU machine's prepared command, run on the CPU emulator
with the tiny shape, so CI proves every step of it works end to end."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_emulator_mode(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    out = tmp_path / "results"
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--emulator", str(out)],
                          env=env, capture_output=True, text=True, timeout=900)
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "all steps passed" in summary
    for step in ("emulator_tests", "bench", "trace"):
        assert f"=== {step}: exit 0" in summary, summary
    assert list(out.glob("bench-*.json")), sorted(p.name for p in out.iterdir())
    assert list(out.glob("*.png"))
    assert list(out.glob("*trace*.json")), sorted(p.name for p in out.iterdir())
