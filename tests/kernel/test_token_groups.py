"""Token groups (kernel/token_groups.py): in a big step a mat-mul's consecutive blocks share
their rows and split the step's tokens. The choice of members, the program's words and
regions, the verifier on both modes (with a negative control), the kernel on the emulator bit
for bit against row tiles (with a negative control), and the cost model."""

from __future__ import annotations

import copy
import dataclasses
import re

import numpy as np
import pytest

from helpers.batch import run_steps
from monokernel.errors import KernelError, ProgramError
from monokernel.kernel import token_groups as tg
from monokernel.kernel.executor import KernelExecutor
from monokernel.kernel.isa import Op, Word
from monokernel.kernel.program import TOKEN_SHARES, Tokens
from monokernel.kernel.schedule import schedule, tensor_core_splits
from monokernel.model.config import ModelConfig

MAX_SEQ = 64
TOKENS = 32


def tc_program(config, blocks: int, token_groups, tokens: int = TOKENS):
    splits, min_chunk = tensor_core_splits(config, blocks, MAX_SEQ)
    return schedule(config, blocks, MAX_SEQ, splits, min_chunk, merge_ticket_min=1,
                    tokens=tokens, token_groups=token_groups, tensor_cores=True)


# ---- the choice -----------------------------------------------------------------------------
def test_members_minimise_the_input_and_the_shared_weights():
    """c minimises T b / c + 2 (c - 1) n over powers of two with >= 8 tokens a member; a step
    runs in groups from max(8 c, 2 n c / b + 1) tokens."""
    # SmolLM2's QKV at 64 tokens: 10 weight rows, fp32 input: 64 / 4 x 4 + 6 x 10 = 124 is
    # the least of 256, 148, 124, 172 (c = 1, 2, 4, 8)
    assert tg.choose(64, 4, 10, 132) == (4, 32)
    # Llama's GATE_UP: 126 weight rows; sharing them costs more than the input saved
    assert tg.choose(64, 4, 126, 132) == (1, 0)
    # bf16 input, 16 rows at 64 tokens: 128 / c + 32 (c - 1): 128, 96, 128 -> 2, from
    # max(16, 2 x 16 x 2 / 2 + 1 = 33) tokens
    assert tg.choose(64, 2, 16, 132) == (2, 33)
    # at least 8 tokens a member, at most the blocks
    assert tg.choose(8, 4, 1, 132) == (1, 0)
    assert tg.choose(64, 4, 1, 2) == (2, 16)
    for tokens, b, rows, blocks in [(64, 4, 10, 132), (32, 2, 5, 132), (64, 2, 1, 132)]:
        c, m = tg.choose(tokens, b, rows, blocks)
        cost = lambda k: tokens * b / k + 2 * (k - 1) * rows  # noqa: E731
        assert all(cost(c) <= cost(k) for k in (1, 2, 4, 8) if tokens >= 8 * k)
        assert m * b * (1 - 1 / c) > 2 * (c - 1) * rows and m >= 8 * c


