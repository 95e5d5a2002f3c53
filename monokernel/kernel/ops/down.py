"""DOWN_RESIDUAL: residual += h @ Wd (megakernel.cu "Op: DOWN_RESIDUAL"). Tiles: even slices
of Wd's rows; h is copied into shared memory first."""

from __future__ import annotations

import numpy as np

from ..costmodel.tokens import widen_matmul
from ..costmodel.parts import OpBatch, Phases, copy_rounds, matvec, prefetched, trips
from ..isa import Args, Op
from ..program import Instruction, split_even

OP = Op.DOWN_RESIDUAL
ARGS = Args()
SIGNALS = True


def tile(plan, layer: int) -> list[Instruction]:
    F = plan.config.intermediate_size
    out = []
    for lo, hi in split_even(plan.config.hidden_size, plan.num_blocks):
        if hi <= lo:
            out.append(Instruction(OP, layer, (lo, hi)))
            continue
        out.append(Instruction(OP, layer, (lo, hi), reads=[("ffn_h", 0, F), ("residual", lo, hi)],
                               writes=[("residual", lo, hi)], weight_bytes=2 * (hi - lo) * F))
    return out


def cost(b: OpBatch, g, d) -> Phases:
    F = b.program.config.intermediate_size
    busy = b.busy()
    l2, hbm = trips(d, "DOWN_RESIDUAL", busy)
    # the first of its trips is the copy of ffn_h into shared memory, one element per thread a
    # round or as the copy loop compiles
    l2 = l2 + busy * (copy_rounds(-(-F // d.threads), d) - 1)
    rounds, issue = matvec(b.n, F, g, d)
    other = busy * g.bar_sync
    pref = prefetched(d, b.n * F * 2)
    return widen_matmul(b, g, d, Phases(l2, hbm, other, rounds, b.weight_bytes.astype(np.float64),
                                        pref, issue=busy * issue), F)
