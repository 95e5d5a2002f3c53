"""``monokernel plan | calibrate | bench | trace``: the kernel's program, its predicted and
measured speed, and its timeline.

    monokernel plan  [--model DIR|FILE.gguf | --shape NAME] [--blocks 132] [--context 1024]
                     [--predict h200|h100|h200-fit [--design NAME] [--batch B] [--prompt P]]
    monokernel calibrate TRACE.json [--model DIR | --shape NAME] [--gpu h200] [--design v1]
    monokernel bench [--model DIR | --shape NAME[,NAME...]] [--backends LIST]
                     [--context 16,512,2048] [--steps N] [--warmup N] [--blocks N] [--out DIR]
    monokernel bench ... --batch B [--prompt P] [--new-tokens N] [--repeats R] [--step-tokens T]
                         [--slots S] [--tensor-cores] [--device-only] [--no-predict]
                     (served rates: time to first token, aggregate tokens/s at batch B)
    monokernel trace [--model DIR | --shape NAME] [--backend emulator|cuda] [--blocks N]
                     [--context N] [--out DIR]

--shape uses a seeded synthetic checkpoint, written once into $MONOKERNEL_CACHE/synth/<shape>.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .plan import H200_SMS, cmd_plan


# `monokernel bench` defaults: the GPU comparison where a GPU is, else what a CPU can run in
# about a minute (the emulator is an instrument for correctness, ~0.5 s per SmolLM2 step).
GPU_DEFAULTS = {"backends": "cuda,cuda-multi,cuda-multi-graph,cuda-multi-graph-pdl,hf",
                "context": "16,512,2048",
                "steps": 100, "warmup": 10}
CPU_DEFAULTS = {"backends": "numpy,emulator", "context": "16", "steps": 5, "warmup": 1}


def _slices_arg(text: str) -> bool | int:
    """--input-slices: "auto" (True: input_slices.choose per op) or a number."""
    if text == "auto":
        return True
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a power of two or auto, got {text!r}") \
            from None


def add_commands(sub) -> None:
    from ..kernel.costmodel import DESIGNS
    from .bench import BACKENDS as BENCH_BACKENDS

    p = sub.add_parser("plan", help="schedule the decode step and print its instruction program")
    _add_model_or_shape(p)
    p.add_argument("--blocks", type=int, default=H200_SMS,
                   help=f"persistent blocks (default {H200_SMS}, the SMs of an H200)")
    p.add_argument("--context", type=int, default=1024,
                   help="context length for the KV-cache bytes (default 1024)")
    p.add_argument("--predict", default=None, metavar="GPU",
                   help="also predict the step's time with the cost model on this GPU "
                        "(h200, h100, or h200-fit: the H200 fitted to its measured decode "
                        "steps); a prediction, not a measurement")
    p.add_argument("--design", default=None,
                   help=f"kernel design for --predict: {', '.join(DESIGNS)} (default: the "
                        "design the kernel implements now, costmodel.design_for; v5: the "
                        "kernel before issue 15's leaner step, as compiled)")
    p.add_argument("--batch", type=int, default=None, metavar="B",
                   help="with --predict: a decode step of B sequences at --context, on the "
                        "design of many tokens per step (default: the one built, the "
                        "tensor-core kernel of slots, v6-mma, on the program its executor "
                        "of 64 slots runs): us/step and tokens/s")
    p.add_argument("--prompt", type=int, default=None, metavar="P",
                   help="with --predict: the time to first token of a P-token prompt, "
                        "prefilled in chunks (the design's prefill_chunk, or --chunk)")
    p.add_argument("--chunk", type=int, default=None, metavar="T",
                   help="with --prompt: tokens per prefill step (default: the design's)")
    p.add_argument("--input-slices", type=_slices_arg, default=True, metavar="S",
                   help="with --batch or --prompt: O_PROJ's and DOWN's input in S slices (a "
                        "power of two; 1: none; kernel/input_slices.py); default auto, each "
                        "op's by the cost model, as the tensor-core executor chooses")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("calibrate", help="fit the cost model's constants to a GPU trace "
                                         "(from `monokernel trace`) and compare per op; "
                                         "--probes: the GPU's probes beside the table")
    p.add_argument("trace", nargs="?", help="trace JSON written by `monokernel trace`")
    p.add_argument("--probes", default=None, metavar="SMOKE_JSON",
                   help="smoke.json of a GPU run (tools/smoke.py): its L2, HBM and cluster "
                        "probes beside the cost model's table, and what follows for its "
                        "levers (tools/probes.py)")
    _add_model_or_shape(p)
    p.add_argument("--gpu", default="h200", help="GPU whose constants start the fit (h200, h100)")
    p.add_argument("--design", default=None,
                   help="kernel design the traced kernel implements "
                        "(default: costmodel.design_for)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("bench", help="decode latency of each backend vs the bandwidth floor")
    _add_model_or_shape(p, several=True)
    p.add_argument("--backends", default=None,
                   help=f"comma list of: {', '.join(BENCH_BACKENDS)} (default: "
                        f"{GPU_DEFAULTS['backends']} with a GPU, else {CPU_DEFAULTS['backends']})")
    p.add_argument("--context", default=None,
                   help="comma list of context lengths (default: "
                        f"{GPU_DEFAULTS['context']} with a GPU, else {CPU_DEFAULTS['context']})")
    p.add_argument("--steps", type=int, default=None,
                   help=f"timed decode steps per row (default {GPU_DEFAULTS['steps']} with a "
                        f"GPU, else {CPU_DEFAULTS['steps']})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed steps before them (default {GPU_DEFAULTS['warmup']} with a "
                        f"GPU, else {CPU_DEFAULTS['warmup']})")
    p.add_argument("--blocks", type=int, default=None,
                   help="persistent blocks (default: the backend's own, the SM count on a GPU)")
    p.add_argument("--max-seq", type=int, default=None,
                   help="the executors' KV-cache length (default: what the rows need; the GPU "
                        "check gives every step one length, so they share compiled kernels)")
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON and PNG")
    p.add_argument("--batch", type=int, default=None, metavar="B",
                   help="served rates instead of decode latency: B sequences generating "
                        "together (aggregate tokens/s) and a prompt's time to first token, "
                        "through the Engine (tools/bench_batch.py)")
    p.add_argument("--prompt", type=int, default=None, metavar="P",
                   help="with --batch: prompt length in tokens (default 32)")
    p.add_argument("--new-tokens", type=int, default=16, metavar="N",
                   help="with --batch: tokens each sequence generates (default 16)")
    p.add_argument("--repeats", type=int, default=3,
                   help="with --batch: prompts timed for the time to first token (default 3)")
    p.add_argument("--step-tokens", type=int, default=None, metavar="T",
                   help="with --batch: kernel backends' option step_tokens (prompt chunks)")
    p.add_argument("--slots", type=int, default=None, metavar="S",
                   help="with --batch: kernel backends' option slots (steps of up to S "
                        "sequences; without it a kernel runs one sequence at a time)")
    p.add_argument("--tensor-cores", action="store_true",
                   help="with --batch and --slots: kernel backends' option tensor_cores (the "
                        "mat-muls on mma.sync, bf16 inputs)")
    p.add_argument("--device-only", action="store_true",
                   help="with --batch and --slots: only the kernel's device times (each prompt "
                        "chunk step, decode steps of B sequences) beside the H200 prediction, "
                        "no Engine run")
    p.add_argument("--no-predict", action="store_true",
                   help="with --batch: leave the device times' H200 predictions out (CPU work: "
                        "plan --predict computes them afterwards)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("trace", help="timeline of one traced decode step (Perfetto JSON + PNG)")
    _add_model_or_shape(p)
    p.add_argument("--backend", default="emulator",
                   choices=["emulator", "emulator-multi", "cuda", "cuda-multi"])
    p.add_argument("--blocks", type=int, default=None,
                   help="persistent blocks (default: the backend's own)")
    p.add_argument("--context", type=int, default=16,
                   help="positions prefilled before the traced step (default 16)")
    p.add_argument("--max-seq", type=int, default=None,
                   help="the executor's KV-cache length (default: context + 1)")
    p.add_argument("--out", default="benchmarks/traces", help="folder for the JSON and PNG")
    p.set_defaults(func=cmd_trace)


def _add_model_or_shape(p: argparse.ArgumentParser, several: bool = False) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", default=None,
                   help="HF model folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--shape", default=None,
                   help="a known shape with seeded synthetic weights, e.g. smollm2-135m, "
                        "qwen3-0.6b, llama-3.2-1b, tiny" + (" (comma list)" if several else ""))


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"monokernel: error: expected a comma list of integers, got {s!r}")


def synthetic_dir(shape: str) -> Path:
    """$MONOKERNEL_CACHE/synth/<shape>, written once (seed 0)."""
    from ..model.config import ModelConfig
    from ..model.cache import cache_dir
    from ..model.synth import write_synthetic

    name = ModelConfig.from_name(shape).name  # unknown shapes fail here, naming the known ones
    out = cache_dir() / "synth" / name
    if not (out / "config.json").is_file():
        print(f"writing synthetic {name} checkpoint (seed 0) into the cache ...", file=sys.stderr)
        write_synthetic(name, out, seed=0)
    return out


def _load(args, shape: str | None):
    from ..model.loader import load_model

    if shape:
        return shape, load_model(synthetic_dir(shape), progress=False)
    model = load_model(args.model)
    return _model_label(model), model


def _model_label(model) -> str:
    name = model.config.name
    return name if name and name != "custom" else model.path.name


def _safe_path(s: str) -> str:
    """A path as recorded in results: never an absolute path of this machine."""
    return Path(s).name if Path(s).is_absolute() else s


def cmd_calibrate(args) -> int:
    from .calibrate import cmd_calibrate as run

    return run(args)


# ================================================================================================
# bench
# ================================================================================================
def bench_command_line(args) -> str:
    """The command that reproduces this run, every option spelled out."""
    parts = ["monokernel", "bench"]
    if args.shape:
        parts += ["--shape", args.shape]
    elif args.model:
        parts += ["--model", _safe_path(args.model)]
    parts += ["--backends", args.backends, "--context", args.context, "--steps", str(args.steps),
              "--warmup", str(args.warmup)]
    if args.blocks is not None:
        parts += ["--blocks", str(args.blocks)]
    if getattr(args, "max_seq", None) is not None:
        parts += ["--max-seq", str(args.max_seq)]
    parts += ["--out", _safe_path(args.out)]
    return shlex.join(parts)


def cmd_bench(args) -> int:
    from .bench import (KERNEL_BACKENDS, check_backends, format_table, run_bench, write_json,
                        write_results)

    from .bench import cuda_unavailable_reason

    if getattr(args, "batch", None) is not None or getattr(args, "prompt", None) is not None:
        return cmd_bench_batch(args)

    if any(getattr(args, k) is None for k in GPU_DEFAULTS):
        no_gpu = cuda_unavailable_reason()
        defaults = CPU_DEFAULTS if no_gpu else GPU_DEFAULTS
        for k, v in defaults.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
        if no_gpu:
            print(f"monokernel bench: no CUDA device ({no_gpu}); running the CPU backends "
                  f"{args.backends} (pass --backends to choose)", file=sys.stderr)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    check_backends(backends)  # before loading anything: no CUDA device -> exit now
    contexts = _ints(args.context)
    if args.steps < 1 or args.warmup < 0 or not contexts or min(contexts) < 1:
        raise SystemExit("monokernel: error: need --steps >= 1, --warmup >= 0 and every "
                         "--context >= 1")
    need = max(contexts) + args.warmup + args.steps + 2
    max_seq = getattr(args, "max_seq", None)
    if max_seq is not None and max_seq < need:
        raise SystemExit(f"monokernel: error: --max-seq {max_seq} is too short for context "
                         f"{max(contexts)} + {args.warmup} warmup + {args.steps} steps "
                         f"(needs {need})")
    shapes = [s.strip() for s in args.shape.split(",")] if args.shape else [None]
    models = [_load(args, s) for s in shapes]
    command = bench_command_line(args)
    doc = run_bench(models, backends, contexts, args.steps, args.warmup, args.blocks,
                    log=lambda s: print(s, file=sys.stderr, flush=True),
                    on_row=lambda d: write_json(dict(d, command=command), args.out),
                    max_seq_len=max_seq)
    doc["command"] = command
    print(format_table(doc))
    jpath, ppath = write_results(doc, args.out)
    print(f"wrote {jpath}" + (f" and {ppath.name}" if ppath else ""))
    failed = [r for r in doc["results"] if r.get("error") and r["backend"] in
              KERNEL_BACKENDS + ("numpy",)]
    return 1 if failed else 0


def cmd_bench_batch(args) -> int:
    """``bench --batch B [--prompt P]``: served rates (tools/bench_batch.py)."""
    from . import bench_batch as bb
    from .bench import check_backends, cuda_unavailable_reason

    batch = 1 if args.batch is None else args.batch
    prompt = 32 if args.prompt is None else args.prompt
    for flag, v in (("--batch", batch), ("--prompt", prompt), ("--new-tokens", args.new_tokens),
                    ("--repeats", args.repeats)):
        if v < 1:
            raise SystemExit(f"monokernel: error: {flag} must be >= 1, got {v}")
    if args.backends is None:
        args.backends = "numpy,emulator" if cuda_unavailable_reason() else "cuda,numpy"
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    check_backends(backends)
    if "hf" in backends or "hf-compile" in backends:
        raise SystemExit("monokernel: error: --batch measures monokernel's backends only "
                         "(not hf, hf-compile)")
    if args.tensor_cores and not (args.slots or 0) > 1:
        raise SystemExit("monokernel: error: --tensor-cores needs --slots S (S >= 2): tensor "
                         "cores are built for a kernel of slots")
    options = {k: v for k, v in (("step_tokens", args.step_tokens), ("slots", args.slots),
                                 ("tensor_cores", args.tensor_cores or None))
               if v is not None}
    max_seq = getattr(args, "max_seq", None)
    if max_seq is not None and max_seq < prompt + args.new_tokens + 2:
        raise SystemExit(f"monokernel: error: --max-seq {max_seq} is too short for a "
                         f"{prompt}-token prompt and {args.new_tokens} new tokens (needs "
                         f"{prompt + args.new_tokens + 2})")
    if args.device_only and not (args.slots or 0) > 1:
        raise SystemExit("monokernel: error: --device-only needs --slots S (S >= 2): device "
                         "times are for a kernel of slots")
    parts = ["monokernel", "bench"] + (["--shape", args.shape] if args.shape else
                                        ["--model", _safe_path(args.model)] if args.model else [])
    parts += ["--backends", args.backends, "--batch", str(batch), "--prompt", str(prompt),
              "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    if args.blocks is not None:
        parts += ["--blocks", str(args.blocks)]
    if args.step_tokens is not None:
        parts += ["--step-tokens", str(args.step_tokens)]
    if args.slots is not None:
        parts += ["--slots", str(args.slots)]
    if args.tensor_cores:
        parts.append("--tensor-cores")
    if max_seq is not None:
        parts += ["--max-seq", str(max_seq)]
    if args.device_only:
        parts.append("--device-only")
    if args.no_predict:
        parts.append("--no-predict")
    shapes = [s.strip() for s in args.shape.split(",")] if args.shape else [None]
    models = [_load(args, s) for s in shapes]
    doc = bb.run(models, backends, batch, prompt, args.new_tokens, args.repeats, args.blocks,
                 options, log=lambda s: print(s, file=sys.stderr, flush=True), max_seq=max_seq,
                 device_only=args.device_only, predict=not args.no_predict,
                 command=shlex.join(parts + ["--out", _safe_path(args.out)]), out_dir=args.out)
    print(bb.format_table(doc))
    print(f"wrote {bb.write(doc, args.out)}")
    return 1 if any(r.get("error") or r.get("device_error") for r in doc["results"]) else 0


# ================================================================================================
# trace
# ================================================================================================
def cmd_trace(args) -> int:
    from . import trace as tr
    from .bench import check_backends, make_kernel_executor, prompt_tokens

    check_backends([args.backend])
    max_seq = getattr(args, "max_seq", None) or args.context + 1
    if max_seq <= args.context:
        raise SystemExit(f"monokernel: error: --max-seq {max_seq} leaves no position for the "
                         f"traced step after context {args.context}")
    label, model = _load(args, args.shape)
    ex = make_kernel_executor(args.backend, model, max_seq, args.blocks, trace=True)
    # the timer's resolution first: calibrate refuses a trace whose tick is too coarse
    tick_ns = tr.timer_tick_ns(ex)
    ex.reset()
    tokens = prompt_tokens(model.config.vocab_size, args.context + 1)
    for pos, tok in enumerate(tokens):  # the last step is the traced one
        ex.launch_step(tok, pos, None)
    records = ex.trace_records()
    step_us = tr.step_time_ns(records) / 1e3
    stem = f"trace-{label}-{ex.name}-ctx{args.context}"
    out = Path(args.out)
    meta = {"model": label, "backend": ex.name, "blocks": ex.blocks, "context": args.context,
            "step_us": step_us, **tick_ns}
    rate = tr.ns_per_cycle(records)
    if rate is not None:  # busy and wait times come from the cycle counter (trace.timestamps)
        meta.update(busy_timer="clock64 (cycles, scaled by each block's timer span)",
                    busy_tick_ns=rate)
    print(f"{label} on {ex.name}, {ex.blocks} blocks, traced step at position {args.context}")
    print(tr.format_summary(tr.op_summary(ex, records), step_us))
    jpath = tr.write_chrome_trace(out / f"{stem}.json", tr.trace_events(ex, records), meta)
    print(f"wrote {jpath} (open it in ui.perfetto.dev)")
    try:
        ppath = tr.plot_timeline(out / f"{stem}.png", ex, records,
                                 title=f"{label} on {ex.name}: one decode step at position "
                                       f"{args.context}, {ex.blocks} blocks, {step_us:.1f} us")
    except ImportError as e:  # the GPU machine may lack matplotlib; the JSON has everything
        print(f"monokernel: no PNG timeline: {e}", file=sys.stderr)
        return 0
    print(f"wrote {ppath}")
    return 0
