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
# token groups (token_groups.py): the input (ffn_h, stored bf16) bytes an element, the weight
# rows a tile row, the tile rows of the op
INPUT_BYTES = 2
WEIGHT_ROWS = 1
# a tensor-core kernel stores the residual's bf16 copy (residual_in) in a pass after the
# mat-mul's epilogue (megakernel.cu store_residual_in; the cost model's residual_copy_pass)
RESIDUAL_COPY_PASS = True
# an input split may cut its input columns (kernel/input_slices.py): the buffer it reads
INPUT = "ffn_h"


def input_columns(config) -> int:
    """The mat-mul's input columns (token_groups.input_reads)."""
    return config.intermediate_size


def tile_rows(plan) -> int:
    return plan.config.hidden_size


def row_accesses(plan, layer: int, lo: int, hi: int) -> tuple[list, list]:
    """(reads, writes) of residual rows [lo, hi) for a token."""
    if hi <= lo:
        return [], []
    return ([("ffn_h", 0, plan.config.intermediate_size), ("residual", lo, hi)],
            plan.residual_writes(lo, hi))


def tile(plan, layer: int) -> list[Instruction]:
    F = plan.config.intermediate_size
    out = []
    for lo, hi in split_even(tile_rows(plan), plan.num_blocks):
        reads, writes = row_accesses(plan, layer, lo, hi)
        out.append(Instruction(OP, layer, (lo, hi), reads=reads, writes=writes,
                               weight_bytes=2 * (hi - lo) * F if hi > lo else 0))
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
