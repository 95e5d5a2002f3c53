"""The tensor-core twins (emulator/cuda_cpu_mma.h) under the sanitizers, each with a negative
control: the strict build (one OS thread per CUDA thread) under ThreadSanitizer runs the
warp-tiled product clean and reports a missing __syncthreads between the shared-memory stores and
ldmatrix; AddressSanitizer runs it clean and reports an ldmatrix row past the shared buffer's end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers.mma import kernel_source, wx_inputs, wx_reference
from monokernel.kernel.emulator import asan_preload_env

pytestmark = pytest.mark.sanitizer

# The strict (one OS thread per CUDA thread) build of mma_wx, driven by this main().
STRICT_MAIN = r"""
int main(int argc, char** argv) {
  if (argc != 7) return 2;
  WxParams p{};
  p.n_out = std::atoi(argv[1]);
  p.k = std::atoi(argv[2]);
  p.tokens = std::atoi(argv[3]);
  p.mode = std::atoi(argv[4]);
  std::vector<unsigned short> w((size_t)p.n_out * p.k), x((size_t)p.tokens * p.k);
  std::vector<float> y((size_t)p.tokens * p.n_out, NAN);
  std::FILE* f = std::fopen(argv[5], "rb");
  if (!f || std::fread(w.data(), 2, w.size(), f) != w.size() || std::fread(x.data(), 2, x.size(), f) != x.size())
    return 2;
  std::fclose(f);
  p.w = w.data();
  p.x = x.data();
  p.y = y.data();
  const int grid = ((p.n_out + 15) / 16) * ((p.tokens + 8 * WX_WARPS - 1) / (8 * WX_WARPS));
  if (emu::launch(&emu::kernel_entry<&mma_wx>, grid, 32 * WX_WARPS, &p, 120.0) != 0) {
    std::fprintf(stderr, "emu: %s\n", emu::last_error());
    return 3;
  }
  f = std::fopen(argv[6], "wb");
  if (!f || std::fwrite(y.data(), 4, y.size(), f) != y.size()) return 2;
  std::fclose(f);
  return 0;
}
"""
STRICT_SIZE = (17, 40, 9)  # 2 blocks of 64 threads: every edge padded, both warps staging W


def _tsan_reason() -> str | None:
    from monokernel.kernel.emulator.strict import tsan_available

    return tsan_available()


def run_strict_wx(tmp_path, *defines: str) -> tuple[subprocess.CompletedProcess, np.ndarray | None]:
    from monokernel.kernel.emulator.build import compile_unit, rewrite_shared
    from monokernel.kernel.emulator.strict import STRICT_FLAGS, TSAN_FLAGS, TSAN_OPTIONS

    unit = f'#line 1 "test_mma.cu"\n{rewrite_shared(kernel_source())}\n#line 1 "strict_main"\n{STRICT_MAIN}'
    exe = tmp_path / "mma_strict"
    compile_unit(unit, [*STRICT_FLAGS, *TSAN_FLAGS, *defines], exe, "the mma strict driver", executable=True)
    n_out, k, tokens = STRICT_SIZE
    w, x = wx_inputs(n_out, k, tokens)
    (tmp_path / "in.bin").write_bytes(w.tobytes() + x.tobytes())
    out = tmp_path / "out.bin"
    proc = subprocess.run([str(exe), str(n_out), str(k), str(tokens), "3", str(tmp_path / "in.bin"), str(out)],
                          env=dict(os.environ, TSAN_OPTIONS=TSAN_OPTIONS), capture_output=True, text=True,
                          timeout=300)
    y = np.fromfile(out, np.float32).reshape(tokens, n_out) if out.is_file() else None
    return proc, y


def test_strict_build_under_tsan_is_clean_and_matches_numpy(tmp_path):
    if (reason := _tsan_reason()) is not None:
        pytest.skip(reason)
    proc, y = run_strict_wx(tmp_path)
    assert "ThreadSanitizer" not in proc.stderr, proc.stderr[-6000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref, tol = wx_reference(*wx_inputs(*STRICT_SIZE))
    assert np.all(np.abs(y.astype(np.float64) - ref) <= tol)


def test_negative_control_missing_syncthreads_is_a_data_race(tmp_path):
    """Without the __syncthreads between the tile stores and ldmatrix, another thread's store and
    a lane's ldmatrix read of that row are unordered: TSan must say so, at the ldmatrix twin."""
    if (reason := _tsan_reason()) is not None:
        pytest.skip(reason)
    proc, _ = run_strict_wx(tmp_path, "-DMMA_TEST_NO_SYNC")
    assert "WARNING: ThreadSanitizer: data race" in proc.stderr, proc.stderr[-3000:]
    assert "emu::ldmatrix" in proc.stderr and "mma_wx" in proc.stderr, proc.stderr[-6000:]


