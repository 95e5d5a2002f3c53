"""``monokernel plan``: the instruction program of one decode step and its CPU-side speed
proxies (instructions and bytes per op, bytes vs weights, counters, critical-path hops), and
with ``--predict GPU`` the cost model's predicted time per op and per token
(kernel/costmodel/): a prediction, never a measurement."""

from __future__ import annotations

import time

H200_SMS = 132


def cmd_plan(args) -> int:
    from ..model.config import ModelConfig
    from ..kernel import costmodel as cm
    from ..kernel.schedule import schedule

    predict = getattr(args, "predict", None)
    batch, prompt = getattr(args, "batch", None), getattr(args, "prompt", None)
    chunk = getattr(args, "chunk", None)
    slices = getattr(args, "input_slices", True)
    from ..kernel.input_slices import MAX_SLICES

    if slices is not True and (not 1 <= slices <= MAX_SLICES or slices & (slices - 1)):
        raise SystemExit(f"monokernel: error: --input-slices must be a power of two in [1, "
                         f"{MAX_SLICES}], got {slices}")
    if slices is not True and (batch is None and prompt is None):
        raise SystemExit("monokernel: error: --input-slices needs --batch B or --prompt P "
                         "(and --predict GPU)")
    if predict:  # bad names and numbers fail now, not after scheduling
        cm.gpu(predict)
        if getattr(args, "design", None):
            cm.design(args.design)
        for flag, v in (("--batch", batch), ("--prompt", prompt), ("--chunk", chunk)):
            if v is not None and v < 1:
                raise SystemExit(f"monokernel: error: {flag} must be >= 1, got {v}")
        if chunk is not None and prompt is None:
            raise SystemExit("monokernel: error: --chunk needs --prompt P")
    else:
        for flag in ("design", "batch", "prompt", "chunk"):
            if getattr(args, flag, None) is not None:
                raise SystemExit(f"monokernel: error: --{flag} needs --predict GPU")
    if args.shape:
        cfg = ModelConfig.from_name(args.shape)
        label = cfg.name
    else:
        from ..model.loader import resolve_model_dir

        d = resolve_model_dir(args.model)
        cfg = ModelConfig.from_hf(d)
        label = cfg.name if cfg.name not in ("", "custom") else d.name
    t0 = time.perf_counter()
    # the program an LLM runs: built for a 2048-position cache (the default max_seq_len), or
    # the context (or prompt) if longer; the split policy depends on it
    # (schedule.default_attn_splits)
    max_seq = max(args.context + 1, (prompt or 0) + 1, min(2048, cfg.max_position_embeddings))
    from ..progress import waiting

    with waiting(f"scheduling and verifying the program of {label} on {args.blocks} blocks"):
        prog = schedule(cfg, args.blocks, max_seq)
    t_sched = time.perf_counter() - t0
    print(plan_report(label, prog, args.context))
    print(f"scheduled and verified in {t_sched:.1f} s")
    if predict:
        print()
        print(predict_report(prog, args.predict, getattr(args, "design", None), args.context))
        from ..kernel.schedule import MAX_STEP_TOKENS

        design = getattr(args, "design", None)
        if batch is not None:  # the program of a kernel of `batch` slots: steps of that many
            many = _tokens_program(cfg, args.blocks, max_seq, prog, design,
                                   min(max(batch, 2), MAX_STEP_TOKENS), slices)
            print()
            print(batch_report(many, args.predict, design, args.context, batch))
        if prompt is not None:  # prompt chunks of the most tokens a step carries
            many = _tokens_program(cfg, args.blocks, max_seq, prog, design, MAX_STEP_TOKENS,
                                   slices)
            print()
            print(prompt_report(many, args.predict, design, prompt, chunk))
    return 0


def _built(d, prog) -> str:
    from ..kernel import costmodel as cm

    if d.name != cm.design_for(prog, tensor_cores=True).name:
        return "not built yet"
    from ..kernel.isa import Op

    return "built: backend option tensor_cores" + (
        f"; input slices: O_PROJ {prog.slices_of(Op.O_PROJ_RESIDUAL)}, DOWN "
        f"{prog.slices_of(Op.DOWN_RESIDUAL)}" if prog.input_slices > 1 else "")


