"""Decode latency of every backend on the same weights, against the memory-bandwidth floor.

Method (ARCHITECTURE section 8):

- Every backend runs in this one process on the same checkpoint (a real model folder, or a
  seeded synthetic one of a named shape), with the same prompt tokens.
- For each (shape, backend, context): reset, prefill positions 0..context-1 (kernel executors
  run one decode step per position, as they do in generation; numpy and Hugging Face run a
  batched prefill), then time ``warmup + steps`` single-token decode steps at positions context,
  context+1, ... and keep the last ``steps``. A kernel step is ``executor.run_launches()``:
  the whole step including embedding and the on-device sample, which advances the position in
  device memory, so nothing is copied between steps. Each step is timed by ``device.time``:
  CUDA events around the launch(es) on the GPU, ``time.perf_counter`` on the CPU. After timing,
  the position in device memory is checked, so a step that did not run cannot pass as fast.
- Reported per row: median us/token, the p10-p90 spread, tokens/s, GB/s = weight bytes per token
  (ModelConfig.weight_bytes_per_token()) / median time, and x-floor.
- The floor is measured in the same run: weight bytes per token / device-to-device copy bandwidth
  (bytes read + written by a large copy: 1 GiB with CuPy on the GPU; 256 MiB with NumPy for the
  CPU backends, labelled as host memory). GPU and CPU backends each get their own floor.
- hf: transformers on torch (CUDA if present, else CPU), eager, bf16, DynamicCache, one decode
  forward + argmax per step. hf-compile: StaticCache + torch.compile(mode="reduce-overhead");
  a failure is recorded in the results and the run continues.

The results (raw per-step times included), the date, device, commit and command, and the
kernels' register/shared/local-memory report are written as JSON, with a PNG bar chart beside it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import BackendUnavailableError, KernelError
from ..kernel.isa import State
from ..model.loader import LoadedModel
from ..kernel.base import wall_times
from ..progress import progress_bar, ticking

def _kernel_backends() -> tuple[str, ...]:
    """The kernel backends' names, from their registries (cuda_backend and executor)."""
    from ..kernel.cuda_backend import BACKENDS as CUDA
    from ..kernel.executor import BACKENDS as EMULATOR

    return tuple(CUDA) + tuple(EMULATOR)


KERNEL_BACKENDS = _kernel_backends()
BACKENDS = KERNEL_BACKENDS + ("numpy", "hf", "hf-compile")
GPU_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 256 << 20


@dataclass
class Result:
    backend: str
    shape: str
    context: int
    device: str  # "gpu" or "cpu": which floor applies
    times_us: list[float] = field(default_factory=list)  # device time per step (see module doc)
    e2e_us_per_token: float | None = None  # what a user of LLM.generate sees, host included
    timing: dict = field(default_factory=dict)  # how times_us was taken
    blocks: int | None = None
    error: str | None = None

    @property
    def median_us(self) -> float:
        return float(np.median(self.times_us)) if self.times_us else float("nan")

    def percentile_us(self, q: float) -> float:
        return float(np.percentile(self.times_us, q)) if self.times_us else float("nan")


# ================================================================================================
# The floor: measured copy bandwidth
# ================================================================================================
def gpu_copy_bandwidth(nbytes: int = GPU_COPY_BYTES, repeat: int = 10) -> float:
    """Bytes/s moved (read + written) by a device-to-device copy timed with CUDA events, median
    of ``repeat``; CuPy when installed, else torch (hf-only runs)."""
    if cuda_unavailable_reason() is None:
        import cupy as xp

        src, dst = xp.ones(nbytes, xp.uint8), xp.empty(nbytes, xp.uint8)
        events = lambda: (xp.cuda.Event(), xp.cuda.Event())  # noqa: E731
        copy = lambda: xp.copyto(dst, src)  # noqa: E731
        elapsed_ms = xp.cuda.get_elapsed_time
    else:
        import torch

        src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        events = lambda: (torch.cuda.Event(enable_timing=True),  # noqa: E731
                          torch.cuda.Event(enable_timing=True))
        copy = lambda: dst.copy_(src)  # noqa: E731
        elapsed_ms = lambda a, b: a.elapsed_time(b)  # noqa: E731
    times = []
    for k in range(repeat + 2):  # two warm-up copies
        start, stop = events()
        start.record()
        copy()
        stop.record()
        stop.synchronize()
        if k >= 2:
            times.append(elapsed_ms(start, stop) / 1e3)
    return 2 * nbytes / float(np.median(times))


