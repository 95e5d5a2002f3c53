"""``monokernel calibrate TRACE.json``: fit the cost model's constants to a measured step.

The trace is the Perfetto JSON that ``monokernel trace`` writes (tools/trace.py): per block and
instruction slot, a "wait" slice START..READY and an op slice READY..END, and in ``otherData``
the model, backend, blocks and context. The program is scheduled again from those, and the
constants the model is least sure of are fitted by least squares (Levenberg-Marquardt on the
relative error of every instruction's busy time READY..END, plus the hop gaps READY minus the
counter's last signal END): L2 latency, HBM latency, the achieved HBM bandwidth, the
signal's fence (inside the producer's busy time) and the poll loop's sleep (the rest of the
hop gap). The fit uses each instruction's measured lead (how long
its prefetch ran before the wait returned), so it reads the kernel's phases, not the schedule.

Then it prints, per op, the measured busy time beside the prediction with the starting and the
fitted constants, and the whole step re-simulated. A trace from the CPU emulator runs too, but
its timings are CPU timings, not GPU timings: the fitted numbers then describe that CPU.
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ..errors import CostModelError
from ..kernel import costmodel as cm
from ..kernel.isa import Op, TraceWord, TRACE_WORDS

# The constants the fit moves (those the design's time depends on: fit_constants); everything
# else keeps its table value.
FIT = ("l2_latency", "hbm_latency", "hbm_bw", "fence", "nanosleep")


def fit_constants(d: cm.KernelDesign) -> tuple[str, ...]:
    """FIT as the design uses it: the weight stream's rate is gemv_bw where the design streams
    at the GEMV rate, the signal's barrier is a release add where it has no SC fence, and a
    poll loop without a sleep has no nanosleep to fit (a constant the design never reads would
    be left to drift: the fit cannot see it)."""
    out = ["l2_latency", "hbm_latency", "gemv_bw" if d.gemv_rate else "hbm_bw",
           "fence" if d.signal_sc_fence else "release"]
    return tuple(out + (["nanosleep"] if d.poll_sleep else []))
BOUND = np.log(1e4)  # no constant moves more than 10^4x from the table's value
# A timestamp is off by up to one tick of the trace's timer, a busy time (two stamps) by up to two:
# the fit refuses a trace whose tick is more than this share of the fitted ops' median busy time.
MAX_TICK_SHARE = 0.1
_LABELS = {"l2_latency": ("L2 latency", "us", 1.0), "hbm_latency": ("HBM latency", "us", 1.0),
           "hbm_bw": ("HBM bandwidth", "TB/s", 1e-6), "fence": ("signal fence", "us", 1.0),
           "nanosleep": ("poll sleep", "us", 1.0), "release": ("signal release", "us", 1.0),
           "gemv_bw": ("GEMV bandwidth", "TB/s", 1e-6)}


# ================================================================================================
# Reading a trace
# ================================================================================================
def load_trace(path: str | Path) -> tuple[dict, list[dict]]:
    """(otherData, traceEvents) of a trace JSON written by ``monokernel trace``, or of the same
    gzipped (``.json.gz``: how benchmarks/results keeps a GPU's trace)."""
    path = Path(path)
    if not path.is_file():
        raise CostModelError(f"{path}: no such trace file")
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        doc = json.loads(raw.decode())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError) as e:
        raise CostModelError(f"{path}: not a JSON trace ({e})") from None
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise CostModelError(f"{path}: no traceEvents: not a trace written by `monokernel trace`")
    meta = doc.get("otherData") or {}
    for key in ("blocks", "context"):
        if key not in meta:
            raise CostModelError(f"{path}: otherData has no {key!r}: not a trace written by "
                                 "`monokernel trace`")
    return meta, doc["traceEvents"]


