"""EMBED: residual = embed[token] (megakernel.cu "Op: EMBED"). Tiles: even slices of the
hidden size; the token comes from the state words (a token outside the vocabulary is
refused: ErrCode.BAD_TOKEN)."""

from __future__ import annotations

import numpy as np

from ..costmodel.parts import OpBatch, Phases, trips
from ..isa import STATE_WORDS, Args, Op
from ..program import Instruction, split_even

OP = Op.EMBED
ARGS = Args()
SIGNALS = True


def tile(plan, layer: int) -> list[Instruction]:
    out = []
    for lo, hi in split_even(plan.config.hidden_size, plan.num_blocks):
        out.append(Instruction(OP, 0, (lo, hi), reads=[("state", 0, STATE_WORDS)],
                               writes=plan.residual_writes(lo, hi),
                               weight_bytes=2 * (hi - lo)))
    return out


def row_rounds(columns, rows: int, d) -> np.ndarray:
    """Dependent HBM rounds of an EMBED instruction of ``columns`` columns (its tile) for a
    step of ``rows`` rows: a row a round (embed_loads 0), or the tile's columns over the
    threads, threads // columns rows a pass, embed_loads rows a thread in flight (megakernel.cu
    op_embed)."""
    columns = np.asarray(columns)
    if d.embed_loads <= 0:
        return np.full(columns.shape, float(rows))
    per_pass = np.maximum(d.threads // np.maximum(columns, 1), 1)
    column_passes = np.ceil(columns / d.threads)
    return column_passes * np.ceil(rows / (per_pass * d.embed_loads))


def cost(b: OpBatch, g, d) -> Phases:
    l2, hbm = trips(d, "EMBED", b.busy())
    z = b.zeros()
    rows = 1 if b.shape is None else b.shape.tokens  # one embedding row per token
    # the embedding rows' trip, once a round
    hbm = hbm * row_rounds(b.n, rows, d)
    return Phases(l2, hbm, z, z.copy(), rows * b.weight_bytes.astype(np.float64), z.copy())
