"""Token groups picked by the cost model (kernel/group_picks.py): the picks of the served
shapes, each faster on the model than the closed form's; the program the tensor-core executor
runs takes them; a picked program's logits on the emulator bit for bit those of row tiles."""

from __future__ import annotations

import dataclasses

import numpy as np

from helpers.batch import run_steps
from monokernel.kernel import costmodel as cm
from monokernel.kernel import group_picks as gp
from monokernel.kernel.costmodel.tokens import StepShape
from monokernel.kernel.executor import KernelExecutor
from monokernel.kernel.isa import Op
from monokernel.kernel.schedule import schedule, tensor_core_splits
from monokernel.model.config import ModelConfig

BLOCKS, MAX_SEQ, TOKENS = 132, 2048, 64


def test_the_picks_of_the_served_shapes_at_64_tokens():
    """On 132 blocks, 64 tokens a step: Llama-3.2-1B's O_PROJ and DOWN in row tiles (the
    closed form: 2 each; the model counts the row split's rounds, which the closed form's
    bytes do not) and QKV in 2 (closed form 4; GATE_UP in row tiles by both, with its 21
    staged rows beside block_mma_rows' ring), SmolLM2's DOWN in 2 (closed form 4), Qwen3's
    O_PROJ, GATE_UP and DOWN in row tiles (64 rows a block: the row split, its weights through
    block_mma_rows' ring; a member of 32 is in the k split); each pick's one-layer step
    predicted faster than the closed form's, and Llama's
    whole program's by more than 5 % (benchmarks/NOTES.md "Token groups picked by the cost
    model")."""
    g, shape = cm.gpu(gp.MODEL_GPU), StepShape.decode(TOKENS, 16)
    want = {"llama-3.2-1b": {Op.RMS_QKV_ROPE: 2, Op.O_PROJ_RESIDUAL: 1, Op.DOWN_RESIDUAL: 1},
            "smollm2-135m": {Op.DOWN_RESIDUAL: 2},
            "qwen3-0.6b": {Op.O_PROJ_RESIDUAL: 1, Op.RMS_GATE_UP: 1, Op.DOWN_RESIDUAL: 1}}
    for name, picks in want.items():
        cfg = ModelConfig.from_name(name)
        splits, min_chunk = tensor_core_splits(cfg, BLOCKS, MAX_SEQ)
        assert gp.pick(cfg, BLOCKS, MAX_SEQ, splits, min_chunk, TOKENS) == picks, name
        if picks is True:
            continue

        def program(config, groups):
            return schedule(config, BLOCKS, MAX_SEQ, splits, min_chunk, merge_ticket_min=1,
                            tokens=TOKENS, token_groups=groups, tensor_cores=True,
                            input_slices=True)

        def step_us(prog):
            return cm.predict(prog, g, cm.design_for(prog, tensor_cores=True),
                              shape=shape).total_us

        one = dataclasses.replace(cfg, num_layers=1)
        closed = program(one, True)
        for op, c in picks.items():
            assert gp.members(closed, op) != c, (name, op)
            assert gp.members(program(one, {op: c}), op) == c, (name, op)
            assert step_us(program(one, {op: c})) < step_us(closed), (name, op)
        if name == "llama-3.2-1b":  # the whole model's program and step (~10 % faster)
            picked = gp.tensor_core_program(cfg, BLOCKS, MAX_SEQ, splits, min_chunk, TOKENS)
            assert {op: gp.members(picked, op) for op in picks} == picks
            assert step_us(picked) < 0.95 * step_us(program(cfg, True))


def test_no_pick_below_two_shares_or_where_the_attention_is_not_merged_by_ticket():
    """A program of 8 tokens a step takes no groups (True: the closed form's none); nor one
    whose attention is not merged by ticket (qwen3-gqa-tiny's 2 KV heads of 3 splits on 3
    blocks: block 1 holds units of both; schedule then runs row tiles)."""
    cfg = ModelConfig.from_name("llama-3.2-1b")
    splits, min_chunk = tensor_core_splits(cfg, BLOCKS, MAX_SEQ)
    assert gp.pick(cfg, BLOCKS, MAX_SEQ, splits, min_chunk, 8) is True
    gqa = ModelConfig.from_name("qwen3-gqa-tiny")
    prog = schedule(gqa, 3, 64, 3, 1, merge_ticket_min=1, tokens=32, token_groups=True,
                    tensor_cores=True)
    assert prog.merge_ticket_min != 1
    assert all(ins.group is None for q in prog.queues for ins in q)
    assert gp.pick(gqa, 3, 64, 3, 1, 32) is True


