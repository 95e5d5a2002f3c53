"""The GPU check's first GPU step (ARCHITECTURE section 9): in well under a minute, prove that
the kernel compiles for every shape, that one step of each agrees with the NumPy reference, that
it fits (registers, shared memory, no spills), that the watchdog names a stuck instruction, where
the blocks run (%smid of every block), how fine %globaltimer ticks, how fast L2 serves one SM,
every SM and every SM the same lines (the cost model's l2_bw), how fast HBM streams into every
SM by loads, cp.async and cp.async.bulk (its gemv_bw and hbm_bw), and whether blocks in
thread-block clusters of 2 and 4 fill every SM at once (its input_multicast lever). Nothing
here is a benchmark of the kernel; it exists so that a broken build costs seconds of GPU time,
not minutes.

The cheap probes come first (timer tick, L2 read, HBM stream, cluster placement, block
placement, watchdog: one shape, one step each), then one step of every shape, and
DIR/smoke.json is rewritten after every check, so a step stopped at its time limit still says
what it proved.

    python -m monokernel.tools.smoke --out DIR [--backend cuda|emulator] [--shapes a,b,c]
                                     [--max-seq N] [--probes-only]

--probes-only: the GPU's own probes (timer tick, L2 read, HBM stream, cluster placement) and
nothing else (the tensor-core GPU check runs these alone).

Writes DIR/smoke.json (every check, pass or fail, with its numbers) and exits 1 if one failed.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

GPU_SHAPES = ("smollm2-135m", "qwen3-0.6b", "llama-3.2-1b")
RTOL_OF_MAX = 2e-3  # as the GPU tests (tests/kernel/test_cuda_backend.py)
MAX_SEQ = 64  # default KV-cache length; the GPU check passes its one length (--max-seq)
TOKEN = 517


class Checks:
    """Runs named checks, records each outcome; one failing check does not stop the others."""

    def __init__(self, log=print, on_row=None):
        self.rows: list[dict] = []
        self.log = log
        self.on_row = on_row  # called after every check (smoke.json is rewritten)

    def run(self, name: str, fn) -> object:
        t0 = time.perf_counter()
        row = {"check": name}
        try:
            info = fn()
            row.update(ok=True, **(info or {}))
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {e}",
                       traceback=traceback.format_exc(limit=4))
        row["seconds"] = round(time.perf_counter() - t0, 2)
        self.rows.append(row)
        detail = {k: v for k, v in row.items() if k not in ("check", "ok", "traceback")}
        self.log(f"{'PASS' if row['ok'] else 'FAIL'} {name}: {detail}")
        if self.on_row is not None:
            self.on_row()
        return row

    @property
    def ok(self) -> bool:
        return all(r["ok"] for r in self.rows)


def one_step(backend: str, model, blocks: int | None,
             max_seq: int = MAX_SEQ) -> dict:
    """Compile, run one step at position 0, compare the logits with the reference."""
    from ..kernel.base import DeviceSample
    from ..model.reference import greedy_reference_run
    from ..runtime import make_executor

    t0 = time.perf_counter()
    ex = make_executor(backend, model, max_seq, **({"blocks": blocks} if blocks else {}))
    t_build = time.perf_counter() - t0
    ex.reset()
    ex.poison()
    logits = ex.step(TOKEN, 0).logits
    ref = greedy_reference_run(model, [TOKEN], 1)[1][0]  # prepare's, from the cache
    if not np.isfinite(logits).all():
        raise AssertionError("non-finite logits")
    err = float(np.max(np.abs(logits.astype(np.float64) - ref)) / np.max(np.abs(ref)))
    if not err <= RTOL_OF_MAX:
        raise AssertionError(f"max|kernel - ref| = {err:.3g} * max|ref| > {RTOL_OF_MAX}")
    ex.reset()
    tok = ex.step(TOKEN, 0, DeviceSample(0.0, 0)).token
    if tok != int(np.argmax(ref)):
        raise AssertionError(f"device greedy token {tok} != reference argmax {int(np.argmax(ref))}")
    res = ex.device.resources(ex.module)
    spills = {n: r["local_bytes"] for n, r in res.items() if r.get("local_bytes")}
    if spills:
        raise AssertionError(f"local (spill) bytes per kernel: {spills}")
    mk = res.get("megakernel", {})
    return {"blocks": ex.blocks, "build_s": round(t_build, 2), "rel_err": err,
            "megakernel": mk, "kernels": len(res)}


def watchdog(backend: str, model, blocks: int | None,
             max_seq: int = MAX_SEQ) -> dict:
    """One wait made unsatisfiable (the LM head's, which no later instruction of the step
    waits on): the watchdog stops every block and the error names that instruction."""
    from ..errors import KernelError
    from ..kernel.schedule import schedule
    from ..runtime import make_executor

    probe = make_executor(backend, model, max_seq, **({"blocks": blocks} if blocks else {}))
    prog = copy.deepcopy(schedule(model.config, probe.blocks, max_seq))
    last = max((i, b) for b, q in enumerate(prog.queues) for i, ins in enumerate(q)
               if ins.wait is not None)
    i, b = last
    ins = prog.queues[b][i]
    ins.wait = (ins.wait[0], ins.wait[1] + 1)
    label = ins.label(b, i)
    ex = make_executor(backend, model, max_seq, program=prog, watchdog_ms=300)
    t0 = time.perf_counter()
    try:
        ex.step(TOKEN, 0)
    except KernelError as e:
        took = time.perf_counter() - t0
        if "watchdog" not in str(e) or label not in str(e):
            raise AssertionError(f"the error does not name {label}: {e}") from None
        if took > 5:
            raise AssertionError(f"the watchdog took {took:.1f} s (deadline 0.3 s)") from None
        return {"named": label, "seconds_to_error": round(took, 2)}
    raise AssertionError("a stuck wait did not raise")


def placement(backend: str, model, blocks: int | None,
             max_seq: int = MAX_SEQ) -> dict:
    """%smid of every block of a traced step: one block per SM is the design."""
    from ..kernel.isa import Op, TraceWord
    from ..runtime import make_executor

    ex = make_executor(backend, model, max_seq, trace=True,
                       **({"blocks": blocks} if blocks else {}))
    ex.reset()
    ex.step(TOKEN, 0)
    rec = ex.trace_records()
    sms = []
    for b, q in enumerate(ex.program.queues):
        first = next(i for i, ins in enumerate(q) if ins.op != Op.NOOP)
        sms.append(int(rec[b, first, TraceWord.SMID]))
    distinct = len(set(sms))
    if distinct != len(sms):
        raise AssertionError(f"{len(sms)} blocks on {distinct} SMs: {sms}")
    return {"blocks": len(sms), "distinct_sms": distinct, "smid_first": sms[:8]}


def timer_tick(backend: str) -> dict:
    from ..kernel.devices.cuda import CupyDevice

    if backend != "cuda":
        return {"skipped": "the emulator's timer is the host's steady clock"}
    tick, distinct = CupyDevice().timer_tick_ns()
    return {"tick_ns": tick, "distinct_values_in_4096_reads": distinct}


def l2_read(backend: str) -> dict:
    """The L2 read rates of one SM, of every SM from its own lines and of every SM from the
    same lines (CupyDevice.l2_read): what the cost model's l2_bw (the table's 7.0 TB/s) and its
    token groups' shared inputs assume, measured."""
    from ..kernel.devices.cuda import CupyDevice

    if backend != "cuda":
        return {"skipped": "the emulator has no L2"}
    return CupyDevice().l2_read()


