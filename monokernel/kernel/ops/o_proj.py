"""O_PROJ_RESIDUAL: merge the attention splits, then residual += attn @ Wo (megakernel.cu "Op:
O_PROJ_RESIDUAL"). Tiles: even slices of Wo's rows. Every block merges all used splits itself,
unless ATTENTION merged them by ticket this step (then it reads the merged vector). With
q/k-norm, blocks first cache the step's roped, normed keys (late q/k: after every attention
unit of the layer has read them raw, which every O_PROJ instruction waits for): each its KV
heads' keys of its part of the step's rows (``keys``: key_parts)."""

from __future__ import annotations

import numpy as np

from ..costmodel.tokens import widen_matmul
from ..costmodel.parts import (OpBatch, Phases, copy_rounds, issue_us, matvec, prefetched,
                               trips)
from ..isa import MERGE_CHUNK, Args, Op, field, merge_block_ways, pack, unpack
from ..program import TOKEN_SHARES, Instruction, Tokens, split_even
from .attention import merges_by_ticket, used_splits

OP = Op.O_PROJ_RESIDUAL
ARGS = Args("splits",  # position splits per KV head (as ATTENTION's)
            "min_chunk",  # fewest positions per split (as ATTENTION's)
            "keys",  # late q/k: the KV heads and the part of the rows whose keys this block
            # caches (key_parts), isa.PACKED_WORDS["O_PROJ_KEYS"]
            "merge_min")  # fewest used splits that ATTENTION merged by ticket (0: never)
SIGNALS = True
# token groups (token_groups.py): the input (the merged attention, stored bf16) bytes an
# element, the weight rows a tile row, the tile rows of the op. Only a tensor-core kernel's
# programs have them, whose attention is merged by ticket (merge_min 1)
INPUT_BYTES = 2
WEIGHT_ROWS = 1
# a tensor-core kernel stores the residual's bf16 copy (residual_in) in a pass after the
# mat-mul's epilogue (megakernel.cu store_residual_in; the cost model's residual_copy_pass)
RESIDUAL_COPY_PASS = True
# an input split may cut its input columns (kernel/input_slices.py): the buffer it reads
INPUT = "attn"


def input_columns(config) -> int:
    """The mat-mul's input columns (token_groups.input_reads)."""
    return config.q_dim


def tile_rows(plan) -> int:
    return plan.config.hidden_size


def row_accesses(plan, layer: int, lo: int, hi: int) -> tuple[list, list]:
    """(reads, writes) of residual rows [lo, hi) for a token, the attention merged by ticket
    (a program with token groups; the block's own key caching is not a row's)."""
    if hi <= lo:
        return [], []
    c = plan.config
    return [("residual", lo, hi), ("attn", 0, c.q_dim)], plan.residual_writes(lo, hi)


