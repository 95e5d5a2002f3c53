"""The discrete-event simulation of one decode step: ``predict(program, gpu, design, context)``.

The per-block queues run as a simulation: an instruction starts when its block's previous one
ends, fetches its words, issues its L2 prefetch, and becomes ready when its counter has all its
signals (the last signal's time + the hop latency) or, if they are already there, after one
acquire load. Its busy time is ``busy_us`` of the phases its op's cost entry gives
(kernel/ops/<op>.py ``cost``): its weight stream runs at min(bytes in flight / latency, the
SM's share of HBM bandwidth) (Little's law), where the bytes the prefetch brought into L2
during the wait are read at L2 latency.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import CostModelError
from .. import ops
from ..isa import Op
from . import levers
from .design import KernelDesign, design_for
from .gpu import GPU, constant_range, corner, gpu
from .parts import OpBatch, Phases, fetch_us, hop_parts, step_end_us
from .tokens import StepShape, logits_rows, step_end_extra_us


@dataclass
class Prediction:
    """Predicted times of one decode step (us). start/ready/end: per block, per slot (NaN for
    NOOP); trips: dependent round trips after the wait incl. the stream's rounds."""

    program: object
    gpu: GPU
    design: KernelDesign
    context: int
    start: np.ndarray
    ready: np.ndarray
    end: np.ndarray
    trips: np.ndarray
    step_us: float  # the launch's start (t = 0) to the last end of the simulated step
    launch_us: float  # launch overhead per token
    critical: list[tuple[int, int]]  # (block, slot) from the first instruction to the last
    critical_hops: int
    shape: StepShape | None = None  # the step's tokens; None: one token at ``context``

    @property
    def total_us(self) -> float:
        return self.step_us + self.launch_us

    @property
    def tokens_per_s(self) -> float:
        """Tokens the step generates (one per token that needs logits) per second."""
        made = 1 if self.shape is None else self.shape.logits
        return made / self.total_us * 1e6

    @property
    def floor_us(self) -> float:
        return self.program.config.weight_bytes_per_token() / self.gpu.hbm_bw

    @property
    def x_floor(self) -> float:
        return self.total_us / self.floor_us

    def op_rows(self) -> list[dict]:
        """Per op: instructions, mean and max busy time (ready -> end), mean wait, median
        round trips after the wait of the busy instructions, time on the critical path."""
        prog = self.program
        crit: dict[Op, float] = {}
        prev_end = 0.0
        for blk, slot in self.critical:
            op = prog.queues[blk][slot].op
            crit[op] = crit.get(op, 0.0) + self.end[blk, slot] - prev_end
            prev_end = self.end[blk, slot]
        rows = []
        for op in Op:
            sel = [(bb, i) for bb, q in enumerate(prog.queues) for i, ins in enumerate(q)
                   if ins.op == op and op != Op.NOOP and not np.isnan(self.end[bb, i])]
            if not sel:  # not in the program
                continue
            bi = tuple(np.array(sel).T)
            busy = self.end[bi] - self.ready[bi]
            wait = self.ready[bi] - self.start[bi]
            nonempty = np.array([not prog.queues[bb][i].empty for bb, i in sel])
            trips = self.trips[bi][nonempty] if nonempty.any() else np.zeros(1)
            rows.append({"op": op.name, "instructions": len(sel), "busy_mean_us": busy.mean(),
                         "busy_max_us": busy.max(), "wait_mean_us": wait.mean(),
                         "trips": float(np.median(trips)), "critical_us": crit.get(op, 0.0)})
        return rows


def _batches(program, context: int, shape: StepShape | None = None
             ) -> dict[Op, tuple[list[tuple[int, int]], OpBatch]]:
    by_op: dict[Op, list] = {}
    for blk, q in enumerate(program.queues):
        for i, ins in enumerate(q):
            if ins.op != Op.NOOP:
                by_op.setdefault(ins.op, []).append((blk, i, ins))
    out = {}
    for op, items in by_op.items():
        out[op] = ([(t[0], t[1]) for t in items], _batch(program, context, items, shape))
    return out