def cpu_copy_bandwidth(nbytes: int = CPU_COPY_BYTES, repeat: int = 5) -> float:
    """Bytes/s moved (read + written) by a NumPy copy in host memory, median of ``repeat``."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    times = wall_times(lambda: np.copyto(dst, src), repeat + 1)[1:]  # the first one warms up
    return 2 * nbytes / float(np.median(times))


FLOOR_METHODS = {
    "gpu": (gpu_copy_bandwidth, f"CuPy (else torch) device-to-device copy of "
                                f"{GPU_COPY_BYTES >> 20} MiB (read + write), CUDA events, "
                                "median of 10"),
    "cpu": (cpu_copy_bandwidth, f"NumPy host-memory copy of {CPU_COPY_BYTES >> 20} MiB "
                                "(read + write), perf_counter, median of 5; the CPU backends' "
                                "memory"),
}


# ================================================================================================
# Backends
# ================================================================================================
def check_backends(backends: list[str]) -> None:
    """Fail before any work: unknown names, or a CUDA backend without a CUDA device."""
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise BackendUnavailableError(f"unknown backend(s) {', '.join(unknown)} "
                                      f"(known: {', '.join(BACKENDS)})")
    cuda = [b for b in backends if b.startswith("cuda")]
    if cuda:
        reason = cuda_unavailable_reason()
        if reason:
            raise BackendUnavailableError(f"no CUDA device: backend {', '.join(cuda)} needs an "
                                          f"NVIDIA GPU with CuPy ({reason})")


def cuda_unavailable_reason() -> str | None:
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not installed: {e}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError without a driver
        return f"{type(e).__name__}: {e}"
    return None if n > 0 else "cupy sees 0 devices"


def device_class(backend: str) -> str:
    if backend.startswith("cuda"):
        return "gpu"
    if backend.startswith("hf"):
        return "gpu" if _torch_cuda() else "cpu"
    return "cpu"


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def make_kernel_executor(backend: str, model: LoadedModel, max_seq_len: int,
                         blocks: int | None, **options):
    """The backend's own default grid unless ``blocks`` is given (one block per SM on a GPU)."""
    from ..runtime import make_executor

    if blocks is not None:
        options["blocks"] = blocks
    return make_executor(backend, model, max_seq_len, **options)


def prompt_tokens(vocab_size: int, n: int) -> list[int]:
    """Seeded token ids, the same for every backend (ids 0..2 are special tokens in synthetic
    vocabularies, so they are left out)."""
    rng = np.random.default_rng(0)
    return [int(t) for t in rng.integers(3, vocab_size, size=n)]


def time_kernel(ex, context: int, warmup: int, steps: int) -> tuple[list[float], dict]:
    """Device seconds per decode step: ``run_launches`` back to back (the step reads token and
    position from device memory and advances them itself), timed by ``device.time_steps``:
    on the GPU, CUDA events around batches queued behind a hold kernel, so the host's
    submission is never inside the window. ``info["calls"]`` of time_steps says how many steps
    it ran (a batch retried with a longer hold runs its steps again)."""
    ex.reset()
    for pos, tok in enumerate(prompt_tokens(ex.config.vocab_size, context)):
        ex.launch_step(tok, pos, None)
    ran = 0
    if warmup > 0:
        ran += ex.device.time_steps(ex.run_launches, warmup)[1].get("calls", warmup)
    times, info = ex.device.time_steps(ex.run_launches, steps)
    ran += info.get("calls", steps)
    control = ex.read_buffer("control")
    ex.check_error(control)
    want = context + ran
    if int(control[State.POS]) != want:
        raise KernelError(f"{ex.name}: after the timed steps the position is "
                          f"{int(control[State.POS])}, expected {want}: steps did not run")
    return list(times), info


