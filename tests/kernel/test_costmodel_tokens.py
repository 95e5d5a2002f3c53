"""The cost model of steps of many tokens (kernel/costmodel/tokens.py, design v7: issue 17,
predicted before it is built): a step of one token is the one-token model's, bit for bit;
batch 1 does not get slower; more tokens per step cost more per step and less per token; the
predictions never beat the bytes the step must move; 2D tiles are never worse than row tiles;
and `plan --batch / --prompt` print their predictions. Every number here is a prediction."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.kernel import program
from monokernel.cli import main
from monokernel.errors import CostModelError
from monokernel.kernel import costmodel as cm
from monokernel.kernel.costmodel.tokens import (Segment, StepShape, mma_us, prefill_shapes,
                                                tile_split)
from monokernel.kernel.isa import Op


def small():
    """A 3-layer SmolLM2 on 32 blocks: quick to schedule and to simulate, every op present."""
    return program("smollm2-135m", 32, 300, num_layers=3)


V7 = cm.design("v7")


def test_a_step_of_one_token_is_the_one_token_model():
    prog = small()
    for d in (cm.V6, V7):
        for ctx in (0, 17, 200):
            a = cm.predict(prog, "h200", d, ctx)
            b = cm.predict(prog, "h200", d, shape=StepShape.decode(1, ctx))
            assert b.total_us == a.total_us


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"])
@pytest.mark.parametrize("context", [16, 1024])
def test_batch_one_is_no_slower_on_the_design_of_many_tokens(name, context):
    """Issue 17: batch-1 decode predicted no slower than before (within 2%). v7 runs its one
    token through the same code as a batch (mma, attention on tensor cores): that path, not
    a separate mat-vec, must keep the speed; so must v8's levers."""
    prog = program(name)
    before = cm.predict(prog, "h200", cm.V6, context).total_us
    for d in (V7, cm.design("v8"), cm.design("v8-cluster")):
        after = cm.predict(prog, "h200", d, context).total_us
        assert after <= before * 1.02, (d.name, before, after)


def test_more_tokens_cost_more_per_step_and_less_per_token():
    prog = small()
    prev = None
    for batch in (1, 2, 8, 32, 64):
        p = cm.predict(prog, "h200", V7, shape=StepShape.decode(batch, 64))
        if prev is not None:
            assert p.total_us >= prev.total_us
            assert p.tokens_per_s > prev.tokens_per_s
        prev = p


def test_a_step_never_beats_the_bytes_it_moves():
    """Weights once, every sequence's K/V once: at the copy rate that is a floor no
    prediction may go under, whatever the batch."""
    prog = program("qwen3-0.6b")
    c = prog.config
    for batch, ctx in ((64, 1024), (64, 16), (8, 1024)):
        p = cm.predict(prog, "h200", V7, shape=StepShape.decode(batch, ctx))
        kv = batch * (ctx + 1) * c.num_layers * c.kv_dim * 2 * 2
        floor = (c.weight_bytes_per_token() + kv) / p.gpu.hbm_bw
        assert p.step_us > floor, (batch, ctx, p.step_us, floor)


def test_2d_tiles_are_never_worse_than_row_tiles():
    prog = small()
    rows = cm.design("v7-rows")
    for shape in (StepShape.decode(64, 16), StepShape.decode(16, 200),
                  StepShape.chunk(0, 256, True)):
        assert cm.predict(prog, "h200", V7, shape=shape).step_us <= \
            cm.predict(prog, "h200", rows, shape=shape).step_us
    st = cm.Static(prog, 0, cm.gpu("h200"), rows, StepShape.decode(64, 16))
    assert set(st.tiles.values()) == {(1, 1)}


def test_tile_split_cuts_the_broadcast_when_it_dominates():
    g = cm.gpu("h200")
    # one token: nothing to split; many tokens over a long input: split
    assert tile_split(np.full(132, 16), 8192, 1, g, V7) == (1, 1)
    c, s = tile_split(np.full(132, 16), 8192, 512, g, V7)
    assert c * s > 1
    # token groups are never narrower than the mma's 8 columns
    c, s = tile_split(np.full(132, 16), 576, 16, g, V7)
    assert 16 / c >= 8


def test_mma_time_pads_to_the_fragment_and_scales():
    g = cm.gpu("h200")
    one = mma_us(np.array([16]), 16, 8, g)[0]
    assert one > 0
    assert mma_us(np.array([1]), 1, 1, g)[0] == one  # padded to one m16n8k16
    assert mma_us(np.array([32]), 64, 16, g)[0] == pytest.approx(16 * one)
    assert mma_us(np.array([0]), 64, 16, g)[0] == 0.0


def test_the_lm_head_runs_only_for_tokens_that_need_logits():
    prog = small()
    g = cm.gpu("h200")
    st = cm.Static(prog, 0, g, V7, StepShape.chunk(0, 64, last=False))
    head = [(b, i) for b, q in enumerate(prog.queues) for i, ins in enumerate(q)
            if ins.op == Op.RMS_LM_HEAD]
    for f in ("bytes", "rounds", "other", "compute"):
        assert all(st.fields[f][b, i] == 0 for b, i in head), f
    last = cm.Static(prog, 0, g, V7, StepShape.chunk(0, 64, last=True))
    assert sum(last.fields["bytes"][b, i] for b, i in head) > 0


def test_bf16_inputs_halve_the_mat_muls_broadcasts_only():
    """v6-mma-seg's mat-muls read bf16 inputs: O_PROJ and DOWN the bf16 their producers store
    (stored_bf16_inputs: megakernel.cu store_in, isa.BF16_INPUTS): at batch 64 their input's
    time from L2 halves against fp32, and the step's other phases are what they were; the RMS
    ops the residual's bf16 copy (residual_in: input_bytes 2): their input's time drops, and
    only theirs."""
    from monokernel.kernel.schedule import schedule
    from monokernel.model.config import ModelConfig

    cfg = ModelConfig.from_name("smollm2-135m").replace(num_layers=3)
    prog = schedule(cfg, 32, 300, merge_ticket_min=1, tokens=64)
    g = cm.gpu("h200")
    built = cm.design("v6-mma-seg")
    assert built.stored_bf16_inputs and built.input_bytes == 2
    rms_fp32 = built.replace(input_bytes=4)  # the RMS ops on the fp32 residual
    fp32 = rms_fp32.replace(stored_bf16_inputs=False)  # and O_PROJ and DOWN on fp32 inputs
    shape = StepShape.decode(64, 16)
    a, b, c = (cm.Static(prog, 0, g, d, shape) for d in (fp32, rms_fp32, built))
    K = {Op.O_PROJ_RESIDUAL: prog.config.q_dim, Op.DOWN_RESIDUAL: prog.config.intermediate_size}
    rms = (Op.RMS_QKV_ROPE, Op.RMS_GATE_UP, Op.RMS_LM_HEAD)
    for blk, q in enumerate(prog.queues):
        for i, ins in enumerate(q):
            cut = a.fields["other"][blk, i] - b.fields["other"][blk, i]
            rms_cut = b.fields["other"][blk, i] - c.fields["other"][blk, i]
            busy = ins.tile[1] > ins.tile[0]
            if ins.op in K and busy:
                # 64 rows x K elements, 2 bytes fewer each, at the SM's share of L2
                assert cut == pytest.approx(64 * K[ins.op] * 2 / (g.l2_bw / g.sms)), ins.op
            else:
                assert cut == 0, ins.op
            assert rms_cut > 0 if ins.op in rms and busy else rms_cut == 0, ins.op
            for f in ("l2", "hbm", "rounds", "bytes", "compute"):
                assert a.fields[f][blk, i] == b.fields[f][blk, i] == c.fields[f][blk, i], \
                    (ins.op, f)
    totals = [cm.predict(prog, g, d, shape=shape).total_us for d in (fp32, rms_fp32, built)]
    assert totals[0] > totals[1] > totals[2], totals