def _tokens_program(cfg, blocks: int, max_seq: int, prog, design_name: str | None,
                    tokens: int, input_slices: bool | int = True):
    """The program a step of many tokens is predicted on: for the built tensor-core design
    (design_for(tensor_cores=True)) and the designs on its segments (attn_segments), the one
    its executor of steps of up to ``tokens`` rows runs (splits fixed by absolute position,
    every step's attention merged by ticket, the mat-muls' token groups the cost model picks
    for that many tokens a step (group_picks.py): a smaller step runs in row tiles where groups would not pay; with
    O_PROJ's and DOWN's input slices chosen per op, as its executor does, or ``input_slices``
    of each); another design takes the default program."""
    from ..kernel import costmodel as cm
    from ..kernel.group_picks import tensor_core_program
    from ..kernel.schedule import tensor_core_splits

    from ..errors import ProgramError

    if design_name is not None and not cm.design(design_name).attn_segments:
        if input_slices is not True:
            raise SystemExit(f"monokernel: error: --input-slices is for the tensor-core "
                             f"program; design {design_name} predicts another")
        return prog
    splits, min_chunk = tensor_core_splits(cfg, blocks, max_seq)
    try:
        return tensor_core_program(cfg, blocks, max_seq, splits, min_chunk, tokens,
                                   input_slices)
    except ProgramError as e:
        raise SystemExit(f"monokernel: error: --input-slices {input_slices}: {e}") from None


def _tokens_design(design_name: str | None, prog):
    """The design a step of many tokens is predicted on: the one named, which must have
    tensor cores, or the one built (design_for the tensor-core program ``prog``: prompts in
    chunks of its tokens a step, the RMS ops' staged rows its shape fits); a named design on
    the built one's segments (attn_segments) takes the same chunks, staged rows and
    residual_in's store (header.residual_in_epilogue)."""
    from ..kernel import costmodel as cm

    built = cm.design_for(prog, tensor_cores=True)
    d = built if design_name is None or cm.design(design_name).name == built.name \
        else cm.design(design_name)
    if not d.tensor_cores:
        raise SystemExit(f"monokernel: error: design {d.name} runs one token per step; "
                         "--batch and --prompt predict a design with many tokens per step "
                         f"({', '.join(n for n, x in cm.DESIGNS.items() if x.tensor_cores)})")
    if d is not built and d.attn_segments:  # another design on its segments: its shape's fit
        d = d.replace(prefill_chunk=built.prefill_chunk,
                      rms_stage_rows=min(d.rms_stage_rows, built.rms_stage_rows),
                      residual_copy_epilogue=built.residual_copy_epilogue)
    return d


def _tiles(st) -> str:
    return ", ".join(f"{op} {c}x{s}" for op, (c, s) in st.tiles.items() if (c, s) != (1, 1)) \
        or "row tiles"


def _floor_line(prog, g, shapes, fmt) -> str:
    """The floor of ``shapes``' steps (costmodel/floor.py) with the tiling built and with the
    input split, formatted by ``fmt`` (us -> text)."""
    from ..kernel.costmodel.floor import step_floor

    built, split = (sum(step_floor(prog.config, s, g, prog.num_blocks, split)[0] for s in shapes)
                    for split in (False, True))
    return (f"floor on {g.name} (no hops, no fixed work: the mat-muls' L2, HBM and mma, "
            f"attention's K/V; costmodel/floor.py): {fmt(built)} with the tiling built (row "
            f"tiles, token groups), {fmt(split)} with the input split")