# A one-launch row (many steps per launch) is one sample per launch: repeated this often, so
# its median and spread mean something.
CHAINED_REPEATS = 5


def time_kernel_chained(ex, context: int, warmup: int, steps: int,
                        repeats: int = CHAINED_REPEATS) -> tuple[list[float], dict]:
    """Device seconds per decode step when one launch runs them all (many steps per launch,
    R6), ``repeats`` times: each time the prompt and the warmup steps in one launch, then one
    launch of ``steps`` decode steps timed by ``device.time`` (CUDA events around it on the
    GPU), divided by ``steps``: the step-boundary hops are inside, the launch overhead once.
    One value per repeat, every one at the same positions."""
    from ..kernel.base import DeviceSample

    greedy = DeviceSample(0.0, 0)
    prompt = prompt_tokens(ex.config.vocab_size, context)
    out = []
    for _ in range(repeats):
        ex.reset()
        list(ex.run_steps(prompt, 0, greedy, stop_pos=context + warmup))
        ex.prepare_decode_launch(steps)
        n0 = ex.launches
        (t,) = ex.device.time(ex.run_launches, 1)
        control = ex.read_buffer("control")
        ex.check_error(control)
        want = context + warmup + steps
        if int(control[State.POS]) != want or ex.launches - n0 != 1:
            raise KernelError(f"{ex.name}: after one launch of {steps} steps the position is "
                              f"{int(control[State.POS])}, expected {want}: steps did not run")
        out.append(t / steps)
    return out, {"timer": f"device.time around one launch of {steps} steps, divided by the "
                          f"steps (many steps per launch), {repeats} launches",
                 "repeats": repeats}


def time_numpy(ex, context: int, warmup: int, steps: int) -> tuple[list[float], dict]:
    ex.reset()
    ids = prompt_tokens(ex.config.vocab_size, context)
    state = {"tok": int(np.argmax(ex.prefill(ids, 0))), "pos": len(ids)}

    def step():
        logits = ex.step(state["tok"], state["pos"]).logits
        state["tok"], state["pos"] = int(np.argmax(logits)), state["pos"] + 1

    wall_times(step, warmup)
    return wall_times(step, steps), {"timer": "time.perf_counter per step (host = device)"}


def time_end_to_end(ex, context: int, steps: int) -> float:
    """Seconds per generated token as a user of ``LLM.generate`` sees them: the Engine's greedy
    loop (prefill of ``context`` prompt tokens, then ``steps`` decode steps, EOS ignored), host
    work and every copy included; the prefill is not counted."""
    from ..runtime import Engine
    from ..sampling import SamplingParams

    eng = Engine(ex)
    params = SamplingParams(max_new_tokens=steps + 1, temperature=0, ignore_eos=True)
    n = sum(1 for _ in eng.generate_ids(prompt_tokens(ex.config.vocab_size, context), params))
    if n != steps + 1:
        raise KernelError(f"{ex.name}: end-to-end run made {n} tokens, expected {steps + 1}")
    return eng.stats.decode_s / steps