def _batch(program, context: int, items: list, shape: StepShape | None) -> OpBatch:
    ins = [t[2] for t in items]
    return OpBatch(program, context, np.array([x.layer for x in ins], np.int64),
                   np.array([x.tile[0] for x in ins], np.int64),
                   np.array([x.tile[1] for x in ins], np.int64),
                   np.array([x.weight_bytes for x in ins], np.int64), ins, shape)


# the ops of the last layer that only the rows needing logits need (last_layer_logits): after
# RMS_QKV_ROPE has written every row's K/V, no later step reads the other rows' residual
LAST_LAYER_OPS = (Op.ATTENTION, Op.O_PROJ_RESIDUAL, Op.RMS_GATE_UP, Op.DOWN_RESIDUAL)


def _step_batches(program, context: int, shape: StepShape | None, d: KernelDesign
                  ) -> list[tuple[Op, list[tuple[int, int]], OpBatch | None, bool, bool]]:
    """(op, where, batch, whether its tiles are the op's, whether it idles) of a step:
    _batches', and with ``last_layer_logits`` the last layer's LAST_LAYER_OPS apart, on the
    rows needing logits (tokens.logits_rows; a batch of None where no row does: the
    instructions only wait and signal); with ``last_layer_skip`` where no row needs logits,
    those instructions idle (``idle_phases``), every row otherwise."""
    out = []
    last = program.config.num_layers - 1
    skip = shape is not None and d.last_layer_skip and not any(s.logits for s in shape.segments)
    rows = logits_rows(shape) if shape is not None and (d.last_layer_logits or skip) else shape
    for op, (where, batch) in _batches(program, context, shape).items():
        if rows == shape or op not in LAST_LAYER_OPS:  # (every row needs its logits)
            out.append((op, where, batch, True, False))
            continue
        items = [(b, i, ins) for (b, i), ins in zip(where, batch.instructions)]
        rest = [t for t in items if t[2].layer != last]
        tail = [t for t in items if t[2].layer == last]
        out.append((op, [t[:2] for t in rest], _batch(program, context, rest, shape), True, False))
        if skip:
            out.append((op, [t[:2] for t in tail], _batch(program, context, tail, shape), False,
                        True))
            continue
        out.append((op, [t[:2] for t in tail],
                    _batch(program, context, tail, rows) if rows.segments else None, False,
                    False))
    return out


def idle_phases(op: Op, b: OpBatch, g: GPU, d: KernelDesign) -> Phases:
    """An instruction of the last layer's LAST_LAYER_OPS in a step where no row needs logits
    (last_layer_skip; megakernel.cu last_layer_idle): after its wait, the idle test (its
    threads' rows of the token table, one __syncthreads_or); then only what later steps read:
    late q/k's O_PROJ caching its part of the step's keys (ops/o_proj.py key_caching), and a
    sliced op's signal of its row group's counter (slice_mma: the counters count every step).
    No weights, no mat-mul, no outputs; its own signal after it, as always."""
    n = len(b.lo)
    z = np.zeros(n)
    l2, other = z.copy(), np.full(n, g.bar_sync + g.shfl)
    if op == Op.O_PROJ_RESIDUAL:
        key_l2, key_other = ops.module(op).key_caching(b, g, d)
        l2, other = l2 + key_l2, other + key_other
    if op in (Op.O_PROJ_RESIDUAL, Op.DOWN_RESIDUAL) and \
            any(getattr(i, "split", None) is not None for i in b.instructions):
        sliced = np.array([getattr(i, "split", None) is not None for i in b.instructions])
        other = other + sliced * hop_parts(g, d)["signal"]
    return Phases(l2, z.copy(), other, z.copy(), z.copy(), z.copy())


