"""The throughput levers of the many-token design (issue 17), as the cost model charges them
before any of them is built. Each is a ``KernelDesign`` knob (design.py says what the kernel
would do); here is what it changes in an op's phases and in the simulation's waits:

- ``fused_ffn`` (lever 1): DOWN runs in RMS_GATE_UP's instruction on the block's own h rows:
  no wait between them (``waits``), GATE_UP signals nothing (``signals``), DOWN has no h copy
  nor h input read, and it adds its H x T fp32 partial into the residual by float atomics;
- ``kv_copy_rate`` (lever 2): ATTENTION's stream at the copy rate (``Phases.copy``);
  ``weights_copy_rate``: the mat-muls' weights too, in steps of many tokens;
- ``input_multicast`` (lever 3): a mat-mul's input at ``input_rate`` (tokens._tile_us);
- ``data_flag_hops`` (lever 4): no signal (parts.hop_parts), the input's L2 trip merged into
  the poll (``apply``), inputs and outputs at ``flag_factor`` x their bytes (tokens._tile_us),
  in steps of up to that many tokens (``for_step``: larger ones use the counters).

With every knob off, nothing here changes a phase: v7 predicts as before.
"""

from __future__ import annotations

import numpy as np

from .. import ops
from ..isa import Op
from .design import KernelDesign
from .parts import OpBatch, Phases

_MATMULS = (Op.RMS_QKV_ROPE, Op.O_PROJ_RESIDUAL, Op.RMS_GATE_UP, Op.DOWN_RESIDUAL, Op.RMS_LM_HEAD)
# bytes of LL words per byte of data: 4 data bytes + the step's 4-byte flag per 8-byte store
LL_FACTOR = 2.0


def for_step(d: KernelDesign, shape) -> KernelDesign:
    """The design a step of ``shape`` (tokens.StepShape; None: one token) runs: with
    data-as-flag hops for steps of up to ``data_flag_hops`` tokens, the counters beyond."""
    if d.data_flag_hops and shape is not None and shape.tokens > d.data_flag_hops:
        return d.replace(data_flag_hops=0)
    return d


def flag_factor(d: KernelDesign) -> float:
    """What a waited-on input or an output store moves per byte of data."""
    return LL_FACTOR if d.data_flag_hops else 1.0


def output_factor(b: OpBatch, d: KernelDesign) -> float:
    """What a mat-mul's outputs move per byte of its one-token-per-row epilogue (the residual
    rows read and written): LL words with data flags; with the fused FFN, O_PROJ also writes its
    rows into the second residual the fused FFN's atomics add to (GATE_UP still reads the first:
    adding into the one other blocks are still reading would race)."""
    f = flag_factor(d)
    if d.fused_ffn and b.instructions and b.instructions[0].op == Op.O_PROJ_RESIDUAL:
        f *= 1.5  # one more 4-byte store per row and token beside the 8 bytes read + written
    return f


def input_rate(g, d: KernelDesign) -> float:
    """Bytes/us at which a block receives a mat-mul input every block of its cluster reads:
    its L2 share, or with multicast m x that (L2 sends each line once per cluster) up to the
    SM's own fill path (``l2_fill``)."""
    share = g.l2_bw / g.sms
    if d.input_multicast <= 1:
        return share
    return min(d.input_multicast * share, max(g.l2_fill, share))


def input_bytes(b: OpBatch, d: KernelDesign) -> int:
    """Bytes per element of a mat-mul's input as its blocks read it: 2 for O_PROJ's and DOWN's
    with ``stored_bf16_inputs`` (their producers store bf16), else ``input_bytes``."""
    if d.stored_bf16_inputs and b.instructions and \
            b.instructions[0].op in (Op.O_PROJ_RESIDUAL, Op.DOWN_RESIDUAL):
        return 2
    return d.input_bytes