class HFRunner:
    """transformers on torch, on the same checkpoint folder; bf16 weights as stored. Works with
    transformers 4.45+ (``past_key_values``, ``cache_position``) and 5.x (``cache``)."""

    def __init__(self, model_dir: Path, max_cache_len: int):
        import inspect

        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        # no dtype argument (its name changed in 4.56); the stored weights are bf16, so the
        # cast is exact whatever dtype this version loads them in
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        self.model = self.model.to(device=self.dev, dtype=torch.bfloat16).eval()
        self.info = {"device": self.dev, "dtype": "bfloat16",
                     "attn_implementation": getattr(self.model.config, "_attn_implementation",
                                                    None)}
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.pass_cache_position = "cache_position" in params
        self.max_cache_len = max_cache_len
        self._static = None  # (StaticCache, compiled forward), built once: one compilation

    def _timer(self, fn, n: int) -> list[float]:
        torch = self.torch
        if self.dev != "cuda":
            return wall_times(fn, n)
        out = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        return out

    def _kwargs(self, cache, positions):
        kw = {self.cache_kw: cache, "use_cache": True, "position_ids": positions[None]}
        if self.pass_cache_position:
            kw["cache_position"] = positions
        return kw

    def time(self, context: int, warmup: int, steps: int, compile: bool) -> tuple[list[float], dict]:
        torch = self.torch
        from transformers import DynamicCache, StaticCache

        ids = torch.tensor([prompt_tokens(self.model.config.vocab_size, context)],
                           device=self.dev)
        n = ids.shape[1]
        with torch.inference_mode():
            if compile:
                if self._static is None:
                    cache = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len,
                                        max_batch_size=1, device=self.dev, dtype=torch.bfloat16)
                    self._static = (cache, torch.compile(self.model.forward,
                                                         mode="reduce-overhead", fullgraph=True))
                    warmup += 3  # compilation and CUDA-graph recording happen in the first calls
                cache, forward = self._static
                cache.reset()
            else:
                cache, forward = DynamicCache(), self.model.forward
            out = self.model(input_ids=ids, **self._kwargs(cache, torch.arange(n, device=self.dev)))
            state = {"tok": out.logits[:, -1].argmax(-1, keepdim=True), "pos": n}

            def step():
                pos = torch.tensor([state["pos"]], device=self.dev)
                o = forward(input_ids=state["tok"], **self._kwargs(cache, pos))
                state["tok"] = o.logits[:, -1].argmax(-1, keepdim=True).clone()
                state["pos"] += 1

            self._timer(step, warmup)
            return self._timer(step, steps), {
                "timer": "CUDA events around each step, Python dispatch included (HF is "
                         "host-bound; no back-to-back form)" if self.dev == "cuda" else
                         "time.perf_counter per step"}


# ================================================================================================
# The run
# ================================================================================================
def run_bench(models: list[tuple[str, LoadedModel]], backends: list[str], contexts: list[int],
              steps: int, warmup: int, blocks: int | None = None, log=print,
              on_row=None, max_seq_len: int | None = None) -> dict:
    """Measure every (model, backend, context); return the results document (see module doc).
    ``on_row(doc)`` is called with the document so far after every row (the CLI rewrites its
    JSON then, so a run stopped by a timeout keeps every row it finished). ``max_seq_len``:
    the executors' KV-cache length (default: just what the rows need); the GPU check passes
    one length for all its steps, so they share compiled kernels and verified programs."""
    check_backends(backends)
    if steps < 1 or warmup < 0 or not contexts or min(contexts) < 1:
        raise ValueError("need steps >= 1, warmup >= 0 and contexts >= 1 (the prompt the "
                         "timed steps follow)")
    # the end-to-end run needs context + steps + 1 positions; the device timing context +
    # warmup + steps
    need = max(contexts) + warmup + steps + 2
    if max_seq_len is None:
        max_seq_len = need
    elif max_seq_len < need:
        raise ValueError(f"max_seq_len {max_seq_len} is too short for context {max(contexts)} + "
                         f"{warmup} warmup + {steps} steps (needs {need})")
    results: list[Result] = []
    resources: dict[str, dict] = {}
    setups: dict[str, dict] = {}
    floors: dict[str, dict] = {}
    for where in sorted({device_class(b) for b in backends}):  # first: every row can cite it
        fn, method = FLOOR_METHODS[where]
        try:
            floors[where] = {"copy_bandwidth_GBps": fn() / 1e9, "method": method}
        except Exception as e:
            log(f"floor ({where}): ERROR {_err(e)}")
            floors[where] = {"copy_bandwidth_GBps": None, "method": method, "error": _err(e)}
    weight_bytes = {shape: m.config.weight_bytes_per_token() for shape, m in models}
    doc = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": device_name(),
        "commit": git_commit(),
        "commit_source": commit_info()[1],
        "host": {"python": platform.python_version(), "platform": platform.platform(terse=True),
                 **_versions()},
        "method": {"warmup": warmup, "steps": steps, "contexts": contexts,
                   "device_time": "median_us: per decode step, GPU work only (CUDA events "
                                  "around back-to-back launches or graph replays queued behind "
                                  "a hold kernel, or around one launch of all the steps for a "
                                  "backend that runs many per launch; perf_counter on CPU "
                                  "backends)",
                   "end_to_end": "e2e_us_per_token: wall time per generated token of the "
                                 "Engine's greedy loop (LLM.generate), host work included",
                   "floor": "weight bytes per token / measured copy bandwidth"},
        "floors": floors,
        "weight_bytes_per_token": weight_bytes,
        "backends": setups,
        "resources": resources,
        "results": [],
    }

    def add(r: Result) -> None:
        results.append(r)
        doc["results"].append(_row(r, weight_bytes[r.shape], floors.get(r.device)))
        if on_row is not None:
            on_row(doc)

    # a row is minutes on the emulator: a bar over the rows, its clock kept moving, the row
    # being measured as its label
    bar = progress_bar(total=len(models) * len(backends) * len(contexts), desc="bench",
                       unit="row")
    say = log

    def log(msg: str) -> None:
        with bar.external_write_mode(file=sys.stderr):  # the bar steps aside for the line
            say(msg)

    with bar, ticking(bar):
        _run_rows(models, backends, contexts, steps, warmup, blocks, max_seq_len, resources,
                  setups, add, log, bar)
    return doc


