"""The floor of a step of many tokens: what no kernel that tiles its mat-muls as megakernel.cu
does (row tiles and token groups: each output of a mat-mul from one block's whole k-loop) can
beat on a GPU of the table, whatever it spends on hops and fixed work.

A mat-mul of R weight rows, K input columns and T tokens on B blocks: the block that computes
the outputs of r rows for t tokens moves its rows' weights (r K x 2 bytes) and its tokens'
inputs (t K x b bytes) from L2 into its SM, whatever else it does: its own rows stream from HBM
through L2, the rows it shares with its token group's other members and every input come from
L2. The busiest block computes at least R T / B outputs, and of all its shapes r x t = R T / B
moves the fewest bytes at 2 r = b t (clamped to 1 <= r <= R, 1 <= t <= T): 2 K sqrt(2 b R T /
B). Those bytes arrive at most at the SM's share of the L2 bandwidth (every block of the op
reads at once). The op can also go no faster than its weights from HBM (R K x 2 bytes at the
table's bandwidth, not the achieved GEMV rate) nor its mma at the table's rate; the floor is the
largest of the three (they can overlap).

``split=True`` allows what the built tiling does not: the input dimension split over s blocks
(s a power of two up to MAX_SLICES). A block then moves K / s of its rows and tokens for s
times the outputs (r t = R T s / B), writes its fp32 partials (4 r t bytes) and, the reduction
spread over the blocks in a fixed order, reads the s partials of its R T / B outputs and
writes their sums (4 (s + 1) R T / B bytes): the floor of the split that the cost model's
tile_2d (one last drawer reducing its row group) does not reach.

Attention's floor is its K/V bytes from HBM (each segment reads its sequence's cache once) and,
for a chunk, its scores and values on tensor cores. Nothing else is charged: no hop, no barrier,
no norm, no merge, no step end. So a design's prediction that falls below its floor has lost a
cost (tests/kernel/test_costmodel_floor.py holds the built design above it), and a target below
the floor needs what the tiling above cannot give: a cluster's multicast of the input (one L2
read for many SMs), a split of the input dimension (design knob tile_2d), or a faster L2 than
the table's (a GPU measurement)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .design import BUILT_MMA, DESIGNS

# bytes an input element as the built tensor-core design's mat-muls read it (bf16: residual_in,
# attention's merged output, FFN h)
INPUT_BYTES = DESIGNS[BUILT_MMA[0]].input_bytes
MAX_SLICES = 16


@dataclass(frozen=True)
class OpFloor:
    """One mat-mul's (or attention's) floor in a step, per layer: its L2, HBM and mma times
    (us); ``us`` the largest."""

    op: str
    l2_us: float
    hbm_us: float
    mma_us: float

    @property
    def us(self) -> float:
        return max(self.l2_us, self.hbm_us, self.mma_us)


def busiest_block_bytes(rows: int, k: int, tokens: int, blocks: int,
                        input_bytes: int = INPUT_BYTES) -> float:
    """The fewest bytes the busiest of ``blocks`` blocks moves into its SM for a mat-mul of
    ``rows`` x ``k`` weights by ``tokens`` tokens (module docstring)."""
    if rows <= 0 or tokens <= 0:
        return 0.0
    area = rows * tokens / blocks
    t = np.sqrt(2.0 * area / input_bytes)  # the best token count, 2 r = b t
    t = min(max(t, area / rows, 1.0), float(tokens), max(area, 1.0))
    r = max(area / t, 1.0)
    return float(k * (2.0 * r + input_bytes * t))


def split_block_bytes(rows: int, k: int, tokens: int, blocks: int, slices: int) -> float:
    """busiest_block_bytes with the input split over ``slices`` blocks, the partials written
    and reduced (module docstring)."""
    if slices == 1:
        return busiest_block_bytes(rows, k, tokens, blocks)
    outputs = rows * tokens / blocks
    return busiest_block_bytes(rows, k / slices, tokens, blocks / slices) \
        + 4.0 * outputs * slices + 4.0 * (slices + 1) * outputs


def matmul_floor(op: str, rows: int, k: int, tokens: int, g, blocks: int,
                 split: bool = False) -> OpFloor:
    l2_share = g.l2_bw / g.sms
    slices = [1 << i for i in range(MAX_SLICES.bit_length()) if split or i == 0]
    moved = min(split_block_bytes(rows, k, tokens, blocks, s) for s in slices)
    return OpFloor(op, moved / l2_share,
                   rows * k * 2.0 / g.hbm_bw if tokens else 0.0,
                   2.0 * rows * k * tokens / (g.mma_tflops * 1e6))


def layer_floors(config, shape, g, blocks: int, split: bool = False) -> list[OpFloor]:
    """The floors of one layer's ops in a step of ``shape`` (tokens.StepShape)."""
    c, T = config, shape.tokens
    H, KV, D = c.num_heads, c.num_kv_heads, c.head_dim
    mm = [("RMS_QKV_ROPE", (H + 2 * KV) * D, c.hidden_size),
          ("O_PROJ_RESIDUAL", c.hidden_size, H * D),
          ("RMS_GATE_UP", 2 * c.intermediate_size, c.hidden_size),
          ("DOWN_RESIDUAL", c.hidden_size, c.intermediate_size)]
    out = [matmul_floor(op, rows, k, T, g, blocks, split) for op, rows, k in mm]
    kv_bytes = sum(2.0 * KV * D * 2 * (s.context + s.tokens) for s in shape.segments)
    flops = sum(4.0 * H * D * s.tokens * (s.context + (s.tokens + 1) / 2)
                for s in shape.segments if s.tokens > 1)
    out.append(OpFloor("ATTENTION", 0.0, kv_bytes / g.hbm_bw, flops / (g.mma_tflops * 1e6)))
    return out


def step_floor(config, shape, g, blocks: int, split: bool = False
               ) -> tuple[float, dict[str, float]]:
    """(us, per op us over the step) of a step of ``shape``: every layer's floors and the LM
    head's for the tokens that need logits; ``split``: with the input split (module
    docstring)."""
    per_op: dict[str, float] = {}
    for f in layer_floors(config, shape, g, blocks, split):
        per_op[f.op] = f.us * config.num_layers
    per_op["RMS_LM_HEAD"] = matmul_floor("RMS_LM_HEAD", config.vocab_size, config.hidden_size,
                                         shape.logits, g, blocks, split).us
    return sum(per_op.values()), per_op
