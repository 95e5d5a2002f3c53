"""Per-instruction timelines of one decode step, from a kernel built with MK_TRACE.

Each block's thread 0 records three moments per instruction (isa.TraceWord): START before the
counter wait, READY when the wait is satisfied, END after the signal; NOOP slots stay zero. Each
is stamped twice: %globaltimer (ns, the same clock on every SM, but it may tick every 32 ns to 1
us) and clock64 (the SM's cycle counter). ``timestamps`` places a block's moments by its cycle
counter, converted to ns by the block's own %globaltimer span over the step and anchored at its
first START: times within a block (busy, wait) at cycle resolution, blocks aligned to one
%globaltimer tick. In the emulator both clocks are the host's steady clock. Everything here is
normalised to the earliest START of the step and reported in microseconds.

``trace_events`` -> Chrome/Perfetto JSON (open in ui.perfetto.dev or chrome://tracing): one track
(tid) per block, an op slice READY..END named "<OP> L<layer>", and a "wait" slice START..READY
for every instruction that waits on a counter.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..kernel.isa import Op, TraceWord


def timer_tick_ns(executor) -> dict:
    """The resolution of the clock the trace's timestamps come from, measured before the traced
    step and written into the trace's metadata: ``monokernel calibrate`` refuses a trace whose
    tick is too coarse for the ops it fits. On the GPU %globaltimer (its tick differs between
    GPUs and drivers, often 32 ns or 1 us); on the emulator the host's steady clock."""
    device = executor.device
    if hasattr(device, "timer_tick_ns"):
        tick, distinct = device.timer_tick_ns()
        return {"timer": "%globaltimer", "timer_tick_ns": int(tick),
                "timer_distinct_in_4096_reads": int(distinct)}
    import time

    res = time.get_clock_info("monotonic").resolution
    return {"timer": "host steady clock (emulator)", "timer_tick_ns": max(1, int(res * 1e9))}


_GT = [TraceWord.START, TraceWord.READY, TraceWord.END]
_CLK = [TraceWord.START_CLK, TraceWord.READY_CLK, TraceWord.END_CLK]


def timestamps(records: np.ndarray) -> np.ndarray:
    """float64 [blocks, slots, 3]: START, READY, END in ns after the step's earliest START
    (NaN where no instruction ran). A block whose records carry cycle counts is placed by them:
    ns per cycle = its %globaltimer span / its cycle span over the step (first START to last
    END: thousands of ticks, so the rate is exact to a tick over the span), from its first
    START's %globaltimer. Records without cycle counts (older traces, the cost model's
    synthetic ones) keep their %globaltimer stamps."""
    ran = records[..., TraceWord.END] > 0
    if not ran.any():
        raise ValueError("the trace records are empty (no traced step ran)")
    t0 = int(records[..., TraceWord.START][ran].min())
    # integers first: %globaltimer counts ns since an epoch (~1.7e18), past float64's 53 bits
    gt = (records[..., _GT].astype(np.int64) - t0).astype(np.float64)
    out = np.where(ran[..., None], gt, np.nan)
    for b in range(records.shape[0]):
        slots = np.flatnonzero(ran[b])
        if not slots.size or not (records[b, slots][:, _CLK] > 0).all():
            continue
        first = slots[np.argmin(gt[b, slots, 0])]
        last = slots[np.argmax(gt[b, slots, 2])]
        clk = (records[b][:, _CLK].astype(np.int64)
               - int(records[b, first, TraceWord.START_CLK])).astype(np.float64)
        span_gt, span_clk = gt[b, last, 2] - gt[b, first, 0], clk[last, 2]
        if span_gt <= 0 or span_clk <= 0:
            continue
        out[b, slots] = gt[b, first, 0] + clk[slots] * (span_gt / span_clk)
    return out


def ns_per_cycle(records: np.ndarray) -> float | None:
    """The median over blocks of the cycle counter's ns per cycle (None without cycle counts):
    the resolution of the busy times ``timestamps`` gives."""
    rates = []
    ran = records[..., TraceWord.END] > 0
    for b in range(records.shape[0]):
        slots = np.flatnonzero(ran[b])
        if not slots.size or not (records[b, slots][:, _CLK] > 0).all():
            continue
        gt = records[b, slots][:, _GT].astype(np.int64)
        clk = records[b, slots][:, _CLK].astype(np.int64)
        span_gt = int(gt[:, 2].max() - gt[:, 0].min())
        span_clk = int(clk[:, 2].max() - clk[:, 0].min())
        if span_gt > 0 and span_clk > 0:
            rates.append(span_gt / span_clk)
    return float(np.median(rates)) if rates else None


def _recorded(executor, records: np.ndarray):
    """Yield (block, slot, instruction, start, ready, end) in ns relative to the step's start
    (``timestamps``), for every non-NOOP instruction that ran in the traced step; ready ==
    start when the instruction has no counter wait."""
    p = executor.program
    ts = timestamps(records)
    for b, q in enumerate(p.queues):
        for i, ins in enumerate(q):
            if ins.op == Op.NOOP:
                continue
            if records[b, i, TraceWord.END] == 0:
                raise ValueError(f"block {b} slot {i} ({ins.op.name}) has no trace record: was "
                                 "the executor built with trace=True and a step run?")
            start, ready, end = (float(x) for x in ts[b, i])
            # without a wait, START..READY is bookkeeping, counted as the op's own time
            yield b, i, ins, start, (ready if ins.wait is not None else start), end