def hbm_stream(backend: str) -> dict:
    """The rate of a stream from HBM into every SM by 16-byte loads, 16-byte cp.async and
    cp.async.bulk (CupyDevice.hbm_stream): what the cost model charges K/V and weights at
    (gemv_bw) against the copy rate its lever 2 assumes (hbm_bw), measured."""
    from ..kernel.devices.cuda import CupyDevice

    from .probes import kv_verdict

    if backend != "cuda":
        return {"skipped": "the emulator has no HBM"}
    rows = CupyDevice().hbm_stream()
    return {**rows, "verdict": kv_verdict(rows)}  # NOTES.md's rule, applied (tools/probes.py)


def cluster_placement(backend: str) -> dict:
    """Whether blocks in clusters of 2 and 4, one an SM, are all resident at once, with and
    without a cooperative launch (CupyDevice.cluster_placement): what the cost model's
    input_multicast lever assumes, asked of the GPU."""
    from ..kernel.devices.cuda import CupyDevice

    from .probes import cluster_verdict

    if backend != "cuda":
        return {"skipped": "the emulator has no clusters"}
    dev = CupyDevice()
    rows = dev.cluster_placement()
    return {**rows, "verdict": cluster_verdict(rows, dev.num_sms)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m monokernel.tools.smoke", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for smoke.json")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "emulator"])
    ap.add_argument("--shapes", default=None,
                    help=f"comma list (default: {','.join(GPU_SHAPES)} on cuda, tiny on the "
                         "emulator)")
    ap.add_argument("--blocks", type=int, default=None,
                    help="persistent blocks (default: one per SM on cuda, 3 on the emulator)")
    ap.add_argument("--max-seq", type=int, default=MAX_SEQ,
                    help=f"KV-cache length of every executor (default {MAX_SEQ}; the GPU check "
                         "gives all its steps one length, so they share compiled kernels)")
    ap.add_argument("--probes-only", action="store_true",
                    help="only the GPU's own probes: timer tick, L2 read and HBM stream "
                         "rates, cluster placement")
    args = ap.parse_args(argv)
    from ..model.loader import load_model
    from .commands import synthetic_dir

    emu = args.backend == "emulator"
    shapes = args.shapes.split(",") if args.shapes else (["tiny"] if emu else list(GPU_SHAPES))
    blocks = args.blocks or (3 if emu else None)
    n = args.max_seq
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checks = Checks(log=lambda s: print(s, flush=True))

    def write() -> None:
        """smoke.json as it stands, atomically (a reader never sees half a file)."""
        tmp = out / ".smoke.json.tmp"
        tmp.write_text(json.dumps({"backend": args.backend, "shapes": shapes, "max_seq": n,
                                   "ok": checks.ok, "checks": checks.rows},
                                  indent=1, default=str))
        tmp.replace(out / "smoke.json")

    checks.on_row = write
    # the cheap probes first: a GPU whose timer, placement or watchdog is off is known in seconds
    checks.run("timer tick", lambda: timer_tick(args.backend))
    checks.run("l2 read", lambda: l2_read(args.backend))
    checks.run("hbm stream", lambda: hbm_stream(args.backend))
    checks.run("cluster placement", lambda: cluster_placement(args.backend))
    if args.probes_only:
        shapes = []
    models = {}

    def load(shape: str) -> bool:
        row = checks.run(f"load {shape}", lambda: models.__setitem__(
            shape, load_model(synthetic_dir(shape), progress=False)))
        return row["ok"]

    first = shapes[0] if shapes else None
    if first is not None and load(first):
        m = models[first]
        checks.run(f"placement {first}", lambda: placement(args.backend, m, blocks, n))
        checks.run(f"watchdog {first}", lambda: watchdog(args.backend, m, blocks, n))
    for shape in shapes:
        if shape in models or (shape != first and load(shape)):
            checks.run(f"one step {shape}", lambda s=shape: one_step(args.backend, models[s],
                                                                     blocks, n))
    write()
    print(f"smoke: {'all checks passed' if checks.ok else 'FAILED'} "
          f"({sum(r['ok'] for r in checks.rows)}/{len(checks.rows)}); wrote {out / 'smoke.json'}")
    return 0 if checks.ok else 1


if __name__ == "__main__":
    sys.exit(main())