def _run_rows(models, backends, contexts, steps, warmup, blocks, max_seq_len, resources, setups,
              add, log, bar) -> None:
    for shape, model in models:
        hf = None
        for backend in backends:
            bar.set_description(f"bench {shape} {backend}")
            where = device_class(backend)
            e2e = None
            try:
                if backend in KERNEL_BACKENDS:
                    ex = make_kernel_executor(backend, model, max_seq_len, blocks)
                    resources.setdefault(ex.device.name, ex.device.resources(ex.module))
                    p = ex.program
                    setups[f"{shape}/{backend}"] = {
                        "blocks": p.num_blocks, "slots_per_block": p.max_len,
                        "counters": p.num_counters, "critical_path_hops": p.critical_path_hops()}
                    timer = time_kernel_chained if ex.multi_step \
                        else time_kernel
                    run = lambda c, ex=ex, timer=timer: timer(ex, c, warmup, steps)  # noqa: E731
                    e2e = lambda c, ex=ex: time_end_to_end(ex, c, steps)  # noqa: E731
                elif backend == "numpy":
                    from ..runtime import make_executor

                    ex = make_executor("numpy", model, max_seq_len)
                    run = lambda c, ex=ex: time_numpy(ex, c, warmup, steps)  # noqa: E731
                    e2e = lambda c, ex=ex: time_end_to_end(ex, c, steps)  # noqa: E731
                else:
                    hf = hf or HFRunner(model.path, max_seq_len)
                    setups[f"{shape}/{backend}"] = hf.info
                    run = lambda c, hf=hf, comp=backend == "hf-compile": hf.time(  # noqa: E731
                        c, warmup, steps, comp)
                nb = getattr(ex, "blocks", None) if backend in KERNEL_BACKENDS else None
            except Exception as e:  # record and go on: one broken backend must not lose the run
                for c in contexts:
                    add(Result(backend, shape, c, where, error=_err(e)))
                    bar.update(1)
                log(f"{shape} {backend}: ERROR {_err(e)}")
                continue
            for c in contexts:
                bar.set_description(f"bench {shape} {backend} context {c}")
                r = Result(backend, shape, c, where, blocks=nb)
                try:
                    times, r.timing = run(c)
                    r.times_us = [t * 1e6 for t in times]
                    if e2e is not None:
                        r.e2e_us_per_token = e2e(c) * 1e6
                    log(f"{shape} {backend} context {c}: {r.median_us:.1f} us/step on the device"
                        + (f", {r.e2e_us_per_token:.1f} us/token end to end"
                           if r.e2e_us_per_token else ""))
                except Exception as e:
                    r.error = _err(e)
                    log(f"{shape} {backend} context {c}: ERROR {r.error}")
                add(r)
                bar.update(1)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]