def batch_report(prog, gpu_name: str, design_name: str | None, context: int,
                 batch: int) -> str:
    """A decode step of ``batch`` sequences at ``context``: per op, the 2D tiles, and last
    ``predicted on <gpu>: <N> us/step, <M> tokens/s at batch <B>``."""
    from ..kernel import costmodel as cm
    from ..kernel.costmodel.tokens import StepShape

    g, d = cm.gpu(gpu_name), _tokens_design(design_name, prog)
    shape = StepShape.decode(batch, context)
    st = cm.Static(prog, context, g, d, shape)
    p = cm.predict(prog, g, d, static=st) if not shape.single else \
        cm.predict(prog, g, d, context)
    one = cm.predict(prog, g, cm.design_for(prog), context)
    lines = [f"cost model (a PREDICTION, not a measurement) of a step of many tokens: "
             f"{g.name}, design {d.name} ({_built(d, prog)}), {batch} sequences at context "
             f"{context}",
             f"{'op':<16} {'busy us':>8} {'path us':>8} {'share':>6}"]
    for r in p.op_rows():
        lines.append(f"{r['op']:<16} {r['busy_mean_us']:>8.2f} {r['critical_us']:>8.1f} "
                     f"{r['critical_us'] / p.total_us:>6.1%}")
    fast, slow = (cm.predict(prog, cm.corner(g.name, f), d, context, shape=shape).tokens_per_s
                  for f in (True, False))
    lines += [f"tiles (token groups x input slices): {_tiles(st)}",
              f"range: low {slow:.0f} / nominal {p.tokens_per_s:.0f} / high {fast:.0f} tokens/s "
              "(every constant at its slow / table / fast end at once)",
              f"as built ({one.design.name}, one token per step): {one.total_us:.0f} us/token, "
              f"{one.tokens_per_s:.0f} tokens/s whatever the batch",
              _floor_line(prog, g, [shape], lambda us: f"{us:.0f} us/step "
                          f"({shape.tokens * 1e6 / us:.0f} tokens/s)"),
              f"predicted on {g.name}: {p.total_us:.0f} us/step, {p.tokens_per_s:.0f} tokens/s "
              f"at batch {batch}"]
    return "\n".join(lines)


