"""NVRTC (the compiler CuPy's RawModule uses on the GPU machine) compiles megakernel.cu.

nvcc (test_compile.py) and NVRTC differ: NVRTC has no standard headers and no <math.h> macros,
so a kernel that builds with nvcc can still fail at `LLM(backend="cuda")`. NVRTC needs no GPU
or driver; it comes from the `nvidia-cuda-nvrtc` wheel through `cuda-bindings` (test extra).
"""

import pytest

from monokernel.model.config import ModelConfig
from monokernel.kernel.executor import kernel_source

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")

# What CupyDevice.compile passes, plus what CuPy adds itself (-arch of the device, -ftz=true).
OPTIONS = [b"-std=c++17", b"--generate-line-info", b"-ftz=true"]


def nvrtc_compile(source: str, arch: str, defines: dict[str, str]) -> tuple[bool, str]:
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"megakernel.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    opts = OPTIONS + [f"-arch={arch}".encode()] + [f"-D{k}={v}".encode()
                                                   for k, v in defines.items()]
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    except RuntimeError as e:  # no libnvrtc found
        pytest.skip(f"NVRTC library not loadable: {e}")
    _, n = nvrtc.nvrtcGetProgramLogSize(prog)
    # NVRTC writes into the buffer: a bytearray, never `b" " * n` (for n == 1, an empty log,
    # that is the interpreter's shared b" ", and NVRTC's NUL then sat in every later b" " of
    # the process: safetensors headers padded with it stopped loading, test_synth)
    log = bytearray(n)
    nvrtc.nvrtcGetProgramLog(prog, log)
    nvrtc.nvrtcDestroyProgram(prog)
    assert b" " == bytes([32])
    return err == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace").strip("\0 \n")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("shape", ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b", "qwen2-tiny"])
def test_nvrtc_compiles_megakernel(shape, arch):
    ok, log = nvrtc_compile(kernel_source(ModelConfig.from_name(shape), 1024), arch, {})
    assert ok, log
    assert "warning" not in log.lower(), log


@pytest.mark.parametrize("defines", [{"MK_TRACE": "1"}, {"MK_PREFETCH": "0"}])
def test_nvrtc_compiles_variants(defines):
    ok, log = nvrtc_compile(kernel_source(ModelConfig.from_name("smollm2-135m"), 512), "sm_90",
                            defines)
    assert ok, log


def test_nvrtc_reports_errors_at_real_lines():
    """A broken kernel names megakernel.cu and the line, thanks to the #line directive."""
    src = kernel_source(ModelConfig.from_name("tiny"), 64)
    marker = "__device__ bool op_embed("
    assert marker in src
    src = src.replace(marker, "this is not C++;\n" + marker, 1)
    ok, log = nvrtc_compile(src, "sm_90", {})
    assert not ok
    assert "megakernel.cu" in log, log