class Static:
    """Per-instruction phases of a program at one context and design, [blocks, slots]. They
    do not depend on the constants the calibration fits (latencies, bandwidth, fence). With a
    ``shape`` (tokens.StepShape), the phases of a step of those tokens; ``context`` is then
    the shape's largest."""

    def __init__(self, program, context: int, g: GPU, d: KernelDesign,
                 shape: StepShape | None = None):
        if shape is None and d.tensor_cores:
            # a design of many tokens runs one token as a step of one (its attention units
            # dealt over the blocks as in any step)
            shape = StepShape.decode(1, context)
        if shape is not None:
            context = shape.max_context
        d = levers.for_step(d, shape)
        self.step = shape
        if context < 0 or context + 1 > program.max_seq_len:
            raise CostModelError(
                f"context {context} does not fit the program's KV cache of "
                f"{program.max_seq_len} positions (need context + 1 <= max_seq_len)")
        B, L = program.num_blocks, program.max_len
        self.shape = (B, L)
        self.fields = {k: np.zeros((B, L)) for k in
                       ("l2", "hbm", "other", "rounds", "bytes", "pref", "early", "issue",
                        "compute", "copy", "rolling")}
        self.tiles: dict[str, tuple[int, int]] = {}  # per op: tokens.tile_split's (c, s)
        for op, where, batch, own_tiles, idle in _step_batches(program, context, shape, d):
            if batch is None or not where:  # (last_layer_logits) nothing to compute
                continue
            ph = idle_phases(op, batch, g, d) if idle else \
                levers.apply(op, batch, ops.module(op).cost(batch, g, d), g, d)
            bi = tuple(np.array(where).T)
            f = self.fields
            f["l2"][bi], f["hbm"][bi], f["other"][bi] = ph.l2_trips, ph.hbm_trips, ph.other_us
            f["rounds"][bi], f["bytes"][bi] = ph.rounds, ph.stream_bytes
            f["pref"][bi] = np.minimum(ph.prefetch_bytes, ph.stream_bytes)
            for name in ("early", "issue", "compute", "copy", "rolling"):
                if getattr(ph, name) is not None:
                    f[name][bi] = getattr(ph, name)
            if own_tiles:
                self.tiles[op.name] = ph.tiles


def predict(program, g: GPU | str = "h200", d: KernelDesign | None = None, context: int = 16,
            static: "Static | None" = None, shape: StepShape | None = None) -> Prediction:
    """Predicted time of one decode step on GPU ``g`` (a name or a ``GPU``) with kernel design
    ``d`` (default ``design_for(program)``) at ``context`` positions already in the cache (the
    step attends over context + 1). Pass ``static`` (a ``Static`` of the same program, context
    and design) to reuse the phases when only the GPU's constants change. ``shape``: a step of
    many tokens (tokens.StepShape; a design with tensor cores), ``context`` then unused."""
    g = gpu(g) if isinstance(g, str) else g
    d = design_for(program) if d is None else d
    if shape is not None and shape.single:
        context, shape = shape.segments[0].context, None  # the one-token step
    st = static or Static(program, context, g, d, shape)
    d = levers.for_step(d, st.step)
    return _simulate(program, g, d, context if st.step is None else st.step.max_context, st)


def busy_constants(g: GPU, d: KernelDesign, num_blocks: int) -> tuple[float, ...]:
    """What ``busy_us`` needs of the GPU and design: (HBM share per SM (at the GEMV rate with
    gemv_rate), L2 share per SM, L2 latency, HBM latency, signal cost, barrier, loaded HBM
    latency, 1.0 with stream_ramp else 0.0, HBM share per SM at the copy rate)."""
    bw = g.gemv_bw if d.gemv_rate else g.hbm_bw
    return (bw / min(num_blocks, g.sms), g.l2_bw / min(num_blocks, g.sms), g.l2_latency,
            g.hbm_latency, hop_parts(g, d)["signal"], g.bar_sync, g.hbm_loaded_latency,
            float(d.stream_ramp), g.hbm_bw / min(num_blocks, g.sms))


