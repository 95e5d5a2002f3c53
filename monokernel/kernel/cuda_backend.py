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

from ..errors import BackendUnavailableError
from .devices.cuda import HOST_GRACE_S, CupyDevice
from .executor import KernelExecutor, user_options


# ================================================================================================
# Executors
# ================================================================================================
def _cuda_executor(model, max_seq_len, *, multi: bool = False, graph: bool = False,
                   pdl: bool = False, blocks: int | None = None, watchdog_ms: int = 2000,
                   device_id: int = 0, **options) -> KernelExecutor:
    """One block per SM by default; the host's wait allows the kernel's watchdog plus
    HOST_GRACE_S before it gives up on a launch. ``pdl`` (with ``multi``): programmatic
    dependent launch, refused below sm_90 or without the driver's cuLaunchKernelEx."""
    device = CupyDevice(device_id, host_timeout_s=watchdog_ms / 1000 + HOST_GRACE_S)
    if pdl:
        if int(device.cc) < 90:
            raise BackendUnavailableError(
                f"programmatic dependent launch needs sm_90+; {device.gpu_name} is "
                f"sm_{device.cc}: use cuda-multi-graph")
        device.launch_ex()  # a missing driver entry point fails here, not at the first step
    return KernelExecutor(model, max_seq_len, device=device, multi=multi, graph=graph, pdl=pdl,
                          blocks=blocks or device.num_sms, watchdog_ms=watchdog_ms, **options)


def _cuda_multi(model, max_seq_len, **options) -> KernelExecutor:
    return _cuda_executor(model, max_seq_len, multi=True, **options)


def _cuda_multi_graph(model, max_seq_len, **options) -> KernelExecutor:
    return _cuda_executor(model, max_seq_len, multi=True, graph=True, **options)


def _cuda_multi_graph_pdl(model, max_seq_len, **options) -> KernelExecutor:
    """The strong multi-kernel baseline (issue 8): one launch per op, replayed as a CUDA graph,
    every launch a programmatic dependent launch, so that the next op's blocks are resident
    and have issued their L2 weight prefetch when the previous op ends. A separate name rather
    than a change to ``cuda-multi-graph``, so that the graph alone and graph + PDL are an A/B
    pair in one bench run. Needs sm_90+ (griddepcontrol) and a CUDA 12.3+ driver (PDL edges
    in captured graphs); refused with the reason on older GPUs."""
    return _cuda_executor(model, max_seq_len, multi=True, graph=True, pdl=True, **options)


def _cuda_noprefetch(model, max_seq_len, **options) -> KernelExecutor:
    """The megakernel without its L2 weight prefetch: the A/B twin for benchmarks/NOTES.md."""
    return _cuda_executor(model, max_seq_len, prefetch=False, name="cuda-noprefetch", **options)


def _cuda_1step(model, max_seq_len, **options) -> KernelExecutor:
    """The megakernel with one launch per decode step (the host feeds every token): the A/B
    twin of many steps per launch (R6) until a GPU has measured both."""
    return _cuda_executor(model, max_seq_len, multi_step=False, name="cuda-1step", **options)


def _cuda_sync1(model, max_seq_len, **options) -> KernelExecutor:
    """The megakernel with the v1 hop (MK_SYNC=1: fence + atomicAdd, two loads per poll): the
    A/B twin of the release/acquire hop until a GPU has measured both (benchmarks/NOTES.md)."""
    return _cuda_executor(model, max_seq_len, sync=1, name="cuda-sync1", **options)


def _cuda_block_merge(model, max_seq_len, **options) -> KernelExecutor:
    """The megakernel with every O_PROJ block merging the attention splits itself at every
    context (merge_ticket_min=0): the A/B twin of the merge by ticket until a GPU has measured
    both (benchmarks/NOTES.md)."""
    return _cuda_executor(model, max_seq_len, merge_ticket_min=0, name="cuda-block-merge",
                          **options)


# backend name -> factory(model, max_seq_len, **options), read by runtime.make_executor
BACKENDS = {"cuda": _cuda_executor, "cuda-noprefetch": _cuda_noprefetch,
            "cuda-1step": _cuda_1step, "cuda-sync1": _cuda_sync1,
            "cuda-block-merge": _cuda_block_merge,
            "cuda-multi": _cuda_multi, "cuda-multi-graph": _cuda_multi_graph,
            "cuda-multi-graph-pdl": _cuda_multi_graph_pdl}

# the options a user may give each (runtime.make_executor names any other)
for _factory, _fixed in ((_cuda_executor, ()), (_cuda_noprefetch, ("prefetch", "name")),
                         (_cuda_1step, ("multi_step", "name")),
                         (_cuda_sync1, ("sync", "name")),
                         (_cuda_block_merge, ("merge_ticket_min", "name")),
                         (_cuda_multi, ("multi",)), (_cuda_multi_graph, ("multi", "graph")),
                         (_cuda_multi_graph_pdl, ("multi", "graph", "pdl"))):
    _factory.OPTIONS = user_options(*_fixed, extra=("device_id",))

# backend name -> the options of executor.kernel_build its factory passes (what decides the
# compiled kernel): the GPU check's prepare step compiles each backend's kernel ahead of time.
# test_cuda_backend checks it against the executors the factories build.
BUILD_OPTIONS: dict[str, dict] = {
    "cuda": {}, "cuda-noprefetch": {"prefetch": False},
    "cuda-1step": {}, "cuda-sync1": {"sync": 1}, "cuda-block-merge": {},
    "cuda-multi": {}, "cuda-multi-graph": {}, "cuda-multi-graph-pdl": {"pdl": True}}