def measured(program, events: list[dict], path: str = "trace") -> tuple[np.ndarray, ...]:
    """start, ready, end [blocks, slots] in us (NaN where the program has a NOOP). Checks that
    the trace's instructions are the program's, slot by slot."""
    B, L = program.num_blocks, program.max_len
    start, ready, end = (np.full((B, L), np.nan) for _ in range(3))
    for ev in events:
        if ev.get("ph") != "X":
            continue
        b, args = int(ev["tid"]), ev.get("args", {})
        i = int(args.get("slot", -1))
        if not (0 <= b < B and 0 <= i < len(program.queues[b])):
            raise CostModelError(f"{path}: event {ev.get('name')!r} at block {b} slot {i} is "
                                 f"outside the program ({B} blocks): pass the traced model's "
                                 "--shape or --model")
        ins = program.queues[b][i]
        ts, dur = float(ev["ts"]), float(ev["dur"])
        if ev.get("cat") == "wait":
            start[b, i], ready[b, i] = ts, ts + dur
            continue
        if args.get("op") != ins.op.name or int(args.get("layer", -1)) != ins.layer:
            raise CostModelError(
                f"{path}: block {b} slot {i} is {args.get('op')} L{args.get('layer')} in the "
                f"trace but {ins.op.name} L{ins.layer} in the program: the trace comes from "
                "another model or schedule (pass its --shape or --model)")
        if ins.wait is None:
            start[b, i] = ts
        ready[b, i], end[b, i] = ts, ts + dur
    ran = [(b, i) for b, q in enumerate(program.queues) for i, ins in enumerate(q)
           if ins.op != Op.NOOP]
    missing = [(b, i) for b, i in ran if np.isnan(end[b, i]) or np.isnan(start[b, i])]
    if missing:
        b, i = missing[0]
        raise CostModelError(f"{path}: {len(missing)} instruction(s) have no record, first "
                             f"{program.queues[b][i].label(b, i)}")
    return start, ready, end


# ================================================================================================
# The fit
# ================================================================================================
class Fit:
    """The calibration problem of one program at one context: measured busy times and hop gaps
    against ``costmodel.busy_us`` with the measured leads."""

    def __init__(self, program, context: int, g0: cm.GPU, d: cm.KernelDesign,
                 start: np.ndarray, ready: np.ndarray, end: np.ndarray):
        self.program, self.g0, self.d = program, g0, d
        self.keys = fit_constants(d)
        st = cm.Static(program, context, g0, d)
        queues = program.queues
        nodes = [(b, i) for b, q in enumerate(queues) for i, ins in enumerate(q)
                 if ins.op != Op.NOOP]
        self.nodes = nodes
        bi = tuple(np.array(nodes).T)
        self.arrays = {k: v[bi] for k, v in st.fields.items()}
        self.lead = ready[bi] - start[bi]
        self.busy = end[bi] - ready[bi]
        self.signals = np.array([queues[b][i].signal is not None for b, i in nodes], np.float64)
        self.ops = np.array([queues[b][i].op for b, i in nodes])
        # hop gaps: READY - the counter's count-th signal END, where the block waited for it
        ends: dict[int, list[float]] = {}
        for b, q in enumerate(queues):
            for i, ins in enumerate(q):
                if ins.signal is not None and ins.op != Op.NOOP:
                    ends.setdefault(ins.signal, []).append(end[b, i])
        for v in ends.values():
            v.sort()
        gaps = []
        for b, i in nodes:
            ins = queues[b][i]
            if ins.wait is None or ins.wait[0] not in ends:
                continue
            c, need = ins.wait
            last = ends[c][need - 1]
            if start[b, i] < last < ready[b, i]:
                gaps.append(ready[b, i] - last)
        self.gaps = np.array(gaps)

    def gpu(self, x: np.ndarray) -> cm.GPU:
        x0 = self.x0()
        x = np.clip(x, x0 - BOUND, x0 + BOUND)
        return self.g0.replace(**{k: float(np.exp(v)) for k, v in zip(self.keys, x)})

    def x0(self) -> np.ndarray:
        return np.log([getattr(self.g0, k) for k in self.keys])

    def predicted_busy(self, g: cm.GPU) -> np.ndarray:
        a = self.arrays
        k = cm.busy_constants(g, self.d, self.program.num_blocks)
        return cm.busy_us(k, a["l2"], a["hbm"], a["other"], a["rounds"], a["bytes"], a["pref"],
                          self.lead, self.signals, np.minimum, np.maximum, early=a["early"],
                          issue=a["issue"])

    def predicted_gap(self, g: cm.GPU) -> float:
        p = cm.hop_parts(g, self.d)
        return p["propagate"] + p["detect"]

    def residuals(self, x: np.ndarray) -> np.ndarray:
        g = self.gpu(x)
        r = (self.predicted_busy(g) - self.busy) / (self.busy + 0.5)
        if len(self.gaps):
            rg = (self.predicted_gap(g) - self.gaps) / (self.gaps + 0.5)
            r = np.concatenate([r, rg * np.sqrt(len(r) / len(rg))])  # the gaps weigh as much
        return r

    def solve(self, iters: int = 60) -> cm.GPU:
        """Levenberg-Marquardt from the table's constants, in log space, within BOUND."""
        with np.errstate(all="ignore"):
            return self.gpu(levenberg_marquardt(self.residuals, self.x0(), iters))