def test_the_executor_runs_the_picks_and_they_leave_every_logit_bitwise(synth_model):
    """The tensor-core executor's default program is group_picks.tensor_core_program (on 6
    blocks at 32 tokens llama3-tiny's QKV in row tiles, the closed form's in groups); a
    picked program's logits (a hand-mixed pick: QKV in 4, O_PROJ in row tiles, GATE_UP in
    2) are bit for bit those of the same kernel in row tiles (a token's k-loop is the same
    whichever block runs it)."""
    model = synth_model("llama3-tiny")
    cfg, blocks, max_seq, tokens = model.config, 6, 64, 32
    splits, min_chunk = tensor_core_splits(cfg, blocks, max_seq)
    assert gp.pick(cfg, blocks, max_seq, splits, min_chunk, tokens) == {Op.RMS_QKV_ROPE: 1}
    ex = KernelExecutor(model, max_seq, blocks=blocks, slots=6, page_size=16,
                        tensor_cores=True, step_tokens=tokens)
    assert ex.program is gp.tensor_core_program(cfg, blocks, max_seq, splits, min_chunk,
                                                tokens)
    assert gp.members(ex.program, Op.RMS_QKV_ROPE) == 1

    def program(groups):
        return schedule(cfg, blocks, max_seq, splits, min_chunk, merge_ticket_min=1,
                        tokens=tokens, token_groups=groups, tensor_cores=True)

    assert gp.members(program(True), Op.RMS_QKV_ROPE) > 1
    want = run_steps(model, program(False), blocks, max_seq, tokens)
    mixed = program({Op.RMS_QKV_ROPE: 4, Op.O_PROJ_RESIDUAL: 1, Op.RMS_GATE_UP: 2})
    assert [gp.members(mixed, op) for op in (Op.RMS_QKV_ROPE, Op.O_PROJ_RESIDUAL,
                                             Op.RMS_GATE_UP)] == [4, 1, 2]
    got = run_steps(model, mixed, blocks, max_seq, tokens)
    assert len(got) == len(want) == 98
    bad = [k for k in want if not np.array_equal(got[k], want[k])]
    assert not bad, f"rows {bad[:5]} differ"


def test_a_pick_is_remembered_on_disk_per_arguments_and_sources(tmp_path, monkeypatch):
    """A later process reads the pick from $MONOKERNEL_CACHE/picks instead of searching; a
    damaged file is searched again and rewritten; other sources of the kernel package (a
    changed cost model) are another key, so they pick again."""
    monkeypatch.setenv("MONOKERNEL_CACHE", str(tmp_path))
    cfg = ModelConfig.from_name("llama3-tiny")
    args = (cfg, 6, 64, *tensor_core_splits(cfg, 6, 64), 32)
    real, searched = gp._search, []
    monkeypatch.setattr(gp, "_search", lambda *a: searched.append(a) or real(*a))
    gp._pick.cache_clear()
    want = gp.pick(*args)
    assert want == {Op.RMS_QKV_ROPE: 1} and len(searched) == 1
    files = list((tmp_path / "picks").iterdir())
    assert len(files) == 1 and files[0].read_text() == '[["RMS_QKV_ROPE", 1]]'
    gp._pick.cache_clear()  # as a new process: read, not searched
    assert gp.pick(*args) == want and len(searched) == 1
    files[0].write_text('[["NO_SUCH_OP", 3]')  # damaged: searched again, rewritten
    gp._pick.cache_clear()
    assert gp.pick(*args) == want and len(searched) == 2
    assert files[0].read_text() == '[["RMS_QKV_ROPE", 1]]'
    gp._pick.cache_clear()
    monkeypatch.setattr(gp, "sources_digest", lambda: "another cost model")
    assert gp.pick(*args) == want and len(searched) == 3
    assert len(list((tmp_path / "picks").iterdir())) == 2
    gp._pick.cache_clear()