def busy_us(k: tuple[float, ...], l2, hbm, other, rounds, nbytes, pref, lead, signals,
            mn=min, mx=max, early=0.0, issue=0.0, compute=0.0, copy=0.0, rolling=0.0):
    """Ready -> end of one instruction (or of arrays of them: pass ``mn=np.minimum,
    mx=np.maximum``): its dependent round trips and fixed work, then its weight stream at
    min(bytes in flight / latency, the SM's HBM share), then its signal. ``k`` is
    ``busy_constants``; ``lead``: how long its L2 prefetch has run when the wait returns;
    ``early``: HBM loads issued at the start that its first L2 trip needs (their loaded
    latency past the lead and that trip is on the path); ``issue``: the stream's compute after
    its data (on the path of a latency-bound stream only); ``compute``: tensor-core time of the
    stream's products (a step of many tokens), running beside the stream; ``copy``: 1.0 for a
    stream at the copy rate (levers.py); ``rolling``: the share of its rounds whose loads
    the walk prefetched into L2 itself (Phases.rolling), at L2's latency. The one formula the
    simulation and the calibration share."""
    share, l2_share, L2, HBM, sig, bar, HBM_loaded, ramp, copy_share = k
    share = share + copy * (copy_share - share)
    fixed = l2 * L2 + hbm * HBM + other + early * mx(HBM_loaded - lead - L2, 0.0)
    hits = mn(pref, share * (lead + fixed))  # the prefetch ran from the start until the stream
    h = hits / mx(nbytes, 1.0)
    lat = h * L2 + (1 - h) * HBM  # the prefetched share of the rounds hits L2
    first = ramp * lat * (nbytes > 0)  # stream_ramp: the first bytes a latency after the start
    lat = rolling * L2 + (1 - rolling) * lat
    stream = mx(rounds * lat + issue, first + (nbytes - hits) / share + hits / l2_share)
    stream = mx(stream, first + compute)
    return fixed + stream + signals * sig + (1 - signals) * bar


def prefetch_issue_us(pref, d: KernelDesign):
    """Issuing the prefetches: one 128-byte line per thread per pass, a few cycles each."""
    return np.ceil(np.asarray(pref) / 128 / d.threads) * 0.004


