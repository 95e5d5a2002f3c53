"""A fake CuPy: just the surface monokernel's CUDA backend uses. "Device memory" is host memory;
launches either run in the CPU emulator (``launch_mode="emulator"``: the backend's argument
packing, copies, graphs and waits are tested against the reference) or do nothing
(``"noop"``: the host-side cost of the GPU check is timed without a GPU). Tests install an
instance as ``cupy``; tests/fakecupy/ makes it importable as the ``cupy`` package for a
subprocess (scripts/gpu_check.sh --fake-cupy)."""

from __future__ import annotations

import ctypes
import types

import numpy as np

from monokernel.kernel.isa import params_dtype


class FakeArray:
    lazy = False  # FakeCupy(launch_mode="noop") sets it

    def __init__(self, shape, dtype):
        self.a = np.zeros(shape, dtype)
        self.shape, self.dtype, self.nbytes = self.a.shape, self.a.dtype, self.a.nbytes
        self.data = types.SimpleNamespace(ptr=self.a.ctypes.data,
                                          copy_to_host_async=self._copy_to_host_async)

    def _copy_to_host_async(self, dst: int, size: int, stream=None) -> None:
        ctypes.memmove(dst, self.a.ctypes.data, size)

    def set(self, arr, stream=None):
        if not self.lazy:  # "noop" launches never read device memory: skip the host copy,
            self.a[...] = arr  # which on a GPU is the device's work, not the host's

    def get(self, stream=None):
        return self.a.copy()

    def fill(self, value):
        self.a.fill(value)