def residual_copy(b: OpBatch, d: KernelDesign) -> tuple[int, float]:
    """(dependent L2 rounds, bytes an output) of the op's pass storing the residual's bf16
    copy after its mat-mul (``residual_copy_pass``: the op modules whose RESIDUAL_COPY_PASS
    says they run megakernel.cu's store_residual_in, the residual's mat-mul writers); (0, 0)
    for every other op or design."""
    if d.residual_copy_pass and b.instructions and \
            getattr(ops.module(b.instructions[0].op), "RESIDUAL_COPY_PASS", False):
        # in the epilogue (residual_copy_epilogue): its store beside the residual's, no pass
        return (0, 2.0) if d.residual_copy_epilogue else (1, 6.0)
    return 0, 0.0


def rms_input(b: OpBatch) -> bool:
    """Whether the op's input is the residual its mma_rms norms (it reads the rows first): the
    op module's RMS_INPUT."""
    return len(b.instructions) > 0 and \
        getattr(ops.module(b.instructions[0].op), "RMS_INPUT", False)


def rms_staged(b: OpBatch, d: KernelDesign, tokens) -> np.ndarray:
    """Per instruction, the share of an RMS op's ``tokens`` rows staged in shared memory as
    bf16: all of a share of at most ``rms_stage_rows``, else none, or with
    ``rms_stage_partial`` its first rms_stage_rows."""
    tokens = np.asarray(tokens, np.float64)
    if d.rms_stage_partial:
        share = np.minimum(tokens, d.rms_stage_rows) / np.maximum(tokens, 1.0)
    else:
        share = (tokens <= d.rms_stage_rows).astype(np.float64)
    return share * rms_input(b)


def fused_down(b: OpBatch, d: KernelDesign) -> bool:
    return d.fused_ffn and len(b.instructions) > 0 and b.instructions[0].op == Op.DOWN_RESIDUAL


def atomic_us(rows: int, tokens: float, g) -> float:
    """A block's red.global.add.v4.f32 of its partial (``rows`` x ``tokens`` fp32) into the
    residual: L2 absorbs the atomics at (at best) the SM's share of its bandwidth; the release
    after them is the instruction's signal."""
    return rows * tokens * 4.0 / (g.l2_bw / g.sms)


def apply(op: Op, b: OpBatch, ph: Phases, g, d: KernelDesign) -> Phases:
    """An op's phases with the levers that change trips or the stream's rate (the many-token
    costs are in tokens.widen_matmul)."""
    busy = b.busy()
    if d.data_flag_hops and op != Op.EMBED:
        # the poll is the read of the input: its first dependent L2 trip after the wait
        ph.l2_trips = np.maximum(ph.l2_trips - busy, 0.0)
    if op == Op.DOWN_RESIDUAL and d.fused_ffn:
        # h is the block's own, in shared memory: no copy of ffn_h (DOWN's only L2 trips:
        # tokens.widen_matmul drops its input read); its partial of every residual row goes out
        # by atomics (at one token here; tokens.widen_matmul charges a step's tokens)
        H = b.program.config.hidden_size
        ph.l2_trips = np.zeros_like(ph.l2_trips)
        if b.shape is None or b.shape.single:
            ph.other_us = ph.other_us + busy * atomic_us(H, 1, g)
    if op == Op.ATTENTION and d.kv_copy_rate:
        ph.copy = busy
    many = b.shape is not None and not b.shape.single
    if op in _MATMULS and d.weights_copy_rate and many:
        ph.copy = busy
    return ph


def waits(prev, ins, d: KernelDesign) -> bool:
    """Whether ``ins`` waits on its counter when its block ran ``prev`` just before it: a fused
    DOWN continues its block's GATE_UP of the same layer."""
    return not (d.fused_ffn and prev is not None and ins.op == Op.DOWN_RESIDUAL
                and prev.op == Op.RMS_GATE_UP and prev.layer == ins.layer)


def signals(ins, d: KernelDesign) -> bool:
    """Whether ``ins`` signals: a GATE_UP fused with its DOWN has no consumer elsewhere."""
    if ins.signal is None:
        return False
    return not (d.fused_ffn and ins.op == Op.RMS_GATE_UP)
