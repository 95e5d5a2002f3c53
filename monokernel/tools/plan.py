"""``monokernel plan``: the instruction program of one decode step and its CPU-side speed
proxies (instructions and bytes per op, bytes vs weights, counters, critical-path hops)."""

from __future__ import annotations

import time

H200_SMS = 132


def cmd_plan(args) -> int:
    from ..model.config import ModelConfig
    from ..kernel.scheduler import schedule

    if args.shape:
        cfg = ModelConfig.from_name(args.shape)
        label = cfg.name
    else:
        from ..model.loader import resolve_model_dir

        d = resolve_model_dir(args.model)
        cfg = ModelConfig.from_hf(d)
        label = cfg.name if cfg.name not in ("", "custom") else d.name
    t0 = time.perf_counter()
    prog = schedule(cfg, args.blocks, args.context + 1)
    t_sched = time.perf_counter() - t0
    print(plan_report(label, prog, args.context))
    print(f"scheduled and verified in {t_sched:.1f} s")
    return 0


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
             f"{'share':>6}"]
    for r in rows:
        w = weights[r["op"]]
        lines.append(f"{r['op']:<16} {r['instructions']:>12} {w / 1e6:>10.3f} "
                     f"{(r['bytes'] - w) / 1e6:>8.3f} {r['bytes'] / 1e6:>9.3f} "
                     f"{r['bytes'] / total if total else 0:>6.1%}")
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
              f"critical path:          {prog.critical_path_hops()} dependency hops per token"]
    return "\n".join(lines)
