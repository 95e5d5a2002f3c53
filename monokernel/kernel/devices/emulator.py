"""The emulator device: the Device interface (kernel/devices/__init__.py) on the CPU.
'Device memory' is host memory; kernels run in the CPU emulator (kernel/emulator/: one OS thread
per block, fibers for threads), built from the same megakernel.cu by g++."""

from __future__ import annotations

import threading

import numpy as np

from ..base import wall_times
from ..isa import NUM_THREADS


class EmulatorDevice:
    """'Device memory' is host memory; kernels run in the CPU emulator."""

    name = "emulator"

    def __init__(self, sanitize: str | None = None, timeout_s: float = 600.0):
        self.sanitize = sanitize
        self.timeout_s = timeout_s

    def compile(self, source: str, names: list[str], defines: dict[str, str]):
        from ..emulator import build

        flags = [f"-D{k}={v}" for k, v in defines.items()]
        return build(source, names, filename="megakernel.cu", sanitize=self.sanitize,
                     extra_flags=flags)

    def alloc(self, shape, dtype) -> np.ndarray:
        return np.zeros(shape, dtype)

    def alloc_mapped(self, shape, dtype) -> np.ndarray:
        """Memory both sides read and write while a launch runs (host-mapped on a GPU)."""
        return np.zeros(shape, dtype)

    def upload(self, arr: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(arr).copy()

    def ptr(self, buf: np.ndarray) -> int:
        return buf.ctypes.data

    def write(self, buf: np.ndarray, arr: np.ndarray) -> None:
        buf[...] = arr

    def read(self, buf: np.ndarray) -> np.ndarray:
        return buf.copy()

    def fill(self, buf: np.ndarray, value) -> None:
        buf[...] = value

    def launch(self, module, name: str, grid: int, params: np.ndarray, cooperative: bool,
               pdl: bool = False, shared_bytes: int = 0) -> None:
        """``pdl`` changes nothing here: launches run one after another, and the emulator's
        build of MK_PDL=1 has no griddepcontrol (it is sm_90 device code only). Nor does
        ``shared_bytes``: the shim's emu::dynamic_shared sizes each block's dynamic shared
        memory at the kernel's first call (the kernel asks for MK_DYN_SMEM)."""
        module.launch(name, grid, NUM_THREADS, params.ctypes.data, self.timeout_s)

    def synchronize(self) -> None:
        pass

    def start(self, fn) -> "ThreadRun":
        """Run ``fn`` (launches) without waiting for it: on the emulator a launch runs to its
        end in the calling thread, so it gets a thread of its own (ctypes releases the GIL)."""
        return ThreadRun(fn)

    def capture(self, fn):
        """Record the launches ``fn`` makes so that ``replay`` repeats them (a CUDA graph on
        the GPU); the emulator simply calls ``fn`` again."""
        return fn

    def replay(self, graph) -> None:
        graph()

    def time(self, fn, repeat: int = 1) -> list[float]:
        """Seconds taken by each of ``repeat`` calls of ``fn`` (CUDA events on the GPU)."""
        return wall_times(fn, repeat)

    def time_steps(self, fn, steps: int, batch: int = 10) -> tuple[list[float], dict]:
        """Seconds per call of ``fn``: on the emulator the host is the device, so wall time."""
        return wall_times(fn, steps), {"timer": "time.perf_counter per call (host = device)",
                                       "calls": steps}

    def resources(self, module) -> dict:
        """Registers, shared and local (spill) bytes per kernel; the emulator has none."""
        return {}


class ThreadRun:
    """A launch running in a thread: ``done()`` without waiting, ``finish()`` joins it and
    re-raises what it raised."""

    def __init__(self, fn):
        self._error: BaseException | None = None

        def run():
            try:
                fn()
            except BaseException as e:  # handed to finish()
                self._error = e
        self._thread = threading.Thread(target=run, name="monokernel-launch", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def finish(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error
