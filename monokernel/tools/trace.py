"""Per-instruction timelines of one decode step, from a kernel built with MK_TRACE.

Each block's thread 0 records three timestamps per instruction (isa.TraceWord): START before the
counter wait, READY when the wait is satisfied, END after the signal; NOOP slots stay zero. Times
come from %globaltimer on the GPU and a steady clock in the emulator, in nanoseconds; everything
here is normalised to the earliest START of the step and reported in microseconds.

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


def _recorded(executor, records: np.ndarray):
    """Yield (block, slot, instruction, start, ready, end) in ns relative to the step's start,
    for every non-NOOP instruction that ran in the traced step; ready == start when the
    instruction has no counter wait."""
    p = executor.program
    t0 = _step_origin(records)
    for b, q in enumerate(p.queues):
        for i, ins in enumerate(q):
            if ins.op == Op.NOOP:
                continue
            r = records[b, i]
            if r[TraceWord.END] == 0:
                raise ValueError(f"block {b} slot {i} ({ins.op.name}) has no trace record: was "
                                 "the executor built with trace=True and a step run?")
            start = int(r[TraceWord.START]) - t0
            # without a wait, START..READY is bookkeeping, counted as the op's own time
            ready = int(r[TraceWord.READY]) - t0 if ins.wait is not None else start
            yield b, i, ins, start, ready, int(r[TraceWord.END]) - t0


def _step_origin(records: np.ndarray) -> int:
    starts = records[..., TraceWord.START]
    starts = starts[starts > 0]
    if not starts.size:
        raise ValueError("the trace records are empty (no traced step ran)")
    return int(starts.min())


def step_time_ns(records: np.ndarray) -> int:
    """Earliest START to latest END of the traced step."""
    ends = records[..., TraceWord.END]
    return int(ends.max()) - _step_origin(records)


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
