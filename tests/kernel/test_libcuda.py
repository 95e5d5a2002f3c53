"""kernel/libcuda.py: cuLaunchKernelEx through ctypes (programmatic dependent launch).

The ctypes structures must match the driver's: a wrong size or offset would hand the driver a
garbled launch configuration on the GPU while every fake-CuPy test passes. So a C++ program is
compiled against the CUDA toolkit's own cuda.h (nvcc finds the header; skipped without nvcc)
and its sizeof/alignof/offsetof and enum values are compared with the ctypes layout. The
errors for a missing driver library or entry point are checked without a GPU.
"""

from __future__ import annotations

import ctypes
import gc
import shutil
import subprocess
import types

import pytest

from monokernel.errors import KernelError
from monokernel.kernel import libcuda
from monokernel.kernel.libcuda import (CUclusterDim, CUlaunchAttribute, CUlaunchAttributeValue,
                                       CUlaunchConfig)

NVCC = shutil.which("nvcc")
CONFIG_FIELDS = ("gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY", "blockDimZ",
                 "sharedMemBytes", "hStream", "attrs", "numAttrs")


def ctypes_layout() -> dict[str, int]:
    out = {"sizeof CUlaunchAttributeValue": ctypes.sizeof(CUlaunchAttributeValue),
           "alignof CUlaunchAttributeValue": ctypes.alignment(CUlaunchAttributeValue),
           "sizeof CUlaunchAttribute": ctypes.sizeof(CUlaunchAttribute),
           "alignof CUlaunchAttribute": ctypes.alignment(CUlaunchAttribute),
           "offsetof CUlaunchAttribute.id": CUlaunchAttribute.id.offset,
           "offsetof CUlaunchAttribute.value": CUlaunchAttribute.value.offset,
           "offsetof CUlaunchAttributeValue.programmaticStreamSerializationAllowed":
               CUlaunchAttributeValue.programmaticStreamSerializationAllowed.offset,
           "offsetof CUlaunchAttributeValue.cooperative":
               CUlaunchAttributeValue.cooperative.offset,
           "offsetof CUlaunchAttributeValue.clusterDim": CUlaunchAttributeValue.clusterDim.offset,
           "sizeof CUlaunchAttributeValue::clusterDim": ctypes.sizeof(CUclusterDim),
           "sizeof CUlaunchConfig": ctypes.sizeof(CUlaunchConfig),
           "alignof CUlaunchConfig": ctypes.alignment(CUlaunchConfig),
           "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION":
               libcuda.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
           "CU_LAUNCH_ATTRIBUTE_COOPERATIVE": libcuda.CU_LAUNCH_ATTRIBUTE_COOPERATIVE,
           "CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION": libcuda.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
           "CUDA_SUCCESS": libcuda.CUDA_SUCCESS}
    for f in CONFIG_FIELDS:
        out[f"offsetof CUlaunchConfig.{f}"] = getattr(CUlaunchConfig, f).offset
    return out


def header_layout(tmp_path) -> dict[str, int]:
    """The same quantities as the C compiler sees them in the toolkit's cuda.h."""
    keys = list(ctypes_layout())
    exprs = []
    for k in keys:
        kind, _, what = k.partition(" ")
        if kind == "offsetof":
            struct, member = what.split(".")
            exprs.append(f"offsetof({struct}, {member})")
        elif kind in ("sizeof", "alignof"):
            exprs.append(f"{kind}({what})")
        else:
            exprs.append(k)
    src = tmp_path / "layout.cpp"
    src.write_text("#include <cuda.h>\n#include <cstddef>\n#include <cstdio>\nint main() {\n"
                   + "".join(f'  std::printf("%lld\\n", (long long)({e}));\n' for e in exprs)
                   + "}\n")
    exe = tmp_path / "layout"
    proc = subprocess.run([NVCC, str(src), "-o", str(exe)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    values = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30,
                            check=True).stdout.split()
    return dict(zip(keys, map(int, values)))


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (CUDA toolkit's cuda.h needed)")
def test_ctypes_layout_matches_cuda_h(tmp_path):
    want = header_layout(tmp_path)
    got = ctypes_layout()
    assert got == want, {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert want["sizeof CUlaunchAttribute"] == 72 and want["offsetof CUlaunchAttribute.value"] == 8


def test_programmatic_launch_config_fields_and_lifetime():
    cfg = libcuda.programmatic_launch_config(132, 256, 0xABC0)
    gc.collect()  # the attribute array must live as long as the config
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ) == (132, 1, 1)
    assert (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ, cfg.sharedMemBytes) == (256, 1, 1, 0)
    assert cfg.hStream == 0xABC0 and cfg.numAttrs == 1
    attr = cfg.attrs[0]
    assert attr.id == libcuda.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert attr.value.programmaticStreamSerializationAllowed == 1
    raw = ctypes.string_at(ctypes.addressof(attr), ctypes.sizeof(attr))
    assert raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == (1).to_bytes(4, "little")
    assert libcuda.programmatic_launch_config(1, 32, 0).hStream is None  # the legacy stream


def test_launch_config_of_clusters_and_cooperative_launches():
    """launch_config's attributes as the driver reads them: the cluster's blocks in clusterDim
    (x; y and z 1), cooperative 1, in the order asked; no attribute: numAttrs 0."""
    cfg = libcuda.launch_config(132, 32, 0, 120 * 1024, cluster=2, cooperative=True)
    gc.collect()
    assert cfg.numAttrs == 2 and cfg.sharedMemBytes == 120 * 1024
    ids = [cfg.attrs[i].id for i in range(2)]
    assert ids == [libcuda.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                   libcuda.CU_LAUNCH_ATTRIBUTE_COOPERATIVE] == [4, 2]
    dim = cfg.attrs[0].value.clusterDim
    assert (dim.x, dim.y, dim.z) == (2, 1, 1)
    raw = ctypes.string_at(ctypes.addressof(cfg.attrs[0]), ctypes.sizeof(CUlaunchAttribute))
    assert raw[8:20] == b"".join(v.to_bytes(4, "little") for v in (2, 1, 1))
    assert cfg.attrs[1].value.cooperative == 1
    assert libcuda.launch_config(4, 32, 0).numAttrs == 0
    pdl = libcuda.launch_config(4, 32, 0, programmatic=True)
    assert pdl.numAttrs == 1 and pdl.attrs[0].id == 6


def test_missing_driver_library_is_a_kernel_error(monkeypatch):
    def no_lib(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    with pytest.raises(KernelError, match="cuLaunchKernelEx, but the driver library could not "
                                          "be loaded .*libcuda.so.1"):
        libcuda.load_launch_ex()


def test_driver_without_cu_launch_kernel_ex_is_a_kernel_error():
    with pytest.raises(KernelError, match="no cuLaunchKernelEx .*CUDA 12.0"):
        libcuda.LibcudaLaunchEx(types.SimpleNamespace())


def test_driver_without_max_active_clusters_says_so():
    """A driver library with cuLaunchKernelEx but not cuOccupancyMaxActiveClusters (the cluster
    probe's occupancy row): the row says the entry point is missing, not a made-up CUresult."""
    lib = types.SimpleNamespace(cuLaunchKernelEx=ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0))
    ex = libcuda.LibcudaLaunchEx(lib)
    rc, n = ex.max_active_clusters(0, 0)
    assert (rc, n) == (libcuda.NO_ENTRY_POINT, 0) and rc != libcuda.CUDA_SUCCESS
    assert ex.error_name(rc) == "not in this driver library"
    assert ex.error_name(700) == "CUresult 700"  # and no cuGetErrorName either: the number