def levenberg_marquardt(fun, x0: np.ndarray, iters: int = 60) -> np.ndarray:
    """Minimise |fun(x)|^2 (forward-difference Jacobian; a handful of parameters)."""
    x = np.asarray(x0, np.float64).copy()
    r = fun(x)
    cost = float(r @ r)
    lam = 1e-3
    for _ in range(iters):
        J = np.empty((len(r), len(x)))
        for j in range(len(x)):
            xp = x.copy()
            xp[j] += 1e-6
            J[:, j] = (fun(xp) - r) / 1e-6
        A, grad = J.T @ J, J.T @ r
        while True:
            step = -np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), grad)
            rn = fun(x + step)
            cn = float(rn @ rn)
            if cn < cost:
                x, r, cost = x + step, rn, cn
                lam = max(lam / 3, 1e-12)
                break
            lam *= 4
            if lam > 1e12:
                return x
        if np.abs(step).max() < 1e-10:
            break
    return x


# ================================================================================================
# A synthetic trace from the model itself (for tests, and to see what a trace will look like)
# ================================================================================================
def write_synthetic_trace(pred: cm.Prediction, path: str | Path, model: str) -> Path:
    """Write the prediction's timeline as the trace ``monokernel trace`` would write, through
    tools/trace.py's own writer."""
    from . import trace as tr

    prog = pred.program
    records = np.zeros((prog.num_blocks, prog.max_len, TRACE_WORDS), np.uint64)
    t0 = 1_000_000  # ns; a zero START means "not recorded"
    for b, q in enumerate(prog.queues):
        for i, ins in enumerate(q):
            if ins.op == Op.NOOP:
                continue
            if np.isnan(pred.end[b, i]):
                raise CostModelError(f"{ins.label(b, i)} was not simulated: only "
                                     "programs whose every instruction runs make a trace")
            for word, t in ((TraceWord.START, pred.start[b, i]),
                            (TraceWord.READY, pred.ready[b, i]), (TraceWord.END, pred.end[b, i])):
                records[b, i, word] = t0 + int(round(t * 1e3))
    ex = SimpleNamespace(program=prog, name="costmodel")
    step_us = tr.step_time_ns(records) / 1e3
    meta = {"model": model, "backend": f"costmodel-{pred.gpu.name}-{pred.design.name}",
            "blocks": prog.num_blocks, "context": pred.context, "step_us": step_us,
            "timer": "cost model (rounded to ns)", "timer_tick_ns": 1}
    return tr.write_chrome_trace(path, tr.trace_events(ex, records), meta)


# ================================================================================================
# The command
# ================================================================================================
def _config(args, meta: dict, path: str):
    from ..model.config import ModelConfig

    if getattr(args, "shape", None):
        return ModelConfig.from_name(args.shape)
    if getattr(args, "model", None):
        from ..model.loader import resolve_model_dir

        return ModelConfig.from_hf(resolve_model_dir(args.model))
    from ..errors import ConfigError

    name = str(meta.get("model", ""))
    try:
        return ModelConfig.from_name(name)
    except ConfigError:
        raise CostModelError(f"{path}: the traced model {name!r} is not a known shape: pass "
                             "--model DIR (or --shape NAME) for it") from None


def check_tick(fit: "Fit", meta: dict, path: str = "trace") -> str | None:
    """Refuse (CostModelError) a trace whose timer tick is too coarse for the busy times it
    fits; return a note when the trace does not say its tick (written before it was
    recorded). A trace whose busy times come from the cycle counter (``busy_tick_ns``: ns
    per cycle, tools/trace.py timestamps) is judged by that resolution, not %globaltimer's."""
    tick = meta.get("busy_tick_ns", meta.get("timer_tick_ns"))
    if tick is None:
        return ("NOTE: this trace does not record its timer's tick (an older `monokernel "
                "trace`): the busy times below may be quantised.")
    busy = fit.busy[fit.busy > 0]
    median_us = float(np.median(busy)) if busy.size else 0.0
    tick_us = float(tick) / 1e3
    if tick_us <= 0 or tick_us > MAX_TICK_SHARE * median_us:
        raise CostModelError(
            f"{path}: the trace's timer ({meta.get('busy_timer', meta.get('timer', 'timer'))}) "
            f"ticks every {tick} ns, "
            f"too coarse for ops whose median busy time is {median_us:.3f} us (a fit needs a "
            f"tick <= {MAX_TICK_SHARE:.0%} of it): the fitted constants would describe the "
            "timer, not the GPU")
    return None