class FakeCupy:
    """Just the CuPy surface cuda_backend uses, recording what it is asked to do."""

    def __init__(self, num_sms=4, blocks_per_sm=1, hang=False, launch_mode="emulator",
                 nvrtc=False, static_shared=9000):
        from monokernel.kernel.devices.emulator import EmulatorDevice

        fake = self
        self.num_sms = num_sms
        self.static_shared = static_shared  # every kernel's static shared memory, bytes
        self.launch_mode = launch_mode  # "emulator": launches run there; "noop": they do nothing
        FakeArray.lazy = launch_mode == "noop"
        self.emulator = EmulatorDevice()
        self.launches: list[tuple[str, int, bool]] = []
        self.hang = hang
        self.streams: dict[int, object] = {}
        self.param_size = params_dtype().itemsize
        # nvrtc=True: RawModule really compiles with NVRTC (cuda-bindings) on first
        # get_function, behind an on-disk cache like CuPy's, so the GPU check's host side is
        # timed with its compiles (scripts/gpu_check.sh --fake-cupy)
        self.nvrtc = nvrtc
        self.nvrtc_compiles: list[float] = []  # seconds of each real compile in this process

        class CompileException(Exception):
            def get_message(self):
                return str(self)

        class Device:
            compute_capability = "90"

            def __init__(self, i=0):
                pass

            def use(self):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

        class Stream:
            def __init__(self, non_blocking=False):
                self.ptr = 1000 + len(fake.streams)
                self.captured = None
                fake.streams[self.ptr] = self

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

            def begin_capture(self, mode=None):
                self.captured = []

            def end_capture(self):
                nodes, self.captured = self.captured, None
                return types.SimpleNamespace(launch=lambda stream=None: [n() for n in nodes])

        class Event:
            def __init__(self, block=False, disable_timing=False):
                pass

            def record(self, stream=None):
                pass

            @property
            def done(self):
                return not fake.hang

        def launch(func, gx, gy, gz, bx, by, bz, smem, stream, kparams, extra=None,
                   cooperative=False):
            # kernelParams[0] points at the struct; the driver copies its bytes at the call
            arg_ptr = ctypes.c_void_p.from_address(kparams).value
            struct = np.frombuffer(ctypes.string_at(arg_ptr, fake.param_size), np.uint8).copy()
            name = fake.functions[func]
            # the driver's rule: past 48 KB with the static, dynamic shared memory needs
            # cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES) first
            if smem > fake.dynamic_allowed.get(func, 48 * 1024 - fake.static_shared):
                raise RuntimeError(f"CUDA_ERROR_INVALID_VALUE: {name} launched with {smem} B "
                                   "of dynamic shared memory it was not allowed")
            fake.launch_shared.append((name, smem))

            def run():
                fake.launches.append((name, gx, cooperative))
                if fake.launch_mode == "emulator" and name in fake.emulated:
                    fake.module.launch(name, gx, bx, struct.ctypes.data, 60.0)

            s = fake.streams[stream]
            s.captured.append(run) if s.captured is not None else run()

        class RawKernel:
            def __init__(self, name):
                self.kernel = types.SimpleNamespace(ptr=hash(name) & 0xFFFFFF)
                fake.functions[self.kernel.ptr] = name
                self.num_regs, self.local_size_bytes = 64, 0
                self.shared_size_bytes = fake.static_shared
                self.const_size_bytes, self.max_threads_per_block = 0, 1024

        class RawModule:
            def __init__(self, code, options):
                defines = dict(o[2:].split("=", 1) for o in options if o.startswith("-D"))
                from monokernel.kernel.executor import KERNEL_NAMES

                if "megakernel" in code:
                    fake.kernel_defines = defines  # the -D options of the last kernel build
                if '"probes.cu"' in code:
                    fake.probe_defines = defines  # and of the last probes build

                # probes.cu (its kernels) and every launch in "noop" mode do nothing here
                if fake.launch_mode == "emulator" and "megakernel" in code \
                        and '"probes.cu"' not in code:
                    fake.module = fake.emulator.compile(code, KERNEL_NAMES, defines)
                    fake.emulated = set(KERNEL_NAMES)

                self.code, self.options, self.compiled = code, options, False

            def get_function(self, name):
                if fake.nvrtc and not self.compiled:
                    try:
                        seconds = nvrtc_compile_cached(self.code, self.options)
                    except RuntimeError as e:
                        raise CompileException(str(e)) from None
                    if seconds is not None:
                        fake.nvrtc_compiles.append(seconds)
                    self.compiled = True
                return RawKernel(name)

        self.functions: dict[int, str] = {}
        self.emulated: set[str] = set()
        self.dynamic_allowed: dict[int, int] = {}  # func -> bytes (funcSetAttribute 8)
        self.launch_shared: list[tuple[str, int]] = []  # (kernel, dynamic shared bytes)

        def set_attribute(func, attribute, value):
            if attribute == 8:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                self.dynamic_allowed[func] = value
        self.cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(
                getDeviceCount=lambda: 1,
                getDeviceProperties=lambda i: {"name": b"Fake H200", "multiProcessorCount": num_sms,
                                               "cooperativeLaunch": 1}),
            Device=Device, Stream=Stream, Event=Event,
            driver=types.SimpleNamespace(
                launchKernel=launch,
                launchCooperativeKernel=lambda *a: launch(*a, cooperative=True),
                occupancyMaxActiveBlocksPerMultiprocessor=lambda f, t, s: blocks_per_sm,
                funcSetAttribute=set_attribute),
            compiler=types.SimpleNamespace(CompileException=CompileException),
            get_elapsed_time=lambda a, b: 0.5)
        self.RawModule = RawModule
        self.launch_ex = FakeLaunchEx(self, launch)
        self.zeros = lambda shape, dtype: FakeArray(shape, dtype)
        self.empty = lambda shape, dtype: FakeArray(shape, dtype)
        self.ones = lambda shape, dtype: _filled(FakeArray(shape, dtype), 1)
        self.arange = _arange
        self.copyto = lambda dst, src: np.copyto(dst.a, src.a)
        self.uint8, self.uint32, self.uint64 = np.uint8, np.uint32, np.uint64
        self.__version__ = "0.0-fake"
        self.show_config = lambda: print("fake CuPy (tests/helpers/fake_cupy.py): NVRTC compiles",
                                         "real (sm_90)" if nvrtc else "none", "; launches are",
                                         launch_mode)


# What CuPy adds to a RawModule's options on an H200: its arch and -ftz=true.
NVRTC_EXTRA = ("-arch=sm_90", "-ftz=true")


