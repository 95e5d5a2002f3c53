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


def row_rounds(lo, hi, rows: int, d) -> np.ndarray:
    """Dependent HBM rounds of EMBED instructions of tiles [lo, hi) for a step of ``rows``
    rows: a row a round (embed_stage_bytes 0), or the rows' 16-byte chunks of the tile (8
    columns each, from the chunk holding lo to the one holding hi - 1) staged by cp.async,
    embed_stage_bytes a pass, a pass one round (megakernel.cu op_embed)."""
    lo, hi = np.asarray(lo), np.asarray(hi)
    if d.embed_stage_bytes <= 0:
        return np.full(lo.shape, float(rows))
    chunks = np.maximum((hi + 7) // 8 - lo // 8, 1)
    per_pass = np.maximum(d.embed_stage_bytes // (16 * chunks), 1)
    return np.ceil(rows / per_pass)


def cost(b: OpBatch, g, d) -> Phases:
    l2, hbm = trips(d, "EMBED", b.busy())
    z = b.zeros()
    rows = 1 if b.shape is None else b.shape.tokens  # one embedding row per token
    # the embedding rows' trip, once a round
    rounds = row_rounds(b.lo, b.hi, rows, d)
    hbm = hbm * rounds
    # staged: a pass's barrier after its copies land, and one after its stores when another
    # pass reuses the stage
    other = z if d.embed_stage_bytes <= 0 else b.busy() * (2 * rounds - 1) * g.bar_sync
    return Phases(l2, hbm, other, z.copy(), rows * b.weight_bytes.astype(np.float64), z.copy())
