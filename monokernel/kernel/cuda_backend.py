"""The CUDA backends: executors on the CUDA device (kernel/devices/cuda.py, CuPy).

``cuda`` runs megakernel.cu's persistent kernel as one cooperative launch per generation (many
decode steps per launch; ``cuda-1step``: one per step);
``cuda-multi`` runs the same program as one launch per op, and ``cuda-multi-graph`` (or
``cuda-multi`` with ``graph=True``) replays a whole step from a captured CUDA graph.
``cuda-multi-graph-pdl`` is the strongest multi-kernel baseline: the graph of
``cuda-multi-graph`` whose launches use programmatic dependent launch (sm_90+; kernel/libcuda.py),
so each op's prologue overlaps the previous op's tail. The plain ``cuda-multi-graph`` stays as
it was (its kernels are built without MK_PDL), so the two are each other's A/B twin. The Engine,
the program and the buffers are the executor's; the device (kernel/devices/cuda.py) only
compiles, allocates, copies and launches, so it is the only code that needs a GPU; this file
names the backends and the options each sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import BackendUnavailableError
from .base import Backend
from .devices.cuda import HOST_GRACE_S, CupyDevice
from .executor import KernelExecutor, KernelOptions

# ================================================================================================
# Executors
# ================================================================================================
@dataclass(frozen=True)
class CudaOptions(KernelOptions):
    """The kernel options on a GPU: ``blocks`` defaults to one per SM, the watchdog to 2 s;
    ``device_id``: which CUDA device."""

    blocks: int | None = field(default=None, metadata={"min": 1})
    watchdog_ms: int = field(default=2000, metadata={"min": 1})
    device_id: int = field(default=0, metadata={"min": 0})


def _cuda_executor(model, max_seq_len, o: CudaOptions, **extra) -> KernelExecutor:
    """One block per SM by default; the host's wait allows the kernel's watchdog plus
    HOST_GRACE_S before it gives up on a launch. ``pdl`` (with ``multi``): programmatic
    dependent launch, refused below sm_90 or without the driver's cuLaunchKernelEx."""
    device = CupyDevice(o.device_id, host_timeout_s=o.watchdog_ms / 1000 + HOST_GRACE_S)
    if o.pdl:
        if int(device.cc) < 90:
            raise BackendUnavailableError(
                f"programmatic dependent launch needs sm_90+; {device.gpu_name} is "
                f"sm_{device.cc}: use cuda-multi-graph")
        device.launch_ex()  # a missing driver entry point fails here, not at the first step
    kw = o.executor_kwargs()
    kw["blocks"] = o.blocks or device.num_sms
    return KernelExecutor(model, max_seq_len, device=device, **kw, **extra)


def _cuda(backend: str, **fixed) -> Backend:
    """A CUDA backend: the megakernel (or the multi-kernel baseline) with ``fixed`` options,
    which its users may not give."""
    return Backend(backend, CudaOptions, _cuda_executor, fixed)


# backend name -> Backend (options family, fixed options, factory), read by runtime.make_executor
BACKENDS = {
    "cuda": _cuda("cuda"),
    # A/B twins: each stays until the measurement named here retires it (the GPU check's bench
    # rows, recorded in benchmarks/RESULTS.md); then it goes, or `cuda` becomes it.
    # The megakernel without its L2 weight prefetch. Retired by: `cuda` faster than it at
    # contexts 16 and 512 on every shape (predicted: 4-22% slower without it).
    "cuda-noprefetch": _cuda("cuda-noprefetch", prefetch=False, name="cuda-noprefetch"),
    # One launch per decode step (the host feeds every token). Retired by: `cuda` (many steps
    # per launch, R6) faster per token at context 16 on every shape (predicted: 7-8 us/token).
    "cuda-1step": _cuda("cuda-1step", multi_step=False, name="cuda-1step"),
    # The fenced hop (MK_SYNC=1: fence + atomicAdd, two loads per poll). Retired by: `cuda`
    # (the release/acquire hop) faster at context 16 on every shape, and the trace's hop gap
    # (calibrate) below this twin's (predicted: ~0.4 us less per hop).
    "cuda-sync1": _cuda("cuda-sync1", sync=1, name="cuda-sync1"),
    # Every O_PROJ block merges the attention splits itself at every context
    # (merge_ticket_min=0). Retired by: `cuda` (the merge by ticket from
    # isa.merge_ticket_min_splits) no slower at context 2048 on Qwen3-0.6B and Llama-3.2-1B,
    # where the ticket merges (benchmarks/NOTES.md, "Kernel v2 part 1, third session").
    "cuda-block-merge": _cuda("cuda-block-merge", merge_ticket_min=0, name="cuda-block-merge"),
    # one launch per op
    "cuda-multi": _cuda("cuda-multi", multi=True),
    # one launch per op, a whole step replayed from a captured CUDA graph
    "cuda-multi-graph": _cuda("cuda-multi-graph", multi=True, graph=True),
    # The strong multi-kernel baseline (issue 8): the graph of cuda-multi-graph whose launches
    # are programmatic dependent launches, so the next op's blocks are resident and have issued
    # their L2 weight prefetch when the previous op ends. A separate name so that the graph
    # alone and graph + PDL are an A/B pair in one bench run. Needs sm_90+ (griddepcontrol) and
    # a CUDA 12.3+ driver (PDL edges in captured graphs); refused with the reason on older GPUs.
    "cuda-multi-graph-pdl": _cuda("cuda-multi-graph-pdl", multi=True, graph=True, pdl=True),
}

# backend name -> the options of executor.kernel_build its factory passes (what decides the
# compiled kernel): the GPU check's prepare step compiles each backend's kernel ahead of time.
# test_cuda_backend checks it against the executors the factories build.
BUILD_OPTIONS: dict[str, dict] = {
    "cuda": {}, "cuda-noprefetch": {"prefetch": False},
    "cuda-1step": {}, "cuda-sync1": {"sync": 1}, "cuda-block-merge": {},
    "cuda-multi": {}, "cuda-multi-graph": {}, "cuda-multi-graph-pdl": {"pdl": True}}