def test_members_count_the_inputs_reads():
    """With the op's input columns, a member's input is charged once a row pass (32 weight
    rows a k-split pass; 128 a row-split pass, in a share of more than 32 rows at k <= 2048)
    and an RMS op's once more in mma_rms unless its share is staged (then once). Llama's
    GATE_UP (126 weight rows a tile, 2048 columns, 33 rows staged): at 64 tokens row tiles
    read the 64-row share twice (8 t bytes a column), groups of 2 their 32-row shares once (2 t
    + 252): groups from 43 tokens, where the input read once chose row tiles."""
    assert tg.input_reads(64, 126, 2048, 33) == 2   # mma_rms + one row-split pass
    assert tg.input_reads(64, 252, 2048, 33) == 3   # ... two row-split passes
    assert tg.input_reads(32, 252, 2048, 33) == 1   # staged
    assert tg.input_reads(32, 252, 2048) == 8       # k split, 32 rows a pass, stored input
    assert tg.input_reads(64, 252, 8192) == 8       # past MMA_ROWS_SPLIT_MAX_K: the k split
    assert tg.input_reads(64, 252, 2048) == 2       # the row split
    assert tg.choose(64, 4, 126, 132) == (1, 0)
    assert tg.choose(64, 4, 126, 132, 2048, 33) == (2, 43)
    # at 128 tokens: groups of 4 (32-row shares staged) over 2 (64-row shares, three reads)
    assert tg.choose(128, 4, 126, 132, 2048, 33) == (4, 109)
    for tokens, rows, staged in [(64, 126, 33), (128, 126, 33), (64, 10, 64), (128, 24, 64)]:
        c, m = tg.choose(tokens, 4, rows, 132, 2048, staged)

        def cost(k, t):
            return tg.input_reads(-(-t // k), k * rows, 2048, staged) * t * 4 / k + \
                2 * (k - 1) * rows

        assert all(cost(c, tokens) <= cost(k, tokens) for k in (1, 2, 4, 8)
                   if tokens >= 8 * k)
        if c > 1:  # groups win at every step size from min_tokens, not just below it
            assert all(cost(c, t) < cost(1, t) for t in range(m, tokens + 1))
            assert m == 8 * c or cost(c, m - 1) >= cost(1, m - 1)


def test_min_tokens_fits_its_byte_in_a_program_of_256_tokens():
    """Word.GROUP keeps min_tokens in 8 bits (the input slices' bits above them): where the
    groups pay only at a program's full 256 tokens, choose says from 255 (the same steps:
    none has 255 < T < 256 tokens), and an asked min_tokens of 256 is refused."""
    assert tg.choose(256, 2, 234, 132, 2048, 64) == (4, tg.MAX_MIN_TOKENS) == (4, 255)
    assert tg.choose(128, 2, 234, 132, 2048, 64)[1] <= 128
    with pytest.raises(ProgramError, match="members from 256 tokens"):
        tc_program(ModelConfig.from_name("llama3-tiny"), 3, (2, 256), tokens=256)


def test_the_programs_of_the_three_shapes():
    """On 132 blocks, 64 tokens a step: the members the NOTES prediction names (Llama's RMS
    ops' picks with its 21 staged rows, beside block_mma_rows' sums and ring: NOTES "The ring
    in block_mma_rows, as built")."""
    want = {"smollm2-135m": {Op.RMS_QKV_ROPE: 4, Op.O_PROJ_RESIDUAL: 4, Op.RMS_GATE_UP: 2,
                             Op.DOWN_RESIDUAL: 4},
            "llama-3.2-1b": {Op.RMS_QKV_ROPE: 4, Op.O_PROJ_RESIDUAL: 2, Op.RMS_GATE_UP: 1,
                             Op.DOWN_RESIDUAL: 2}}
    for shape, members in want.items():
        cfg = ModelConfig.from_name(shape)
        splits, min_chunk = tensor_core_splits(cfg, 132, 2048)
        prog = schedule(cfg, 132, 2048, splits, min_chunk, merge_ticket_min=1, tokens=64,
                        token_groups=True)
        got = {}
        for ins in prog.queues[0]:
            if ins.layer == 0 and ins.op in members:
                got[ins.op] = ins.group.members if ins.group else 1
        assert got == members, shape


def test_picked_members_are_validated_and_min_tokens_fits_its_byte():
    """A pick (a dict {Op: c}, group_picks.py) outside the op's candidates is refused by name;
    the threshold of a pick's c is the fewest tokens from which c beats row tiles by the
    closed form's bytes, the program's full step where it never does, and never past
    Word.GROUP's byte."""
    cfg = ModelConfig.from_name("llama3-tiny")
    with pytest.raises(ProgramError, match="RMS_GATE_UP in token groups of 4"):
        tc_program(cfg, 3, {Op.RMS_GATE_UP: 4})
    assert tg.candidates(256, 132) == [1, 2, 4, 8] and tg.candidates(16, 3) == [1, 2]
    assert tg._threshold(lambda c, t: 0.0 if c > 1 else 1.0, 2, 256) == 16
    assert tg._threshold(lambda c, t: 1.0, 2, 128) == 128
    assert tg._threshold(lambda c, t: 1.0, 2, 256) == tg.MAX_MIN_TOKENS == 255
    prog = tc_program(cfg, 3, {Op.RMS_GATE_UP: 2, Op.DOWN_RESIDUAL: 1})
    got = {ins.op: ins.group for ins in prog.queues[0]
           if ins.op in (Op.RMS_GATE_UP, Op.DOWN_RESIDUAL)}
    assert got[Op.RMS_GATE_UP].members == 2 and got[Op.DOWN_RESIDUAL] is None
    assert 2 * tg.MIN_SHARE <= got[Op.RMS_GATE_UP].min_tokens <= TOKENS


# ---- the program --------------------------------------------------------------------------
def test_a_group_shares_its_members_rows_and_splits_the_tokens(synth_model):
    """Three blocks in groups of two: blocks 0 and 1 share their rows (the union of their
    tiles), block 2 is a group of one; the words carry members, index, min_tokens and rows;
    the regions say which tokens and steps each covers."""
    model = synth_model("llama3-tiny")
    prog = tc_program(model.config, 3, 2)
    words = prog.words()
    for k, ins in enumerate(prog.queues[0]):
        if ins.op not in tg.GROUPED_OPS:
            assert ins.group is None
            continue
        mates = [prog.queues[b][k] for b in range(3)]
        assert [m.group.members for m in mates] == [2, 2, 1]
        assert [m.group.index for m in mates] == [0, 1, 0]
        assert mates[0].group.tile == mates[1].group.tile == (mates[0].tile[0], mates[1].tile[1])
        assert mates[2].group.tile == mates[2].tile
        g = words[0, k, Word.GROUP]
        assert (g & 0xff, g >> 8 & 0xff, g >> 16) == (2, 0, 16)
        assert words[0, k, Word.GROUP_TILE] == mates[0].tile[0] | mates[1].tile[1] << 16
        shares = {r[3] for r in mates[1].writes if len(r) > 3}
        assert shares == {Tokens(steps_hi=16), Tokens(TOKEN_SHARES // 2, TOKEN_SHARES, 16)}
    # a CUDA-core program has none (its words stay 0)
    plain = schedule(model.config, 3, MAX_SEQ, tokens=TOKENS)
    assert (plain.words()[:, :, Word.GROUP] == 0).all()


def test_token_groups_need_a_program_merged_by_ticket_and_sane_members(synth_model):
    cfg = synth_model("llama3-tiny").config
    with pytest.raises(ProgramError, match="merge_ticket_min 1"):
        schedule(cfg, 3, MAX_SEQ, tokens=TOKENS, token_groups=2)
    with pytest.raises(ProgramError, match="members"):
        tc_program(cfg, 3, 4)  # more members than blocks
    with pytest.raises(ProgramError, match="members"):
        tc_program(cfg, 3, (2, 1))  # fewer tokens than members
    with pytest.raises(KernelError, match="tensor-core kernel"):
        KernelExecutor(synth_model("llama3-tiny"), MAX_SEQ, blocks=3, slots=2, step_tokens=TOKENS,
                       merge_ticket_min=1, program=tc_program(cfg, 3, 2))


def _same_share(prog):
    """A copy of ``prog`` whose members all take share 0: two blocks write the same tokens of
    the group's rows."""
    bad = copy.deepcopy(prog)
    for q in bad.queues:
        for i, ins in enumerate(q):
            if ins.group is not None and ins.group.members > 1:
                j, m, mt = 0, ins.group.members, ins.group.min_tokens
                share = Tokens(0, TOKEN_SHARES // m, mt)
                fix = lambda rs: [r if len(r) < 4 or r[3].steps_lo < mt  # noqa: E731
                                  else (*r[:3], share) for r in rs]
                q[i] = dataclasses.replace(ins, group=dataclasses.replace(ins.group, index=j),
                                           reads=fix(ins.reads), writes=fix(ins.writes))
    return bad


def test_the_verifier_proves_both_modes_and_rejects_a_shared_share(synth_model):
    """The regions of both modes pass (schedule verified them); members taking the same
    share of the tokens are two unordered writers of the same rows and tokens."""
    prog = tc_program(synth_model("qwen3-gqa-tiny").config, 4, 2)
    with pytest.raises(ProgramError) as info:
        _same_share(prog).verify(use_cache=False)
    # two members of one group (blocks 0 and 1, the same op) on the same rows and tokens
    assert re.search(r"A[WR] hazard on \w+\[\d+:\d+\]: block 1 #\d+ (\w+)\(layer 0.* "
                     r"after block 0 #\d+ \1\(", str(info.value)), str(info.value)
    # row tiles in the small steps: a group's writes overlap its members' row-tile writes in
    # rows and tokens, but never in the same step
    ins = prog.queues[0][next(k for k, i in enumerate(prog.queues[0])
                              if i.op == Op.DOWN_RESIDUAL)]
    rows_mode = [r[3] for r in ins.writes if len(r) > 3 and r[3].steps_lo == 1]
    group_mode = [r[3] for r in ins.writes if len(r) > 3 and r[3].steps_lo > 1]
    assert rows_mode and group_mode and not rows_mode[0].overlaps(group_mode[0])


# ---- the kernel on the emulator ---------------------------------------------------------
def _run(model, prog, blocks: int) -> dict:
    return run_steps(model, prog, blocks, MAX_SEQ, TOKENS)


@pytest.mark.parametrize("arch", ["llama3-tiny", "qwen3-gqa-tiny", "qwen2-tiny", "tiny"])
def test_groups_leave_every_logit_bitwise_as_row_tiles(synth_model, arch):
    """Steps of 4 to 32 rows (groups from 16) on 4 blocks in groups of 2 and of 4, and on 3
    blocks in groups of 2 (a group of one beside): every row's logits bit for bit those of
    the same kernel in row tiles (a token's k-loop is the same whichever block runs it)."""
    model = synth_model(arch)
    for blocks, members in ((4, 2), (4, 4), (3, 2)):
        want = _run(model, tc_program(model.config, blocks, False), blocks)
        got = _run(model, tc_program(model.config, blocks, members), blocks)
        assert len(got) == len(want) == 98
        bad = [k for k in want if not np.array_equal(got[k], want[k])]
        assert not bad, f"{arch} {blocks} blocks, groups of {members}: rows {bad[:5]} differ"


def test_negative_control_members_on_the_same_share_change_the_logits(synth_model):
    """The same run with every member on share 0: in a big step the other share's tokens
    are never multiplied and share 0's residual rows get each product added twice, so no row
    of the first step (32 rows: shares of 16) has row tiles' logits."""
    model = synth_model("llama3-tiny")
    want = _run(model, tc_program(model.config, 4, False), 4)
    got = _run(model, _same_share(tc_program(model.config, 4, 2)), 4)
    first = [(0, p) for p in range(5)] + [(1, p) for p in range(11)] + [(2, p) for p in range(16)]
    assert all(not np.array_equal(got[k], want[k]) for k in first)


# ---- the cost model ---------------------------------------------------------------------
def test_the_cost_model_reads_the_programs_groups():
    """A step of 64 sequences predicts faster with the program's groups (its tiles line says
    them); a step of one or 8 sequences (row tiles: fewer tokens than any op's min_tokens)
    predicts the same."""
    from monokernel.kernel import costmodel as cm
    from monokernel.kernel.costmodel.tokens import StepShape

    cfg = ModelConfig.from_name("smollm2-135m")
    g, d = cm.gpu("h200"), cm.design("v6-mma-seg")
    rows, groups = (tc_program(cfg, 132, tgv, tokens=64) for tgv in (False, True))

    def step_us(prog, batch):
        shape = StepShape.decode(batch, 16)
        st = cm.Static(prog, 16, g, d, shape)
        return cm.predict(prog, g, d, static=st).total_us, st.tiles

    for batch in (1, 8):
        assert step_us(groups, batch)[0] == pytest.approx(step_us(rows, batch)[0], rel=1e-12)
    t_rows, _ = step_us(rows, 64)
    t_groups, tiles = step_us(groups, 64)
    assert t_groups < 0.85 * t_rows, (t_groups, t_rows)
    assert tiles["RMS_QKV_ROPE"] == (4, 1) and tiles["RMS_GATE_UP"] == (2, 1)


def test_the_cost_model_multiplies_a_members_group_rows_by_its_share_of_tokens():
    """The mma work the model charges an instruction is what megakernel.cu block_mma runs: in a
    step of at least min_tokens, its group's rows (the union of its members' tiles, in weight
    rows: RMS_QKV_ROPE's tile rows are row pairs) by ceil(T / members) tokens; in a smaller
    step its own rows by every token. (Before, the model charged a member its own rows by all
    T tokens: 2x the mma work of SmolLM2's DOWN, whose 4-5 rows pad to 16.)"""
    from monokernel.kernel import costmodel as cm
    from monokernel.kernel.costmodel.tokens import StepShape, mma_us

    cfg = ModelConfig.from_name("smollm2-135m")
    g, d = cm.gpu("h200"), cm.design("v6-mma-seg")
    prog = tc_program(cfg, 132, True, tokens=64)
    weight_rows = {Op.RMS_QKV_ROPE: 2, Op.O_PROJ_RESIDUAL: 1, Op.RMS_GATE_UP: 2,
                   Op.DOWN_RESIDUAL: 1}
    k = {Op.RMS_QKV_ROPE: cfg.hidden_size, Op.O_PROJ_RESIDUAL: cfg.q_dim,
         Op.RMS_GATE_UP: cfg.hidden_size, Op.DOWN_RESIDUAL: cfg.intermediate_size}
    for batch in (8, 64):
        st = cm.Static(prog, 16, g, d, StepShape.decode(batch, 16))
        checked = set()
        for b, q in enumerate(prog.queues):
            for j, ins in enumerate(q):
                if ins.op not in weight_rows or ins.layer != 0 or ins.tile[1] <= ins.tile[0]:
                    continue
                grp = ins.group
                grouped = grp.members > 1 and batch >= grp.min_tokens
                lo, hi = grp.tile if grouped else ins.tile
                tokens = -(-batch // grp.members) if grouped else batch
                want = mma_us(np.array([weight_rows[ins.op] * (hi - lo)]), k[ins.op], tokens, g)
                assert st.fields["compute"][b, j] == pytest.approx(float(want[0]), rel=1e-9), \
                    (ins.op, batch, b)
                checked.add((ins.op, grouped))
        # every op grouped at 64 (SmolLM2: 4 / 4 / 2 / 4 members), none at 8
        assert checked == {(op, batch == 64) for op in weight_rows}, checked
