"""ATTENTION: flash-decoding partials per (KV head, position split) unit (megakernel.cu "Op:
ATTENTION"). Units are spread evenly over the blocks, the same every layer; unit (g, s) covers
positions [s * chunk, (s + 1) * chunk) of the step's n_pos (isa.split_chunk) for the GROUP
query heads of g. When the step uses at least ``merge_min`` splits, the last instruction of a
KV group to draw the group's ticket merges the group's splits into `attn` (merge by ticket;
in a kernel of slots a ticket per row and group, its last holder merging the row); otherwise
every O_PROJ block merges them itself. With ``merge_min`` 1 (the tensor-core kernel)
a row of one used split is normalised into `attn` by its one unit instead (isa.unit_finishes)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np

from ...errors import CostModelError
from ..costmodel.parts import OpBatch, Phases, issue_us
from ..costmodel.tokens import mma_us, widen_attention
from ..isa import (KV_UNROLL, MERGE_CHUNK, MERGE_TICKET_WAYS, PREFETCH_MAX_BYTES, SEG_KEYS,
                   SEG_QUERIES, T_TILE, Args, Op, attn_k_vec, attn_round_positions,
                   merge_by_ticket, merge_row_lanes, merge_ways, row_finishes, row_rotations,
                   seg_sub, segment_part_rows, segment_parts, split_chunk, split_part_rows,
                   split_parts, splits_used,
                   unit_finishes)
from ..program import Instruction, Region, split_even

OP = Op.ATTENTION
ARGS = Args("splits",  # position splits per KV head
            "min_chunk",  # fewest positions per split
            "ticket",  # the ticket counter of its KV group (merge by ticket), -1: none
            "tickets",  # tickets of its KV group per step (0: never merges by ticket)
            "merge_min")  # fewest used splits that merge by ticket (0: never)
SIGNALS = True


def units(plan) -> list[tuple[int, int]]:
    """The (KV head, split) units of each block: [lo, hi) of g * splits + s."""
    return split_even(plan.config.num_kv_heads * plan.attn_splits, plan.num_blocks)


def merge_min(plan, least: int) -> int:
    """The program's merge_ticket_min: ``least`` where the merge by ticket applies (a merge
    large enough, 0 < least <= splits, and no block holding units of two KV groups: one ticket
    per instruction), else 0."""
    S = plan.attn_splits
    one_group = all(hi <= lo or lo // S == (hi - 1) // S for lo, hi in units(plan))
    return least if 0 < least <= S and one_group else 0


def tile(plan, layer: int) -> list[Instruction]:
    c, S = plan.config, plan.attn_splits
    D, gd = c.head_dim, c.group_size * c.head_dim
    blocks = units(plan)
    tickets, group_tickets = [], []
    if plan.merge_min:
        # a ticket counter per KV group and row of a step: the one-sequence kernel draws its
        # group's first (one ticket per group), a kernel of slots row r's at ticket + r
        # (megakernel.cu attention_ticket)
        for g in range(c.num_kv_heads):
            tickets.append(plan.counter(f"L{layer}.ATTENTION.ticket{g}"))
            for r in range(1, plan.tokens):
                plan.counter(f"L{layer}.ATTENTION.ticket{g}.row{r}")
        group_tickets = [sum(1 for lo, hi in blocks if hi > lo and lo // S == g)
                         for g in range(c.num_kv_heads)]
    out = []
    for lo, hi in blocks:
        reads: list[Region] = []
        writes: list[Region] = []
        for u in range(lo, hi):
            g = u // S
            reads += [("q", g * gd, (g + 1) * gd),
                      ("k_cache", layer * c.kv_dim + g * D, layer * c.kv_dim + (g + 1) * D),
                      ("v_cache", layer * c.kv_dim + g * D, layer * c.kv_dim + (g + 1) * D)]
            if c.qk_norm:  # the new key, normed and roped in the unit (kernel: late q/k)
                reads.append(("k_raw", g * D, (g + 1) * D))
            writes += [("attn_o", u * gd, (u + 1) * gd),
                       ("attn_ml", u * c.group_size * 2, (u + 1) * c.group_size * 2)]
            if plan.merge_min == 1 and u % S == 0:  # a row of one split (unit_finishes)
                writes.append(("attn", g * gd, (g + 1) * gd))
        args = {"splits": S, "min_chunk": plan.min_chunk, "ticket": -1}
        ins = Instruction(OP, layer, (lo, hi), reads=reads, writes=writes)
        if plan.merge_min and hi > lo:  # the units lie in one KV group (merge_min's condition)
            g = lo // S
            args.update(ticket=tickets[g], tickets=group_tickets[g], merge_min=plan.merge_min)
            # verify() sees the group's ticket: the tail waits for every instruction of the
            # group and one runs. A kernel of slots has a ticket per row, so a row's tail waits
            # only for that row's holders and tails of different rows run on different blocks;
            # the abstraction stays sound because the tail's accesses are all row-indexed (row
            # r's partials, written only by its holders, and attn of row r, written only by its
            # tail), which strict TSan checks on the kernel itself.
            ins.ticket = (tickets[g], group_tickets[g])
            ins.tail_reads = [("attn_o", g * S * gd, (g + 1) * S * gd),
                              ("attn_ml", g * S * c.group_size * 2,
                               (g + 1) * S * c.group_size * 2)]
            ins.tail_writes = [("attn", g * gd, (g + 1) * gd)]
        ins.args = ARGS.pack(args)
        out.append(ins)
    return out


# ---- cost ------------------------------------------------------------------------------------
def used_splits(program, n_pos: int) -> int:
    return splits_used(n_pos, program.attn_splits, program.attn_min_chunk)


def merges_by_ticket(program, d, used: int) -> bool:
    """O_PROJ reads the step's attention merged in ATTENTION (and the design charges it so):
    by ticket, or by the row's one unit (unit_finishes)."""
    return d.o_proj_merge_ticket and merge_by_ticket(used, program.merge_ticket_min)