def _row(r: Result, weight_bytes: int, floor: dict | None) -> dict:
    d = asdict(r)
    if r.error or not r.times_us:
        return d
    med = r.median_us
    bw = floor and floor["copy_bandwidth_GBps"]
    floor_us = weight_bytes / (bw * 1e9) * 1e6 if bw else None
    d.update(n=len(r.times_us), median_us=med, p10_us=r.percentile_us(10),
             p90_us=r.percentile_us(90), tokens_per_s=1e6 / med,
             GBps=weight_bytes / (med * 1e-6) / 1e9, floor_us=floor_us,
             x_floor=med / floor_us if floor_us else None)
    return d


def _versions() -> dict:
    out = {"numpy": np.__version__}
    for mod in ("cupy", "torch", "transformers"):
        m = sys.modules.get(mod)
        if m is not None:
            out[mod] = getattr(m, "__version__", "?")
    return out


def device_name() -> str:
    """The GPU's name when CuPy or torch sees one, else the CPU's model name."""
    if cuda_unavailable_reason() is None:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    if _torch_cuda():
        import torch

        return torch.cuda.get_device_name(0)
    return cpu_name()


def cpu_name() -> str:
    """"CPU " and the CPU's model name (/proc/cpuinfo, else what platform says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU " + (platform.processor() or platform.machine())


# The GPU machine gets the working tree without .git: the caller writes the commit first, into
# MONOKERNEL_COMMIT or a file .commit at the repository's root (scripts/gpu_check.sh's header).
COMMIT_ENV = "MONOKERNEL_COMMIT"
COMMIT_FILE = Path(__file__).resolve().parents[2] / ".commit"


def commit_info() -> tuple[str, str]:
    """(commit, where it came from): $MONOKERNEL_COMMIT, else the repository's .commit file,
    else ``git rev-parse``; ("unknown", why) when none says."""
    env = os.environ.get(COMMIT_ENV, "").strip()
    if env:
        return env, f"${COMMIT_ENV}"
    try:
        text = COMMIT_FILE.read_text().strip()
    except OSError:
        text = ""
    if text:
        return text.split()[0], ".commit file"
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                           timeout=10, cwd=COMMIT_FILE.parent)
    except (OSError, subprocess.SubprocessError):
        return "unknown", "no $MONOKERNEL_COMMIT, no .commit file, no git"
    if r.returncode == 0 and r.stdout.strip():
        return r.stdout.strip(), "git rev-parse HEAD"
    return "unknown", "no $MONOKERNEL_COMMIT, no .commit file, not a git checkout"


def git_commit() -> str:
    """The commit as results record it (short form; see commit_info)."""
    commit = commit_info()[0]
    return commit[:7] if re.fullmatch(r"[0-9a-f]{40}", commit) else commit


# ================================================================================================
# Output: table, JSON, chart
# ================================================================================================
def format_table(doc: dict) -> str:
    head = (f"{'backend':<20} {'shape':<14} {'context':>7} {'n':>4} {'us/step':>10} "
            f"{'p10-p90 us':>21} {'tokens/s':>9} {'GB/s':>8} {'x-floor':>8} "
            f"{'e2e us/token':>13}")
    lines = [head, "-" * len(head)]
    for r in doc["results"]:
        pre = f"{r['backend']:<20} {r['shape']:<14} {r['context']:>7} "
        if r.get("error"):
            lines.append(pre + f"{'-':>4} ERROR {r['error']}")
            continue
        spread = f"{r['p10_us']:.1f}-{r['p90_us']:.1f}"
        xf = f"{r['x_floor']:.2f}" if r["x_floor"] is not None else "?"
        e2e = f"{r['e2e_us_per_token']:.1f}" if r.get("e2e_us_per_token") else "-"
        lines.append(pre + f"{r['n']:>4} {r['median_us']:>10.1f} {spread:>21} "
                     f"{r['tokens_per_s']:>9.1f} "
                     f"{r['GBps']:>8.2f} {xf:>8} {e2e:>13}")
    lines.append("n: timed samples (batches of back-to-back steps, or launches of many steps); "
                 "us/step: device time per decode step (GPU work only); e2e: wall time per "
                 "generated token through the Engine (LLM.generate), host included")
    ok = {w: f for w, f in doc["floors"].items() if f["copy_bandwidth_GBps"]}
    for where, f in doc["floors"].items():
        bw = f"{f['copy_bandwidth_GBps']:.1f} GB/s" if where in ok else f"ERROR {f.get('error')}"
        lines.append(f"floor ({where}): copy bandwidth {bw} [{f['method']}]")
    for shape, wb in doc["weight_bytes_per_token"].items():
        floors = ", ".join(f"{where} {wb / (f['copy_bandwidth_GBps'] * 1e9) * 1e6:.1f} us"
                           for where, f in ok.items())
        lines.append(f"{shape}: {wb / 1e6:.1f} MB of weights per token; floor {floors or '?'}")
    return "\n".join(lines)


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "unknown"


def results_stem(doc: dict) -> str:
    """bench-<date>-<device>-<commit>: the same for every rewrite of one run's document."""
    date = datetime.datetime.fromisoformat(doc["date"]).strftime("%Y%m%d-%H%M%S")
    dev = "cpu" if doc["device"].startswith("CPU ") else _slug(doc["device"])
    return f"bench-{date}-{dev}-{_slug(doc['commit'])}"