def _simulate(program, g: GPU, d: KernelDesign, context: int, st: "Static") -> Prediction:
    B, L = st.shape
    f = {k: v.tolist() for k, v in st.fields.items()}
    issue = prefetch_issue_us(st.fields["pref"], d).tolist()
    parts = hop_parts(g, d)
    propagate, detect = parts["propagate"], parts["detect"]
    fetch = fetch_us(g, d)
    check = g.l2_latency + g.bar_sync  # the first acquire load finds the count already there
    k = busy_constants(g, d, program.num_blocks)

    queues = program.queues
    n_sig = [0] * program.num_counters
    for q in queues:
        for ins in q:
            if levers.signals(ins, d):
                n_sig[ins.signal] += 1
    sig_ends: list[list[tuple[float, int, int]]] = [[] for _ in range(program.num_counters)]
    visible: list[float | None] = [None] * program.num_counters
    last_sig: list[tuple[int, int] | None] = [None] * program.num_counters
    nan = float("nan")
    start = [[nan] * L for _ in range(B)]  # after the instruction's words are fetched (T_START)
    ready = [[nan] * L for _ in range(B)]
    end = [[nan] * L for _ in range(B)]
    # what made each instruction ready: (its block's previous node or the counter's last
    # signaler, whether that was a hop)
    bound: list[list] = [[None] * L for _ in range(B)]
    t_block = [0.0] * B
    prev_node: list[tuple[int, int] | None] = [None] * B
    prev_ins: list = [None] * B  # the block's last instruction run (levers.waits)
    ptr = [0] * B
    if d.steps_per_launch > 1:  # EMBED waits for the previous step's token: one more hop,
        # on the step counter whatever the other hops are (levers.py: it orders the step's
        # plain K/V cache stores before the next step's reads)
        t_block = [sum(hop_parts(g, d.replace(data_flag_hops=0)).values())] * B

    def resolve(c: int, need: int, stuck: bool) -> bool:
        ends = sig_ends[c]
        if visible[c] is not None:
            return True
        if len(ends) < need or (len(ends) < n_sig[c] and not stuck):
            return False
        t, blk, slot = sorted(ends)[need - 1]
        visible[c] = t + propagate
        last_sig[c] = (blk, slot)
        return True

    remaining = sum(1 for q in queues for ins in q if ins.op != Op.NOOP)
    stuck = False
    while remaining:
        progress = False
        for b in range(B):
            q = queues[b]
            while ptr[b] < len(q):
                i = ptr[b]
                ins = q[i]
                if ins.op == Op.NOOP:
                    ptr[b] += 1
                    continue
                s = t_block[b] + fetch
                t_check = s + issue[b][i]
                if ins.wait is not None and levers.waits(prev_ins[b], ins, d):
                    c, need = ins.wait
                    if not resolve(c, need, stuck):
                        break
                    via_counter = visible[c] + detect
                    if via_counter > t_check + check:
                        r, bnd = via_counter, (last_sig[c], True)
                    else:
                        r, bnd = t_check + check, (prev_node[b], False)
                else:
                    r, bnd = t_check, (prev_node[b], False)
                lead = r - s
                if ins.wait is not None and prev_node[b] is not None and \
                        not levers.waits(prev_ins[b], ins, d):
                    # a fused DOWN's prefetch went out with its GATE_UP's, before that wait,
                    # behind GATE_UP's own prefetch (the same HBM share)
                    pb, pi = prev_node[b]
                    lead = max(ready[pb][pi] - start[pb][pi] - f["pref"][pb][pi] / k[0], 0.0)
                sig = levers.signals(ins, d)
                e = r + busy_us(k, f["l2"][b][i], f["hbm"][b][i], f["other"][b][i],
                                f["rounds"][b][i], f["bytes"][b][i], f["pref"][b][i],
                                lead, 1.0 if sig else 0.0, early=f["early"][b][i],
                                issue=f["issue"][b][i], compute=f["compute"][b][i],
                                copy=f["copy"][b][i], rolling=f["rolling"][b][i])
                start[b][i], ready[b][i], end[b][i], bound[b][i] = s, r, e, bnd
                if sig:
                    sig_ends[ins.signal].append((e, b, i))
                t_block[b] = e
                prev_node[b] = (b, i)
                prev_ins[b] = ins
                ptr[b] += 1
                remaining -= 1
                progress = True
        if not progress:
            if stuck:
                raise CostModelError("the simulated queues deadlock (a wait can never be met); "
                                     "run Program.verify() for the instructions")
            stuck = True
        else:
            stuck = False

    end_a = np.array(end, np.float64)
    last = np.unravel_index(np.nanargmax(end_a), end_a.shape)
    node: tuple[int, int] | None = (int(last[0]), int(last[1]))
    chain, hops = [], 0
    while node is not None:
        chain.append(node)
        node, hop = bound[node[0]][node[1]]
        hops += hop
    chain.reverse()
    st_a = np.array(start, np.float64)
    trips = st.fields["l2"] + st.fields["hbm"] + st.fields["rounds"]
    end = float(np.nanmax(end_a)) + step_end_us(g, d) + step_end_extra_us(st.step, g, d)
    return Prediction(program, g, d, context, st_a, np.array(ready, np.float64), end_a, trips,
                      end, g.launch / d.steps_per_launch, chain, hops, st.step)


def predict_range(program, gpu_name: str, d: KernelDesign, context: int) -> tuple[float, float]:
    """(low, high) us/token: every constant at its fast end, then at its slow end. A band, not
    a confidence interval: the ends assume every constant errs the same way at once."""
    return tuple(predict(program, corner(gpu_name, fast), d, context).total_us
                 for fast in (True, False))


def sensitivity(program, g: GPU | str, d: KernelDesign, context: int,
                static: Static | None = None) -> dict[str, float]:
    """Total us/token with L2 or HBM latency at the low and high end of its range."""
    base = gpu(g) if isinstance(g, str) else g
    st = static or Static(program, context, base, d)
    out = {}
    for const in ("l2_latency", "hbm_latency"):
        lo, hi = constant_range(base.name, const)
        for tag, v in (("low", lo), ("high", hi)):
            gg = base.replace(**{const: v})
            out[f"{const}_{tag}"] = predict(program, gg, d, context, st).total_us
    return out