def test_staged_rms_inputs_are_read_from_l2_once():
    """The RMS ops read their rows in mma_rms first: unstaged, block_mma's first pass reads
    them again (past l1_input_bytes) and every row pass after it; staged (a share of at most
    rms_stage_rows rows, megakernel.cu mma_rms), only mma_rms's one read is left. At batch 64
    on row tiles (every block's share: 64 rows x 576 bf16 of residual_in, 74 KB, past L1's
    64 KB) staging cuts each RMS instruction's time from L2 by at least one read of its share
    and changes nothing else; a share larger than the rows staged is charged as unstaged, or
    with rms_stage_partial (as built) less, its first rows staged."""
    from monokernel.kernel.schedule import schedule
    from monokernel.model.config import ModelConfig

    cfg = ModelConfig.from_name("smollm2-135m").replace(num_layers=3)
    prog = schedule(cfg, 32, 300, merge_ticket_min=1, tokens=64)
    g = cm.gpu("h200")
    built = cm.design("v6-mma-seg")
    assert built.rms_stage_rows == 64 == cm.design_for(prog, tensor_cores=True).rms_stage_rows
    shape = StepShape.decode(64, 16)
    assert built.rms_stage_partial
    whole = built.replace(rms_stage_partial=False)
    st = {rows: cm.Static(prog, 0, g, whole.replace(rms_stage_rows=rows), shape)
          for rows in (0, 8, 64)}
    part = cm.Static(prog, 0, g, built.replace(rms_stage_rows=8), shape)
    assert 64 * cfg.hidden_size * built.input_bytes > built.l1_input_bytes
    one_read = 64 * cfg.hidden_size * built.input_bytes / (g.l2_bw / g.sms)
    rms = (Op.RMS_QKV_ROPE, Op.RMS_GATE_UP, Op.RMS_LM_HEAD)
    cut_any = False
    for blk, q in enumerate(prog.queues):
        for i, ins in enumerate(q):
            unstaged, staged = st[0].fields["other"][blk, i], st[64].fields["other"][blk, i]
            assert st[8].fields["other"][blk, i] == unstaged, ins.op  # shares of 64 > 8
            if ins.op in rms and ins.tile[1] > ins.tile[0]:
                assert unstaged - staged >= one_read * (1 - 1e-9), ins.op
                # (the rest, 56 rows x 1152 bytes, within l1_input_bytes: no re-read)
                assert staged <= part.fields["other"][blk, i] < unstaged, ins.op
                cut_any = True
            else:
                assert unstaged == staged == part.fields["other"][blk, i], ins.op
            for f in ("l2", "hbm", "rounds", "bytes", "compute"):
                assert st[0].fields[f][blk, i] == st[64].fields[f][blk, i], (ins.op, f)
    assert cut_any
    assert cm.predict(prog, g, built, shape=shape).total_us < \
        cm.predict(prog, g, built.replace(rms_stage_rows=0), shape=shape).total_us


def test_row_tickets_spread_the_merge_over_a_groups_blocks():
    """v6-mma(-seg) draws a ticket per row (megakernel.cu attention_row_tickets): at batch 64,
    context 1024, the rows' merges spread over each KV group's blocks, so the busiest
    ATTENTION instruction's other time falls below the group ticket's (whose last drawer
    merges all 64 rows) and the step is faster; a step of one row (batch 1), whose one merge
    is the same work either way, costs what it did (the group's other instructions no longer
    draw, off the critical path)."""
    from monokernel.kernel.schedule import schedule, tensor_core_splits
    from monokernel.model.config import ModelConfig

    cfg = ModelConfig.from_name("smollm2-135m").replace(num_layers=3)
    splits, min_chunk = tensor_core_splits(cfg, 132, 1100)
    prog = schedule(cfg, 132, 1100, splits, min_chunk, merge_ticket_min=1, tokens=64)
    g = cm.gpu("h200")
    built = cm.design("v6-mma-seg")
    assert built.attn_row_tickets
    group = built.replace(attn_row_tickets=False)
    attn = np.array([[ins.op == Op.ATTENTION for ins in q] for q in prog.queues])
    for batch in (64, 1):
        shape = StepShape.decode(batch, 1024)
        a, b = cm.Static(prog, 0, g, group, shape), cm.Static(prog, 0, g, built, shape)
        # the merge's share of ATTENTION's other time: against no merge in ATTENTION at all
        base = cm.Static(prog, 0, g, group.replace(o_proj_merge_ticket=False), shape)
        before, after = (x.fields["other"][attn] - base.fields["other"][attn] for x in (a, b))
        for f in ("hbm", "rounds", "bytes", "compute"):
            assert np.array_equal(a.fields[f], b.fields[f]), f
        if batch == 1:  # one merge, by a holder of the row either way; others draw nothing
            assert after.max() == pytest.approx(before.max())
            assert cm.predict(prog, g, built, shape=shape).total_us == pytest.approx(
                cm.predict(prog, g, group, shape=shape).total_us)
        else:
            assert after.max() < 0.25 * before.max(), (after.max(), before.max())
            assert cm.predict(prog, g, built, shape=shape).total_us < \
                cm.predict(prog, g, group, shape=shape).total_us


def test_attention_prefetch_of_a_step_is_its_first_rows_or_rolling():
    """ATTENTION's prefetch in a step of many rows. Without the rolling prefetch only the step's
    first row's units are prefetched (prefetch_weights before the wait): an instruction's
    prefetched bytes are those of row 0's units. With it (v6-mma-seg as built:
    megakernel.cu attention_prefetch_next) every unit's bytes but the instruction's first
    unit's are, plus that one's positions cached before the step (prefetched before the
    wait, whichever row's it is); the step at batch 64, context 1024 is faster, and batch 1
    (row 0 only) is unchanged."""
    from monokernel.kernel.schedule import schedule, tensor_core_splits
    from monokernel.model.config import ModelConfig

    cfg = ModelConfig.from_name("smollm2-135m").replace(num_layers=2)
    splits, min_chunk = tensor_core_splits(cfg, 132, 1100)
    prog = schedule(cfg, 132, 1100, splits, min_chunk, merge_ticket_min=1, tokens=64)
    g = cm.gpu("h200")
    built = cm.design("v6-mma-seg")
    assert built.attn_rolling_prefetch and built.attn_first_unit_prefetch
    first_only = built.replace(attn_rolling_prefetch=False, attn_first_unit_prefetch=False)
    attn = np.array([[ins.op == Op.ATTENTION for ins in q] for q in prog.queues])
    one = cm.Static(prog, 0, g, first_only, StepShape.decode(1, 1024))
    shape = StepShape.decode(64, 1024)
    a, b = cm.Static(prog, 0, g, first_only, shape), cm.Static(prog, 0, g, built, shape)
    # the first row's units: what a step of that row alone prefetches
    assert np.array_equal(a.fields["pref"][attn], one.fields["pref"][attn])
    nbytes, pref = b.fields["bytes"][attn], b.fields["pref"][attn]
    busy = nbytes > 0
    # a full unit: K and V of the program's positions a split (fixed by absolute position)
    unit = 2 * prog.attn_min_chunk * cfg.head_dim * 2.0
    assert np.all(pref[busy] <= nbytes[busy])
    assert np.all(pref[busy] >= nbytes[busy] - unit), "more than a unit not prefetched"
    assert pref.sum() > 10 * a.fields["pref"][attn].sum()
    # the prefetch turns K/V rounds from HBM into L2 latency: 10% of this step since the K
    # loop keeps its four loads in flight at head_dim 64 (isa.attn_k_vec; over 20% when they went
    # one at a time); without it the two would be equal
    assert cm.predict(prog, g, built, shape=shape).total_us < \
        0.95 * cm.predict(prog, g, first_only, shape=shape).total_us
    single = StepShape.decode(1, 1024)
    assert cm.predict(prog, g, built, shape=single).total_us == pytest.approx(
        cm.predict(prog, g, first_only, shape=single).total_us)


