"""Tensor-core helpers (kernel/mma.cuh) and their warp-level CPU twins (emulator/cuda_cpu_mma.h).

The kernels (tests/helpers/mma.py) are valid CUDA too: test_kernels_compile_without_spills_or_stack
builds them with nvcc, test_kernels_compile_with_nvrtc with NVRTC. What is checked here:
  - the layout: every (lane, register, half) of the A, B and C/D fragments of mma.m16n8k16, and
    every lane's registers of ldmatrix.x4 / .x2, against the helper's own copy of the PTX ISA's
    tables, with a twin that swaps two registers as the negative control;
  - a warp-tiled Y = X W^T through every combination of ldmatrix and global-fragment loads, on
    awkward sizes (zero padding at every edge), against NumPy float64 of the same bf16 inputs;
  - a lane missing at an mma, or a partial warp at an ldmatrix, is the emulator's warp error
    naming it, not a hang;
  - nvcc: no spills, no stack, and the SASS has HMMA.16816.F32.BF16 and LDSM.
The sanitizer builds are test_mma_sanitizers.py. Only a GPU run proves the PTX path itself: the
layout and product tests run on the emulator and, as their `gpu`-marked `cuda` parameter, through
CuPy on a device (docs/tensor-cores.md).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from helpers.mma import (FRAG_PARAMS, KERNEL_NAMES, SIZES, CupyRunner, EmulatorRunner, a_coord, b_coord,
                         cd_coord, kernel_source, layout_mismatches, run_ldmatrix, run_wx, struct,
                         wx_inputs, wx_reference)
from monokernel.errors import KernelError
from monokernel.kernel.emulator import build

@pytest.fixture(scope="module")
def mod():
    return build(kernel_source(), KERNEL_NAMES, filename="test_mma.cu")


@pytest.fixture(scope="module", params=["emulator", pytest.param("cuda", marks=pytest.mark.gpu)])
def runner(request):
    """The twins on the CPU and, where a GPU and CuPy are present, the PTX itself: the only
    proof of the PTX path (conftest skips the gpu parameter with its reason elsewhere;
    scripts/gpu_check.sh runs it with the other `-m gpu` tests)."""
    if request.param == "emulator":
        return EmulatorRunner(request.getfixturevalue("mod"))
    return CupyRunner()


# ================================================================================================
# Layouts
# ================================================================================================
def test_reference_tables_cover_each_element_once():
    """The ISA tables above are permutations: each matrix element sits in exactly one place."""
    a = {a_coord(lane, r, h) for lane in range(32) for r in range(4) for h in (0, 1)}
    b = {b_coord(lane, r, h) for lane in range(32) for r in range(2) for h in (0, 1)}
    cd = {cd_coord(lane, i) for lane in range(32) for i in range(4)}
    assert len(a) == 256 and a == {(m, k) for m in range(16) for k in range(16)}
    assert len(b) == 128 and b == {(k, n) for k in range(16) for n in range(8)}
    assert len(cd) == 128 and cd == {(m, n) for m in range(16) for n in range(8)}


def test_mma_layout_every_lane_register_and_half(runner):
    assert layout_mismatches(runner) == []


def test_negative_control_twin_with_swapped_registers_is_rejected():
    """A twin that takes a[1] for a[2] and back must fail the layout check: on every one-hot
    case of those two registers (each lane, each half), and on every B case (their A is full);
    never on a[0], a[3] or C."""
    bad_mod = build(kernel_source(), KERNEL_NAMES, filename="test_mma.cu",
                    extra_flags=["-DEMU_MMA_MUTANT_SWAP_A12"])
    bad = {m.split(":")[0] for m in layout_mismatches(EmulatorRunner(bad_mod))}
    want = {f"A lane {lane} a[{r}] half {h}" for lane in range(32) for r in (1, 2) for h in (0, 1)}
    want |= {f"B lane {lane} b[{r}] half {h}" for lane in range(32) for r in (0, 1) for h in (0, 1)}
    assert bad == want, sorted(bad ^ want)[:5]


def test_ldmatrix_x4_and_x2_layouts(runner):
    """Distinct 16-bit ids in 32 shared rows, each lane passing a scrambled row: lane l gets, of
    matrix i (the rows named by lanes 8i..8i+7), row l >> 2, elements 2 (l & 3) and 2 (l & 3) + 1;
    with .x2.trans (V's B fragments in the segment attention), of the transposed matrix: rows
    2 (l & 3) and 2 (l & 3) + 1, element l >> 2 of each."""
    src, row_of_lane, out4, out2, out2t = run_ldmatrix(runner)
    for n, out in ((4, out4), (2, out2)):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for i in range(n):
                row = src[row_of_lane[8 * i + g]]
                want = int(row[2 * t]) | int(row[2 * t + 1]) << 16
                assert out[lane, i] == want, f"x{n} lane {lane} r[{i}] = {out[lane, i]:#x}, want {want:#x}"
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for i in range(2):
            lo, hi = src[row_of_lane[8 * i + 2 * t]], src[row_of_lane[8 * i + 2 * t + 1]]
            want = int(lo[g]) | int(hi[g]) << 16
            assert out2t[lane, i] == want, f"x2.trans lane {lane} r[{i}] = {out2t[lane, i]:#x}"


# ================================================================================================
# The product against NumPy
# ================================================================================================
@pytest.mark.parametrize("mode", [0, 1, 2, 3], ids=["global", "ldmatrix-A", "ldmatrix-B", "ldmatrix-AB"])
def test_warp_tiled_product_matches_numpy(runner, mode):
    for n_out, k, tokens in SIZES:
        y = run_wx(runner, n_out, k, tokens, mode)
        ref, tol = wx_reference(*wx_inputs(n_out, k, tokens))
        err = np.abs(y.astype(np.float64) - ref)
        assert np.all(err <= tol), (n_out, k, tokens, float(np.nanmax(err - tol)))
        assert np.abs(ref).max() > 1.0  # a real product, not zeros


def test_product_check_sees_a_dropped_k_step(mod):
    """The tolerance has teeth: zeroing the last k16 step's W columns (what a product that
    stops one step early computes) fails it."""
    n_out, k, tokens = 40, 48, 3
    y = run_wx(EmulatorRunner(mod), n_out, k, tokens, 3)
    w, x = wx_inputs(n_out, k, tokens)
    w_short = w.copy()
    w_short[:, 32:] = 0
    ref_short, _ = wx_reference(w_short, x)
    ref, tol = wx_reference(w, x)
    assert np.all(np.abs(y - ref) <= tol)
    assert not np.all(np.abs(ref_short - ref) <= tol)


# ================================================================================================
# Warp errors
# ================================================================================================
def test_cp_async_copies_16_bytes_a_thread_into_shared_memory(runner):
    """mma.cuh cp_async_16 + cp_async_wait (the segment attention's K staging): 64 chunks by 32
    threads, each output chunk read back from shared memory by another thread after the
    barrier, byte for byte the source's."""
    from helpers.mma import run_cp_async

    src, out = run_cp_async(runner)
    assert np.array_equal(out.reshape(64, 16), np.roll(src.reshape(64, 16), -1, axis=0))


def _cp_async_read_twice(mod, kernel: str, threads: int, seed: int):
    """(64 source chunks of 16 bytes, none 0xff; the 2 x 64 chunks ``kernel`` read back: before
    and after its wait) on the emulator."""
    from helpers.mma import CP_PARAMS

    runner = EmulatorRunner(mod)
    src = np.random.default_rng(seed).integers(0, 255, 64 * 16, dtype=np.uint8)  # no 0xff byte
    bufs = [runner.buffer(v) for v in (src, np.zeros(2 * 64 * 16, np.uint8))]
    runner.launch(kernel, 1, threads,
                  struct(CP_PARAMS, src=runner.ptr(bufs[0]), out=runner.ptr(bufs[1]), chunks=64,
                         offset=0))
    return src, runner.read(bufs[1])


def test_cp_async_twin_lands_a_copy_at_the_wait_not_before(mod):
    """The emulator's cp.async (cuda_cpu_mma.h): a thread reading its own chunk after the
    issue and before cp_async_wait sees 0xff bytes (NaN as bf16 and fp32), not the source, so a
    kernel that reads a tile before its wait shows it in its numbers; after the wait, the
    source's bytes. (A GPU's copy may land early; the twin takes the latest the ISA allows.)"""
    src, out = _cp_async_read_twice(mod, "cp_async_before_wait", 32, seed=3)
    assert (out[:64 * 16] == 0xff).all()
    assert np.array_equal(out[64 * 16:], src)


def test_cp_async_wait_group_lands_all_but_the_newest_groups(mod):
    """cp_async_commit / cp_async_wait_group<1> (the PTX ISA's commit_group and wait_group): 16
    threads copy 4 rounds of their own chunks, committing the first three as groups; after
    wait_group 1 the first two groups' chunks (0-31) are the source's, the newest group's
    (32-47) and the uncommitted round's (48-63) not yet (0xff); after cp_async_wait, all."""
    src, out = _cp_async_read_twice(mod, "cp_async_groups", 16, seed=4)
    assert np.array_equal(out[:32 * 16], src[:32 * 16])
    assert (out[32 * 16:64 * 16] == 0xff).all()
    assert np.array_equal(out[64 * 16:], src)


def test_cp_async_of_a_misaligned_source_is_an_error_naming_cp_async(mod):
    """cp.async.cg of 16 bytes needs 16-byte aligned addresses (the PTX ISA); the twin refuses a
    source 8 bytes off, naming cp.async, instead of copying what the GPU would not."""
    from helpers.mma import run_cp_async

    with pytest.raises(KernelError, match=r"cp\.async addresses .* not 16-byte aligned"):
        run_cp_async(EmulatorRunner(mod), offset=8)


def test_missing_lane_is_a_warp_error_naming_mma(mod):
    d = np.zeros(32, np.float32)
    with pytest.raises(KernelError, match=r"lane 7 .*mma_m16n8k16_bf16"):
        EmulatorRunner(mod).launch("mma_missing_lane", 1, 32, struct(FRAG_PARAMS, d=d.ctypes.data))


def test_partial_warp_is_an_error_naming_ldmatrix(mod):
    """ldmatrix needs all 32 lanes: a block of 48 threads leaves the second warp 16 short."""
    with pytest.raises(KernelError, match=r"ldmatrix.x4 needs all 32 lanes"):
        run_ldmatrix(EmulatorRunner(mod), block=48)


# ================================================================================================
# nvcc and NVRTC
# ================================================================================================
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (CUDA toolkit needed)")


def ptxas_properties(report: str) -> dict[str, tuple[int, int, int]]:
    """``-Xptxas -v`` output -> {function: (stack frame, spill store, spill load bytes)}."""
    return {m[1]: (int(m[2]), int(m[3]), int(m[4])) for m in re.finditer(
        r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
        r"(\d+) bytes spill loads", report)}


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    root = tmp_path_factory.mktemp("mma-nvcc")
    src = root / "test_mma.cu"
    src.write_text(kernel_source())
    out = {}
    for arch in ("sm_80", "sm_90"):
        cubin = root / f"test_mma_{arch}.cubin"
        proc = subprocess.run([NVCC, "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", str(src),
                               "-o", str(cubin)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"nvcc -arch={arch} failed:\n{proc.stderr[-4000:]}"
        out[arch] = (cubin, proc.stdout + proc.stderr)
    return out


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_compile_without_spills_or_stack(cubins, arch):
    props = ptxas_properties(cubins[arch][1])
    assert set(KERNEL_NAMES) <= set(props), props
    assert all(v == (0, 0, 0) for v in props.values()), props


@needs_nvcc
def test_sass_has_tensor_core_mma_and_ldmatrix(cubins):
    from monokernel.kernel.sass_facts import SassToolMissing, cuobjdump

    try:
        tool = cuobjdump()
    except SassToolMissing as e:
        pytest.skip(str(e))
    proc = subprocess.run([tool, "-sass", str(cubins["sm_90"][0])], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    funcs = dict(re.findall(r"Function : (\w+)\n(.*?)(?=\n\s*Function : |\Z)", proc.stdout, flags=re.DOTALL))
    wx = funcs["mma_wx"]
    assert "HMMA.16816.F32.BF16" in wx
    assert re.search(r"\bLDSM\.16\.M88\.4\b", wx) and re.search(r"\bLDSM\.16\.M88\.2\b", wx)
    assert re.search(r"\bLDSM\.16\.M88\.4\b", funcs["ldmatrix_fragments"])
    assert re.search(r"\bLDSM\.16\.MT88\.2\b", funcs["ldmatrix_fragments"])
    assert re.search(r"\bLDGSTS\.E\.BYPASS\.128\b", funcs["cp_async_chunks"])
    assert re.search(r"\bLDGDEPBAR\b", funcs["cp_async_chunks"])
    # commit_group a round, wait_group 1 (all but the newest group), then wait_all
    groups = funcs["cp_async_groups"]
    assert len(re.findall(r"\bLDGSTS\.E\.BYPASS\.128\b", groups)) >= 4
    assert re.search(r"\bDEPBAR\.LE SB0, 0x1\b", groups) and re.search(r"\bDEPBAR\.LE SB0, 0x0\b", groups)
    assert "HMMA.16816.F32.BF16" in funcs["mma_fragments"]


def test_kernels_compile_with_nvrtc():
    """NVRTC (CuPy's compiler on the GPU machine) has no standard headers: mma.cuh must not need
    any. Compiled with the options CupyDevice.compile passes, plus CuPy's own."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")
    err, prog = nvrtc.nvrtcCreateProgram(kernel_source().encode(), b"test_mma.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    opts = [b"-std=c++17", b"--generate-line-info", b"-ftz=true", b"-arch=sm_90"]
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    except RuntimeError as e:  # no libnvrtc found
        pytest.skip(f"NVRTC library not loadable: {e}")
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    log = bytearray(n)  # a bytearray, never b" " * n (see test_nvrtc.py)
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    text = log.decode(errors="replace").strip("\0 \n")
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, text
    assert "warning" not in text.lower(), text
