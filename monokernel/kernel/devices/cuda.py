"""The CUDA device: the Device interface (kernel/devices/__init__.py) on CuPy.

Guarantees (ARCHITECTURE sections 4 and 5):
- CuPy is imported lazily: importing this module costs nothing; building a device without CuPy
  or without a GPU raises BackendUnavailableError saying which.
- Every copy and launch goes to one non-blocking stream owned by the device, so a step can be
  captured into a graph and nothing races with CuPy's default stream.
- A cooperative grid that cannot be co-resident is refused with KernelError before launch
  (CuPy's own cooperative launch would silently shrink the grid, and a smaller grid than the
  program's would deadlock on counters nobody signals).
- The host never waits on the GPU without a deadline: it polls a CUDA event and raises
  KernelError naming the launches in flight when the deadline passes.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from pathlib import Path

import numpy as np

from ...errors import BackendUnavailableError, KernelError
from .. import libcuda
from ..isa import NUM_THREADS

CUPY_MISSING = "CuPy is not installed: pip install monokernel[cuda12] (or monokernel[cuda13])"
# Reads up to this size are staged through pinned host memory (the per-step control words,
# the logits); larger ones use a plain .get() after the bounded wait.
PINNED_READ_MAX = 1 << 20
# Extra host-side patience beyond the kernel's own watchdog before a launch counts as hung.
HOST_GRACE_S = 5.0
# time_steps: launches queued behind one hold kernel at most, and the hold's start and bound
MAX_QUEUED_LAUNCHES = 500
HOLD_NS_START = 2_000_000
HOLD_NS_MAX = 50_000_000
PROBES_PATH = Path(__file__).parent.parent / "probes.cu"
# cuFuncSetAttribute's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (CUDA driver API)
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
# The L2 probe's dynamic shared memory a block (unused): more than half of an SM's (228 KB on
# an H100 / H200, 164 KB on an A100), within a block's opt-in (227 / 163 KB), so that the
# probe's blocks run one an SM and its per-SM rates mean what they say
L2_PROBE_SHARED = 120 * 1024
# The HBM stream probe (probes.cu mk_hbm_stream): its ring of up to HBM_MAX_STAGES stages of
# HBM_STAGE_BYTES (inside L2_PROBE_SHARED, which it asks, so its blocks run one an SM too), the
# megakernel's threads a block, and its cases: (name, mode, bytes a copy, stages). Mode 0:
# 16-byte loads into registers; 1: 16-byte cp.async.cg; 2: cp.async.bulk of a K/V row at
# head_dim 64 and 128, and of a whole stage. 4 stages: three in flight while one is read (the
# mechanism's ceiling); 2: one, as attention's two tile buffers (MK_ATTN_PIPE) keep
# (benchmarks/NOTES.md, "What the K/V stream's rate is worth"). probes.cu gets HBM_MAX_STAGES
# as a -D (its mbarriers, its cp.async wait depth) and runs no case of other stages than 2 and it.
# HBM_PROBE_MIB: the buffer streamed, far past an H200's 60 MB L2.
HBM_MAX_STAGES = 4
HBM_PROBE_MIB = 1024
HBM_STAGE_BYTES = 16 * 1024
HBM_THREADS = 256
HBM_CASES = (("loads_16", 0, 16, 0), ("cp_async_16", 1, 16, 4), ("cp_async_16_x2", 1, 16, 2),
             ("bulk_rows_128", 2, 128, 4), ("bulk_rows_128_x2", 2, 128, 2),
             ("bulk_rows_256", 2, 256, 4), ("bulk_stage", 2, HBM_STAGE_BYTES, 4))
assert all(ring in (0, 2, HBM_MAX_STAGES) for _, _, _, ring in HBM_CASES)
# The cluster probe's (blocks a cluster, cooperative) cases: the cost model's input_multicast
# lever needs clusters that keep one block on every SM, co-resident (levers.py, design.py)
CLUSTER_CASES = ((2, False), (2, True), (4, False), (4, True))
CLUSTER_WAIT_NS = 20_000_000  # how long a block waits for the grid's others (bounded)


def sum_upto(n: int) -> int:
    """0 + 1 + ... + (n - 1) mod 2^32: what mk_hbm_stream's blocks sum from a buffer of 0, 1,
    2, ... (uint32)."""
    return n * (n - 1) // 2 % (1 << 32) if n > 0 else 0


# Compiled modules of this process, keyed by (device, hash of source and options). CuPy also
# caches the cubin on disk (~/.cupy/kernel_cache), so a new process skips NVRTC too.
_MODULES: dict[tuple[int, str], "CupyModule"] = {}


def import_cupy():
    """CuPy, or BackendUnavailableError with the install command."""
    try:
        import cupy
    except ImportError as e:
        raise BackendUnavailableError(f"{CUPY_MISSING} ({e})") from None
    return cupy


def _require_device(cp, device_id: int) -> None:
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, driver too old, no device: CUDARuntimeError
        raise BackendUnavailableError(f"no CUDA device ({e})") from None
    if n == 0:
        raise BackendUnavailableError("no CUDA device (cudaGetDeviceCount returned 0)")
    if not 0 <= device_id < n:
        raise BackendUnavailableError(f"no CUDA device {device_id} (this machine has {n})")


class CupyModule:
    """The compiled megakernel.cu: one RawModule and its kernels by name."""

    def __init__(self, raw, kernels: dict, key: str):
        self.raw = raw
        self.kernels = kernels  # name -> cupy.RawKernel
        self.key = key


class CupyDevice:
    """Device memory is CuPy arrays; kernels come from NVRTC through cupy.RawModule."""

    name = "cuda"

    def __init__(self, device_id: int = 0, host_timeout_s: float = 2.0 + HOST_GRACE_S):
        cp = import_cupy()
        _require_device(cp, device_id)
        self.cp = cp
        self.device_id = device_id
        self.device = cp.cuda.Device(device_id)
        self.device.use()
        props = cp.cuda.runtime.getDeviceProperties(device_id)
        raw_name = props.get("name", b"?")
        self.gpu_name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        self.num_sms = int(props["multiProcessorCount"])
        self.cooperative_launch = bool(props.get("cooperativeLaunch", 1))
        self.unified_addressing = bool(props.get("unifiedAddressing", 1))
        self.cc = self.device.compute_capability  # "90" on an H100/H200
        self.host_timeout_s = host_timeout_s
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._pinned: dict[int, np.ndarray] = {}  # nbytes -> pinned uint8 staging buffer
        self._in_flight: list[str] = []  # launches since the last completed wait
        self._coresident_ok: set[tuple[str, str, int, int]] = set()
        self._dynamic_shared_ok: set[tuple[str, str, int]] = set()  # (module, kernel, bytes)
        self._broken: str | None = None
        self._probe_module: CupyModule | None = None
        self._launch_ex: libcuda.LibcudaLaunchEx | None = None  # cuLaunchKernelEx, on first use
        self.launch_count = 0  # launches queued (a graph replay is one), for time_steps

    def __repr__(self) -> str:
        return f"CupyDevice({self.device_id}: {self.gpu_name}, sm_{self.cc}, {self.num_sms} SMs)"

    # ---- compile --------------------------------------------------------------------------
    def compile(self, source: str, names: list[str], defines: dict[str, str]) -> CupyModule:
        """NVRTC through cupy.RawModule. CuPy adds ``-arch=sm_<cc>`` of the current device
        itself (a second -arch would conflict) and ``-ftz=true``. ``#line`` in the source makes
        NVRTC's log name megakernel.cu's own lines."""
        cp = self.cp
        options = ("-std=c++17", "--generate-line-info") + tuple(
            f"-D{k}={v}" for k, v in sorted(defines.items()))
        key = hashlib.sha256("\0".join((source, " ".join(options), self.cc)).encode()).hexdigest()
        cached = _MODULES.get((self.device_id, key))
        if cached is not None:
            return cached
        raw = cp.RawModule(code=source, options=options)
        kernels = {}
        try:
            with self.device:
                for n in names:
                    kernels[n] = raw.get_function(n)  # the first one compiles and loads
        except cp.cuda.compiler.CompileException as e:
            raise KernelError(
                f"cuda: NVRTC could not compile megakernel.cu for sm_{self.cc} "
                f"(options {' '.join(options)}):\n{e.get_message()}") from None
        except Exception as e:  # a kernel name missing from the module, a load failure
            raise KernelError(f"cuda: loading kernel {n!r} from megakernel.cu failed: "
                              f"{type(e).__name__}: {e}") from None
        mod = CupyModule(raw, kernels, key)
        _MODULES[(self.device_id, key)] = mod
        return mod

    # ---- memory ---------------------------------------------------------------------------
    def alloc(self, shape, dtype):
        with self.device, self.stream:
            return self.cp.zeros(shape, dtype)

    def upload(self, arr: np.ndarray):
        arr = np.ascontiguousarray(arr)
        with self.device, self.stream:
            buf = self.cp.empty(arr.shape, arr.dtype)
        buf.set(arr, stream=self.stream)
        return buf

    def alloc_mapped(self, shape, dtype) -> np.ndarray:
        """Pinned host memory the kernel reads and writes while the host polls it (tokens as
        they are made, the stop request). With unified addressing (every 64-bit CUDA platform
        since sm_20) cudaHostAlloc'd memory is mapped and its device pointer is the host
        pointer, so the numpy array's own address goes into Params."""
        if not self.unified_addressing:
            raise KernelError(f"cuda: {self.gpu_name} lacks unified addressing, which mapped "
                              "host memory (tokens streamed from a running launch) needs")
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        arr = self._pinned_empty(n).view(dtype).reshape(shape)
        arr[...] = 0
        return arr

    def ptr(self, buf) -> int:
        if isinstance(buf, np.ndarray):  # mapped host memory (alloc_mapped)
            return int(buf.ctypes.data)
        return int(buf.data.ptr)

    def write(self, buf, arr: np.ndarray) -> None:
        self._check_usable()
        host = np.ascontiguousarray(np.asarray(arr, dtype=buf.dtype).reshape(buf.shape))
        buf.set(host, stream=self.stream)  # pageable source: staged before set() returns

    def read(self, buf) -> np.ndarray:
        """Copy a buffer back after a bounded wait for everything queued before it."""
        what = f"reading a {buf.dtype} buffer of shape {tuple(buf.shape)}"
        if buf.nbytes > PINNED_READ_MAX:
            self.wait(what)  # a copy to pageable memory would block the host unbounded
            return buf.get(stream=self.stream)
        staging = self._pinned.get(buf.nbytes)
        if staging is None:
            staging = self._pinned[buf.nbytes] = self._pinned_empty(buf.nbytes)
        self._check_usable()
        buf.data.copy_to_host_async(staging.ctypes.data, buf.nbytes, stream=self.stream)
        self.wait(what)  # one bounded wait covers the launches before the copy and the copy
        return staging.view(buf.dtype).reshape(buf.shape).copy()

    def _pinned_empty(self, nbytes: int) -> np.ndarray:
        import cupyx

        return cupyx.empty_pinned((nbytes,), np.uint8)

    def fill(self, buf, value) -> None:
        self._check_usable()
        with self.device, self.stream:
            buf.fill(value)

    # ---- launch ---------------------------------------------------------------------------
    def launch(self, module: CupyModule, name: str, grid: int, params: np.ndarray,
               cooperative: bool, pdl: bool = False, shared_bytes: int = 0) -> None:
        """One launch of ``name`` with ``grid`` blocks of NUM_THREADS threads; ``params`` is the
        struct Params argument (a structured numpy array of one element, params_dtype()).
        ``pdl``: launch through cuLaunchKernelEx with programmatic stream serialization allowed
        (the kernel must execute griddepcontrol.wait before reading its predecessor's output:
        megakernel.cu's thin kernels built with MK_PDL=1 do). ``shared_bytes``: dynamic shared
        memory per block (megakernel.cu MK_DYN_SMEM), allowed past the default 48 KB with
        static first (cuFuncSetAttribute, once per kernel)."""
        self._check_usable()
        if pdl and cooperative:
            raise KernelError(f"cuda: {name}: a cooperative launch cannot also be a "
                              "programmatic dependent launch here")
        kernel = module.kernels[name]
        func = kernel.kernel.ptr
        arg = np.ascontiguousarray(params).reshape(-1)
        if arg.size != 1:
            raise KernelError(f"cuda: {name} takes one Params struct, got {arg.size}")
        # cuLaunchKernel's kernelParams: an array of pointers, one per kernel argument; the
        # driver copies the struct's bytes before it returns.
        kparams = np.array([arg.ctypes.data], dtype=np.uintp)
        drv = self.cp.cuda.driver
        label = f"{name} (grid {grid} x {NUM_THREADS} threads{', PDL' if pdl else ''})"
        if shared_bytes:
            self._allow_dynamic_shared(module, name, shared_bytes)
        if cooperative:
            self._check_coresident(module, name, grid, shared_bytes)
        try:
            with self.device:
                if cooperative:
                    drv.launchCooperativeKernel(func, grid, 1, 1, NUM_THREADS, 1, 1,
                                                shared_bytes, self.stream.ptr,
                                                kparams.ctypes.data)
                elif pdl:
                    ex = self.launch_ex()
                    cfg = libcuda.programmatic_launch_config(grid, NUM_THREADS, self.stream.ptr,
                                                             shared_bytes)
                    rc = ex.launch(ctypes.addressof(cfg), func, kparams.ctypes.data)
                    if rc != libcuda.CUDA_SUCCESS:
                        raise KernelError(f"cuLaunchKernelEx returned {ex.error_name(rc)}")
                else:
                    drv.launchKernel(func, grid, 1, 1, NUM_THREADS, 1, 1, shared_bytes,
                                     self.stream.ptr, kparams.ctypes.data, 0)
        except Exception as e:
            raise KernelError(f"cuda: launch of {label} failed: {type(e).__name__}: {e}") \
                from None
        self._in_flight.append(label)
        self.launch_count += 1

    def launch_ex(self) -> "libcuda.LibcudaLaunchEx":
        """The driver's cuLaunchKernelEx (libcuda.load_launch_ex), loaded on first use."""
        if self._launch_ex is None:
            self._launch_ex = libcuda.load_launch_ex()
        return self._launch_ex

    def _allow_dynamic_shared(self, module: CupyModule, name: str, nbytes: int) -> None:
        """Let ``name`` take ``nbytes`` of dynamic shared memory a block (beyond 48 KB with its
        static shared memory the driver asks for this opt-in), once per kernel and size."""
        key = (module.key, name, nbytes)
        if key in self._dynamic_shared_ok:
            return
        try:
            with self.device:
                self.cp.cuda.driver.funcSetAttribute(
                    module.kernels[name].kernel.ptr,
                    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
        except Exception as e:
            raise KernelError(f"cuda: {name} cannot take {nbytes} B of dynamic shared memory a "
                              f"block on {self.gpu_name} (beside "
                              f"{module.kernels[name].shared_size_bytes} B static): "
                              f"{type(e).__name__}: {e}") from None
        self._dynamic_shared_ok.add(key)

    def _check_coresident(self, module: CupyModule, name: str, grid: int,
                          shared_bytes: int = 0) -> None:
        """A persistent kernel whose blocks wait on each other needs every block resident at
        once: refuse a grid larger than the occupancy calculator allows."""
        key = (module.key, name, grid, shared_bytes)
        if key in self._coresident_ok:
            return
        if not self.cooperative_launch:
            raise KernelError(f"cuda: {self.gpu_name} does not support cooperative launches, "
                              f"which the persistent {name} needs")
        kernel = module.kernels[name]
        per_sm = self.cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            kernel.kernel.ptr, NUM_THREADS, shared_bytes)
        limit = per_sm * self.num_sms
        if grid > limit:
            raise KernelError(
                f"cuda: grid of {grid} blocks cannot be co-resident: {name} fits {per_sm} "
                f"block(s) of {NUM_THREADS} threads per SM x {self.num_sms} SMs = {limit} on "
                f"{self.gpu_name} ({kernel.num_regs} registers/thread, "
                f"{kernel.shared_size_bytes} B static + {shared_bytes} B dynamic shared "
                f"memory per block); "
                f"use blocks <= {limit}")
        self._coresident_ok.add(key)

    # ---- waiting --------------------------------------------------------------------------
    def wait(self, what: str) -> None:
        """Wait for all work queued on the stream, for at most ``host_timeout_s``. On expiry
        raise KernelError naming the launches in flight and refuse all further work (the GPU
        may still be running them)."""
        self._check_usable()
        ev = self.cp.cuda.Event(block=False, disable_timing=True)
        ev.record(self.stream)
        start = time.perf_counter()
        deadline = start + self.host_timeout_s
        try:
            while not ev.done:
                now = time.perf_counter()
                if now > deadline:
                    self._broken = "host wait expired"
                    raise KernelError(
                        f"cuda: {self._in_flight_text()} did not finish within "
                        f"{self.host_timeout_s:.1f} s ({what}); the kernel's watchdog did not "
                        "stop it, so the GPU may still be busy; this executor refuses further "
                        "work")
                if now - start > 1e-3:  # spin for the first millisecond, then back off
                    time.sleep(50e-6)
        except KernelError:
            raise
        except Exception as e:  # an asynchronous CUDA error surfaces on the event query
            self._broken = f"{type(e).__name__}"
            raise KernelError(f"cuda: {self._in_flight_text()} failed ({what}): "
                              f"{type(e).__name__}: {e}") from None
        self._in_flight.clear()

    def _in_flight_text(self) -> str:
        f = self._in_flight
        if not f:
            return "the queued copies"
        if len(f) == 1:
            return f"launch of {f[0]}"
        return f"{len(f)} launches ({f[0]} ... {f[-1]})"

    def _check_usable(self) -> None:
        if self._broken:
            raise KernelError(f"cuda: the device is unusable after an earlier error "
                              f"({self._broken}); create a new LLM in a new process")

    def synchronize(self) -> None:
        self.wait("synchronize")

    def start(self, fn) -> "_EventRun":
        """Queue the launches ``fn`` makes and return without waiting: ``done()`` polls an
        event recorded after them, ``finish()`` is the bounded wait."""
        fn()
        ev = self.cp.cuda.Event(block=False, disable_timing=True)
        ev.record(self.stream)
        return _EventRun(self, ev)

    # ---- graphs and timing ----------------------------------------------------------------
    def capture(self, fn):
        """Record the launches ``fn`` makes on the stream into a CUDA graph (nothing runs)."""
        self.wait("before graph capture")
        self.stream.begin_capture()
        try:
            fn()
        finally:
            graph = self.stream.end_capture()
            self._in_flight.clear()  # captured, not launched
        return graph

    def replay(self, graph) -> None:
        self._check_usable()
        try:
            graph.launch(stream=self.stream)
        except Exception as e:
            raise KernelError(f"cuda: launching the captured graph failed: "
                              f"{type(e).__name__}: {e}") from None
        self._in_flight.append("captured graph of one step")
        self.launch_count += 1

    def _probes(self) -> CupyModule:
        """probes.cu (hold, timer, L2, HBM and cluster kernels), compiled on first use."""
        if self._probe_module is None:
            src = '#line 1 "probes.cu"\n' + PROBES_PATH.read_text()
            self._probe_module = self.compile(
                src, ["mk_hold", "mk_timer_tick", "mk_l2_read", "mk_hbm_stream",
                      "mk_cluster_place"], {"HBM_MAX_STAGES": str(HBM_MAX_STAGES)})
        return self._probe_module

    @staticmethod
    def _params(typed) -> tuple[list[np.ndarray], np.ndarray]:
        """A raw launch's kernelParams from its arguments, each (value, NumPy type; a pointer
        is np.uint64): (the one-element arrays, which must outlive the launch call, the array
        of their addresses)."""
        args = [np.array([v], t) for v, t in typed]
        return args, np.array([a.ctypes.data for a in args], dtype=np.uintp)

    def _launch_raw(self, kernel, typed, blocks: int = 1, threads: int = 32,
                    shared_bytes: int = 0) -> None:
        """``kernel`` with the arguments ``typed`` ((value, NumPy type) each, _params)."""
        _args, ptrs = self._params(typed)
        with self.device:
            self.cp.cuda.driver.launchKernel(kernel.kernel.ptr, blocks, 1, 1, threads, 1, 1,
                                             shared_bytes, self.stream.ptr, ptrs.ctypes.data, 0)
        self.launch_count += 1

    def l2_read(self, kib_per_block: int = 192, reps: int = 200,
                threads: int = 1024) -> dict[str, dict]:
        """The L2 read rate (probes.cu mk_l2_read) of one block alone, of a block on every SM
        each reading its own ``kib_per_block`` KiB, and of every SM's block reading the same
        KiB, each ``reps`` times (after one launch that brings the lines into L2): per case the
        blocks, the distinct SMs they ran on (%smid: a rate per SM needs one block an SM),
        bytes, GPU seconds (the best of three) and GB/s in all and per SM. Every SM's own lines
        total num_sms x kib_per_block KiB (25 MiB on an H200): inside its L2. Each block asks
        L2_PROBE_SHARED bytes of dynamic shared memory it does not use, more than half an SM's,
        so no two blocks share an SM (distinct_sms then equals blocks on an idle GPU)."""
        cp = self.cp
        words = kib_per_block * 1024 // 16
        with self.device, self.stream:
            buf = cp.zeros(self.num_sms * words * 16, cp.uint8)
            sink = cp.zeros(self.num_sms * threads * 4, cp.uint8)
            smid = cp.zeros(self.num_sms * 4, cp.uint8)
        module = self._probes()
        kernel = module.kernels["mk_l2_read"]
        self._allow_dynamic_shared(module, "mk_l2_read", L2_PROBE_SHARED)
        out = {}
        for name, blocks, stride in (("one_sm", 1, words), ("every_sm_own_lines", self.num_sms,
                                                             words),
                                     ("every_sm_same_lines", self.num_sms, 0)):
            def launch(blocks=blocks, stride=stride):
                self._launch_raw(kernel, (
                    (buf.data.ptr, np.uint64), (words, np.int64), (stride, np.int64),
                    (reps, np.int32), (sink.data.ptr, np.uint64), (smid.data.ptr, np.uint64)),
                    blocks, threads, L2_PROBE_SHARED)
                self._in_flight.append(f"mk_l2_read({name})")

            launch()  # the lines into L2
            seconds = min(self.time(launch, repeat=3))
            nbytes = blocks * words * 16 * reps
            sms = self.read(smid).view(np.uint32)[:blocks]
            out[name] = {"blocks": blocks, "distinct_sms": len(set(sms.tolist())),
                         "shared_bytes": L2_PROBE_SHARED,
                         "bytes": nbytes, "seconds": seconds,
                         "GB_s": nbytes / seconds / 1e9 if seconds > 0 else None,
                         "per_sm_GB_s": nbytes / seconds / 1e9 / blocks if seconds > 0
                         else None}
        self.wait("l2 read")
        return out

    def hbm_stream(self, mib: int | None = None) -> dict[str, dict]:
        """The rate of a stream from HBM into every SM (probes.cu mk_hbm_stream), one way a
        case (HBM_CASES): a block on every SM streams its share of a ``mib`` MiB buffer
        (HBM_PROBE_MIB unless given: far past L2, each launch reads it once), by 16-byte
        loads, by 16-byte cp.async, and by cp.async.bulk copies of a K/V row or of a whole
        stage into a ring in shared memory of 4 or 2 stages. Per case: blocks, distinct SMs,
        bytes, GPU seconds (the best of three after one untimed launch), GB/s in all and per
        SM, and ``read_all``: whether the sum (mod 2^32) of what the blocks read is that of the
        words streamed (the buffer holds 0, 1, 2, ... as uint32), so a case whose copies did
        not land is not mistaken for a rate."""
        cp = self.cp
        mib = HBM_PROBE_MIB if mib is None else mib
        blocks = self.num_sms
        stages = (mib << 20) // blocks // HBM_STAGE_BYTES
        if stages < HBM_MAX_STAGES:
            raise ValueError(f"hbm_stream: {mib} MiB gives each of {blocks} blocks fewer than "
                             f"{HBM_MAX_STAGES} stages of {HBM_STAGE_BYTES} bytes")
        block_bytes = stages * HBM_STAGE_BYTES
        words = blocks * block_bytes // 4
        assert HBM_MAX_STAGES * HBM_STAGE_BYTES <= L2_PROBE_SHARED  # the ring in what it asks
        with self.device, self.stream:
            buf = cp.arange(words, dtype=cp.uint32)
            sink = cp.zeros(blocks * HBM_THREADS * 4, cp.uint8)
            smid = cp.zeros(blocks * 4, cp.uint8)
        module = self._probes()
        kernel = module.kernels["mk_hbm_stream"]
        self._allow_dynamic_shared(module, "mk_hbm_stream", L2_PROBE_SHARED)
        out = {}
        for name, mode, chunk, ring in HBM_CASES:
            def launch(mode=mode, chunk=chunk, ring=ring, name=name):
                self._launch_raw(kernel, (
                    (buf.data.ptr, np.uint64), (block_bytes, np.int64), (mode, np.int32),
                    (chunk, np.int32), (HBM_STAGE_BYTES, np.int32), (ring, np.int32),
                    (sink.data.ptr, np.uint64), (smid.data.ptr, np.uint64)),
                    blocks, HBM_THREADS, L2_PROBE_SHARED)
                self._in_flight.append(f"mk_hbm_stream({name})")

            with self.device, self.stream:
                sink.fill(0)
            launch()
            got = int(self.read(sink).view(np.uint32).sum(dtype=np.uint64)) % (1 << 32)
            seconds = min(self.time(launch, repeat=3))
            nbytes = blocks * block_bytes
            sms = self.read(smid).view(np.uint32)[:blocks]
            out[name] = {"mode": mode, "bytes_a_copy": chunk, "stages": ring,
                         "stage_bytes": HBM_STAGE_BYTES, "blocks": blocks,
                         "threads": HBM_THREADS, "distinct_sms": len(set(sms.tolist())),
                         "bytes": nbytes, "seconds": seconds,
                         "GB_s": nbytes / seconds / 1e9 if seconds > 0 else None,
                         "per_sm_GB_s": nbytes / seconds / 1e9 / blocks if seconds > 0
                         else None,
                         "read_all": got == sum_upto(words)}
        self.wait("hbm stream")
        return out

    def cluster_placement(self) -> dict[str, dict]:
        """Whether blocks in thread-block clusters fill every SM at once, as the megakernel's
        grid must (probes.cu mk_cluster_place): per case of CLUSTER_CASES, num_sms rounded
        down to whole clusters of blocks, each asking L2_PROBE_SHARED bytes (one an SM),
        launched by cuLaunchKernelEx with the cluster dimension (and cooperative, in the
        cases that say so). Per case: the launch's result ("ok" or the driver's error),
        cuOccupancyMaxActiveClusters for it, the distinct SMs and cluster ids the blocks saw,
        whether each block's rank was below the cluster size, and ``all_resident``: every
        block counted the whole grid in before CLUSTER_WAIT_NS ran out. A refused launch is a
        result here, not an error: it is what the probe asks."""
        cp = self.cp
        module = self._probes()
        kernel = module.kernels["mk_cluster_place"]
        func = kernel.kernel.ptr
        self._allow_dynamic_shared(module, "mk_cluster_place", L2_PROBE_SHARED)
        ex = self.launch_ex()
        out = {}
        for cluster, coop in CLUSTER_CASES:
            name = f"cluster_{cluster}{'_cooperative' if coop else ''}"
            blocks = self.num_sms // cluster * cluster
            if blocks == 0:
                out[name] = {"cluster": cluster, "cooperative": coop, "blocks": 0,
                             "launch": f"not launched: {self.num_sms} SMs hold no cluster"}
                continue
            with self.device, self.stream:
                words = cp.zeros((4 * blocks + 1) * 4, cp.uint8)
            cfg = libcuda.launch_config(blocks, 32, self.stream.ptr, L2_PROBE_SHARED,
                                        cluster=cluster, cooperative=coop)
            with self.device:
                rc_occ, most = ex.max_active_clusters(func, ctypes.addressof(cfg))
                _args, ptrs = self._params([(words.data.ptr, np.uint64),
                                            (CLUSTER_WAIT_NS, np.int64)])
                rc = ex.launch(ctypes.addressof(cfg), func, ptrs.ctypes.data)
            row = {"cluster": cluster, "cooperative": coop, "blocks": blocks,
                   "max_active_clusters": most if rc_occ == libcuda.CUDA_SUCCESS
                   else ex.error_name(rc_occ),
                   "launch": "ok" if rc == libcuda.CUDA_SUCCESS else ex.error_name(rc)}
            if rc == libcuda.CUDA_SUCCESS:
                self._in_flight.append(f"mk_cluster_place({name})")
                self.launch_count += 1
                got = self.read(words).view(np.uint32)[:4 * blocks].reshape(blocks, 4)
                row.update({"distinct_sms": len(set(got[:, 0].tolist())),
                            "distinct_clusters": len(set(got[:, 1].tolist())),
                            "ranks_below_cluster": bool((got[:, 2] < cluster).all()),
                            "all_resident": bool((got[:, 3] == blocks).all())})
            out[name] = row
        self.wait("cluster placement")
        return out

    def hold(self, ns: int) -> None:
        """Queue a kernel that keeps the stream busy for ``ns`` nanoseconds."""
        self._launch_raw(self._probes().kernels["mk_hold"], [(ns, np.int64)])
        self._in_flight.append(f"mk_hold({ns} ns)")

    def timer_tick_ns(self, reads: int = 4096) -> tuple[int, int]:
        """(smallest step of %globaltimer seen in ``reads`` reads, distinct values seen)."""
        with self.device, self.stream:
            out = self.cp.zeros(2, self.cp.uint64)
        self._launch_raw(self._probes().kernels["mk_timer_tick"],
                         [(out.data.ptr, np.uint64), (reads, np.int32)])
        self._in_flight.append("mk_timer_tick")
        tick, distinct = (int(v) for v in self.read(out))
        return tick, distinct

    def time_steps(self, fn, steps: int, batch: int = 10) -> tuple[list[float], dict]:
        """GPU seconds per call of ``fn`` (which only queues work), in batches of up to
        ``batch`` back-to-back calls: a hold kernel keeps the stream busy while the host queues
        the batch, so the events around it see GPU work only. Returns (seconds per call, one
        value per batch; info).

        A batch queues at most MAX_QUEUED_LAUNCHES launches: CUDA's queue of pending launches
        is finite (about a thousand), and past it the host blocks inside the timed window. The
        first batch finds out how many launches a call makes (one for the megakernel, one per
        op for cuda-multi) and stops before the next call would pass the limit; later batches
        are sized from it (down to one call). A batch whose queueing outlasted 80 % of the hold
        is retried with a longer hold, at most HOLD_NS_MAX (far inside the host's bounded
        wait); ``info["host_in_window"]`` counts batches that stayed too slow to queue, and
        ``info["calls"]`` the calls of ``fn`` made, retries included (each call runs a
        step)."""
        cp = self.cp
        hold_ns, out, late, calls_made = HOLD_NS_START, [], 0, 0
        per_call: int | None = None  # launches one call queues, once seen
        most_queued = 0
        done = 0
        while done < steps:
            for _attempt in range(3):
                # sized again on a retry: the first batch's retry knows per_call by then
                want = min(batch, steps - done)
                if per_call:
                    want = max(1, min(want, MAX_QUEUED_LAUNCHES // per_call))
                start, end = cp.cuda.Event(), cp.cuda.Event()
                t0 = time.perf_counter()
                self.hold(hold_ns)
                start.record(self.stream)
                l0, n = self.launch_count, 0
                while n < want:
                    fn()
                    n += 1
                    queued = self.launch_count - l0
                    if per_call is None and queued + -(-queued // n) > MAX_QUEUED_LAUNCHES:
                        break  # the next call would pass the limit
                end.record(self.stream)
                queued_ns = (time.perf_counter() - t0) * 1e9
                calls_made += n
                most_queued = max(most_queued, self.launch_count - l0)
                per_call = per_call or max(1, -(-(self.launch_count - l0) // n))
                self.wait("timing")
                if queued_ns < 0.8 * hold_ns:
                    break
                if hold_ns >= HOLD_NS_MAX:
                    late += 1
                    break
                hold_ns = min(HOLD_NS_MAX, int(2 * queued_ns))
            else:
                late += 1
            out.append(cp.cuda.get_elapsed_time(start, end) / 1e3 / n)
            done += n
        return out, {"batch": batch, "hold_ns": hold_ns, "host_in_window": late,
                     "launches_per_call": per_call, "most_queued": most_queued,
                     "calls": calls_made,
                     "timer": "CUDA events around a batch queued behind a hold kernel"}

    def time(self, fn, repeat: int = 1) -> list[float]:
        """Seconds of GPU time between two events around each of ``repeat`` calls of ``fn``."""
        cp = self.cp
        out = []
        for _ in range(repeat):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(self.stream)
            fn()
            end.record(self.stream)
            self.wait("timing")
            out.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        return out

    def resources(self, module: CupyModule) -> dict[str, dict[str, int]]:
        """Per kernel: registers per thread, static shared, local (spill) and constant bytes,
        max threads per block, and resident blocks per SM at NUM_THREADS threads."""
        drv = self.cp.cuda.driver
        out = {}
        for name, k in module.kernels.items():
            out[name] = {
                "registers": int(k.num_regs),
                "shared_bytes": int(k.shared_size_bytes),
                "local_bytes": int(k.local_size_bytes),
                "const_bytes": int(k.const_size_bytes),
                "max_threads_per_block": int(k.max_threads_per_block),
                "blocks_per_sm": int(drv.occupancyMaxActiveBlocksPerMultiprocessor(
                    k.kernel.ptr, NUM_THREADS, 0)),
            }
        return out


class _EventRun:
    """Launches in flight on a CupyDevice's stream (CupyDevice.start)."""

    def __init__(self, device: CupyDevice, event):
        self.device, self.event = device, event

    def done(self) -> bool:
        try:
            return bool(self.event.done)
        except Exception:  # an asynchronous CUDA error: finish() reports it
            return True

    def finish(self) -> None:
        self.device.wait("a multi-step launch")


def kernel_resources(executor) -> dict[str, dict[str, int]]:
    """Registers, shared, local (spill) bytes etc. of each kernel the executor compiled
    ({} on the emulator)."""
    return executor.device.resources(executor.module)