def test_segments_read_a_units_kv_once_for_all_their_rows():
    """attn_segments (built: megakernel.cu SEG_ATTN): a prompt chunk's rows share one rotation and run
    each unit together, so ATTENTION's K/V bytes of a late chunk of 128 rows are each used
    split's K/V once (not once per row, as rotating rows read them), its step is faster, and
    a decode step of one row (a segment of one) moves the same bytes as before."""
    from monokernel.kernel.schedule import schedule, tensor_core_splits
    from monokernel.model.config import ModelConfig

    cfg = ModelConfig.from_name("smollm2-135m").replace(num_layers=2)
    splits, min_chunk = tensor_core_splits(cfg, 132, 1100)
    prog = schedule(cfg, 132, 1100, splits, min_chunk, merge_ticket_min=1, tokens=128)
    g = cm.gpu("h200")
    # as built (megakernel.cu SEG_ATTN), without the rows in parts (their K/V re-reads:
    # test_row_parts_put_a_chunks_attention_on_more_blocks)
    seg = cm.design_for(prog, tensor_cores=True).replace(attn_row_parts=0)
    assert seg.attn_segments
    rows = seg.replace(attn_segments=False)  # a row's own pass, rotating rows (late q/k)
    attn = np.array([[ins.op == Op.ATTENTION for ins in q] for q in prog.queues])
    chunk = StepShape.chunk(896, 128, True)
    a, b = cm.Static(prog, 0, g, rows, chunk), cm.Static(prog, 0, g, seg, chunk)
    kv = 1024 * cfg.head_dim * 2 * 2.0 * cfg.num_kv_heads * cfg.num_layers  # K and V once
    assert b.fields["bytes"][attn].sum() == pytest.approx(kv)
    assert a.fields["bytes"][attn].sum() > 50 * kv  # every row its own pass
    fast, slow = cm.predict(prog, g, seg, shape=chunk), cm.predict(prog, g, rows, shape=chunk)

    def attention_us(p):
        return next(r["critical_us"] for r in p.op_rows() if r["op"] == "ATTENTION")

    # (the whole step: 0.75x, the mat-muls of this program's 128 rows a block the same in both)
    assert attention_us(fast) < 0.5 * attention_us(slow)
    assert fast.total_us < slow.total_us - (attention_us(slow) - attention_us(fast)) / 2
    one = StepShape.decode(1, 1024)
    x, y = cm.Static(prog, 0, g, rows, one), cm.Static(prog, 0, g, seg, one)
    assert x.fields["bytes"][attn].sum() == pytest.approx(y.fields["bytes"][attn].sum())


