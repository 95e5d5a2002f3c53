"""RMS_GATE_UP: h = silu(rmsnorm(residual) @ Wg) * (rmsnorm(residual) @ Wu) (megakernel.cu "Op:
RMS_GATE_UP"). Tiles: even slices of the FFN rows; a warp pass takes row pairs (gate, up)."""

from __future__ import annotations

import numpy as np

from ..costmodel.tokens import widen_matmul
from ..costmodel.parts import OpBatch, Phases, block_sum_us, late_norm, matvec, prefetched, trips
from ..isa import Args, Op
from ..program import Instruction, split_even

OP = Op.RMS_GATE_UP
ARGS = Args()
SIGNALS = True


def tile(plan, layer: int) -> list[Instruction]:
    H = plan.config.hidden_size
    out = []
    for lo, hi in split_even(plan.config.intermediate_size, plan.num_blocks):
        if hi <= lo:
            out.append(Instruction(OP, layer, (lo, hi)))
            continue
        out.append(Instruction(OP, layer, (lo, hi), reads=[("residual", 0, H)],
                               writes=[("ffn_h", lo, hi)],
                               weight_bytes=2 * 2 * (hi - lo) * H + 2 * H))
    return out


def cost(b: OpBatch, g, d) -> Phases:
    H = b.program.config.hidden_size
    busy = b.busy()
    l2, hbm = trips(d, "RMS_GATE_UP", busy)
    rounds, issue = matvec(b.n, H, g, d, pairs=True)
    other = busy * block_sum_us(g)
    pref = prefetched(d, b.n * H * 2, b.n * H * 2)
    return widen_matmul(b, g, d, Phases(l2, hbm, other, rounds, b.weight_bytes.astype(np.float64),
                                        pref, late_norm(busy, d), busy * issue),
                        H, rows=2 * b.n)  # gate and up rows