def calibrate_report(program, context: int, g0: cm.GPU, d: cm.KernelDesign, start, ready, end,
                     meta: dict, path: str = "trace") -> tuple[str, cm.GPU]:
    fit = Fit(program, context, g0, d, start, ready, end)
    note = check_tick(fit, meta, path)
    t0 = time.perf_counter()
    g1 = fit.solve()
    t_fit = time.perf_counter() - t0
    lines = [note, ""] if note else []
    backend = str(meta.get("backend", "?"))
    if backend.startswith("emulator"):
        lines += ["NOTE: this trace comes from the CPU emulator: its timings are CPU timings, not "
                  "GPU timings, so the fitted constants below describe this CPU, not a GPU.", ""]
    lines.append(f"{'constant':<16} {'start (' + g0.name + ')':>14} {'fitted':>12}")
    for k in fit.keys:
        label, unit, scale = _LABELS[k]
        lines.append(f"{label:<16} {getattr(g0, k) * scale:>11.3f} {unit:<4} "
                     f"{getattr(g1, k) * scale:>9.3f} {unit}")
    hop0, hop1 = cm.hop_latency(g0, d), cm.hop_latency(g1, d)
    gap = f"{np.median(fit.gaps):.3f} us" if len(fit.gaps) else "none waited"
    lines.append(f"{'hop':<16} {hop0:>11.3f} us   {hop1:>9.3f} us   (measured READY - last "
                 f"signal END, median: {gap})")
    lines.append("")
    b0, b1 = fit.predicted_busy(g0), fit.predicted_busy(g1)
    lines.append(f"{'op':<16} {'instr':>6} {'measured us':>12} {'start us':>10} {'fitted us':>10} "
                 f"{'fitted/meas':>12}")
    for op in Op:
        sel = fit.ops == op
        if not sel.any():
            continue
        m, f1 = fit.busy[sel].mean(), b1[sel].mean()
        lines.append(f"{op.name:<16} {int(sel.sum()):>6} {m:>12.3f} {b0[sel].mean():>10.3f} "
                     f"{f1:>10.3f} {f1 / m if m > 0 else float('nan'):>12.2f}")
    lines.append("(busy time READY -> END per instruction, mean over its instructions; start: "
                 "the table's constants; fitted: the constants above; both with the measured "
                 "leads)")
    p0 = cm.predict(program, g0, d, context)
    p1 = cm.predict(program, g1, d, context)
    m_step = float(np.nanmax(end) - np.nanmin(start))
    s0, s1 = (float(np.nanmax(p.end) - np.nanmin(p.start)) for p in (p0, p1))
    lines += ["", f"step: measured {m_step:.1f} us; simulated {s1:.1f} us with the fitted "
              f"constants, {s0:.1f} us with the table's (first START to last END); fit in "
              f"{t_fit:.1f} s"]
    return "\n".join(lines), g1


def cmd_calibrate(args) -> int:
    from ..kernel.schedule import schedule

    if getattr(args, "probes", None):
        from .probes import load_probes, probes_report

        print(probes_report(load_probes(args.probes), args.gpu.lower()))
        if not args.trace:
            return 0
    elif not args.trace:
        raise CostModelError("calibrate needs a trace JSON (`monokernel trace`), --probes "
                             "SMOKE_JSON, or both")
    meta, events = load_trace(args.trace)
    g0 = cm.gpu(args.gpu)
    cfg = _config(args, meta, args.trace)
    blocks, context = int(meta["blocks"]), int(meta["context"])
    prog = schedule(cfg, blocks, context + 1)
    d = cm.design(args.design) if args.design else cm.design_for(prog)
    start, ready, end = measured(prog, events, args.trace)
    print(f"{Path(args.trace).name}: {meta.get('model', cfg.name)} on {meta.get('backend', '?')}, "
          f"{blocks} blocks, context {context}; kernel design {d.name}", file=sys.stdout)
    report, _g = calibrate_report(prog, context, g0, d, start, ready, end, meta, args.trace)
    print(report)
    return 0