def nvrtc_compile_cached(code: str, options) -> float | None:
    """Compile ``code`` with NVRTC as CuPy would on an H200, unless a cubin of the same source
    and options is in $CUPY_CACHE_DIR (CuPy's on-disk cache; default ~/.cupy/kernel_cache):
    seconds the compile took, or None on a cache hit. RuntimeError with NVRTC's log when the
    source does not compile."""
    import hashlib
    import os
    import time
    from pathlib import Path

    from cuda.bindings import nvrtc

    opts = [o.encode() for o in tuple(options) + NVRTC_EXTRA]
    key = hashlib.sha256(b"\0".join([code.encode()] + opts)).hexdigest()
    cache = Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")
    path = cache / f"fake-{key}.cubin"
    if path.is_file():
        return None
    t0 = time.perf_counter()
    err, prog = nvrtc.nvrtcCreateProgram(code.encode(), b"megakernel.cu", 0, [], [])
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    ok = err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    if ok:
        # a fresh mutable buffer: NVRTC writes into it (into `b" " * n` it wrote into an
        # immutable bytes object, for n == 1 the interpreter's shared b" ", which then held a
        # NUL in every later b" " of the process: see tests/kernel/test_nvrtc.py)
        _, n = nvrtc.nvrtcGetCUBINSize(prog)
        out = bytearray(n)
        nvrtc.nvrtcGetCUBIN(prog, out)
    else:
        _, n = nvrtc.nvrtcGetProgramLogSize(prog)
        out = bytearray(n)
        nvrtc.nvrtcGetProgramLog(prog, out)
    nvrtc.nvrtcDestroyProgram(prog)
    if not ok:
        raise RuntimeError(out.decode(errors="replace"))
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(out)
    tmp.replace(path)  # atomic: parallel compiles of one source never see half a file
    return time.perf_counter() - t0


class FakeLaunchEx:
    """Stands in for libcuda's cuLaunchKernelEx (monokernel.kernel.libcuda.LibcudaLaunchEx):
    decodes the CUlaunchConfig at the address it is given, records it in ``configs`` (name,
    grid, block, shared bytes, stream, [(attribute id, int value)]), then launches like
    cuLaunchKernel (run now, or captured into the stream's graph)."""

    def __init__(self, fake: FakeCupy, launch):
        self.fake, self._launch = fake, launch
        self.configs: list[dict] = []

    def launch(self, config_addr: int, func: int, kernel_params: int) -> int:
        from monokernel.kernel.libcuda import CUlaunchConfig

        c = CUlaunchConfig.from_address(config_addr)
        attrs = [(c.attrs[i].id, c.attrs[i].value.programmaticStreamSerializationAllowed)
                 for i in range(c.numAttrs)]
        self.configs.append({
            "name": self.fake.functions[func], "grid": (c.gridDimX, c.gridDimY, c.gridDimZ),
            "block": (c.blockDimX, c.blockDimY, c.blockDimZ), "shared": c.sharedMemBytes,
            "stream": c.hStream or 0, "attrs": attrs})
        self._launch(func, c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY,
                     c.blockDimZ, c.sharedMemBytes, c.hStream or 0, kernel_params)
        return 0

    def error_name(self, code: int) -> str:
        return f"CUresult {code}"

    def max_active_clusters(self, func: int, config_addr: int) -> tuple[int, int]:
        """As the driver's, for one block an SM: whole clusters of the config's size."""
        from monokernel.kernel.libcuda import CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, \
            CUlaunchConfig

        c = CUlaunchConfig.from_address(config_addr)
        size = next((c.attrs[i].value.clusterDim.x for i in range(c.numAttrs)
                     if c.attrs[i].id == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION), 1)
        return 0, self.fake.num_sms // size


def _arange(n: int, dtype) -> FakeArray:
    """cupy.arange(n, dtype=...): 0, 1, 2, ... (left zeros with "noop" launches, which never
    read device memory: a large probe buffer then costs the host no pages)."""
    arr = FakeArray((n,), dtype)
    if not FakeArray.lazy:
        arr.a[...] = np.arange(n, dtype=dtype)
    return arr


def _filled(arr: FakeArray, value) -> FakeArray:
    arr.fill(value)
    return arr
