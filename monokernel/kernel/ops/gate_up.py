"""RMS_GATE_UP: h = silu(rmsnorm(residual) @ Wg) * (rmsnorm(residual) @ Wu) (megakernel.cu "Op:
RMS_GATE_UP"). Tiles: even slices of the FFN rows; a warp pass takes row pairs (gate, up)."""

from __future__ import annotations

import numpy as np

from ..costmodel.tokens import widen_matmul
from ..costmodel.parts import OpBatch, Phases, block_sum_us, late_norm, matvec, prefetched, trips
from ..isa import Args, Op
from ..program import Instruction, split_even

OP = Op.RMS_GATE_UP
# its input is the residual, normed by the op (tensor cores: megakernel.cu mma_rms, which
# reads the rows first and stages a small share in shared memory; costmodel levers.py)
RMS_INPUT = True
ARGS = Args()
SIGNALS = True
# token groups (token_groups.py): the input bytes an element choose charges, the weight rows
# a tile row (gate and up), the tile rows of the op. 4, though the op reads residual_in's bf16
# since 2026-12-04: at 2, choose picks groups the cost model predicts slower (benchmarks/
# NOTES.md, "bf16 copies of the residual"); at 4 its picks are the model's best per op to
# within ~1 % (NOTES.md, "Token groups against the full model").
INPUT_BYTES = 4
WEIGHT_ROWS = 2


def input_columns(config) -> int:
    """The mat-mul's input columns (token_groups.input_reads)."""
    return config.hidden_size


def tile_rows(plan) -> int:
    return plan.config.intermediate_size


def row_accesses(plan, layer: int, lo: int, hi: int) -> tuple[list, list]:
    """(reads, writes) of FFN rows [lo, hi) for a token."""
    if hi <= lo:
        return [], []
    return [(plan.rms_input(), 0, plan.config.hidden_size)], [("ffn_h", lo, hi)]


def tile(plan, layer: int) -> list[Instruction]:
    H = plan.config.hidden_size
    out = []
    for lo, hi in split_even(tile_rows(plan), plan.num_blocks):
        reads, writes = row_accesses(plan, layer, lo, hi)
        out.append(Instruction(OP, layer, (lo, hi), reads=reads, writes=writes,
                               weight_bytes=(2 * 2 * (hi - lo) * H + 2 * H) if hi > lo else 0))
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
