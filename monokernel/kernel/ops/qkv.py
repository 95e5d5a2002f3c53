"""RMS_QKV_ROPE: q, k, v = rmsnorm(residual) @ Wqkv (+ bias); RoPE; K/V into the cache
(megakernel.cu "Op: RMS_QKV_ROPE"). Tiles are row pairs (j, j + HEAD_DIM/2) of one head, so
RoPE's partner row is always in the same tile, split evenly over the blocks. With q/k-norm
(Qwen3) q and the new k leave raw ("late q/k"): ATTENTION norms and ropes them, O_PROJ caches
the key."""

from __future__ import annotations

import numpy as np

from ..costmodel.tokens import widen_matmul
from ..costmodel.parts import (OpBatch, Phases, block_sum_us, late_norm, matvec, prefetched,
                               trips)
from ..isa import Args, Op
from ..program import Instruction, Region, split_even

OP = Op.RMS_QKV_ROPE
# its input is the residual, normed by the op (tensor cores: megakernel.cu mma_rms, which
# reads the rows first and stages a small share in shared memory; costmodel levers.py)
RMS_INPUT = True
ARGS = Args()
SIGNALS = True
# token groups (token_groups.py): the input bytes an element choose charges, the weight rows
# a tile row (a row pair), the tile rows of the op. 4, though the op reads residual_in's bf16
# since 2026-12-04: at 2, choose picks groups the cost model predicts slower (benchmarks/
# NOTES.md, "bf16 copies of the residual"); at 4 its picks are the model's best per op to
# within ~1 % (NOTES.md, "Token groups against the full model").
INPUT_BYTES = 4
WEIGHT_ROWS = 2


def input_columns(config) -> int:
    """The mat-mul's input columns (token_groups.input_reads)."""
    return config.hidden_size


def tile_rows(plan) -> int:
    c = plan.config
    return (c.num_heads + 2 * c.num_kv_heads) * (c.head_dim // 2)


def row_accesses(plan, layer: int, lo: int, hi: int) -> tuple[list[Region], list[Region]]:
    """(reads, writes) of row pairs [lo, hi) for a token."""
    c = plan.config
    D, half = c.head_dim, c.head_dim // 2
    writes: list[Region] = []
    for head in range(lo // half, (hi - 1) // half + 1 if hi > lo else 0):
        j0, j1 = max(lo, head * half) - head * half, min(hi, (head + 1) * half) - head * half
        if head < c.num_heads:
            buf, base = "q", head * D
        elif head < c.num_heads + c.num_kv_heads and c.qk_norm:
            buf, base = "k_raw", (head - c.num_heads) * D
        elif head < c.num_heads + c.num_kv_heads:
            buf, base = "k_cache", layer * c.kv_dim + (head - c.num_heads) * D
        else:
            buf, base = "v_cache", layer * c.kv_dim + (head - c.num_heads - c.num_kv_heads) * D
        writes += [(buf, base + j0, base + j1), (buf, base + half + j0, base + half + j1)]
    return ([(plan.rms_input(), 0, c.hidden_size)] if hi > lo else []), writes


def tile(plan, layer: int) -> list[Instruction]:
    H = plan.config.hidden_size
    out = []
    for lo, hi in split_even(tile_rows(plan), plan.num_blocks):
        reads, writes = row_accesses(plan, layer, lo, hi)
        rows = 2 * (hi - lo)
        out.append(Instruction(OP, layer, (lo, hi), reads=reads, writes=writes,
                               weight_bytes=2 * rows * H + (2 * H if hi > lo else 0)))
    return out


def cost(b: OpBatch, g, d) -> Phases:
    c = b.program.config
    half, H = c.head_dim // 2, c.hidden_size
    busy = b.busy()
    l2, hbm = trips(d, "RMS_QKV_ROPE", busy)
    # the kernel walks the tile head by head: each head segment's 2n rows over the warps, then
    # RoPE with barriers in between
    seg_ins, seg_n = [], []
    for k, (lo, hi) in enumerate(zip(b.lo.tolist(), b.hi.tolist())):
        p = lo
        while p < hi:
            n = min(half, p % half + hi - p) - p % half
            seg_ins.append(k)
            seg_n.append(n)
            p += n
    idx, n = np.array(seg_ins, np.int64), np.array(seg_n, np.int64)
    m = len(b.lo)
    seg_rounds, seg_issue = matvec(2 * n, H, g, d)
    rounds = np.bincount(idx, seg_rounds, m)
    other = busy * block_sum_us(g) + np.bincount(idx, np.full(len(n), 2 * g.bar_sync), m)
    hbm = hbm + np.bincount(idx, np.full(len(n), float(c.attention_bias)), m)  # the bias
    pref = np.bincount(idx, prefetched(d, n * H * 2) * 2.0, m) if d.l2_prefetch else b.zeros()
    # a tile row is a row pair (WEIGHT_ROWS weight rows); an output row stores one float
    return widen_matmul(b, g, d, Phases(l2, hbm, other, rounds, b.weight_bytes.astype(np.float64),
                                        pref, late_norm(busy, d), np.bincount(idx, seg_issue, m)),
                        H, rows=WEIGHT_ROWS * b.n, out_bytes=4.0)