def key_parts(heads: int, blocks: int) -> list[tuple[int, int, int, int]]:
    """Late q/k: each block's (kv_first, kv_end, parts, part) of O_PROJ's key caching: the
    step's keys of KV heads [kv_first, kv_end), of its rows [part n / parts, (part + 1) n /
    parts) in a step of n. Each head's rows over ``parts`` blocks, the most that fit the blocks
    and divide TOKEN_SHARES (so a part is a whole share of the verifier's Tokens); with more
    heads than blocks, the heads over the blocks, every row each. (Before the thirty-fifth
    session a head's keys were one block's: a chunk of 256 rows, 4 warp rounds there.)"""
    if heads > blocks:
        return [(k0, k1, 1, 0) for k0, k1 in split_even(heads, blocks)]
    most = field("O_PROJ_KEYS", "PART").most  # (part < parts: parts fits too)
    parts = max(p for p in range(1, min(blocks // heads, most) + 1) if TOKEN_SHARES % p == 0)
    # the units (head, part) spread over the blocks as evenly as their count allows
    units = heads * parts
    out = [(0, 0, 1, 0)] * blocks
    for u in range(units):
        out[u * blocks // units] = (u // parts, u // parts + 1, parts, u % parts)
    return out


def keys_word(kv_first: int, kv_end: int, parts: int, part: int) -> int:
    """The argument ``keys`` (isa.PACKED_WORDS["O_PROJ_KEYS"])."""
    assert kv_first <= kv_end and part < parts
    return pack("O_PROJ_KEYS", kv_first=kv_first, kv_end=kv_end, parts=parts, part=part)


def keys_of(word) -> tuple:
    """(kv_first, kv_end, parts, part) of ``keys`` words (ints or arrays)."""
    return tuple(unpack("O_PROJ_KEYS", word).values())


def tile(plan, layer: int) -> list[Instruction]:
    c, S, B = plan.config, plan.attn_splits, plan.num_blocks
    D, gd = c.head_dim, c.group_size * c.head_dim
    merged = [("attn", 0, c.q_dim)] if plan.merge_min else []
    keys = key_parts(c.num_kv_heads, B) if c.qk_norm else [(0, 0, 1, 0)] * B
    out = []
    for (lo, hi), (k0, k1, parts, part) in zip(split_even(tile_rows(plan), B), keys):
        rows = Tokens(part * TOKEN_SHARES // parts, (part + 1) * TOKEN_SHARES // parts)
        cache = ([("k_raw", k0 * D, k1 * D, rows),
                  ("k_cache", layer * c.kv_dim + k0 * D, layer * c.kv_dim + k1 * D, rows)]
                 if k1 > k0 else [])
        args = ARGS.pack({"splits": S, "min_chunk": plan.min_chunk,
                          "keys": keys_word(k0, k1, parts, part), "merge_min": plan.merge_min})
        if hi <= lo:
            out.append(Instruction(OP, layer, (lo, hi), args=args, reads=cache[:1],
                                   writes=cache[1:]))
            continue
        out.append(Instruction(
            OP, layer, (lo, hi), args=args,
            reads=[("attn_o", 0, c.num_kv_heads * S * gd),
                   ("attn_ml", 0, c.num_kv_heads * S * c.group_size * 2),
                   ("residual", lo, hi)] + cache[:1] + merged,
            writes=plan.residual_writes(lo, hi) + cache[1:],
            weight_bytes=2 * (hi - lo) * c.q_dim))
    return out


def key_cache_rounds(heads, tokens, d) -> tuple[np.ndarray, np.ndarray]:
    """(dependent warp rounds, keys a warp round) of a block's key caching of ``heads`` KV
    heads for ``tokens`` rows (late q/k; arrays or numbers): a warp per head, a token a round
    (k_cache_keys_per_warp 0), or the (row, head) pairs over the block's warps, N keys a warp
    round (one where a round of one a warp does: megakernel.cu cache_keys<1>)."""
    heads, tokens = np.asarray(heads), np.asarray(tokens)
    n = d.k_cache_keys_per_warp
    if n <= 0:
        return tokens * -(-heads // d.warps), np.ones(np.broadcast(heads, tokens).shape)
    pairs = tokens * heads
    keys = np.where(pairs <= d.warps, 1, n)
    return -(-pairs // (d.warps * keys)), keys


def key_caching(b: OpBatch, g, d) -> tuple[np.ndarray, np.ndarray]:
    """(L2 trips, fixed us) of late q/k's key caching before the merge (none without q/k
    norm): blocks cache the step's keys, each its heads' keys of its part of the rows
    (key_parts), each a warp_qk_norm_rope of k_raw (L2) with the k-norm weights and the RoPE
    row (both in L2: ATTENTION read them this layer), its warp_sum, a barrier after them all;
    a warp round after another (design.k_cache_keys_per_warp). A step that skips the last
    layer (last_layer_skip) still runs it there: later steps read those keys."""
    c = b.program.config
    if not c.qk_norm:
        z = np.zeros(len(b.lo))
        return z, z.copy()
    k0, k1, parts, part = keys_of(b.arg("keys"))
    heads = np.maximum(k1 - k0, 0)
    n = 1 if b.shape is None else b.shape.tokens
    rows = (part + 1) * n // parts - part * n // parts  # its part of the step's rows
    owner = ((heads > 0) & (rows > 0)).astype(np.float64)
    rounds, keys = key_cache_rounds(heads, rows, d)
    rounds = owner * rounds
    return ((1 if d.late_qk_one_trip else 3) * rounds,
            rounds * (5 * g.shfl + issue_us(g, d, keys * c.head_dim // 32 * 12))
            + owner * g.bar_sync)


def cost(b: OpBatch, g, d) -> Phases:
    c = b.program.config
    busy = b.busy()
    l2, hbm = trips(d, "O_PROJ_RESIDUAL", busy)
    used = used_splits(b.program, b.context + 1)
    if merges_by_ticket(b.program, d, used):
        # ATTENTION merged the groups: read the merged vector (Q_DIM / 4 float4s over the
        # threads: one round, or as the copy loop compiles)
        l2 = l2 + busy * copy_rounds(-(-c.q_dim // (4 * d.threads)), d)
        merge_bytes = busy * c.q_dim * 4
    else:  # the used splits' partials, MERGE_CHUNK x ways of them a round
        ways = merge_block_ways(c) if d.o_proj_merge_ways else 1
        l2 = l2 + busy * -(-used // (MERGE_CHUNK * ways))
        merge_bytes = busy * c.num_kv_heads * c.group_size * (c.head_dim + 2) * 4 * used
    other = busy * (g.bar_sync + merge_bytes / (g.l2_bw / g.sms))
    key_l2, key_other = key_caching(b, g, d)
    rounds, issue = matvec(b.n, c.q_dim, g, d)
    pref = prefetched(d, b.n * c.q_dim * 2)
    return widen_matmul(b, g, d, Phases(l2 + key_l2, hbm, other + key_other, rounds, b.weight_bytes.astype(np.float64),
                                        pref, issue=busy * issue), c.q_dim)