def step_time_ns(records: np.ndarray) -> float:
    """Earliest START to latest END of the traced step."""
    return float(np.nanmax(timestamps(records)[..., 2]))


def trace_events(executor, records: np.ndarray) -> list[dict]:
    """Chrome trace events ("X" complete events, microseconds) of the traced step."""
    names = executor.program.counter_names
    events: list[dict] = [
        {"name": "thread_name", "ph": "M", "ts": 0, "dur": 0, "pid": 0, "tid": b,
         "args": {"name": f"block {b}"}} for b in range(executor.program.num_blocks)]
    for b, i, ins, start, ready, end in _recorded(executor, records):
        label = f"{ins.op.name} L{ins.layer}"
        if ins.wait is not None:
            events.append({"name": "wait", "cat": "wait", "ph": "X", "pid": 0, "tid": b,
                           "ts": start / 1e3, "dur": (ready - start) / 1e3,
                           "args": {"slot": i, "for": label, "counter": names[ins.wait[0]],
                                    "signals": ins.wait[1]}})
        events.append({"name": label, "cat": "op", "ph": "X", "pid": 0, "tid": b,
                       "ts": ready / 1e3, "dur": (end - ready) / 1e3,
                       "args": {"slot": i, "op": ins.op.name, "layer": ins.layer,
                                "tiles": list(ins.tile)}})
    return events


def write_chrome_trace(path: str | Path, events: list[dict], metadata: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"traceEvents": events, "displayTimeUnit": "ns"}
    if metadata:
        doc["otherData"] = metadata
    path.write_text(json.dumps(doc))
    return path


def op_summary(executor, records: np.ndarray) -> list[dict]:
    """Per op, in step order: instructions, and per-block mean of time spent in it (wait +
    compute) and of time spent waiting on counters, with its share of the step. A block runs its
    instructions one after another, so the times of all ops sum to at most the step time; the
    rest is instruction fetch and the blocks' different finishing times."""
    nb = executor.program.num_blocks
    step = step_time_ns(records)
    rows: dict[Op, dict] = {}
    for _b, _i, ins, start, ready, end in _recorded(executor, records):
        r = rows.setdefault(ins.op, {"op": ins.op.name, "instructions": 0, "wait_ns": 0,
                                     "total_ns": 0})
        r["instructions"] += 1
        r["wait_ns"] += ready - start
        r["total_ns"] += end - start
    out = []
    for op in Op:
        if op not in rows:
            continue
        r = rows[op]
        total, wait = r["total_ns"] / nb / 1e3, r["wait_ns"] / nb / 1e3
        out.append({"op": r["op"], "instructions": r["instructions"], "time_us": total,
                    "wait_us": wait, "compute_us": total - wait,
                    "share": total * 1e3 / step if step else 0.0})
    return out


def format_summary(rows: list[dict], step_us: float) -> str:
    lines = [f"{'op':<16} {'instr':>6} {'time us':>10} {'wait us':>10} {'compute us':>11} "
             f"{'share':>6}"]
    for r in rows:
        lines.append(f"{r['op']:<16} {r['instructions']:>6} {r['time_us']:>10.1f} "
                     f"{r['wait_us']:>10.1f} {r['compute_us']:>11.1f} {r['share']:>6.1%}")
    t = sum(r["time_us"] for r in rows)
    w = sum(r["wait_us"] for r in rows)
    lines.append(f"{'all ops':<16} {sum(r['instructions'] for r in rows):>6} {t:>10.1f} "
                 f"{w:>10.1f} {t - w:>11.1f} {t / step_us if step_us else 0:>6.1%}")
    lines.append(f"step: {step_us:.1f} us (per-block means; the rest is fetch and idle tails)")
    return "\n".join(lines)


def plot_timeline(path: str | Path, executor, records: np.ndarray, title: str = "") -> Path:
    """PNG: one row per block, op slices coloured by op, counter waits hatched grey."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    nb = executor.program.num_blocks
    ops = [op for op in Op if op != Op.NOOP]
    colours = {op: f"C{k}" for k, op in enumerate(ops)}
    fig = Figure(figsize=(14, max(2.8, 0.22 * nb + 1.8)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    spans: dict[tuple, list] = {}
    for b, _i, ins, start, ready, end in _recorded(executor, records):
        if ins.wait is not None:
            spans.setdefault((b, "wait"), []).append((start / 1e3, (ready - start) / 1e3))
        spans.setdefault((b, ins.op), []).append((ready / 1e3, (end - ready) / 1e3))
    for (b, kind), bars in spans.items():
        if kind == "wait":
            ax.broken_barh(bars, (b - 0.4, 0.8), facecolors="0.85", edgecolors="0.6",
                           hatch="///", linewidth=0.2)
        else:
            ax.broken_barh(bars, (b - 0.4, 0.8), facecolors=colours[kind], linewidth=0)
    ax.set_ylim(nb - 0.5, -0.5)
    ax.set_xlim(0, step_time_ns(records) / 1e3)
    ax.set_xlabel("time since the step started (us)")
    ax.set_ylabel("block")
    ax.set_title(title or f"{executor.name}: one decode step, {nb} blocks")
    handles = [Patch(facecolor=colours[op], label=op.name) for op in ops]
    handles.append(Patch(facecolor="0.85", edgecolor="0.6", hatch="///", label="counter wait"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
