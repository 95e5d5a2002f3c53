"""libcuda's cuLaunchKernelEx through ctypes, for programmatic dependent launch (PDL) and for
launches in thread-block clusters (the cluster probe: probes.cu mk_cluster_place).

A launch carrying the attribute CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION may start
while the previous kernel on its stream is still running; the kernel itself then waits for its
predecessor with ``griddepcontrol.wait`` (megakernel.cu, entry points). Launch attributes need
cuLaunchKernelEx (CUDA 12.0+ drivers), which CuPy's ``cupy.cuda.driver`` does not wrap, so it is
called here through ctypes. Stream capture turns such launches into programmatic graph edges
(CUDA 12.3+), which is how ``cuda-multi-graph-pdl`` replays them.

The structures mirror cuda.h of CUDA 12/13 (``CUlaunchConfig_st``, ``CUlaunchAttribute_st``,
``CUlaunchAttributeValue_union``); tests/kernel/test_libcuda.py compiles a C program against the
toolkit's cuda.h and compares every size and offset. No import here needs a GPU or CuPy.
"""

from __future__ import annotations

import ctypes
import sys

from ..errors import KernelError

# cuda.h: enum CUlaunchAttributeID_enum, CUresult
CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CUDA_SUCCESS = 0


class CUclusterDim(ctypes.Structure):
    """``CUlaunchAttributeValue::clusterDim``: blocks a cluster along x, y, z."""

    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class CUlaunchAttributeValue(ctypes.Union):
    """``CUlaunchAttributeValue_union``: 64 bytes (``char pad[64]``); 8-byte aligned in C
    because some members hold pointers (``accessPolicyWindow.base_ptr``, ``CUevent``)."""

    _fields_ = [("pad", ctypes.c_char * 64),
                ("programmaticStreamSerializationAllowed", ctypes.c_int),
                ("cooperative", ctypes.c_int),
                ("clusterDim", CUclusterDim),
                ("_align8", ctypes.c_void_p)]


class CUlaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute_st``: ``id``, ``char pad[8 - sizeof(id)]``, ``value``."""

    _fields_ = [("id", ctypes.c_int),  # CUlaunchAttributeID: a C enum, 4 bytes
                ("pad", ctypes.c_char * 4),
                ("value", CUlaunchAttributeValue)]


class CUlaunchConfig(ctypes.Structure):
    """``CUlaunchConfig_st``."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint),
                ("hStream", ctypes.c_void_p),  # CUstream
                ("attrs", ctypes.POINTER(CUlaunchAttribute)),
                ("numAttrs", ctypes.c_uint)]


def launch_config(grid: int, block: int, stream: int, shared_bytes: int = 0, *,
                  programmatic: bool = False, cluster: int = 0,
                  cooperative: bool = False) -> CUlaunchConfig:
    """A 1-D launch of ``grid`` x ``block`` threads on ``stream`` with the attributes asked:
    programmatic stream serialization allowed, clusters of ``cluster`` blocks (0: none), a
    cooperative launch. The attribute array lives as long as the config (ctypes keeps the
    array assigned to ``attrs`` in the config's ``_objects``)."""
    want = [(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, programmatic),
            (CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, cluster),
            (CU_LAUNCH_ATTRIBUTE_COOPERATIVE, cooperative)]
    want = [(i, v) for i, v in want if v]
    attrs = (CUlaunchAttribute * max(len(want), 1))()
    for a, (i, v) in zip(attrs, want):
        a.id = i
        if i == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION:
            a.value.clusterDim = CUclusterDim(int(v), 1, 1)
        elif i == CU_LAUNCH_ATTRIBUTE_COOPERATIVE:
            a.value.cooperative = 1
        else:
            a.value.programmaticStreamSerializationAllowed = 1
    cfg = CUlaunchConfig(gridDimX=grid, gridDimY=1, gridDimZ=1, blockDimX=block, blockDimY=1,
                         blockDimZ=1, sharedMemBytes=shared_bytes, hStream=stream or None)
    cfg.attrs = attrs
    cfg.numAttrs = len(want)
    return cfg


def programmatic_launch_config(grid: int, block: int, stream: int,
                               shared_bytes: int = 0) -> CUlaunchConfig:
    """launch_config with programmatic stream serialization allowed (PDL)."""
    return launch_config(grid, block, stream, shared_bytes, programmatic=True)


# What a call of an entry point the driver library lacks returns (no CUresult is negative)
NO_ENTRY_POINT = -1


class LibcudaLaunchEx:
    """cuLaunchKernelEx and cuGetErrorName of the driver library. ``launch`` takes addresses
    (a CUlaunchConfig, a CUfunction, the kernelParams array) and returns the CUresult."""

    def __init__(self, lib):
        self.lib = lib
        try:
            fn = lib.cuLaunchKernelEx
        except AttributeError:
            raise KernelError("cuda: the driver library has no cuLaunchKernelEx (it needs a "
                              "CUDA 12.0+ driver); programmatic dependent launch is "
                              "unavailable, use cuda-multi-graph") from None
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._fn = fn
        self._name = getattr(lib, "cuGetErrorName", None)
        if self._name is not None:
            self._name.restype = ctypes.c_int
            self._name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._clusters = getattr(lib, "cuOccupancyMaxActiveClusters", None)
        if self._clusters is not None:
            self._clusters.restype = ctypes.c_int
            self._clusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                       ctypes.c_void_p]

    def launch(self, config_addr: int, func: int, kernel_params: int) -> int:
        return int(self._fn(config_addr, func, kernel_params, None))

    def max_active_clusters(self, func: int, config_addr: int) -> tuple[int, int]:
        """(CUresult, clusters): cuOccupancyMaxActiveClusters of the function at the config's
        cluster size and shared memory: how many such clusters the device holds at once."""
        if self._clusters is None:
            return NO_ENTRY_POINT, 0
        n = ctypes.c_int(0)
        rc = int(self._clusters(ctypes.byref(n), func, config_addr))
        return rc, n.value

    def error_name(self, code: int) -> str:
        if code == NO_ENTRY_POINT:
            return "not in this driver library"
        out = ctypes.c_char_p()
        if self._name is None or self._name(code, ctypes.byref(out)) != CUDA_SUCCESS \
                or not out.value:
            return f"CUresult {code}"
        return f"{out.value.decode()} ({code})"


def load_launch_ex() -> LibcudaLaunchEx:
    """The driver library's cuLaunchKernelEx, or KernelError saying what is missing. Tests
    replace this function with a fake that records the launch configuration."""
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    errors = []
    for name in names:
        try:
            return LibcudaLaunchEx(ctypes.CDLL(name))
        except OSError as e:
            errors.append(f"{name}: {e}")
    raise KernelError("cuda: programmatic dependent launch calls the driver's cuLaunchKernelEx, "
                      f"but the driver library could not be loaded ({'; '.join(errors)})")
