"""Both emulator builds fill shared memory with a poison pattern at each block's start (a GPU's
shared memory holds garbage then): a kernel that reads shared memory it did not write sees NaN
(float) or -1 (int), never a zero or what an earlier block of the same launch or of an earlier
launch left there."""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np

from monokernel.kernel.emulator import build
from monokernel.kernel.emulator.build import compile_unit
from monokernel.kernel.emulator.strict import STRICT_FLAGS, rewrite_shared

KERNEL = r"""
struct PoisonParams { int* ints; float* floats; };

// Thread 0 of each block reports what its block's shared variables held before anyone wrote
// them; then every thread writes them, which no later block may see.
extern "C" __global__ void read_unwritten_shared(const PoisonParams* p) {
  __shared__ int s_int[4];
  __shared__ float s_float;
  const int b = blockIdx.x;
  if (threadIdx.x == 0) {
    p->ints[b] = s_int[1];
    p->floats[b] = s_float;
  }
  __syncthreads();
  s_int[threadIdx.x % 4] = 1234 + b;
  s_float = 1.5f;
  __syncthreads();
}
"""
GRID, BLOCK = 6, 64  # more blocks than host threads: blocks reuse a thread (and its storage)


class PoisonParams(ctypes.Structure):
    _fields_ = [("ints", ctypes.c_void_p), ("floats", ctypes.c_void_p)]


def assert_poisoned(ints: np.ndarray, floats: np.ndarray) -> None:
    assert (ints == -1).all(), ints  # 0xFFFFFFFF
    assert np.isnan(floats).all() and (floats.view(np.uint32) == 0xFFFFFFFF).all(), floats


def test_default_emulator_poisons_shared_memory_at_each_block_start():
    mod = build(KERNEL, ["read_unwritten_shared"], filename="poison.cu")
    for _launch in range(2):  # the second launch finds what the first one wrote
        ints, floats = np.zeros(GRID, np.int32), np.zeros(GRID, np.float32)
        params = PoisonParams(ints.ctypes.data, floats.ctypes.data)
        mod.launch("read_unwritten_shared", GRID, BLOCK, ctypes.addressof(params), 10.0)
        assert_poisoned(ints, floats)


STRICT_MAIN = r"""
#include <cstdio>
int main() {
  for (int launch = 0; launch < 2; ++launch) {
    int ints[%(grid)d];
    float floats[%(grid)d];
    for (int b = 0; b < %(grid)d; ++b) { ints[b] = 0; floats[b] = 0.0f; }
    PoisonParams p{ints, floats};
    int rc = emu::launch(&emu::kernel_entry<&read_unwritten_shared>, %(grid)d, %(block)d, &p, 30.0);
    if (rc != 0) { std::printf("error %%d %%s\n", rc, emu::last_error()); return 1; }
    for (int b = 0; b < %(grid)d; ++b) {
      unsigned u;
      std::memcpy(&u, &floats[b], 4);
      std::printf("%%d %%u\n", ints[b], u);
    }
  }
  return 0;
}
"""


def test_strict_emulator_poisons_shared_memory_at_each_block_start(tmp_path):
    """The strict build (one OS thread per CUDA thread, EMU_SHARED per block index), without
    TSan: the same kernel, two launches."""
    unit = (f'#line 1 "poison.cu"\n{rewrite_shared(KERNEL)}\n'
            + STRICT_MAIN % {"grid": GRID, "block": 32})
    exe = tmp_path / "poison_strict"
    compile_unit(unit, list(STRICT_FLAGS), exe, "the strict poison test", executable=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split() for line in out.stdout.splitlines()]
    assert len(rows) == 2 * GRID, out.stdout
    ints = np.array([int(r[0]) for r in rows], np.int32)
    floats = np.array([int(r[1]) for r in rows], np.uint32).view(np.float32)
    assert_poisoned(ints, floats)


def test_rewrite_shared_leaves_dynamic_shared_memory_alone():
    src = "__shared__ float a[3];\nextern __shared__ int dyn[];\n__shared__ Op s;\n"
    assert rewrite_shared(src) == ("EMU_SHARED(float, a, [3]);\nextern __shared__ int dyn[];\n"
                                   "EMU_SHARED(Op, s, );\n")
