"""``import cupy`` for a subprocess: a fake_cupy.FakeCupy with no-op launches (or emulated ones
with FAKE_CUPY_LAUNCH=emulator), FAKE_CUPY_SMS SMs (default 132, an H200's); with
FAKE_CUPY_NVRTC=1 every RawModule is really compiled by NVRTC for sm_90, behind an on-disk cache
in $CUPY_CACHE_DIR as CuPy's (scripts/gpu_check.sh --fake-cupy: its compile time is counted)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for helpers.fake_cupy
from helpers.fake_cupy import FakeCupy  # noqa: E402

_fake = FakeCupy(num_sms=int(os.environ.get("FAKE_CUPY_SMS", "132")),
                 launch_mode=os.environ.get("FAKE_CUPY_LAUNCH", "noop"),
                 nvrtc=os.environ.get("FAKE_CUPY_NVRTC") == "1")
cuda = _fake.cuda
RawModule = _fake.RawModule
zeros, empty, ones, copyto = _fake.zeros, _fake.empty, _fake.ones, _fake.copyto
uint8, uint64 = _fake.uint8, _fake.uint64
show_config = _fake.show_config
__version__ = _fake.__version__

# cuLaunchKernelEx (programmatic dependent launch) comes from libcuda, not from CuPy: point the
# backend at the fake's (monokernel imports cupy lazily, so it is importable here)
import monokernel.kernel.libcuda as _libcuda  # noqa: E402

_libcuda.load_launch_ex = lambda: _fake.launch_ex
