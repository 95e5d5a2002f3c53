"""The GPU check's prepare step (scripts/gpu_check.sh): everything the later steps would each
pay for again, done once and in parallel before any of them runs.

- every kernel variant the steps will build (shape x backend options, one KV-cache length),
  compiled by NVRTC in parallel processes into CuPy's on-disk cache ($CUPY_CACHE_DIR), so a
  later process loads the cubin instead of compiling (~5-10 s per variant saved each time);
- the verified programs of those builds on one block per SM (the scheduler's proofs in
  $MONOKERNEL_CACHE/verified);
- meanwhile, in this process, the synthetic checkpoints of the shapes
  ($MONOKERNEL_CACHE/synth/<shape>, where ``--shape`` finds them);
- then the reference's greedy runs the smoke step and the GPU tests compare with
  ($MONOKERNEL_CACHE/reference: one float32 model per shape, built once, not in every step).

    python -m monokernel.tools.prepare --max-seq N \
        --build SHAPE:BACKEND[:trace][:slots=N][:tokens=N][:mma]
                                       [--program SHAPE[,KEY=N...] ...]
                                       [--reference TOKENS:STEPS ...] [--jobs N]

A build the steps ask for but this step did not make still works (the step compiles it and
pays for it): the GPU check's per-step time limits, measured in CI on the fake CuPy with the
real NVRTC, are what catch such a miss.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed


def parse_build(spec: str) -> tuple[str, str, bool, int, int, bool]:
    """"smollm2-135m:cuda", "smollm2-135m:cuda:trace", "smollm2-135m:cuda:tokens=16",
    "smollm2-135m:cuda:slots=4:tokens=32" or "smollm2-135m:cuda:slots=4:mma" -> (shape,
    backend, trace, tokens per step, slots, tensor cores). A kernel of slots takes at least as
    many rows a step (executor.KernelExecutor); tensor cores need slots."""
    parts = spec.split(":")
    trace, tokens, slots, mma = False, 1, 1, False
    for extra in parts[2:]:
        key, _, value = extra.partition("=")
        if extra == "trace" and not trace:
            trace = True
        elif extra == "mma" and not mma:
            mma = True
        elif key == "tokens" and value.isdigit() and int(value) >= 1 and tokens == 1:
            tokens = int(value)
        elif key == "slots" and value.isdigit() and int(value) >= 2 and slots == 1:
            slots = int(value)
        else:
            parts = []
            break
    if len(parts) < 2 or (mma and slots < 2):
        raise SystemExit(f"monokernel prepare: error: --build {spec!r}: expected "
                         "SHAPE:BACKEND[:trace][:slots=N][:tokens=N][:mma] (mma with slots)")
    from ..kernel.cuda_backend import BUILD_OPTIONS

    if parts[1] not in BUILD_OPTIONS:
        raise SystemExit(f"monokernel prepare: error: --build {spec!r}: unknown backend "
                         f"{parts[1]!r} (known: {', '.join(BUILD_OPTIONS)})")
    return parts[0], parts[1], trace, max(tokens, slots if slots > 1 else 1), slots, mma


def _compile(label: str, source: str, defines: dict[str, str]) -> tuple[str, float]:
    """In a worker process: one NVRTC build through CupyDevice.compile (CuPy keeps the cubin on
    disk for every later process)."""
    from ..kernel.devices.cuda import CupyDevice
    from ..kernel.executor import KERNEL_NAMES

    t0 = time.perf_counter()
    CupyDevice().compile(source, KERNEL_NAMES, defines)
    return label, time.perf_counter() - t0


def _reference(shape: str, runs: list[tuple[list[int], int]]) -> tuple[str, float]:
    """In a worker process: the reference's greedy runs the later steps compare with, into
    $MONOKERNEL_CACHE/reference (one float32 model per shape, built once for all steps)."""
    from ..model.loader import load_model
    from ..model.reference import greedy_reference_run
    from .commands import synthetic_dir

    t0 = time.perf_counter()
    model = load_model(synthetic_dir(shape), progress=False)
    for tokens, steps in runs:
        greedy_reference_run(model, tokens, steps)
    return f"reference {shape} ({len(runs)} run(s))", time.perf_counter() - t0


def parse_reference(spec: str) -> tuple[list[int], int]:
    """"1,999,5:16" -> ([1, 999, 5], 16)."""
    tokens, _, steps = spec.partition(":")
    try:
        out = [int(t) for t in tokens.split(",")], int(steps)
    except ValueError:
        out = ([], 0)
    if not out[0] or out[1] < 1:
        raise SystemExit(f"monokernel prepare: error: --reference {spec!r}: expected "
                         "TOKEN[,TOKEN...]:STEPS")
    return out


def _verify(label: str, cfg, max_seq: int, options: dict) -> tuple[str, float]:
    """In a worker process: schedule and verify a program on one block per SM (the proof is
    remembered in $MONOKERNEL_CACHE/verified; a 132-block program takes seconds to prove)."""
    from ..kernel.devices.cuda import CupyDevice
    from ..kernel.group_picks import tensor_core_program
    from ..kernel.schedule import schedule, tensor_core_splits

    t0 = time.perf_counter()
    options = dict(options)
    blocks = CupyDevice().num_sms
    if options.pop("tensor_cores", False):  # the program the tensor-core executor schedules
        splits, min_chunk = tensor_core_splits(
            cfg, blocks, max_seq, options.get("attn_splits"), options.get("attn_min_chunk"))
        tensor_core_program(cfg, blocks, max_seq, splits, min_chunk, options.get("tokens", 1))
    else:
        schedule(cfg, blocks, max_seq, **options)
    return label, time.perf_counter() - t0


PROGRAM_OPTIONS = ("attn_splits", "attn_min_chunk", "merge_ticket_min", "tokens")


def parse_program(spec: str) -> tuple[str, dict]:
    """"qwen3-0.6b,attn_splits=16,merge_ticket_min=2" -> (shape, schedule options)."""
    shape, *rest = spec.split(",")
    options = {}
    for item in rest:
        key, _, value = item.partition("=")
        if key not in PROGRAM_OPTIONS or not value.isdigit():
            raise SystemExit(f"monokernel prepare: error: --program {spec!r}: expected "
                             f"SHAPE[,KEY=N...] with KEY one of {', '.join(PROGRAM_OPTIONS)}")
        options[key] = int(value)
    return shape, options


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m monokernel.tools.prepare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-seq", type=int, required=True,
                    help="the KV-cache length every later step uses")
    ap.add_argument("--build", action="append", default=[],
                    metavar="SHAPE:BACKEND[:trace][:slots=N][:tokens=N][:mma]",
                    help="a kernel the later steps build (repeat the option)")
    ap.add_argument("--program", action="append", default=[],
                    metavar="SHAPE[,attn_splits=N][,attn_min_chunk=N][,merge_ticket_min=N]",
                    help="a program the later steps schedule besides the builds' default ones "
                         "(repeat the option)")
    ap.add_argument("--reference", action="append", default=[], metavar="TOKENS:STEPS",
                    help="a greedy reference run the later steps compare with, for every shape "
                         "(repeat the option; e.g. 517:1)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="parallel NVRTC processes (default: the CPU count)")
    args = ap.parse_args(argv)
    from ..kernel.cuda_backend import BUILD_OPTIONS
    from ..kernel.executor import DEFAULT_PAGE_SIZE, kernel_build
    from ..kernel.group_picks import tensor_core_slices
    from ..model.config import ModelConfig
    from ..model.synth import synthetic_config
    from .commands import synthetic_dir

    builds = [parse_build(b) for b in args.build]
    shapes = list(dict.fromkeys(s for s, *_ in builds))
    # the kernels need only the configs: they compile while the checkpoints are written
    configs = {shape: synthetic_config(shape) for shape in shapes}
    compiles: dict[tuple, tuple[str, str, dict]] = {}  # one per distinct (source, defines)
    proofs: dict[tuple, tuple[str, object, int, dict]] = {}
    blocks = None  # the GPU's SMs: a tensor-core kernel's input slices depend on the grid
    for shape, backend, trace, tokens, slots, mma in builds:
        opts = dict(BUILD_OPTIONS[backend], trace=trace, tokens=tokens)
        if slots > 1:
            opts.update(slots=slots, page_size=DEFAULT_PAGE_SIZE, mma=mma)
        if mma:  # the slices of the program its executor schedules (input_slices=True)
            if blocks is None:
                from ..kernel.devices.cuda import CupyDevice

                blocks = CupyDevice().num_sms
            opts["slices"] = tensor_core_slices(configs[shape], blocks, args.max_seq, tokens)
        source, defines = kernel_build(configs[shape], args.max_seq, **opts)
        key = (source, tuple(sorted(defines.items())))
        label = f"{shape}:{backend}" + (":trace" if trace else "") \
            + (f":slots={slots}" if slots > 1 else "") \
            + (f":tokens={tokens}" if tokens > 1 else "") + (":mma" if mma else "")
        if key in compiles:
            compiles[key] = (compiles[key][0] + f" = {label}",) + compiles[key][1:]
        else:
            compiles[key] = (label, source, defines)
        # (tensor cores: every step's attention merged by ticket, the splits fixed by absolute
        # position: executor.KernelExecutor)
        prog = ((("merge_ticket_min", 1), ("tensor_cores", 1)) if mma else ()) \
            + ((("tokens", tokens),) if tokens > 1 else ())
        if (shape, prog) not in proofs:
            proofs[(shape, prog)] = (f"program {shape}" + "".join(f",{k}={v}" for k, v in prog),
                                     configs[shape], args.max_seq, dict(prog))
    for spec in args.program:
        shape, options = parse_program(spec)
        if shape not in configs:
            shapes.append(shape)
            configs[shape] = synthetic_config(shape)
        proofs[(shape, tuple(sorted(options.items())))] = (
            f"program {spec}", configs[shape], args.max_seq, options)
    jobs = max(1, min(args.jobs, len(compiles) + len(proofs)))
    print(f"compiling {len(compiles)} kernel variant(s) and verifying {len(proofs)} program(s) "
          f"at max_seq {args.max_seq} in {jobs} process(es), while writing {len(shapes)} "
          "checkpoint(s)", flush=True)
    import multiprocessing as mp

    t0 = time.perf_counter()
    failed = 0
    # spawn: a worker must not inherit a parent's CUDA state (none is made here, but CuPy and
    # the fake CuPy are imported fresh in each worker either way)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(_compile, *v) for v in compiles.values()]
        futures += [pool.submit(_verify, *v) for v in proofs.values()]
        runs = [parse_reference(r) for r in args.reference]
        for shape in shapes:
            t = time.perf_counter()
            written = ModelConfig.from_hf(synthetic_dir(shape))
            print(f"checkpoint {shape}: {time.perf_counter() - t:.1f} s", flush=True)
            if written != configs[shape]:  # then the steps build other kernels than these
                failed += 1
                print(f"  FAILED: the checkpoint of {shape} has another config than "
                      "synthetic_config gives", flush=True)
            if runs:  # needs the checkpoint: queued behind the compiles
                futures.append(pool.submit(_reference, shape, runs))
        t_ckpt = time.perf_counter() - t0
        for f in as_completed(futures):
            try:
                label, seconds = f.result()
                print(f"  {label}: {seconds:.1f} s", flush=True)
            except Exception as e:  # one broken build must not hide the others
                failed += 1
                print(f"  FAILED: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    t_all = time.perf_counter() - t0
    print(f"prepare: {len(shapes)} checkpoint(s) {t_ckpt:.1f} s, with {len(compiles)} "
          f"compile(s) + {len(proofs)} proof(s) {t_all:.1f} s wall; {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