def ticket_merges(program, d, used: int) -> bool:
    """ATTENTION draws the ticket and merges the splits (not a row of one split)."""
    return merges_by_ticket(program, d, used) and not unit_finishes(used,
                                                                    program.merge_ticket_min)


def _unit_positions(b: OpBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(instruction index, first position, positions) of every attention unit."""
    splits = b.program.attn_splits
    n_pos = b.context + 1
    chunk = split_chunk(n_pos, splits, b.program.attn_min_chunk)
    idx = np.repeat(np.arange(len(b.lo)), b.n)
    units_ = np.concatenate([np.arange(lo, hi) for lo, hi in zip(b.lo.tolist(), b.hi.tolist())]
                            or [np.zeros(0, np.int64)]).astype(np.int64)
    t0 = (units_ % splits) * chunk
    cnt = np.clip(np.minimum(n_pos, t0 + chunk) - t0, 0, None)
    return idx, t0, cnt


def tile_isa(n: np.ndarray, g, d, G: int, D: int, rows=1):
    """(K rounds, V rounds, compute us) of one pass over n <= T_TILE positions, vectorised over
    n. Geometry from isa.py; instruction shapes read off the sm_90 SASS of megakernel.cu:

    - attention_scores: one iteration per attn_round_positions(D) positions; its KV_UNROLL
      loads per lane (KV_UNROLL / attn_k_vec(D) rows of attn_k_vec(D) adjacent chunks each), of
      which the compiled loop keeps ``attn_k_in_flight`` in flight (a group of loads is one HBM
      round; a load whose rows all lie past n is predicated off). The iteration's (load, head)
      dot products run side by side, their rows' shuffle reductions (log2 of the lanes a row)
      together, then the stores: the chains' latency once per iteration, the rest issue-bound.
    - attention_values: the iteration's KV_UNROLL loads all issued before the first FMA (one
      HBM round); per load 8 unpacks and G x (LDS p + 8 FFMA), issue-bound; then the
      cross-slot sum (G x 8 values x log2(KV_PPW) SHFL+FADD), the shared-memory store and
      barrier, and the cross-warp sum (an LDS round, NWARPS dependent adds: ~2 steps).
    - the online softmax between them (one warp per head: max and sum reductions, expf) and
      the tile's four barriers.

    With attn_segments, the pass of ``rows`` rows of a segment (_segment_tile)."""
    if d.attn_segments:
        return _segment_tile(n, g, d, G, D, rows)
    lanes = D // 8  # KV_LANES
    ppw = 32 // lanes  # KV_PPW
    slots = d.warps * ppw  # KV_SLOTS
    per_round = attn_round_positions(D)
    if per_round != slots * KV_UNROLL:
        raise CostModelError(f"isa.attn_round_positions({D}) = {per_round} is not KV_SLOTS "
                             f"{slots} x KV_UNROLL {KV_UNROLL}: the model's geometry is stale")
    kf = min(dict(d.attn_k_in_flight).get(D, KV_UNROLL), KV_UNROLL)
    kvec = attn_k_vec(D)  # the K loop's layout: chunks a lane a row, rows a lane a round
    k_slots, k_rows = d.warps * 32 // (lanes // kvec), KV_UNROLL // kvec
    k_steps = int(np.log2(lanes // kvec))  # a row's shuffle steps
    it = -(-n // per_round)  # loop iterations
    rem = n - np.maximum(it - 1, 0) * per_round  # positions of the last iteration
    u_last = -(-rem // k_slots) * kvec  # its loads with a row in range
    k_rounds = np.maximum(it - 1, 0) * -(-KV_UNROLL // kf) + np.where(it > 0, -(-u_last // kf), 0)
    v_rounds = it
    chain = (2 + k_steps) * g.shfl  # one (row, head) of the scores
    k_issue = issue_us(g, d, it * (KV_UNROLL * (8 + 14 * G) + k_rows * G * 2 * k_steps))
    k_compute = np.maximum(it * chain, k_issue)
    v_issue = issue_us(g, d, it * KV_UNROLL * (8 + 9 * G))
    v_reduce = max(issue_us(g, d, G * 8 * 2 * np.log2(ppw)), np.log2(ppw) * g.shfl) \
        + 2 * g.shfl
    softmax = 10 * g.shfl + 0.02
    compute = (n > 0) * (k_compute + v_issue + v_reduce + softmax + 4 * g.bar_sync)
    if d.attn_tensor_cores:
        # (design v7, predicted) scores and values on tensor cores: K as the 16-row operand
        # against the G queries padded to 8, P (G padded to 16) against V; the same loads
        compute = (n > 0) * (mma_us(n, D, G, g) + mma_us(np.full_like(n, 16), n, D, g)
                             + softmax + 4 * g.bar_sync)
    return k_rounds, v_rounds, compute


def _segment_tile(n: np.ndarray, g, d, G: int, D: int, rows) -> tuple:
    """(K/V rounds, 0, compute us) of a segment's pass over a tile of n <= T_TILE positions
    for its ``rows`` rows that reach it (design attn_segments, predicted), vectorised: the
    block stages the tile's K and V rows in shared memory by cp.async (attn_stage_async; else
    V transposed through registers, its 2-byte stores HEAD_DIM / 8-way bank-conflicted), one
    HBM round, two barriers; then each warp takes
    m-tiles of 16 (row, head) queries, passes of NWARPS m-tiles: scores as mma.sync
    (n / 8 x D / 16 of them), the online softmax in registers per seg_sub(D) positions (a
    thread's rows' max and sum over its 4 lanes: 2 shuffle steps each, an expf a score),
    probabilities x V (n / 16 x D / 8 mma). A pass's mma run at the SM's share of
    mma_tflops when 4 or more warps hold m-tiles (a warp issues to one of the 4 tensor
    cores), a quarter of it per warp below that.

    One m-tile (a decode row: GROUP <= 16 queries) runs split over the warps instead, with
    the same arithmetic per element: the scores' n-blocks over the warps (into shared
    memory, a barrier), one warp's softmax over them in the same fragment layout (its
    probability fragments and corrections into shared memory, a barrier), then
    probabilities x V over the output's D / 8 n-tiles."""
    n = np.asarray(n, np.float64)
    rows = np.broadcast_to(np.asarray(rows, np.float64), n.shape)
    mt = np.ceil(rows * G / 16)
    active = np.minimum(mt, d.warps)
    passes = np.ceil(mt / d.warps)
    n8, n16, d16 = np.ceil(n / 8) * 8, np.ceil(n / 16) * 16, -(-D // 16) * 16
    flops = 2.0 * 16 * d16 * n8 + 2.0 * 16 * D * n16  # an m-tile's QK and PV
    sm_rate = g.mma_tflops * 1e6 / g.sms

    def at(warps):  # mma time of `flops` spread over `warps` warps
        return np.minimum(np.maximum(warps, 1), 4) / 4 * sm_rate

    rate = at(active)
    mma = passes * active * flops / rate
    sub = np.ceil(n / seg_sub(D))
    softmax = passes * (issue_us(g, d, n / 8 * 4 * 8) + sub * 4 * g.shfl)
    chunks = np.ceil(n * D / 8 / d.threads)  # a thread's 16-byte K and V loads
    if d.attn_stage_async:  # a cp.async for each of K and V, zeros past the tile
        stage = issue_us(g, d, chunks * 3) + 2 * g.bar_sync
    else:  # V^T's 2-byte stores (n16 x D / 32 a block), D / 8 wavefronts each (bank conflicts)
        conflicts = n16 * D / 32 * (D // 8) / (g.clock_ghz * 1e3)
        stage = np.maximum(issue_us(g, d, chunks * (2 + 8)), conflicts) + 2 * g.bar_sync
    # one m-tile: the split mode (QK over n / 8 n-blocks, PV over D / 8 n-tiles; one warp's
    # softmax at one instruction a clock)
    qk, pv = 2.0 * 16 * d16 * n8, 2.0 * 16 * D * n16
    one_warp = (n / 8 * 4 * 8 + n / 16 * 4 * 4) / (g.clock_ghz * 1e3) + sub * 4 * g.shfl
    split = qk / at(np.minimum(n8 / 8, d.warps)) + pv / at(min(D // 8, d.warps)) \
        + one_warp + 2 * g.bar_sync
    compute = (n > 0) * (rows > 0) * (stage + np.where(mt == 1, split, mma + softmax))
    return (n > 0).astype(np.float64), np.zeros_like(n), compute


def cost(b: OpBatch, g, d) -> Phases:
    if b.shape is None or (b.shape.single and not d.tensor_cores):
        return _one_token(b, g, d)
    if d.attn_rotate_rows:
        return _step_merge(b, g, d, _rotated(b, g, d))
    return _step_merge(b, g, d, widen_attention(b, g, d, partial(_one_token, merge=False)))


def _rotated(b: OpBatch, g, d) -> Phases:
    """ATTENTION of a step of many rows with the rows' units rotated over each KV group's
    slots (isa.row_rotations) and a unit with no positions skipped: an instruction runs, for every
    row, the splits that land in its slots. Costs per unit from the one-token model (a unit
    is a block-wide pass, the same arithmetic whichever block runs it). With attn_row_parts,
    a segment's rows in parts (isa.segment_parts), each a unit run of every split its last
    row uses, in the slots after the previous part's."""
    prog = b.program
    S = prog.attn_splits
    # what runs a unit: a row, or with attn_segments a segment's rows (its last row's context)
    if d.attn_segments:
        rows = [(s.context + s.tokens - 1, s.tokens) for s in b.shape.segments]
    else:
        rows = [(s.context + i, 1) for s in b.shape.segments for i in range(s.tokens)]
    used = [used_splits(prog, ctx + 1) for ctx, _ in rows]
    probe = np.arange(S)
    keys = ("l2", "hbm", "other", "rounds", "bytes", "pref", "units", "tiles", "warp", "wmma",
            "w_l2", "w_other", "w_rounds")
    per_slot = {k: np.zeros(S) for k in keys}
    cache: dict[tuple[int, int], dict] = {}
    row_bytes, row_pref = [], []  # per row (part), its units' bytes and prefetchable bytes by slot
    units = _split_units(b, d, rows, used) if d.attn_split_parts and d.attn_segments else \
        ((r, first, end, at, None) for r, first, end, at in _part_units(b, d, rows, used))
    for r, first, end, at, split in units:
        ctx, n = rows[r]
        ctx_p, n_p = ctx - n + end, end - first  # the part's last row, its rows
        if (ctx_p, n_p) not in cache:
            one = _unit_costs(OpBatch(prog, ctx_p, np.zeros(S, np.int64), probe, probe + 1,
                                      np.zeros(S), []), g, d, n_p)
            u_p = used_splits(prog, ctx_p + 1)
            one["units"] = (one["bytes"] > 0).astype(np.float64)
            for k in ("l2", "other", "rounds"):  # the warp units' share (waves below)
                one["w_" + k] = one[k] * one["warp"]
            cache[ctx_p, n_p] = {k: np.where(probe < u_p, v, 0.0) for k, v in one.items()}
        got = cache[ctx_p, n_p]
        if split is not None:  # (attn_split_parts) one split's unit, in slot `at`
            got = {k: np.roll(np.where(probe == split, v, 0.0), at - split)
                   for k, v in got.items()}
        else:
            got = {k: np.roll(v, at) for k, v in got.items()}
        for k in keys:
            if k != "pref" or r == 0:  # prefetch_weights: the step's first row's units only
                per_slot[k] += got[k]
        row_bytes.append(got["bytes"])
        row_pref.append(got["pref"])
    # instruction i: its units [lo, hi) of g * S + slot, every group alike
    kv = prog.config.num_kv_heads
    out = {}
    for k in keys:
        cum = np.concatenate([[0.0], np.cumsum(np.tile(per_slot[k], kv))])
        out[k] = cum[b.hi] - cum[b.lo]
    if d.attn_rolling_prefetch:
        out["pref"] = _rolling_prefetch(b, S, kv, row_bytes, row_pref, d.attn_first_unit_prefetch)
    # an instruction's warp units (v6-mma-warp-units) in waves of attn_units_in_flight: a
    # wave's trips, K/V round and fixed work once (its units' alike), their mma at the SM's
    # rate; the block's own units as before
    e = out["warp"]
    wave = np.where(e > 0, np.ceil(e / max(d.attn_units_in_flight, 1)) / np.maximum(e, 1.0), 0.0)
    for k in ("l2", "other", "rounds"):
        out[k] = out[k] - out["w_" + k] * (1.0 - wave)
    out["other"] = out["other"] + out["wmma"]
    ph = Phases(out["l2"], out["hbm"], out["other"], out["rounds"], out["bytes"], out["pref"])
    if d.attn_unit_pipeline:
        # a tile's copies under the work of the tile before (charged as the instruction's mean
        # tile's; the dependent trips stay in turn): with the unit pipeline, each unit's first
        # tile but the instruction's first under its unit before's last (a unit's later tiles
        # staged in turn); by tiles (attn_tile_pipeline), every tile but the instruction's first
        # (a warp unit's tile is its warp's alone: not in the block's pipeline)
        block_other = out["other"] - out["w_other"] * wave - out["wmma"]
        tiles = np.maximum(out["tiles"] - e, 1.0)
        under = tiles - 1.0 if d.attn_tile_pipeline else np.maximum(out["units"] - e - 1.0, 0.0)
        beside = block_other * under / tiles
        ph = replace(ph, other_us=out["other"] - beside, compute=beside)
    return ph


def _rolling_prefetch(b: OpBatch, S: int, kv: int, row_bytes: list[np.ndarray],
                      row_pref: list[np.ndarray], first_unit: bool) -> np.ndarray:
    """attn_rolling_prefetch: an instruction prefetches each unit's K/V into L2 while it runs
    the unit before (megakernel.cu attention_prefetch_next), so every unit's bytes but its
    first's are prefetched. Its first unit's positions cached before the step (``row_pref``,
    as _unit_costs counts them) are prefetched before the wait if it is the step's first
    row's, or with ``first_unit`` (attn_first_unit_prefetch) whichever row's it is."""
    out = np.zeros(len(b.lo))
    every = [np.tile(rb, kv) for rb in row_bytes]  # per row, its units in every group
    for i, (lo, hi) in enumerate(zip(b.lo.tolist(), b.hi.tolist())):
        units = [u[lo:hi] for u in every]  # per row, the instruction's
        total = sum(float(u.sum()) for u in units)
        first = next(((r, int(np.flatnonzero(u > 0)[0])) for r, u in enumerate(units)
                      if (u > 0).any()), None)
        if first is None:
            continue
        r, k = first
        before = np.tile(row_pref[r], kv)[lo:hi][k] if first_unit or r == 0 else 0.0
        out[i] = total - units[r][k] + before
    return out


def _segment_parts(b: OpBatch, d, rows: list[tuple[int, int]], used: list[int]) -> list[int]:
    """Each unit-running row's (segment's) parts: isa.segment_parts with attn_row_parts, else
    1."""
    if not (d.attn_segments and d.attn_row_parts):
        return [1] * len(rows)
    G = b.program.config.group_size
    return [segment_parts(u, n, b.program.attn_splits, G, d.attn_row_parts)
            for (_, n), u in zip(rows, used)]


def _part_units(b: OpBatch, d, rows: list[tuple[int, int]], used: list[int]):
    """(r, first, end, slot) of each part of each unit-running row ``rows[r]`` (context, rows:
    a row, or with attn_segments a segment) of ``used`` splits: the part's rows [first, end)
    of its segment and the unit slot its split 0 runs in, the rotation (isa.row_rotations) of
    the earlier rows' used splits times their parts, then ``used`` slots a part."""
    S = b.program.attn_splits
    parts = _segment_parts(b, d, rows, used)
    offs = row_rotations([u * p for u, p in zip(used, parts)], S)
    for r, ((_, n), u, n_parts, off) in enumerate(zip(rows, used, parts, offs)):
        for p in range(n_parts):
            first, end = segment_part_rows(p, n_parts, n)
            yield r, first, end, (off + p * u) % S


def _split_units(b: OpBatch, d, rows: list[tuple[int, int]], used: list[int]):
    """(attn_split_parts) (r, first, end, slot, split) of each unit of each unit-running row
    ``rows[r]`` (context, rows: a segment) of ``used`` splits: isa.split_parts' parts of each
    split s, the reaching rows [first, end) of the segment (isa.split_part_rows), in the
    slots after the earlier splits' parts, from the rotation of the earlier segments'
    units."""
    S, chunk = b.program.attn_splits, b.program.attn_min_chunk
    G = b.program.config.group_size
    run = 0
    for r, ((ctx, n), u) in enumerate(zip(rows, used)):
        first_pos = ctx - n + 1
        parts = split_parts(u, n, first_pos, chunk, S, G, d.attn_row_parts) if n > 1 else [1] * u
        for s, p in enumerate(parts):
            for k in range(p):
                first, end = split_part_rows(s, k, p, n, first_pos, chunk)
                if end > first:
                    yield r, first, end, run % S, s
                run += 1


def _row_offsets(b: OpBatch, d, used: list[int]) -> list[int]:
    """Each row's rotation (isa.row_rotations): its own, or with attn_segments its segment's,
    the used splits of the step's earlier segments' last rows (times their parts), and with
    attn_row_parts its part's slots after it."""
    S = b.program.attn_splits
    if not d.attn_segments:
        return row_rotations(used, S)
    ends = np.cumsum([s.tokens for s in b.shape.segments]) - 1
    out = []
    for _, first, end, slot in _part_units(b, d, [(0, s.tokens) for s in b.shape.segments],
                                           [used[e] for e in ends]):
        out += [slot] * (end - first)
    return out


def _merge_row_bytes(c, used: int) -> float:
    """The bytes a row's merge reads and writes in one KV group: its used splits' partials
    (G x (head_dim + 2) floats each) and its merged output (G x head_dim)."""
    return (used * c.group_size * (c.head_dim + 2) + c.group_size * c.head_dim) * 4.0


def _step_merge(b: OpBatch, g, d, ph: Phases) -> Phases:
    """The ticket of a step of many rows and its last drawer's merge of the rows that merge
    (megakernel.cu attention_ticket): one pass over all their lanes (isa.merge_row_lanes) after
    a scan of the rows' lanes, each lane one round of loads (merge_ways covers its splits up to
    MERGE_CHUNK x MERGE_TICKET_WAYS), the partials' bytes at the SM's share of L2. With
    attn_row_tickets, a ticket per row instead (_row_ticket_merge)."""
    c = b.program.config
    used = [used_splits(b.program, s.context + i + 1) for s in b.shape.segments
            for i in range(s.tokens)]
    if d.attn_rotate_rows:  # a row of one split finishes in its unit only in slot 0
        offs = _row_offsets(b, d, used)
        merging = [(u, off) for u, off in zip(used, offs) if merges_by_ticket(b.program, d, u)
                   and not row_finishes(u, b.program.merge_ticket_min, off)]
    else:
        merging = [(u, 0) for u in used if ticket_merges(b.program, d, u)]
    if not merging:
        return ph
    used = [u for u, _ in merging]
    ticket = g.ticket if d.ticket_as_compiled else (g.fence if d.signal_sc_fence else g.release)
    # the ticket, three barriers (the partials issued, the draw, the scan of the rows' lanes)
    # and warp 0's shuffle scan (5 steps), whichever ticket
    fixed = 3 * g.bar_sync + ticket + 5 * g.shfl
    rounds = max(-(-u // (MERGE_CHUNK * merge_ways(u))) for u in used)
    if d.attn_rotate_rows and d.attn_row_tickets:
        return _row_ticket_merge(b, g, d, ph, merging, fixed, rounds)
    busy = b.busy()
    passes = -(-sum(merge_row_lanes(c, u) for u in used) // d.threads)
    mb = sum(_merge_row_bytes(c, u) for u in used)
    l2 = ph.l2_trips + busy * (1 + passes * rounds)
    other = ph.other_us + busy * (fixed + mb / (g.l2_bw / g.sms))
    return replace(ph, l2_trips=l2, other_us=other)


def _row_ticket_merge(b: OpBatch, g, d, ph: Phases, merging: list[tuple[int, int]],
                      fixed: float, rounds: int) -> Phases:
    """The tickets per row (attn_row_tickets, megakernel.cu attention_row_tickets) of the
    step's merging rows (used splits, rotation): an instruction that ran units of one draws, a
    thread a row and all at once, the ticket of every such row, then merges the rows it drew
    last: whichever of the row's holders finishes last, so each holder is charged its share,
    sum over its rows of 1 / (the row's holders), rounded up, their lanes in one pass of the
    block's threads. An instruction holding no merging row draws nothing."""
    c, S = b.program.config, b.program.attn_splits
    l2, other = ph.l2_trips.copy(), ph.other_us.copy()
    # the instructions of a layer's group: their slot ranges (each instruction's share is
    # computed over its own layer's and group's instructions)
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for layer, lo, hi in zip(b.layer.tolist(), b.lo.tolist(), b.hi.tolist()):
        if hi > lo:
            groups.setdefault((layer, lo // S), []).append((lo % S, hi - lo))
    share: dict[tuple[int, int, int, int], tuple[bool, float]] = {}
    for (layer, gi), insts in groups.items():
        holds = np.array([[any((j - off) % S < u for j in range(j0, j0 + n)) for u, off in merging]
                          for j0, n in insts], dtype=np.float64)
        holders = np.maximum(holds.sum(axis=0), 1.0)
        for (j0, n), h in zip(insts, holds):
            share[(layer, gi, j0, n)] = (bool(h.any()),
                                         float(np.ceil(np.sum(h / holders) - 1e-9)))
    lanes = np.mean([merge_row_lanes(c, u) for u, _ in merging])
    row_bytes = np.mean([_merge_row_bytes(c, u) for u, _ in merging])
    for i, (layer, lo, hi) in enumerate(zip(b.layer.tolist(), b.lo.tolist(), b.hi.tolist())):
        if hi <= lo:
            continue
        draws, k = share[(layer, lo // S, lo % S, hi - lo)]
        if not draws:
            continue
        passes = -(-int(k * lanes) // d.threads) if k else 0
        l2[i] += 1 + passes * rounds  # the draws (one round, side by side), the merge's rounds
        other[i] += fixed + (k * row_bytes / (g.l2_bw / g.sms) if k else 0.0)
    return replace(ph, l2_trips=l2, other_us=other)


def _segment_tile_positions(cfg) -> int:
    from ..header import segment_tile  # (header imports the ops)

    return segment_tile(cfg)


def _unit_costs(b: OpBatch, g, d, rows: int = 1) -> dict[str, np.ndarray]:
    """Per attention unit of the batch's instructions (in order): its dependent L2 and HBM
    trips, other time, K/V rounds, bytes and prefetched bytes at ``b.context``; with
    attn_segments, of a segment of ``rows`` rows, the last at ``b.context`` (a unit runs the
    rows that reach its positions; their queries and partials at the SM's share of L2)."""
    c = b.program.config
    G, D = c.group_size, c.head_dim
    idx, t0, cnt = _unit_positions(b)
    # a segment's unit stages tiles of header.segment_tile's positions (MK_SEG_TILE)
    tile = _segment_tile_positions(c) if d.attn_segments else T_TILE
    ntile = -(-cnt // tile)
    full, last = np.maximum(ntile - 1, 0), cnt - np.maximum(ntile - 1, 0) * tile
    unit_hbm = np.zeros(len(idx))
    unit_l2 = np.full(len(idx), float(d.trips["ATTENTION"][0]))  # the group's queries
    reach = np.clip(b.context - t0 + 1, 0, rows) if d.attn_segments else 1
    kf, vf, of = tile_isa(np.full(len(idx), tile), g, d, G, D, reach)
    kl, vl, ol = tile_isa(last, g, d, G, D, reach)
    k_rounds, v_rounds = full * kf + kl, full * vf + vl
    unit_other = full * of + ol + 2 * g.bar_sync  # the unit's set-up and end barriers
    if d.attn_segments:  # fp32 queries in, fp32 partials (or a row's bf16 output) out
        unit_other += reach * G * (D * 4 + (D + 2) * 4) / (g.l2_bw / g.sms)
    if d.attn_segments and d.attn_stage_first and not c.qk_norm:
        # the first tile's K and V copies issued before the query tile: the queries' trip
        # runs under the tile's round (charged as the round: an L2 trip is no longer). Late
        # q/k issues them after the query tile (megakernel.cu segment_pass: registers)
        unit_l2 -= (cnt > 0) * float(d.trips["ATTENTION"][0])
    if c.qk_norm and d.attn_segments:
        # late q/k in a segment's unit (megakernel.cu segment_q_tile, segment_keys): a pass's
        # queries normed and roped into its query tiles, SEG_QUERIES a warp a round (the split
        # mode's one m-tile: every warp 16 / warps of them, one round), each round an L2 trip
        # (the first rides the queries' own) and a warp_sum; the segment's own keys in the
        # unit's positions into the K tile, SEG_KEYS a warp a round, each round an L2 trip for
        # their raw keys and RoPE rows and a warp_sum
        mt = np.ceil(reach * G / 16)
        passes = np.ceil(mt / d.warps)
        per_warp = np.where(mt == 1, -(-16 // d.warps), SEG_QUERIES)
        q_rounds = np.where(mt == 1, 1, -(-16 // SEG_QUERIES))
        q_other = passes * q_rounds * (5 * g.shfl + issue_us(g, d, per_warp * D // 32 * 12))
        keys = np.clip(np.minimum(t0 + cnt, b.context + 1) - np.maximum(t0, b.context + 1 - rows),
                       0, None)
        key_rounds = np.ceil(keys / (d.warps * SEG_KEYS))
        k_other = key_rounds * (5 * g.shfl + issue_us(g, d, SEG_KEYS * D // 32 * 12))
        # attn_stage_first: the keys from the last warp down, under the tile's copies; a decode
        # row's one m-tile holds queries on its first min(M, warps) warps only, so where the
        # keys' warps are others, their trip and work run beside the queries' (charged: one
        # trip and the longer norm, then the round: where the key's norm is the longer, up to
        # the round more than the queries' warps' trip, norm and round)
        beside = d.attn_stage_first & (mt == 1) & \
            (np.minimum(reach * G, d.warps) + np.ceil(keys / SEG_KEYS) <= d.warps)
        unit_l2 += passes * (q_rounds - 1) + np.where(beside, 0.0, key_rounds)
        unit_other += np.where(beside, np.maximum(q_other, k_other), q_other + k_other)
    elif c.qk_norm:
        # warp_qk_norm_rope per query head and the key, after the queries' L2 trip: the
        # warp_sum, then the q/k-norm weights and the RoPE row, a barrier; the unit holding the
        # new position scores it from shared memory (barrier, warp_sum)
        if not d.late_qk_one_trip:
            unit_hbm += 1.0
            unit_l2 += 1.0
        unit_other += 5 * g.shfl + g.bar_sync
        holds = (t0 <= b.context) & (b.context < t0 + cnt)  # the new position's unit
        unit_other += holds * (g.bar_sync + 6 * g.shfl)
    pref = np.zeros(len(idx))
    if d.attn_kv_prefetch:  # K and V: a range each, positions before the new one
        old = np.clip(np.minimum(cnt, b.context - t0), 0, None)
        pref = 2 * np.minimum(old * D * 2.0, PREFETCH_MAX_BYTES)
    rounds = (k_rounds + v_rounds).astype(np.float64)
    warp = np.zeros(len(idx))
    wmma = np.zeros(len(idx))
    if d.attn_segments and d.attn_units_in_flight > 1 and rows == 1 and G <= 16:
        # a decode row's unit of at most attn_warp_unit_positions positions runs on one warp
        # (design v6-mma-warp-units, predicted): _warp_unit's trips and work for the block's
        warp = ((cnt <= d.attn_warp_unit_positions) & (cnt > 0)).astype(np.float64)
        w = _warp_unit(cnt, t0, b.context, g, d, c)
        on = warp > 0
        unit_l2, unit_other = np.where(on, w["l2"], unit_l2), np.where(on, w["other"], unit_other)
        rounds = np.where(on, w["rounds"], rounds)
        wmma = np.where(on, w["mma"], 0.0)
    return {"idx": idx, "l2": unit_l2, "hbm": unit_hbm, "other": unit_other,
            "rounds": rounds, "bytes": cnt * 2 * D * 2.0,
            "pref": pref, "tiles": ntile.astype(np.float64), "warp": warp, "wmma": wmma}


def _warp_unit(cnt: np.ndarray, t0: np.ndarray, context: int, g, d, c) -> dict:
    """A decode row's short unit (one tile) on one warp (design v6-mma-warp-units, predicted;
    not built): the warp stages the tile's K and V by cp.async into its own shared memory (its 32
    threads' copies, cp.async.wait and __syncwarp: no block barrier), builds its query m-tile
    (G <= 16 queries; late q/k norms them and the row's own key itself, each an L2 trip), then
    the m-tiles mode's pass on the tile: scores (n / 8 x D / 16 mma), the online softmax per
    seg_sub(D) positions, probabilities x V, and stores its partials. Its trips, K/V round and
    fixed work overlap its instruction's other warp units (up to attn_units_in_flight a wave:
    _rotated); its mma (``mma``) share the SM's tensor cores with them, charged at the SM's
    rate. The same arithmetic per element as a block's unit (the m-tiles mode's), so a row's
    numbers would not depend on which mode ran it."""
    G, D = c.group_size, c.head_dim
    n = np.asarray(cnt, np.float64)
    n8, n16, d16 = np.ceil(n / 8) * 8, np.ceil(n / 16) * 16, -(-D // 16) * 16
    mma = (2.0 * 16 * d16 * n8 + 2.0 * 16 * D * n16) / (g.mma_tflops * 1e6 / g.sms)
    chunks = np.ceil(n * D / 8 / 32)  # a lane's 16-byte K and V copies
    stage = issue_us(g, d, chunks * 3)
    sub = np.ceil(n / seg_sub(D))
    softmax = issue_us(g, d, n / 8 * 4 * 8) + sub * 4 * g.shfl
    io = G * (D * 4 + (D + 2) * 4) / (g.l2_bw / g.sms)  # its queries in, its partials out
    # the queries' trip (under the tile's copies, issued first, unless late q/k: as a block's)
    l2 = np.full_like(n, 0.0 if d.attn_stage_first and not c.qk_norm else 1.0)
    other = stage + softmax + io
    if c.qk_norm:  # late q/k: its G queries and the row's key (in this unit) normed and roped
        holds = (t0 <= context) & (context < t0 + n)
        q_other = 5 * g.shfl + issue_us(g, d, G * D // 32 * 12)
        k_other = holds * (5 * g.shfl + issue_us(g, d, D // 32 * 12))
        l2 = l2 + holds
        other = other + q_other + k_other
    return {"l2": l2 * (n > 0), "other": other * (n > 0), "rounds": (n > 0) * 1.0,
            "mma": mma * (n > 0)}


def _one_token(b: OpBatch, g, d, merge: bool = True) -> Phases:
    c = b.program.config
    G, D = c.group_size, c.head_dim
    u = _unit_costs(b, g, d)
    idx, n = u["idx"], len(b.lo)
    used = used_splits(b.program, b.context + 1)
    other = np.bincount(idx, u["other"], n)
    l2 = np.bincount(idx, u["l2"], n)
    # a row of one split (unit_finishes): its unit stores G x D normalised outputs instead of
    # the partials, no trip more; no ticket
    if merge and ticket_merges(b.program, d, used):
        # every instruction with units (one KV group's): a barrier, the ticket (an acq_rel
        # returning atomic; MK_SYNC=1: fence + atomicAdd); the last of its group (charged to
        # all: the group's last one ends the op) loads the used splits' partials (MERGE_CHUNK x
        # MERGE_TICKET_WAYS a round), merges them and stores the merged vector
        busy = b.busy()
        mb = used * G * (D + 2) * 4.0
        l2_share = g.l2_bw / g.sms
        ticket = g.ticket if d.ticket_as_compiled else (g.fence if d.signal_sc_fence
                                                         else g.release)
        l2 = l2 + busy * (1 + -(-used // (MERGE_CHUNK * MERGE_TICKET_WAYS)))
        other = other + busy * (2 * g.bar_sync + ticket + mb / l2_share + G * D * 4 / l2_share)
    # K/V rounds go to HBM; with attn_kv_prefetch the rows cached before this step were
    # brought into L2 during the wait (the prefetch share of the rounds then hits L2)
    rounds = np.bincount(idx, u["rounds"], n)
    hbm = np.bincount(idx, u["hbm"], n)
    sbytes = np.bincount(idx, u["bytes"], n)
    pref = np.bincount(idx, u["pref"], n) if d.attn_kv_prefetch else b.zeros()
    return Phases(l2, hbm, other, rounds, sbytes, pref)