def test_segment_parts_split_a_chunks_rows_into_the_slots_its_splits_leave():
    """isa.segment_parts (design attn_row_parts, predicted): a chunk's rows in the fewest
    parts of at most most_mtiles m-tiles each, as many as its KV group's slots hold (splits
    // used) at most; one part when off, for a decode row, or when the slots hold one; the
    parts' rows cover the segment's once, in order."""
    from monokernel.kernel.isa import segment_part_rows, segment_parts

    assert segment_parts(5, 128, 44, 3, 0) == 1  # off
    # SmolLM2 (3 queries a KV head): 24 m-tiles; 3 parts of 43 rows would hold 9
    assert segment_parts(5, 128, 44, 3, 8) == 4
    assert segment_parts(5, 128, 44, 3, 1) == 8  # 44 // 5 slots
    assert segment_parts(8, 128, 16, 2, 1) == 2  # Qwen3 at context 1024: 16 // 8
    assert segment_parts(16, 128, 16, 2, 1) == 1  # every slot used
    assert segment_parts(1, 1, 44, 3, 1) == 1  # a decode row: one m-tile
    assert segment_parts(1, 5, 44, 16, 1) == 5  # no part without rows
    for parts, rows in ((3, 128), (8, 128), (5, 5), (7, 100)):
        got = [segment_part_rows(p, parts, rows) for p in range(parts)]
        assert got[0][0] == 0 and got[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
        assert all(end - first >= rows // parts for first, end in got)


def test_split_parts_deal_a_chunks_slots_to_its_splits_by_work():
    """isa.split_parts (design attn_split_parts, predicted, not built): every used split one
    part, then the KV group's slots one at a time to the split whose parts hold the most work
    (its reaching rows x its positions seen), none finer than the m-tile cap and none without
    a row; split_part_rows cover each split's reaching rows (a suffix of the segment's) once,
    in order, and nothing of the rows before them. A decode row: one part a split."""
    from monokernel.kernel.isa import split_part_rows, split_parts

    # Qwen3's chunks of 256 (16 slots of 128 positions, 2 queries a KV head, 4 m-tiles a part)
    assert split_parts(2, 256, 0, 128, 16, 2, 4) == [8, 4]  # the m-tile cap: 32 rows a part
    assert split_parts(6, 256, 512, 128, 16, 2, 4) == [3, 3, 3, 3, 3, 1]
    assert split_parts(8, 256, 768, 128, 16, 2, 4) == [3, 2, 2, 2, 2, 2, 2, 1]
    assert split_parts(3, 1, 300, 128, 16, 2, 4) == [1, 1, 1]  # a decode row
    assert split_parts(16, 40, 1990, 128, 16, 2, 4) == [1] * 16  # every slot a split's
    for used, rows, first_pos in ((2, 256, 0), (6, 256, 512), (8, 256, 768), (5, 100, 450),
                                  (3, 7, 250)):
        parts = split_parts(used, rows, first_pos, 128, 16, 2, 4)
        assert len(parts) == used and sum(parts) <= 16 and min(parts) >= 1
        for s, p in enumerate(parts):
            got = [split_part_rows(s, k, p, rows, first_pos, 128) for k in range(p)]
            reach = [r for r in range(rows) if first_pos + r >= s * 128]
            assert [r for a, b in got for r in range(a, b)] == reach, (used, rows, s)
            assert all(b > a for a, b in got)


def test_split_parts_are_predicted_to_speed_a_chunks_attention_only():
    """attn_split_parts on the built design: Qwen3's chunk steps of a 1024-token prompt each
    as fast or faster (the one at position 512, whose 6 used splits left 4 of 16 slots a KV
    group empty, by more than 3 %); a decode step (segments of one row) bit for bit as
    without it."""
    import dataclasses

    from monokernel.kernel.group_picks import tensor_core_program
    from monokernel.kernel.schedule import tensor_core_splits
    from monokernel.model.config import ModelConfig

    cfg = dataclasses.replace(ModelConfig.from_name("qwen3-0.6b"), num_layers=2)
    splits, min_chunk = tensor_core_splits(cfg, 132, 2048)
    prog = tensor_core_program(cfg, 132, 2048, splits, min_chunk, 256)
    g = cm.gpu("h200")
    built = cm.design_for(prog, tensor_cores=True)
    dealt = built.replace(attn_split_parts=True)
    for shape in prefill_shapes(1024, 256):
        new, old = (cm.predict(prog, g, d, shape=shape).step_us for d in (dealt, built))
        assert new <= old, (shape, new, old)
        if shape.segments[0].context == 512:
            assert new < 0.97 * old, (new, old)
    for shape in (StepShape.decode(64, 16), StepShape.decode(64, 1024)):
        assert cm.predict(prog, g, dealt, shape=shape).step_us == \
            cm.predict(prog, g, built, shape=shape).step_us


def test_row_parts_put_a_chunks_attention_on_more_blocks():
    """attn_row_parts (built: megakernel.cu segment_parts): a late prompt chunk of SmolLM2 (3
    KV heads, 44 slots a group, 5 used splits) runs its attention units on 7x the blocks
    (parts of at most 4 m-tiles: 19 rows), so its busiest ATTENTION instruction and the step
    get faster while the K/V it reads grows by the parts' re-reads only (each part reads its
    splits' K/V up to its last row); a decode step (segments of one row) is predicted as
    without parts, bit for bit."""
    from monokernel.kernel.isa import ROW_PART_MTILES
    from monokernel.kernel.schedule import schedule, tensor_core_splits
    from monokernel.model.config import ModelConfig

    cfg = ModelConfig.from_name("smollm2-135m").replace(num_layers=2)
    splits, min_chunk = tensor_core_splits(cfg, 132, 1100)
    prog = schedule(cfg, 132, 1100, splits, min_chunk, merge_ticket_min=1, tokens=128)
    g = cm.gpu("h200")
    parts = cm.design_for(prog, tensor_cores=True)
    built = parts.replace(attn_row_parts=0)
    assert parts.attn_row_parts == ROW_PART_MTILES == 4
    attn = np.array([[ins.op == Op.ATTENTION for ins in q] for q in prog.queues])
    chunk = StepShape.chunk(512, 128, True)
    a, b = cm.Static(prog, 0, g, built, chunk), cm.Static(prog, 0, g, parts, chunk)

    def busy(st):  # ATTENTION instructions with K/V to read
        return (st.fields["bytes"][attn] > 0).sum()

    assert busy(b) == 7 * busy(a)
    kv_a, kv_b = a.fields["bytes"][attn].sum(), b.fields["bytes"][attn].sum()
    assert kv_a < kv_b < 7 * kv_a
    fast, slow = cm.predict(prog, g, parts, shape=chunk), cm.predict(prog, g, built, shape=chunk)

    def attention(p):
        return next(r for r in p.op_rows() if r["op"] == "ATTENTION")

    assert attention(fast)["busy_max_us"] < 0.5 * attention(slow)["busy_max_us"]
    assert fast.total_us < slow.total_us
    decode = StepShape.decode(16, 700)
    assert cm.predict(prog, g, parts, shape=decode).total_us == \
        cm.predict(prog, g, built, shape=decode).total_us


def test_a_segments_staging_of_v_transposed_pays_its_bank_conflicts():
    """attn_stage_async (built): K and V staged by cp.async as rows. The kernel before it
    transposed V through registers with 2-byte stores whose HEAD_DIM / 8 chunks of a row all
    fall on one shared-memory bank (a V^T row of T_TILE + 8 bf16 is 544 words, a multiple of
    32 banks): every warp store HEAD_DIM / 8 wavefronts, n x HEAD_DIM / 32 of them a tile. The
    model charges that (its decode at context 1024 falls far behind: K/V staging dominates a
    decode unit), and not for the copies."""
    from monokernel.kernel.ops.attention import _segment_tile

    g, d = cm.gpu("h200"), cm.design("v6-mma-seg")
    assert d.attn_stage_async
    n = np.array([128.0])
    for D in (64, 128):
        fast = _segment_tile(n, g, d, 2, D, 1)[2]
        slow = _segment_tile(n, g, d.replace(attn_stage_async=False), 2, D, 1)[2]
        conflicts = 128 * D / 32 * (D // 8) / (g.clock_ghz * 1e3)  # wavefronts at one a clock
        assert slow - fast == pytest.approx(conflicts - 128 * D / 8 / d.threads * 3 * 2
                                            / (g.clock_ghz * 1e3), rel=1e-6)
        assert slow > 1.5 * fast if D == 128 else slow > 1.2 * fast


def test_prefill_shapes_cover_the_prompt_once():
    for prompt, chunk in ((1, 128), (128, 128), (1000, 128), (1024, 512)):
        steps = prefill_shapes(prompt, chunk)
        segs = [s.segments[0] for s in steps]
        assert [s.context for s in segs] == list(range(0, prompt, chunk))
        assert sum(s.tokens for s in segs) == prompt
        assert [s.logits for s in segs] == [0] * (len(segs) - 1) + [1]
    with pytest.raises(CostModelError):
        prefill_shapes(0, 128)
    with pytest.raises(CostModelError):
        Segment(context=-1)
    with pytest.raises(CostModelError):
        StepShape.decode(0, 16)


def test_the_one_token_design_refuses_a_step_of_many():
    with pytest.raises(CostModelError, match="tensor cores"):
        cm.predict(small(), "h200", cm.V6, shape=StepShape.decode(4, 16))


def test_plan_batch_and_prompt_end_with_their_predictions(capsys):
    assert main(["plan", "--shape", "smollm2-135m", "--blocks", "32", "--context", "64",
                 "--predict", "h200", "--batch", "8", "--prompt", "300"]) == 0
    out = capsys.readouterr().out
    # by default the design built (the tensor-core kernel of slots; SmolLM2's head_dim 64 has
    # the attention pipeline, MK_ATTN_PIPE), prompts in its chunks
    assert "PREDICTION" in out
    assert "design v6-mma-last-skip (built: backend option tensor_cores)" in out
    assert "2 steps of up to 256 tokens" in out  # schedule.MAX_STEP_TOKENS
    m = [line for line in out.splitlines() if line.startswith("predicted")]
    assert m[0].startswith("predicted on h200:") and "us/token" in m[0]
    assert m[1].startswith("predicted on h200:") and m[1].endswith("tokens/s at batch 8")
    assert m[2].startswith("predicted time to first token on h200:") and m[2].endswith(" ms")
    us, tps = (float(x) for x in
               __import__("re").match(r"predicted on h200: (\d+) us/step, (\d+) tokens/s",
                                      m[1]).groups())
    assert tps == pytest.approx(8 / us * 1e6, rel=0.01)


@pytest.mark.parametrize("argv, message", [
    (["--batch", "4"], "--batch needs --predict"),
    (["--predict", "h200", "--batch", "0"], "--batch must be >= 1"),
    (["--predict", "h200", "--chunk", "64"], "--chunk needs --prompt"),
    (["--predict", "h200", "--design", "v6", "--batch", "4"], "runs one token per step"),
    (["--predict", "h200", "--batch", "4", "--input-slices", "3"], "a power of two"),
    (["--predict", "h200", "--input-slices", "2"], "--input-slices needs --batch"),
    (["--predict", "h200", "--batch", "4", "--input-slices", "16"], "16-column chunks"),
])
def test_plan_batch_refuses_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--shape", "smollm2-135m", "--blocks", "8", "--context", "16"] + argv)
    assert message in str(e.value)


def test_plan_predicts_the_built_tensor_core_design_on_the_program_it_runs(capsys):
    """`plan --design v6-mma-last-skip` (the design of backend option tensor_cores) predicts on the
    program that option builds: splits fixed by absolute position, every step's attention
    merged by ticket (merge_ticket_min 1); a design not built yet keeps the default program."""
    from monokernel.kernel.schedule import default_attn_splits, schedule, tensor_core_splits
    from monokernel.model.config import ModelConfig

    assert main(["plan", "--shape", "qwen3-0.6b", "--blocks", "32", "--context", "1024",
                 "--predict", "h200", "--design", "v6-mma-last-skip", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "design v6-mma-last-skip (built: backend option tensor_cores" in out
    got = float(out.strip().splitlines()[-1].split(", ")[1].split()[0])
    cfg = ModelConfig.from_name("qwen3-0.6b")
    splits, chunk = tensor_core_splits(cfg, 32, 2048)
    # at least max_seq_len / (the default splits) positions a split; a unit slot per block
    assert chunk == 2048 // default_attn_splits(cfg, 32, 2048)
    assert splits == max(default_attn_splits(cfg, 32, 2048), 32 // cfg.num_kv_heads)
    smol = ModelConfig.from_name("smollm2-135m")
    assert tensor_core_splits(smol, 132, 2048) == (44, 2048 // default_attn_splits(smol, 132,
                                                                                     2048))
    built = schedule(cfg, 32, 2048, splits, chunk, merge_ticket_min=1, tokens=16,
                     token_groups=True, tensor_cores=True, input_slices=True)
    assert built.merge_ticket_min == 1
    # (the built design for Qwen3: v6-mma-last-skip with residual_in in a pass, design_for)
    d = cm.design_for(built, tensor_cores=True)
    assert d.name == "v6-mma-last-skip" and not d.residual_copy_epilogue
    want = cm.predict(built, "h200", d, 1024, shape=StepShape.decode(16, 1024)).tokens_per_s
    default = cm.predict(schedule(cfg, 32, 2048), "h200", d, 1024,
                         shape=StepShape.decode(16, 1024)).tokens_per_s
    assert got == pytest.approx(want, abs=0.5) and abs(want - default) > 1


def test_plan_predicts_a_program_of_input_slices(capsys):
    """`plan --input-slices S` predicts the tensor-core program with O_PROJ's and DOWN's input
    in S slices (kernel/input_slices.py), says so and shows them in the tiles line; by default
    (auto) each op's as the executor chooses (input_slices.choose), 1 none."""
    argv = ["plan", "--shape", "smollm2-135m", "--blocks", "32", "--context", "16",
            "--predict", "h200", "--batch", "32"]
    assert main(argv + ["--input-slices", "2"]) == 0
    out = capsys.readouterr().out
    assert "(built: backend option tensor_cores; input slices: O_PROJ 2, DOWN 2)" in out
    assert "O_PROJ_RESIDUAL 2x2" in out or "O_PROJ_RESIDUAL 1x2" in out, out
    sliced = out.strip().splitlines()[-1]
    assert main(argv + ["--input-slices", "1"]) == 0
    plain = capsys.readouterr().out.strip().splitlines()[-1]
    assert sliced.startswith("predicted on h200:") and sliced != plain
    # auto (the default): each op's as the executor's program has them
    # (group_picks.tensor_core_slices; for SmolLM2 on 32 blocks at 32 tokens a step DOWN only)
    from monokernel.kernel.group_picks import tensor_core_slices
    from monokernel.model.config import ModelConfig

    o, d = tensor_core_slices(ModelConfig.from_name("smollm2-135m"), 32, 2048, 32)
    assert (o, d) == (1, 4)
    assert main(argv) == 0
    auto = capsys.readouterr().out
    assert f"input slices: O_PROJ {o}, DOWN {d})" in auto
    assert auto.strip().splitlines()[-1] not in (plain, sliced)
    with pytest.raises(SystemExit):
        main(argv + ["--input-slices", "many"])


def test_rows_walk_counts_the_rounds_of_block_mma_rows_loop():
    """tokens.rows_walk is the number of times megakernel.cu block_mma_rows' inner loop runs
    for a warp: every k range r (chunks [r C / W, (r + 1) C / W)) in turn, ``unroll`` chunks a
    round; the ranges differ in length where W does not divide C (SmolLM2's 18 chunks: 10
    rounds at unroll 2, not 8 x ceil(18 / 8 / 2) = 16)."""
    from monokernel.kernel.costmodel.tokens import rows_walk

    for chunks in range(1, 80):
        for warps in (4, 8):
            for unroll in (1, 2, 3, 4):
                loop = sum(len(range(r * chunks // warps, (r + 1) * chunks // warps, unroll))
                           for r in range(warps))
                assert rows_walk(chunks, warps, unroll) == loop
    assert rows_walk(18, 8, 2) == 10


def _warp_unit_attention(name: str, context: int):
    from monokernel.kernel.costmodel.simulate import _batches
    from monokernel.kernel.ops import attention
    from monokernel.kernel.schedule import schedule, tensor_core_splits
    from monokernel.model.config import ModelConfig

    cfg = ModelConfig.from_name(name)
    splits, min_chunk = tensor_core_splits(cfg, 132, 2048)
    prog = schedule(cfg, 132, 2048, splits, min_chunk, merge_ticket_min=1, tokens=64,
                    token_groups=True, tensor_cores=True)
    shape = StepShape.decode(64, context)
    _, batch = _batches(prog, context, shape)[Op.ATTENTION]
    g = cm.gpu("h200")
    costs = [attention.cost(batch, g, cm.design(n)) for n in ("v6-mma-tiles",
                                                              "v6-mma-warp-units")]
    return prog, shape, costs


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"])
def test_warp_units_overlap_a_short_contexts_units_and_leave_long_ones(name):
    """v6-mma-warp-units (predicted, not built): at B64 context 16 a decode row's unit (17
    positions, one tile) runs on one warp, an instruction's units in one wave: the same K/V
    bytes, no more trips or rounds than a block's units in turn, the step faster; at context
    1023 (units of 128 positions, past attn_warp_unit_positions) ATTENTION is the built
    design's to the last field (context 1023: 1024 positions, no short last split)."""
    prog, shape, (block, warp) = _warp_unit_attention(name, 16)
    assert np.array_equal(block.stream_bytes, warp.stream_bytes)
    assert (warp.l2_trips <= block.l2_trips).all() and (warp.rounds <= block.rounds).all()
    assert (warp.rounds < block.rounds).any()
    slow, fast = (cm.predict(prog, "h200", cm.design(n), shape=shape).total_us
                  for n in ("v6-mma-tiles", "v6-mma-warp-units"))
    assert fast < slow
    _, _, (block, warp) = _warp_unit_attention(name, 1023)
    for f in ("l2_trips", "hbm_trips", "other_us", "rounds", "stream_bytes", "prefetch_bytes",
              "compute"):
        assert np.array_equal(getattr(block, f), getattr(warp, f)), f


def test_the_row_split_walk_prefetch_puts_all_but_each_walks_first_range_on_l2():
    """mma_rows_prefetch (megakernel.cu block_mma_rows: a warp prefetches its row group's next
    k range into L2 as it starts one): Llama-3.2-1B's LM head at B64 multiplies its 971 rows
    by all 64 rows (the row split; K 2048: 64 chunks, 8 ranges of 8, 4 rounds each at unroll
    2), so 28 of each walk's 32 rounds wait on L2 (Phases.rolling 0.875), as do GATE_UP's
    (in no token groups: all 64 rows, K 2048); DOWN's members, 32 rows each (the k split),
    none; without the knob, none anywhere, and the step slower."""
    from monokernel.kernel.costmodel.simulate import _batches
    from monokernel.kernel.costmodel.tokens import rows_walk
    from monokernel.kernel.isa import MMA_KC, MMA_ROWS_UNROLL
    from monokernel.kernel.ops import down, gate_up, lm_head
    from monokernel.kernel.schedule import schedule, tensor_core_splits
    from monokernel.model.config import ModelConfig

    cfg = ModelConfig.from_name("llama-3.2-1b")
    splits, min_chunk = tensor_core_splits(cfg, 132, 2048)
    prog = schedule(cfg, 132, 2048, splits, min_chunk, merge_ticket_min=1, tokens=64,
                    token_groups=True, tensor_cores=True)
    shape = StepShape.decode(64, 16)
    batches = _batches(prog, 16, shape)
    g = cm.gpu("h200")
    built = cm.design_for(prog, tensor_cores=True)
    off = built.replace(mma_rows_prefetch=False)
    assert built.mma_rows_prefetch
    chunks = cfg.hidden_size // MMA_KC
    walk = rows_walk(chunks, built.warps, MMA_ROWS_UNROLL)
    first = chunks // built.warps // MMA_ROWS_UNROLL
    assert (walk, first) == (32, 4)
    _, head = batches[Op.RMS_LM_HEAD]
    on = lm_head.cost(head, g, built)
    busy = head.n > 0
    assert np.allclose(on.rolling[busy], 1 - first / walk)
    assert lm_head.cost(head, g, off).rolling is None
    def members(op):
        return {i.group.members if i.group is not None else 1 for q in prog.queues for i in q
                if i.op == op}

    _, gu = batches[Op.RMS_GATE_UP]
    assert members(Op.RMS_GATE_UP) == {1}
    assert np.allclose(gate_up.cost(gu, g, built).rolling[gu.n > 0], 1 - first / walk)
    _, dn = batches[Op.DOWN_RESIDUAL]
    assert members(Op.DOWN_RESIDUAL) == {2}  # 32 rows a member: block_mma's k split
    assert np.all(down.cost(dn, g, built).rolling == 0)
    assert cm.predict(prog, g, built, shape=shape).total_us < \
        cm.predict(prog, g, off, shape=shape).total_us


def test_a_share_past_the_staged_rows_reads_only_the_rest_again():
    """rms_stage_partial (megakernel.cu mma_rms stages a share's first MK_RMS_STAGE_ROWS rows):
    levers.rms_staged is the share of an RMS op's rows staged (Llama-3.2-1B's 21 of the LM
    head's 64 at B64, beside block_mma_rows' sums and ring; all of 21; 21 of 32; none of 64
    without the knob), and _passes charges the passes' re-reads for the unstaged share only:
    43 / 64 of the whole share's."""
    from monokernel.kernel.costmodel import levers
    from monokernel.kernel.costmodel.simulate import _batches
    from monokernel.kernel.costmodel.tokens import _passes
    from monokernel.kernel.schedule import schedule, tensor_core_splits
    from monokernel.model.config import ModelConfig

    cfg = ModelConfig.from_name("llama-3.2-1b")
    splits, min_chunk = tensor_core_splits(cfg, 132, 2048)
    prog = schedule(cfg, 132, 2048, splits, min_chunk, merge_ticket_min=1, tokens=64,
                    token_groups=True, tensor_cores=True)
    _, head = _batches(prog, 16, StepShape.decode(64, 16))[Op.RMS_LM_HEAD]
    g = cm.gpu("h200")
    built = cm.design_for(prog, tensor_cores=True)
    whole = built.replace(rms_stage_partial=False)
    assert built.rms_stage_partial and built.rms_stage_rows == 21
    assert np.allclose(levers.rms_staged(head, built, [64, 21, 32]), [21 / 64, 1.0, 21 / 32])
    assert np.allclose(levers.rms_staged(head, whole, [64, 21]), [0.0, 1.0])
    rows, k, b = np.array([971.0]), cfg.hidden_size, built.input_bytes
    t_part, r_part = _passes(rows, k, np.array([64.0]), g, built, b, rms=True,
                             staged=levers.rms_staged(head, built, [64]))
    t_none, r_none = _passes(rows, k, np.array([64.0]), g, built, b, rms=True,
                             staged=levers.rms_staged(head, whole, [64]))
    assert t_none[0] > 0 and t_part[0] == pytest.approx(t_none[0] * 43 / 64)
    assert r_part[0] == r_none[0]  # the walk's rounds do not change
    assert cm.predict(prog, g, built, shape=StepShape.decode(64, 16)).total_us < \
        cm.predict(prog, g, whole, shape=StepShape.decode(64, 16)).total_us


def test_mma_l2_overlap_moves_a_mat_muls_l2_reads_beside_its_mma_and_loses_none():
    """v6-mma-overlap (mma_l2_overlap, predicted, not built): on Llama-3.2-1B's prompt chunk of
    256 tokens at position 512, each mat-mul instruction's L2 reads (its token group's other
    tiles' weights, its inputs, the passes' re-reads) leave its serial work and bound its mma
    time from below together with its HBM stream's bytes at the SM's L2 share: nothing else
    moves (trips, rounds, stream bytes, ATTENTION), no byte is dropped (what leaves other_us
    is inside the new floor), and the step is faster, GATE_UP the most."""
    from monokernel.kernel.costmodel.simulate import _batches
    from monokernel.kernel.ops import down, gate_up, o_proj, qkv
    from monokernel.kernel.schedule import schedule, tensor_core_splits
    from monokernel.model.config import ModelConfig

    cfg = ModelConfig.from_name("llama-3.2-1b")
    splits, min_chunk = tensor_core_splits(cfg, 132, 2048)
    prog = schedule(cfg, 132, 2048, splits, min_chunk, merge_ticket_min=1, tokens=256,
                    token_groups=True, tensor_cores=True)
    shape = StepShape.chunk(512, 256, False)
    g = cm.gpu("h200")
    # every round of every mat-mul loaded into registers (the build before the ring)
    built = cm.design_for(prog, tensor_cores=True).replace(mma_rows_l2_overlap=False,
                                                           mma_k_ring=False)
    over = built.replace(mma_l2_overlap=True)
    assert cm.design("v6-mma-overlap") == cm.DESIGNS["v6-mma-tiles"].replace(
        name="v6-mma-overlap", mma_l2_overlap=True, mma_rows_l2_overlap=True)
    assert not built.mma_l2_overlap
    l2_share = g.l2_bw / g.sms
    batches = _batches(prog, shape.max_context, shape)
    saved = {}
    for op, mod in ((Op.RMS_QKV_ROPE, qkv), (Op.O_PROJ_RESIDUAL, o_proj),
                    (Op.RMS_GATE_UP, gate_up), (Op.DOWN_RESIDUAL, down)):
        _, batch = batches[op]
        a, b = mod.cost(batch, g, built), mod.cost(batch, g, over)
        for f in ("l2_trips", "hbm_trips", "rounds", "stream_bytes", "prefetch_bytes"):
            assert np.array_equal(getattr(a, f), getattr(b, f)), (op, f)
        moved = np.asarray(a.other_us) - np.asarray(b.other_us)
        assert (moved > 0).all(), op  # every instruction of a chunk step reads L2
        floor = moved + np.asarray(a.stream_bytes, np.float64) / l2_share
        assert np.allclose(b.compute, np.maximum(a.compute, floor)), op
        saved[op] = float(np.mean(moved + a.compute - b.compute))
    assert max(saved, key=saved.get) == Op.RMS_GATE_UP and min(saved.values()) > 0, saved
    _, att = batches[Op.ATTENTION]
    from monokernel.kernel.ops import attention

    pa, pb = attention.cost(att, g, built), attention.cost(att, g, over)
    for f in ("l2_trips", "hbm_trips", "other_us", "rounds", "stream_bytes", "compute"):
        assert np.array_equal(getattr(pa, f), getattr(pb, f)), f
    slow, fast = (cm.predict(prog, g, d, shape=shape).step_us for d in (built, over))
    assert fast < 0.8 * slow, (fast, slow)


def test_the_k_split_ring_moves_the_unsliced_ops_reads_beside_their_mma():
    """v6-mma-k-ring (mma_k_ring, megakernel.cu MK_K_RING: block_mma's k split through
    block_mma_rows' ring): on the program of 64 tokens the executor runs (SmolLM2: DOWN in
    input slices, slice_mma's k split in registers), a decode step of 32 rows (every mat-mul in
    the k split) moves every instruction of the unsliced ops exactly as mma_l2_overlap would,
    and none of the sliced DOWN's; the step is faster. The design is built where
    header.k_split_ring says (head_dim 64, steps of more than 32 tokens)."""
    from monokernel.kernel.costmodel.simulate import _batches
    from monokernel.kernel.group_picks import tensor_core_program
    from monokernel.kernel.ops import down, gate_up, o_proj, qkv
    from monokernel.kernel.schedule import tensor_core_splits
    from monokernel.model.config import ModelConfig

    cfg = ModelConfig.from_name("smollm2-135m")
    splits, min_chunk = tensor_core_splits(cfg, 132, 2048)
    prog = tensor_core_program(cfg, 132, 2048, splits, min_chunk, 64, True)
    assert prog.slices_of(Op.DOWN_RESIDUAL) > 1 == prog.slices_of(Op.O_PROJ_RESIDUAL)
    g = cm.gpu("h200")
    kring = cm.design_for(prog, tensor_cores=True)  # as built
    assert kring.name == "v6-mma-k-ring-skip" and kring.mma_k_ring
    rows = kring.replace(mma_k_ring=False)
    over = rows.replace(mma_l2_overlap=True)
    shape = StepShape.decode(32, 16)
    batches = _batches(prog, shape.max_context, shape)
    for op, mod in ((Op.RMS_QKV_ROPE, qkv), (Op.O_PROJ_RESIDUAL, o_proj),
                    (Op.RMS_GATE_UP, gate_up), (Op.DOWN_RESIDUAL, down)):
        _, batch = batches[op]
        a, k, b = (mod.cost(batch, g, d) for d in (rows, kring, over))
        want = a if op == Op.DOWN_RESIDUAL else b
        for f in ("other_us", "compute", "rounds", "stream_bytes"):
            assert np.allclose(getattr(k, f), getattr(want, f)), (op, f)
        if op != Op.DOWN_RESIDUAL:
            assert (np.asarray(k.other_us) < np.asarray(a.other_us)).all(), op
    slow, fast = (cm.predict(prog, g, d, shape=shape).step_us for d in (rows, kring))
    assert fast < slow, (fast, slow)


def test_the_ring_moves_only_block_mma_rows_reads_beside_its_mma():
    """v6-mma-ring (mma_rows_l2_overlap, megakernel.cu block_mma_rows' cp.async ring): an
    instruction's L2 reads move beside its mma exactly as mma_l2_overlap moves them where its
    passes split the rows, the kernel's test (block_mma: a member's tokens above
    isa.MMA_ROWS_SPLIT_ABOVE, its k, K / slices, at most MMA_ROWS_SPLIT_MAX_K), and nowhere
    else (block_mma's k split loads a round into registers): Llama's chunk of 256 moves every
    QKV, O_PROJ and GATE_UP instruction, none of DOWN's (members of 32 tokens); a step of 32
    tokens moves nothing; the chunk step is faster."""
    from monokernel.kernel.costmodel.simulate import _batches
    from monokernel.kernel.isa import MMA_ROWS_SPLIT_ABOVE, MMA_ROWS_SPLIT_MAX_K
    from monokernel.kernel.ops import down, gate_up, o_proj, qkv
    from monokernel.kernel.schedule import schedule, tensor_core_splits
    from monokernel.model.config import ModelConfig

    cfg = ModelConfig.from_name("llama-3.2-1b")
    splits, min_chunk = tensor_core_splits(cfg, 132, 2048)
    prog = schedule(cfg, 132, 2048, splits, min_chunk, merge_ticket_min=1, tokens=256,
                    token_groups=True, tensor_cores=True)
    g = cm.gpu("h200")
    # the row split's ring alone (as built before block_mma's k split took it too)
    ring = cm.design_for(prog, tensor_cores=True).replace(mma_k_ring=False)
    built = ring.replace(mma_rows_l2_overlap=False)  # every round loaded into registers
    over = built.replace(mma_l2_overlap=True)
    assert ring == built.replace(name=ring.name, mma_rows_l2_overlap=True)
    assert cm.design("v6-mma-ring") == cm.DESIGNS["v6-mma-tiles"].replace(
        name="v6-mma-ring", mma_rows_l2_overlap=True)
    K = {Op.RMS_QKV_ROPE: cfg.hidden_size, Op.O_PROJ_RESIDUAL: cfg.q_dim,
         Op.RMS_GATE_UP: cfg.hidden_size, Op.DOWN_RESIDUAL: cfg.intermediate_size}
    moved = {}
    for T in (256, 32):
        shape = StepShape.chunk(512, T, False)
        batches = _batches(prog, shape.max_context, shape)
        for op, mod in ((Op.RMS_QKV_ROPE, qkv), (Op.O_PROJ_RESIDUAL, o_proj),
                        (Op.RMS_GATE_UP, gate_up), (Op.DOWN_RESIDUAL, down)):
            _, batch = batches[op]
            a, r, b = (mod.cost(batch, g, d) for d in (built, ring, over))
            for i, ins in enumerate(batch.instructions):
                grp, split = getattr(ins, "group", None), getattr(ins, "split", None)
                shares = grp is not None and grp.members > 1 and T >= grp.min_tokens
                tokens = -(-T // grp.members) if shares else T
                k = K[op] // (split.slices if split is not None else 1)
                rows_split = tokens > MMA_ROWS_SPLIT_ABOVE and k <= MMA_ROWS_SPLIT_MAX_K
                want = b if rows_split else a
                for f in ("other_us", "compute", "rounds", "stream_bytes"):
                    assert np.isclose(np.asarray(getattr(r, f))[i],
                                      np.asarray(getattr(want, f))[i]), (T, op, i, f)
                moved[T, op] = moved.get((T, op), 0) + rows_split
            want_moved = 0 if T == 32 or op == Op.DOWN_RESIDUAL else len(batch.instructions)
            assert moved[T, op] == want_moved, (T, op)
    shape = StepShape.chunk(512, 256, False)
    slow, fast = (cm.predict(prog, g, d, shape=shape).step_us for d in (built, ring))
    assert fast < 0.9 * slow, (fast, slow)


def test_the_last_layer_on_the_logits_rows_drops_only_the_dead_rows_work():
    """v6-mma-last-layer (last_layer_logits, predicted, not built): tokens.logits_rows keeps
    each segment's rows needing logits (a chunk's last token at its position; every decode
    row; none of a chunk without logits); the last layer's ATTENTION, O_PROJ, GATE_UP and
    DOWN then cost that step (nothing where it is empty: the instructions only wait and
    signal), every other instruction and every decode step exactly as built, and a prompt's
    chunks are faster."""
    import dataclasses

    from monokernel.kernel.costmodel.simulate import LAST_LAYER_OPS, Static
    from monokernel.kernel.costmodel.tokens import Segment, logits_rows
    from monokernel.kernel.group_picks import tensor_core_program
    from monokernel.kernel.schedule import tensor_core_splits
    from monokernel.model.config import ModelConfig

    assert logits_rows(StepShape.chunk(512, 256, True)) == StepShape((Segment(767, 1, 1),))
    assert logits_rows(StepShape.chunk(512, 256, False)).segments == ()
    assert logits_rows(StepShape.decode(4, 30)) == StepShape.decode(4, 30)
    cfg = dataclasses.replace(ModelConfig.from_name("qwen3-0.6b"), num_layers=2)
    splits, min_chunk = tensor_core_splits(cfg, 132, 2048)
    prog = tensor_core_program(cfg, 132, 2048, splits, min_chunk, 256)
    g = cm.gpu("h200")
    # every row through every layer (the built design has last_layer_skip: below)
    built = cm.design_for(prog, tensor_cores=True).replace(last_layer_skip=False)
    assert cm.design("v6-mma-last-layer") == cm.DESIGNS["v6-mma-embed"].replace(
        name="v6-mma-last-layer", last_layer_logits=True)
    last = built.replace(last_layer_logits=True)
    # which slots hold the last layer's pruned ops, which any other instruction
    pruned = np.zeros((prog.num_blocks, prog.max_len), bool)
    for b, q in enumerate(prog.queues):
        for i, ins in enumerate(q):
            pruned[b, i] = ins.layer == cfg.num_layers - 1 and ins.op in LAST_LAYER_OPS
    one_row = StepShape((Segment(767, 1, 1),))
    for shape in (StepShape.chunk(512, 256, True), StepShape.chunk(512, 256, False)):
        a, b = Static(prog, 0, g, built, shape), Static(prog, 0, g, last, shape)
        row = Static(prog, 0, g, built, one_row)
        for f in a.fields:
            assert np.array_equal(a.fields[f][~pruned], b.fields[f][~pruned]), f
            want = row.fields[f][pruned] if shape.logits else 0.0
            assert np.allclose(b.fields[f][pruned], want), (shape, f)
        assert cm.predict(prog, g, last, shape=shape).step_us < \
            cm.predict(prog, g, built, shape=shape).step_us
    for shape in (StepShape.decode(64, 16), StepShape.decode(1, 100)):
        assert cm.predict(prog, g, last, shape=shape).step_us == \
            cm.predict(prog, g, built, shape=shape).step_us
    # last_layer_skip (built: megakernel.cu last_layer_idle): in a step where no row needs
    # logits the pruned instructions idle (simulate.idle_phases): no weights, rounds, mat-mul
    # or pass; their idle test (a barrier) each; O_PROJ's late q/k key caching (later steps
    # read the keys: the same trips as in a computing step) and a slice's group signal. A step
    # with any row needing logits is every row's
    skip = cm.design_for(prog, tensor_cores=True)
    assert skip == built.replace(last_layer_skip=True, name="v6-mma-last-skip")
    none = StepShape.chunk(512, 256, False)
    a, b = Static(prog, 0, g, last, none), Static(prog, 0, g, skip, none)
    assert all(np.array_equal(a.fields[f][~pruned], b.fields[f][~pruned]) for f in a.fields)
    for f in ("hbm", "rounds", "bytes", "pref", "compute"):
        assert not b.fields[f][pruned].any(), f
    assert (b.fields["other"][pruned] >= g.bar_sync).all()
    o_proj = np.zeros_like(pruned)
    for bi, q in enumerate(prog.queues):
        for i, ins in enumerate(q):
            o_proj[bi, i] = pruned[bi, i] and ins.op == Op.O_PROJ_RESIDUAL
    every = Static(prog, 0, g, built, none)
    keys = b.fields["l2"][o_proj]
    assert keys.sum() > 0 and not b.fields["l2"][pruned & ~o_proj].any()
    assert (keys <= every.fields["l2"][o_proj]).all()  # (the merge's trips are not run)
    idle, nothing, full = (cm.predict(prog, g, d, shape=none).step_us for d in (skip, last, built))
    assert nothing < idle < full, (nothing, idle, full)
    for shape in (StepShape.chunk(512, 256, True), StepShape.decode(64, 16)):
        a, b = Static(prog, 0, g, built, shape), Static(prog, 0, g, skip, shape)
        assert all(np.array_equal(a.fields[f], b.fields[f]) for f in a.fields), shape


def test_a_rows_ticket_merge_is_shared_over_its_own_layers_holders():
    """attn_row_tickets (_row_ticket_merge): an instruction's share of the rows it merges is
    over the instructions of its own layer and KV group that hold them, so a layer's
    ATTENTION costs the same whether the batch holds one layer or every layer (the model
    had counted every layer's instructions as holders: each layer's merges charged 1 / L)."""
    import dataclasses

    from monokernel.kernel.costmodel.parts import OpBatch
    from monokernel.kernel.costmodel.simulate import _batches
    from monokernel.kernel.group_picks import tensor_core_program
    from monokernel.kernel.ops import attention
    from monokernel.kernel.schedule import tensor_core_splits
    from monokernel.model.config import ModelConfig

    cfg = dataclasses.replace(ModelConfig.from_name("qwen3-0.6b"), num_layers=4)
    splits, min_chunk = tensor_core_splits(cfg, 132, 2048)
    prog = tensor_core_program(cfg, 132, 2048, splits, min_chunk, 64)
    g, shape = cm.gpu("h200"), StepShape.decode(64, 1024)
    d = cm.design_for(prog, tensor_cores=True)
    assert d.attn_rotate_rows and d.attn_row_tickets
    where, batch = _batches(prog, shape.max_context, shape)[Op.ATTENTION]
    every = attention.cost(batch, g, d)
    merged = 0
    for layer in range(cfg.num_layers):
        mask = batch.layer == layer
        ins = [x for x in batch.instructions if x.layer == layer]
        alone = attention.cost(OpBatch(prog, shape.max_context, batch.layer[mask],
                                       batch.lo[mask], batch.hi[mask],
                                       batch.weight_bytes[mask], ins, shape), g, d)
        for f in ("l2_trips", "other_us"):
            assert np.allclose(np.asarray(getattr(every, f))[mask], getattr(alone, f)), (layer, f)
        merged += float(np.sum(alone.l2_trips))
    assert merged > 0


def test_late_qk_key_caching_costs_its_rounds():
    """O_PROJ's blocks cache a step's keys (late q/k, megakernel.cu cache_keys): before the
    thirty-fourth session a warp per KV head, a row a round (k_cache_keys_per_warp 0: T rounds
    at T rows, which the model had charged as one); as built the (row, head) pairs of the
    block's part of the rows over the warps, KEY_CACHE_KEYS keys a warp round, one where a
    round of one a warp does (a decode step: the same as before). In Qwen3's chunk of 256 rows
    the caching blocks' O_PROJ is slower by about the rounds saved; the other blocks' and a
    one-row step's are equal; Llama (no q/k norm) does not move."""
    import dataclasses

    from monokernel.kernel.costmodel.simulate import _batches
    from monokernel.kernel.isa import KEY_CACHE_KEYS
    from monokernel.kernel.ops import o_proj
    from monokernel.kernel.schedule import schedule, tensor_core_splits
    from monokernel.model.config import ModelConfig

    built = cm.design("v6-mma-keys")
    old = built.replace(k_cache_keys_per_warp=0)
    w = built.warps
    r, k = o_proj.key_cache_rounds(np.array([1, 3, 0]), 256, old)
    assert r.tolist() == [256, 256, 0] and k.tolist() == [1, 1, 1]
    r, k = o_proj.key_cache_rounds(np.array([1, 3, 1]), 256, built)
    assert r.tolist() == [-(-256 // (w * KEY_CACHE_KEYS)), -(-768 // (w * KEY_CACHE_KEYS)),
                          -(-256 // (w * KEY_CACHE_KEYS))]
    assert k.tolist() == [KEY_CACHE_KEYS] * 3
    r, k = o_proj.key_cache_rounds(np.array([1, w]), 1, built)
    assert r.tolist() == [1, 1] and k.tolist() == [1, 1]
    g = cm.gpu("h200")
    for name, late in (("qwen3-0.6b", True), ("llama-3.2-1b", False)):
        cfg = dataclasses.replace(ModelConfig.from_name(name), num_layers=1)
        splits, min_chunk = tensor_core_splits(cfg, 132, 2048)
        prog = schedule(cfg, 132, 2048, splits, min_chunk, merge_ticket_min=1, tokens=256,
                        token_groups=True, tensor_cores=True)
        for shape, slower in ((StepShape.chunk(0, 256, True), late),
                              (StepShape.decode(1, 100), False)):
            batch = _batches(prog, shape.max_context, shape)[Op.O_PROJ_RESIDUAL][1]
            k0, k1, parts, part = o_proj.keys_of(batch.arg("keys"))
            n = shape.tokens
            rows = (part + 1) * n // parts - part * n // parts
            owner = (k1 > k0) & (rows > 0)
            a, b = (o_proj.cost(batch, g, d) for d in (old, built))
            ta, tb = (ph.l2_trips * g.l2_latency + ph.other_us for ph in (a, b))
            np.testing.assert_allclose(ta[~owner], tb[~owner], rtol=1e-12)
            if slower:
                # every head's rows over 15 blocks (o_proj.key_parts): 17 or 18 rows each, one
                # warp round as built, a round a row before
                assert owner.sum() == cfg.num_kv_heads * 15 and set(parts[owner]) == {15}
                assert set(rows[owner]) == {17, 18}
                # the rounds saved, an L2 trip and more each
                assert (ta[owner] - tb[owner] >= (rows[owner] - 1) * g.l2_latency).all()
            else:
                np.testing.assert_allclose(ta, tb, rtol=1e-12)


@pytest.mark.parametrize("heads,blocks", [(8, 132), (2, 3), (3, 3), (8, 3), (1, 132), (4, 7)])
def test_key_parts_cache_every_key_once(heads, blocks):
    """O_PROJ's key caching (late q/k; ops/o_proj.py key_parts, megakernel.cu cache_keys):
    in a step of any number of rows every (row, KV head) key is one block's, each head's rows
    over as many blocks as fit and divide TOKEN_SHARES (the verifier's token shares: a part's
    rows are its Tokens share's), the words round-trip."""
    from monokernel.kernel.ops import o_proj
    from monokernel.kernel.program import TOKEN_SHARES

    keys = o_proj.key_parts(heads, blocks)
    assert len(keys) == blocks
    for k in keys:
        assert o_proj.keys_of(o_proj.keys_word(*k)) == k
    parts = {p for k0, k1, p, _ in keys if k1 > k0}
    assert len(parts) == 1 and TOKEN_SHARES % parts.pop() == 0
    used = sum(k1 > k0 for k0, k1, _, _ in keys)
    assert used == (blocks if heads > blocks else heads * keys[0][2])
    if heads <= blocks:  # the most parts that fit (a part's word below 128) and divide
        fit = min(blocks // heads, 127)
        assert keys[0][2] <= fit and \
            not any(TOKEN_SHARES % q == 0 for q in range(keys[0][2] + 1, fit + 1))
    for n in (1, 2, 17, 64, 255, 256):
        seen = {}
        for b, (k0, k1, p, j) in enumerate(keys):
            lo, hi = j * n // p, (j + 1) * n // p
            s0, s1 = j * TOKEN_SHARES // p, (j + 1) * TOKEN_SHARES // p
            assert (lo, hi) == (s0 * n // TOKEN_SHARES, s1 * n // TOKEN_SHARES)
            for h in range(k0, k1):
                for r in range(lo, hi):
                    assert (r, h) not in seen, f"{n} rows: key ({r}, {h}) twice"
                    seen[r, h] = b
        assert len(seen) == n * heads


def test_embed_costs_its_row_rounds():
    """EMBED in a step of T rows (megakernel.cu op_embed): before the thirty-fifth session a
    row after another, one HBM trip each (embed_stage_bytes 0: T rounds, which the model had
    charged as one); v6-mma-embed (built) the rows' 16-byte chunks of the tile staged by cp.async,
    isa.EMBED_STAGE_BYTES a pass, a pass one round and its barriers. One row: one round
    either way."""
    from monokernel.kernel.costmodel.parts import OpBatch
    from monokernel.kernel.isa import EMBED_STAGE_BYTES
    from monokernel.kernel.ops import embed

    built = cm.design("v6-mma-embed")
    old = built.replace(embed_stage_bytes=0)
    assert old == cm.design("v6-mma-finish").replace(name="v6-mma-embed")
    assert built.embed_stage_bytes == EMBED_STAGE_BYTES
    # tiles: 8 columns aligned (1 chunk), 8 misaligned (2), 16 at 4 (3), empty, 300 at 0 (38)
    lo = np.array([8, 12, 4, 9, 0])
    hi = np.array([16, 20, 20, 9, 300])
    assert embed.row_rounds(lo, hi, 256, old).tolist() == [256] * 5
    chunks = np.array([1, 2, 3, 1, 38])
    want = np.ceil(256 / np.maximum(EMBED_STAGE_BYTES // (16 * chunks), 1))
    assert embed.row_rounds(lo, hi, 256, built).tolist() == want.tolist()
    assert embed.row_rounds(lo, hi, 1, built).tolist() == [1] * 5
    prog = program("qwen3-0.6b", 132, 2048, num_layers=1)
    ins = [q[0] for q in prog.queues if q and q[0].op == Op.EMBED]
    lo = np.array([i.tile[0] for i in ins])
    hi = np.array([i.tile[1] for i in ins])
    wb = np.array([i.weight_bytes for i in ins])
    g = cm.gpu("h200")
    for shape in (StepShape.chunk(0, 256, True), StepShape.decode(1, 10)):
        b = OpBatch(prog, 10, np.zeros(len(ins), np.int64), lo, hi, wb, ins, shape)
        a, c = embed.cost(b, g, old), embed.cost(b, g, built)
        rounds = embed.row_rounds(lo, hi, shape.tokens, built)
        np.testing.assert_allclose(a.hbm_trips, shape.tokens * c.hbm_trips / rounds)
        # Qwen3's tiles of 7 and 8 columns: at most 2 chunks a row, 256 rows a pass
        assert np.all(rounds == 1)
        np.testing.assert_allclose(c.other_us, (2 * rounds - 1) * g.bar_sync)
        assert np.all(a.other_us == 0)