def write_json(doc: dict, out_dir: str | Path) -> Path:
    """Write (or rewrite) the run's JSON atomically: a reader never sees half a file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jpath = out_dir / f"{results_stem(doc)}.json"
    tmp = jpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False))
    tmp.replace(jpath)
    return jpath


def write_results(doc: dict, out_dir: str | Path) -> tuple[Path, Path | None]:
    """The JSON and a .png chart beside it (None without matplotlib)."""
    jpath = write_json(doc, out_dir)
    try:
        ppath = plot_results(jpath.with_suffix(".png"), doc)
    except ImportError as e:  # the GPU machine may lack matplotlib; the JSON has everything
        print(f"monokernel: no PNG chart: {e}", file=sys.stderr)
        ppath = None
    return jpath, ppath


def plot_results(path: Path, doc: dict) -> Path:
    """us/token per backend per context (log scale), one panel per shape; floors as lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shapes = list(doc["weight_bytes_per_token"])
    fig = Figure(figsize=(max(6.0, 4.5 * len(shapes)), 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(shapes), squeeze=False)[0]
    for ax, shape in zip(axes, shapes):
        rows = [r for r in doc["results"] if r["shape"] == shape and not r.get("error")]
        backends = list(dict.fromkeys(r["backend"] for r in rows))
        contexts = sorted({r["context"] for r in rows})
        width = 0.8 / max(len(backends), 1)
        for k, b in enumerate(backends):
            xs, ys, lo, hi = [], [], [], []
            for r in rows:
                if r["backend"] == b:
                    xs.append(contexts.index(r["context"]) + (k - (len(backends) - 1) / 2) * width)
                    ys.append(r["median_us"])
                    lo.append(r["median_us"] - r["p10_us"])
                    hi.append(r["p90_us"] - r["median_us"])
            ax.bar(xs, ys, width, yerr=[lo, hi], label=b, color=f"C{k}", capsize=2)
        wb = doc["weight_bytes_per_token"][shape]
        for where, f in doc["floors"].items():
            if f["copy_bandwidth_GBps"] and any(r["device"] == where for r in rows):
                us = wb / (f["copy_bandwidth_GBps"] * 1e9) * 1e6
                ax.axhline(us, color="k", ls="--" if where == "gpu" else ":", lw=1,
                           label=f"floor ({where} copy) {us:.1f} us")
        ax.set_xticks(range(len(contexts)), [str(c) for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("us / token (median, p10-p90)")
        ax.set_yscale("log")
        ax.set_title(f"{shape} on {doc['device']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