def prompt_report(prog, gpu_name: str, design_name: str | None, prompt: int,
                  chunk: int | None) -> str:
    """The time to first token of a ``prompt``-token prompt prefilled ``chunk`` tokens per
    step (one launch), ending with ``predicted time to first token on <gpu>: <N> ms``."""
    from ..kernel import costmodel as cm
    from ..kernel.costmodel.tokens import prefill_shapes

    g, d = cm.gpu(gpu_name), _tokens_design(design_name, prog)
    chunk = chunk or d.prefill_chunk
    steps = [cm.predict(prog, g, d, shape=s) for s in prefill_shapes(prompt, chunk)]
    total = sum(p.step_us for p in steps) + g.launch
    one = cm.predict(prog, g, cm.design_for(prog), prompt // 2)  # the prompt's mean context
    lines = [f"cost model (a PREDICTION, not a measurement) of a {prompt}-token prompt: "
             f"{g.name}, design {d.name} ({_built(d, prog)}), {len(steps)} step"
             f"{'s' if len(steps) != 1 else ''} of up to {chunk} tokens, one launch "
             f"({g.launch:.0f} us)",
             "steps (us): " + ", ".join(f"{p.step_us:.0f}" for p in steps),
             f"as built ({one.design.name}, one token per step): about "
             f"{prompt * one.step_us / 1e3:.0f} ms (its step at the prompt's mean context)",
             _floor_line(prog, g, prefill_shapes(prompt, chunk), lambda us: f"{us / 1e3:.2f} ms"),
             f"predicted time to first token on {g.name}: {total / 1e3:.2f} ms"]
    return "\n".join(lines)


def predict_report(prog, gpu_name: str, design_name: str | None, context: int) -> str:
    """Per-op predicted times, the critical path, the sensitivity to L2 and HBM latency, and
    last the line ``predicted on <gpu>: <N> us/token (<X>x floor)``."""
    from ..kernel import costmodel as cm
    from ..kernel.isa import row_shape

    t0 = time.perf_counter()
    g = cm.gpu(gpu_name)
    d = cm.design(design_name) if design_name else cm.design_for(prog)
    st = cm.Static(prog, context, g, d)
    p = cm.predict(prog, g, d, context, st)
    sens = cm.sensitivity(prog, g, d, context, st)
    low, high = cm.predict_range(prog, gpu_name, d, context)
    t_model = time.perf_counter() - t0
    hp = cm.hop_parts(g, d)
    c = prog.config
    inflight = "mat-vec loads in flight per lane: " + ", ".join(
        f"{what} {R * K}" for what, (L, K, R) in
        (("H", row_shape(c.hidden_size)), ("FFN", row_shape(c.intermediate_size)),
         ("Q", row_shape(c.q_dim))))
    lo_bw, hi_bw = cm.constant_range(g.name, "gemv_bw")
    gemv = (f" (weight streams at {g.gemv_bw / 1e6:.2f}, band {lo_bw:.1f}-{hi_bw:.1f})"
            if d.gemv_rate else "")
    lines = [f"cost model (a PREDICTION, not a measurement): {g.name}, kernel design {d.name}, "
             f"context {context}, {prog.num_blocks} blocks",
             f"constants: HBM {g.hbm_bw / 1e6:.2f} TB/s{gemv}, HBM latency {g.hbm_latency:.2f} us, "
             f"L2 latency {g.l2_latency:.2f} us; {inflight}; hop {sum(hp.values()):.2f} us (signal {hp['signal']:.2f} + propagate "
             f"{hp['propagate']:.2f} + detect {hp['detect']:.2f})", "",
             f"{'op':<16} {'instr':>6} {'busy us':>8} {'max us':>8} {'wait us':>8} "
             f"{'trips':>6} {'path us':>8} {'share':>6}"]
    rows = p.op_rows()
    for r in rows:
        lines.append(f"{r['op']:<16} {r['instructions']:>6} {r['busy_mean_us']:>8.2f} "
                     f"{r['busy_max_us']:>8.2f} {r['wait_mean_us']:>8.2f} {r['trips']:>6.0f} "
                     f"{r['critical_us']:>8.1f} {r['critical_us'] / p.total_us:>6.1%}")
    tail = cm.step_end_us(g, d)
    if tail:
        lines.append(f"{'step end':<16} {'':>6} {'':>8} {'':>8} {'':>8} {'':>6} {tail:>8.1f} "
                     f"{tail / p.total_us:>6.1%}")
    lines.append(f"{'launch':<16} {'':>6} {'':>8} {'':>8} {'':>8} {'':>6} {p.launch_us:>8.1f} "
                 f"{p.launch_us / p.total_us:>6.1%}")
    lines.append("(busy: ready -> end per instruction, mean and max; wait: start -> ready; "
                 "trips: dependent round trips after the wait incl. the weight stream's, median "
                 "of the busy instructions; path: time on the critical path)")
    lines += ["", critical_path_line(p),
              "sensitivity: " + "; ".join(
                  f"{what} " + ", ".join(f"{cm.constant_range(g.name, const)[k]:.2f} us -> "
                                         f"{sens[f'{const}_{tag}']:.0f}"
                                         for k, tag in ((0, "low"), (1, "high")))
                  for what, const in (("L2 latency", "l2_latency"), ("HBM latency", "hbm_latency")))
              + " us/token",
              f"floor: {prog.config.weight_bytes_per_token() / 1e6:.1f} MB weights / "
              f"{g.hbm_bw / 1e6:.2f} TB/s = {p.floor_us:.1f} us; modelled in {t_model:.1f} s",
              f"range: low {low:.0f} / nominal {p.total_us:.0f} / high {high:.0f} us/token "
              "(every constant at its fast / table / slow end at once)"]
    seen = cm.measured_decode(g.name, c, context)
    if seen and d.name == cm.design_for(prog).name:
        shape, at, us = seen
        then = cm.predict(prog, g, d.replace(**cm.MEASURED_KNOBS), at).total_us
        lines.append(f"measured on {g.name.removesuffix('-fit')}: {us:.1f} us/token, {shape} "
                     f"at context {at} ({cm.MEASURED_SOURCE}), a kernel whose every block read "
                     f"the host's flag: {us / then:.2f}x its prediction ({then:.0f} us; "
                     "benchmarks/NOTES.md, \"The first GPU run\")")
    lines.append(f"predicted on {g.name}: {p.total_us:.0f} us/token ({p.x_floor:.2f}x floor)")
    return "\n".join(lines)


def critical_path_line(p) -> str:
    """The critical path: its instructions and hops, the first and last few steps."""
    q = p.program.queues

    def step(node) -> str:
        ins = q[node[0]][node[1]]
        layer = f" L{ins.layer}" if ins.op.name not in ("EMBED", "RMS_LM_HEAD") else ""
        return f"{ins.op.name}{layer} (block {node[0]})"

    chain = p.critical
    shown = [step(n) for n in chain] if len(chain) <= 8 else \
        [step(n) for n in chain[:4]] + [f"... {len(chain) - 7} more ..."] + \
        [step(n) for n in chain[-3:]]
    chained = " (+1 from the previous step's token)" if p.design.steps_per_launch > 1 else ""
    return (f"critical path: {len(chain)} instructions, {p.critical_hops} hops{chained}: "
            + " -> ".join(shown))


def plan_report(label: str, prog, context: int) -> str:
    """The program's CPU-side speed proxies: instructions and bytes per op, bytes vs weights,
    counters, slots, and the dependency hops on one token's critical path."""
    c = prog.config
    weights = {r["op"]: r["bytes"] for r in prog.op_table(0)}
    rows = prog.op_table(context)
    total = sum(r["bytes"] for r in rows)
    wtotal = sum(weights.values())
    model_bytes = c.weight_bytes_per_token()
    lines = [f"model {label}: {c.arch}, {c.num_layers} layers, hidden {c.hidden_size}, "
             f"{c.num_heads}/{c.num_kv_heads} heads x {c.head_dim}, FFN {c.intermediate_size}, "
             f"vocab {c.vocab_size}",
             f"program: {prog.num_blocks} blocks, {prog.attn_splits} attention splits per KV head, "
             f"context {context}", "",
             f"{'op':<16} {'instructions':>12} {'weight MB':>10} {'KV MB':>8} {'total MB':>9} "
             f"{'share':>6} {'max/mean':>8}"]
    balance = weight_balance(prog)
    for r in rows:
        w = weights[r["op"]]
        bal = f"{balance[r['op']]:>8.2f}" if r["op"] in balance else f"{'-':>8}"
        lines.append(f"{r['op']:<16} {r['instructions']:>12} {w / 1e6:>10.3f} "
                     f"{(r['bytes'] - w) / 1e6:>8.3f} {r['bytes'] / 1e6:>9.3f} "
                     f"{r['bytes'] / total if total else 0:>6.1%} {bal}")
    n_ins = sum(r["instructions"] for r in rows)
    lines.append(f"{'total':<16} {n_ins:>12} {wtotal / 1e6:>10.3f} {(total - wtotal) / 1e6:>8.3f} "
                 f"{total / 1e6:>9.3f}")
    lines += ["",
              f"bytes per token:        {total / 1e6:.3f} MB at context {context} "
              f"({wtotal / 1e6:.3f} MB weights + {(total - wtotal) / 1e6:.3f} MB KV)",
              f"model weight bytes:     {model_bytes / 1e6:.3f} MB per token "
              f"(ModelConfig.weight_bytes_per_token); weights read = "
              f"{wtotal / model_bytes:.3f}x, all bytes = {total / model_bytes:.3f}x",
              f"counters:               {prog.num_counters}",
              f"slots per block:        {prog.max_len} (padded with NOOP)",
              f"critical path:          {prog.critical_path_hops()} dependency hops per token",
              "max/mean: per-block weight bytes of the op's worst layer, busiest block over the "
              "mean of all blocks (1.00 = balanced)"]
    return "\n".join(lines)


def weight_balance(prog) -> dict[str, float]:
    """Per weight op: max over its layers of (busiest block's weight bytes / mean over all
    blocks), the balance proxy of PERFORMANCE.md section 5 (target <= 1.1)."""
    per: dict[tuple[str, int], list[int]] = {}
    for q in prog.queues:
        for ins in q:
            if ins.weight_bytes:
                per.setdefault((ins.op.name, ins.layer), []).append(ins.weight_bytes)
    out: dict[str, float] = {}
    for (op, _layer), b in per.items():
        ratio = max(b) / (sum(b) / prog.num_blocks)
        out[op] = max(out.get(op, 0.0), ratio)
    return out
