"""Input slices (kernel/input_slices.py): O_PROJ's and DOWN's input columns cut over a row
group's blocks, the fp32 partials summed in slice order after the group's counter. The
program's words and regions, the cover of every (token, row, slice) partial by exactly one
member in each mode, the verifier's two parts of a sliced instruction (with negative
controls), what schedule refuses, the kernel on the emulator against the unsliced kernel and
alone vs beside others, and the cost model's reading of a program's slices."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from helpers.batch import MIXED_STEPS, run_steps
from monokernel.errors import ProgramError
from monokernel.kernel import input_slices
from monokernel.kernel.isa import Op, Word
from monokernel.kernel.program import TOKEN_SHARES, InputSlice, Program
from monokernel.kernel.schedule import schedule, tensor_core_splits
from monokernel.model.config import ModelConfig

MAX_SEQ = 64
TOKENS = 32


def sliced(name: str, blocks: int, slices: int, token_groups=False, tokens: int = TOKENS):
    cfg = ModelConfig.from_name(name)
    splits, min_chunk = tensor_core_splits(cfg, blocks, MAX_SEQ)
    return schedule(cfg, blocks, MAX_SEQ, splits, min_chunk, merge_ticket_min=1, tokens=tokens,
                    token_groups=token_groups, tensor_cores=True, input_slices=slices)


def op_slot(prog, op: Op, layer: int = 0) -> list:
    k = next(i for i, ins in enumerate(prog.queues[0]) if ins.op == op and ins.layer == layer)
    return [q[k] for q in prog.queues]


def _span(regions, buf):
    return [(r[1], r[2], r[3] if len(r) > 3 else None) for r in regions if r[0] == buf]


@pytest.mark.parametrize("name,blocks,slices,groups", [
    ("qwen3-tiny", 8, 2, False), ("qwen3-tiny", 12, 2, 2), ("llama3-tiny", 7, 2, False),
    ("qwen3-gqa-tiny", 16, 2, 4)])
def test_every_partial_has_one_writer_and_every_row_one_sum(name, blocks, slices, groups):
    """In each mode (small steps: rows parts by every token; big steps: the group's rows by
    token shares) every (row, slice, token share) of the op's partials is written by exactly
    one member, and every residual row is summed by exactly one member from all s slices;
    Word.GROUP says members | index << 8 | min_tokens << 16 | log2 slices << 24 | slice << 27,
    one counter a row group, the op's signal + 1 + the group."""
    prog = sliced(name, blocks, slices, groups)
    cfg = prog.config
    R = cfg.hidden_size
    for op, K in ((Op.O_PROJ_RESIDUAL, cfg.q_dim), (Op.DOWN_RESIDUAL, cfg.intermediate_size)):
        ins = op_slot(prog, op)
        words = prog.words()
        k = next(i for i, x in enumerate(prog.queues[0]) if x.op == op and x.layer == 0)
        members = ins[0].split.members
        c = members // slices
        assert members == c * slices and c == (groups or 1)
        small = np.zeros((slices, R), int)
        big = np.zeros((slices, R, c), int)
        summed = np.zeros(R, int)
        counters = {}
        for b, x in enumerate(ins):
            if x.split is None:  # past the last whole group: nothing of the op's rows
                assert b >= blocks // members * members and x.empty
                continue
            sl = x.split
            g = words[b, k, Word.GROUP]
            assert (g & 0xff, g >> 8 & 0xff, 1 << (g >> 24 & 7), g >> 27) == \
                (c, x.group.index, slices, sl.index)
            # the kernel's counter: the op's signal + 1 + the block's group
            assert sl.counter == x.signal + 1 + b // members
            counters.setdefault(b // members, set()).add(sl.counter)
            for lo, hi, t in _span(x.writes, "partials"):
                j, r0, r1 = lo // R, lo % R, lo % R + hi - lo
                assert j == sl.index and r1 <= R
                if t.steps_lo == 1:  # the small steps' rows part
                    small[j, r0:r1] += 1
                else:
                    share = t.share_lo * c // TOKEN_SHARES
                    assert share == x.group.index
                    big[j, r0:r1, share] += 1
            # its input: slice j's columns only
            cols = {(lo, hi) for lo, hi, _ in _span(x.reads, op_input(op))}
            assert cols == {(sl.index * K // slices, (sl.index + 1) * K // slices)}
            summed[x.tile[0]:x.tile[1]] += 1
            assert _span(x.sum_reads, "partials") == [
                (j * R + x.tile[0], j * R + x.tile[1], None) for j in range(slices)] \
                or x.empty
        covered = summed > 0
        assert (summed <= 1).all() and (small[:, covered] == 1).all() and \
            (small[:, ~covered] == 0).all()
        if c > 1:
            assert (big[:, covered] == 1).all()
        # one counter a row group, distinct across groups
        assert all(len(v) == 1 for v in counters.values())
        assert len({next(iter(v)) for v in counters.values()}) == len(counters)
        # the rows summed: every residual row once, unless blocks were left over... never
        assert covered.all()


def op_input(op: Op) -> str:
    return "attn" if op == Op.O_PROJ_RESIDUAL else "ffn_h"


def test_the_partials_buffer_and_the_fingerprint():
    prog = sliced("qwen3-tiny", 8, 2, 2)
    assert prog.input_slices == 2
    assert prog.buffer_sizes()["partials"] == TOKENS * prog.config.hidden_size * 2
    plain = schedule(prog.config, 8, MAX_SEQ, *tensor_core_splits(prog.config, 8, MAX_SEQ),
                     merge_ticket_min=1, tokens=TOKENS, token_groups=2, tensor_cores=True)
    assert plain.input_slices == 1 and "partials" not in plain.buffer_sizes()
    assert (plain.words()[:, :, Word.GROUP] >> 24 == 0).all()
    assert plain.fingerprint() != prog.fingerprint()


def test_a_sliced_op_has_no_unsliced_instruction_with_rows():
    """The kernel compiles one number of slices an op and, sliced, no unsliced mat-mul of it
    (megakernel.cu slice_mma): Program.slices_of refuses a program that would need both."""
    prog = copy.deepcopy(sliced("qwen3-tiny", 8, 2, 2))
    k = next(i for i, x in enumerate(prog.queues[0]) if x.op == Op.DOWN_RESIDUAL)
    prog.queues[1][k] = dataclasses.replace(prog.queues[1][k], split=None)
    with pytest.raises(ProgramError, match="unsliced ones with rows"):
        prog.slices_of(Op.DOWN_RESIDUAL)
    x = prog.queues[2][k]
    prog.queues[2][k] = dataclasses.replace(x, split=dataclasses.replace(x.split, slices=4))
    with pytest.raises(ProgramError, match="one number an op"):
        prog.slices_of(Op.DOWN_RESIDUAL)


def test_a_sliced_instruction_is_two_parts_to_the_verifier():
    """Its partials' part signals the group's counter (not the op's), its sum waits for the
    group's every member and then signals the op's counter."""
    prog = sliced("qwen3-tiny", 8, 2, 2)
    vq = prog.verification_queues()[0]
    k = next(i for i, x in enumerate(prog.queues[0]) if x.op == Op.DOWN_RESIDUAL)
    x = prog.queues[0][k]
    parts = [v for v in vq if v.at == k and v.op == Op.DOWN_RESIDUAL]
    assert [p.part for p in parts] == [" [slice partials]", " [slice sum]"]
    assert parts[0].signal == x.split.counter and parts[0].wait == x.wait
    assert parts[1].wait == (x.split.counter, x.split.members) and parts[1].signal == x.signal
    assert parts[1].reads == x.sum_reads and parts[1].writes == x.sum_writes


def _one_counter_each(prog):
    """A copy whose members each signal and wait on a counter of their own: a sum no longer
    waits for the other members' partials."""
    bad = copy.deepcopy(prog)
    for b, q in enumerate(bad.queues):
        for i, ins in enumerate(q):
            if ins.split is not None:
                bad.counter_names.append(f"own{b}.{i}")
                own = len(bad.counter_names) - 1
                q[i] = dataclasses.replace(ins, split=InputSlice(ins.split.slices,
                                                                 ins.split.index, own, 1))
    return bad


def _sum_next_group(prog):
    """A copy whose first group's members sum the next group's rows, which another counter
    orders."""
    bad = copy.deepcopy(prog)
    for q in bad.queues:
        for i, ins in enumerate(q):
            if ins.split is not None and ins.group.tile[0] == 0:
                shift = ins.group.tile[1] - ins.group.tile[0]
                q[i] = dataclasses.replace(ins, sum_reads=[
                    (r[0], r[1] + shift, r[2] + shift) if r[0] == "partials" else r
                    for r in ins.sum_reads])
    return bad


@pytest.mark.parametrize("groups", [False, 2])
def test_the_verifier_rejects_a_sum_that_does_not_wait_for_its_group(groups, monkeypatch):
    """Members on counters of their own: the kernel would wait on the derived counter, which
    the verifier checks first; past that check (switched off here), the sums' reads of the
    other members' partials are unordered. A sum of the next group's rows: unordered too."""
    prog = sliced("qwen3-tiny", 8, 2, groups)
    prog.verify(use_cache=False)
    with pytest.raises(ProgramError, match="not the op's signal"):
        _one_counter_each(prog).verify(use_cache=False)
    with pytest.raises(ProgramError, match=r"hazard on partials\[.*slice (sum|partials)"):
        _sum_next_group(prog).verify(use_cache=False)
    monkeypatch.setattr(Program, "_check_slice_counters", lambda self: None)
    with pytest.raises(ProgramError, match=r"hazard on partials\[.*slice (sum|partials)"):
        _one_counter_each(prog).verify(use_cache=False)


def test_schedule_refuses_slices_it_cannot_run():
    cfg = ModelConfig.from_name("qwen3-tiny")  # q_dim 384, FFN 160
    with pytest.raises(ProgramError, match="merge_ticket_min 1"):
        schedule(cfg, 8, MAX_SEQ, tokens=TOKENS, input_slices=2)
    with pytest.raises(ProgramError, match="power of two"):
        sliced("qwen3-tiny", 8, 3)
    with pytest.raises(ProgramError, match="whole 16-column chunks"):
        sliced("qwen3-tiny", 8, 4)  # 160 / 4 = 40 columns
    with pytest.raises(ProgramError, match="needs that many blocks"):
        sliced("qwen3-tiny", 3, 2, 2)
    with pytest.raises(ProgramError, match="a row group"):
        input_slices.check(Op.DOWN_RESIDUAL, 64, 2, 3, 2)


# ---- the kernel on the emulator ---------------------------------------------------------------
def _run(model, prog, blocks: int, steps=MIXED_STEPS):
    return run_steps(model, prog, blocks, MAX_SEQ, TOKENS, steps, buffer="partials")


def _program(cfg, blocks, groups, slices):
    splits, min_chunk = tensor_core_splits(cfg, blocks, MAX_SEQ)
    return schedule(cfg, blocks, MAX_SEQ, splits, min_chunk, merge_ticket_min=1, tokens=TOKENS,
                    token_groups=groups, tensor_cores=True, input_slices=slices)


@pytest.mark.parametrize("arch,blocks,groups", [("llama3-tiny", 4, False), ("llama3-tiny", 5, 2),
                                                ("qwen3-gqa-tiny", 4, 2)])
def test_sliced_logits_match_row_tiles_within_rounding(synth_model, arch, blocks, groups):
    """Steps of 4 to 32 rows (both modes; 5 blocks: one left over, an empty tile) with O_PROJ's
    and DOWN's input in 2 slices: every row's logits within rounding of the unsliced kernel's
    (the same products summed in another order: fp32 partials of bf16 products, so the
    differences are fp32 sums' rounding passed through the layers' bf16 inputs; the bound is
    the bf16 input rounding's, 1e-2 of the largest logit, which the tensor-core kernel's test
    against the reference uses) and every row written (no NaN of the poison)."""
    model = synth_model(arch)
    want, none = _run(model, _program(model.config, blocks, groups, 1), blocks)
    got, partials = _run(model, _program(model.config, blocks, groups, 2), blocks)
    assert none is None and len(got) == len(want) == 98
    for k in want:
        assert np.isfinite(got[k]).all(), k
        scale = np.abs(want[k]).max()
        assert np.abs(got[k] - want[k]).max() <= 1e-2 * scale, k
    # the slices ran: every (token, slice, residual row) partial written (the buffer was
    # poisoned with NaN; the first step has 32 rows, the kernel's most)
    assert partials.size == TOKENS * 2 * model.config.hidden_size
    assert np.isfinite(partials).all()


@pytest.mark.parametrize("arch", ["llama3-tiny", "qwen3-gqa-tiny"])
def test_a_sliced_sequence_is_bitwise_the_same_alone_and_in_a_batch(synth_model, arch):
    """Batch invariance with input slices: sequence 0 alone (steps of 5 and 1 rows: row mode)
    and beside the others of MIXED_STEPS (steps of 32, 17, 13, 32 and 4 rows: token shares in the
    big ones, its rows at other places in the step) has bit-for-bit the same logits: a
    token's sum runs over the program's 2 slices in slice order, each partial the same
    k-loop in either mode."""
    model = synth_model(arch)
    prog = _program(model.config, 5, 2, 2)
    beside, _ = _run(model, prog, 5)
    alone, _ = _run(model, prog, 5, steps=({0: 5}, {0: 1}, {0: 1}, {0: 1}, {0: 1}))
    mine = sorted(k for k in beside if k[0] == 0)
    assert mine == sorted(alone) and len(mine) == 9
    bad = [k for k in mine if not np.array_equal(alone[k], beside[k])]
    assert not bad, bad


# ---- the cost model ---------------------------------------------------------------------------
def test_the_cost_model_charges_the_programs_slices():
    """A sliced program's ops are predicted as built (tokens.widen_matmul reads the program's
    slices: its token groups x slices in the tiles line, the mma over K / s of the group's
    rows, the partials and their sum after a hop): at batch 64, context 16, Qwen3-0.6B's
    step with 4 slices is predicted faster than without (NOTES: 972 -> 883 us on h200)."""
    from monokernel.kernel import costmodel as cm
    from monokernel.kernel.costmodel.tokens import StepShape

    cfg = ModelConfig.from_name("qwen3-0.6b")
    g, d = cm.gpu("h200"), cm.design("v6-mma-seg")
    splits, min_chunk = tensor_core_splits(cfg, 132, 2048)
    progs = {s: schedule(cfg, 132, 2048, splits, min_chunk, merge_ticket_min=1, tokens=64,
                         token_groups=True, tensor_cores=True, input_slices=s) for s in (1, 4)}
    shape = StepShape.decode(64, 16)
    got = {}
    for s, prog in progs.items():
        st = cm.Static(prog, 16, g, d, shape)
        got[s] = cm.predict(prog, g, d, static=st).total_us
        assert st.tiles["O_PROJ_RESIDUAL"] == st.tiles["DOWN_RESIDUAL"] == (2, s)
        assert st.tiles["RMS_GATE_UP"] == (2, 1)
    assert got[4] < 0.95 * got[1], got


def test_input_slices_true_picks_each_ops_slices_with_the_cost_model():
    """schedule(input_slices=True): each op's s from input_slices.choose, the cost model's
    cheapest at the program's tokens (h200 table, design v6-mma-split): on Qwen3-0.6B at 64
    tokens a step on 132 blocks, token groups of 2, O_PROJ 4 and DOWN 8 (NOTES, "Slice A as
    built"); a row group never wider than the blocks; a program of one token a step none."""
    cfg = ModelConfig.from_name("qwen3-0.6b")
    prog = sliced("qwen3-0.6b", 132, True, True, tokens=64)
    assert prog.slices_of(Op.O_PROJ_RESIDUAL) == 4 and prog.slices_of(Op.DOWN_RESIDUAL) == 8
    assert op_slot(prog, Op.DOWN_RESIDUAL)[0].group.members == 2
    assert prog.buffer_sizes()["partials"] == 64 * cfg.hidden_size * 8
    small = sliced("qwen3-tiny", 3, True, False, tokens=32)
    assert all(ins.split is None or ins.split.members <= 3 for q in small.queues for ins in q)
    one = sliced("qwen3-0.6b", 132, True, False, tokens=1)
    assert one.input_slices == 1


@pytest.mark.parametrize("shape,tokens", [("qwen3-0.6b", 64), ("smollm2-135m", 128),
                                          ("llama-3.2-1b", 256)])
def test_the_kernels_slices_are_the_default_programs(shape, tokens):
    """group_picks.tensor_core_slices (what the GPU check's prepare compiles the tensor-core
    kernel with) is the executor's default program's slices of each op (its token groups the
    cost model's picks: group_picks.tensor_core_program), without building it; and
    schedule.tensor_core_slices the slices of schedule's closed-form groups (Qwen3 at 64
    tokens: 8 / 8 picked, its O_PROJ, GATE_UP and DOWN in row tiles; SmolLM2 at 128: 1 / 8,
    O_PROJ unsliced; Llama at 256: 2 / 4; picks with block_mma_rows' ring, NOTES "The ring in
    block_mma_rows, as built")."""
    from monokernel.kernel import group_picks
    from monokernel.kernel.schedule import tensor_core_slices

    cfg = ModelConfig.from_name(shape)

    def of(prog):
        return prog.slices_of(Op.O_PROJ_RESIDUAL), prog.slices_of(Op.DOWN_RESIDUAL)

    closed = of(sliced(shape, 132, True, True, tokens=tokens))
    assert tensor_core_slices(cfg, 132, MAX_SEQ, tokens) == closed
    splits, min_chunk = tensor_core_splits(cfg, 132, MAX_SEQ)
    picked = of(group_picks.tensor_core_program(cfg, 132, MAX_SEQ, splits, min_chunk, tokens))
    assert group_picks.tensor_core_slices(cfg, 132, MAX_SEQ, tokens) == picked
    assert picked == {"qwen3-0.6b": (8, 8), "smollm2-135m": (1, 8),
                      "llama-3.2-1b": (2, 4)}[shape]


def test_schedule_memo_tells_chosen_slices_from_one():
    """True == 1 in Python: schedule's memo must not hand the program of input_slices=True
    (chosen) to a call asking 1 (none), nor token_groups=True to token_groups=1."""
    chosen = sliced("qwen3-0.6b", 132, True, True, tokens=64)
    none = sliced("qwen3-0.6b", 132, 1, True, tokens=64)
    assert chosen.input_slices == 8 and none.input_slices == 1
    one = sliced("qwen3-0.6b", 132, 1, 1, tokens=64)
    assert all(ins.group is None for q in one.queues for ins in q)


def test_choose_is_the_cost_models_spread_split_in_closed_form():
    """input_slices.choose (no cost-model import: that would be an import cycle) picks one of
    the s costmodel.tokens.spread_slices finds cheapest on the h200 table with design
    v6-mma-split (Llama's DOWN at 128 tokens ties 8 and 16 exactly), over the
    shapes' ops, token groups and step sizes; HOP_BYTES is that table's hop at an SM's L2
    share."""
    from types import SimpleNamespace

    from monokernel.kernel import costmodel as cm, input_slices, ops
    from monokernel.kernel.costmodel.parts import hop_latency
    from monokernel.kernel.costmodel.tokens import _tile_us, spread_slices
    from monokernel.kernel.program import Instruction, split_even

    g, d = cm.gpu(input_slices.CHOICE_GPU), cm.design(input_slices.CHOICE_DESIGN)
    assert input_slices.HOP_BYTES == pytest.approx(hop_latency(g, d) * g.l2_bw / g.sms, abs=1)
    for shape in ("smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"):
        cfg = ModelConfig.from_name(shape)
        for op in input_slices.SLICED_OPS:
            module = ops.module(op)
            tiles = [Instruction(op, 0, t) for t in split_even(cfg.hidden_size, 132)]
            n = max(hi - lo for lo, hi in (i.tile for i in tiles))
            k = module.input_columns(cfg)
            for T in (8, 16, 32, 64, 128):
                for c in (1, 2, 4):
                    plan = SimpleNamespace(tokens=T, config=cfg)
                    want = spread_slices(n, k, T, c, g, d, module.INPUT_BYTES)
                    got = input_slices.choose(plan, module, tiles, c)
                    # one of the model's cheapest (an exact tie may fall either way)
                    cost = [sum(_tile_us(n, k, T, c, s, g, d, in_bytes=module.INPUT_BYTES))
                            for s in (got, want)]
                    assert cost[0] == pytest.approx(cost[1], rel=1e-12), (shape, op.name, T, c)