ASAN_SCRIPT = r"""
import sys
import numpy as np
from monokernel.kernel.emulator import build

source, n_out, k, tokens, mode, out, *flags = sys.argv[1:]
n_out, k, tokens, mode = int(n_out), int(k), int(tokens), int(mode)
mod = build(open(source).read(), ["mma_wx"], filename="test_mma.cu", sanitize="address", extra_flags=flags)
data = np.fromfile(out + ".in", np.uint16)
w, x = data[:n_out * k].copy(), data[n_out * k:].copy()
y = np.full(tokens * n_out, np.nan, np.float32)
p = np.array([(w.ctypes.data, x.ctypes.data, y.ctypes.data, n_out, k, tokens, mode)], np.dtype(
    [("w", np.uint64), ("x", np.uint64), ("y", np.uint64), ("n_out", np.int32), ("k", np.int32),
     ("tokens", np.int32), ("mode", np.int32)], align=True))
grid = -(-n_out // 16) * -(-tokens // 16)
mod.launch("mma_wx", grid, 64, p.ctypes.data, 60.0)
y.tofile(out)
print("ran")
"""


def run_asan_wx(tmp_path, *defines: str) -> tuple[subprocess.CompletedProcess, np.ndarray | None]:
    src = tmp_path / "test_mma.cu"
    src.write_text(kernel_source())
    n_out, k, tokens = STRICT_SIZE
    w, x = wx_inputs(n_out, k, tokens)
    out = tmp_path / "y.bin"
    Path(str(out) + ".in").write_bytes(w.tobytes() + x.tobytes())
    proc = subprocess.run([sys.executable, "-c", ASAN_SCRIPT, str(src), str(n_out), str(k), str(tokens), "3",
                           str(out), *defines], env=asan_preload_env(), capture_output=True, text=True,
                          timeout=600)
    y = np.fromfile(out, np.float32).reshape(tokens, n_out) if out.is_file() else None
    return proc, y


def test_product_under_address_sanitizer_is_clean(tmp_path):
    proc, y = run_asan_wx(tmp_path)
    assert "AddressSanitizer" not in proc.stderr, proc.stderr[-6000:]
    assert proc.returncode == 0 and proc.stdout.startswith("ran"), proc.stderr[-3000:]
    ref, tol = wx_reference(*wx_inputs(*STRICT_SIZE))
    assert np.all(np.abs(y.astype(np.float64) - ref) <= tol)


def test_negative_control_ldmatrix_row_past_shared_end_is_reported(tmp_path):
    """Each warp's X tile moved 8 rows on: warp 1's ldmatrix rows start at the dynamic shared
    buffer's end. ASan must report the overflow in the ldmatrix twin, called from mma_wx."""
    proc, _ = run_asan_wx(tmp_path, "-DMMA_TEST_ROW_SHIFT=8")
    assert proc.returncode != 0 and "ran" not in proc.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]
    assert "emu::ldmatrix" in proc.stderr and "mma_wx" in proc.stderr, proc.stderr[-6000:]
