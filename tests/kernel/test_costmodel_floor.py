"""The floor of a step of many tokens (costmodel/floor.py): the bytes a mat-mul's busiest block
must move, the built design's predictions above it, and `plan`'s line."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from monokernel.cli import main
from monokernel.kernel import costmodel as cm
from monokernel.kernel.costmodel.floor import (busiest_block_bytes, matmul_floor,
                                               split_block_bytes, step_floor)
from monokernel.kernel.costmodel.tokens import StepShape
from monokernel.model.config import ModelConfig


def _tile_bytes(rows, k, tokens, blocks, b=2):
    """By brute force: the fewest bytes k (2 r + b t) of any whole r x t tile (r <= rows,
    t <= tokens) holding at least the busiest block's share of the outputs."""
    need = rows * tokens / blocks
    return min(k * (2 * r + b * t) for r, t in itertools.product(range(1, rows + 1),
                                                                  range(1, tokens + 1))
               if r * t >= need)


@pytest.mark.parametrize("rows, k, tokens, blocks", [
    (64, 32, 8, 4), (960, 576, 128, 132), (576, 1536, 64, 132), (1024, 3072, 64, 132),
    (30, 64, 1, 7), (8, 16, 128, 2)])
def test_the_busiest_block_moves_no_fewer_bytes_than_its_best_tile(rows, k, tokens, blocks):
    """The closed form (the real-valued optimum 2 r = b t, clamped) never exceeds what a
    whole tile moves, and lies within the rounding of r and t to whole rows and tokens."""
    want = _tile_bytes(rows, k, tokens, blocks)
    got = busiest_block_bytes(rows, k, tokens, blocks)
    assert got <= want * (1 + 1e-12)
    # whole rows and tokens add at most one row's and one token's bytes each way
    assert got >= want - k * (2 + 2)


def test_a_small_mat_mul_by_hand():
    # 64 rows x 8 tokens over 4 blocks: 128 outputs a block; the optimum t = sqrt(128) = 11.3
    # is past the step's 8 tokens, so t = 8 and r = 16: 32 x (2 x 16 + 2 x 8) bytes
    assert busiest_block_bytes(64, 32, 8, 4) == 32 * (2 * 16 + 2 * 8)
    # one token: every block its 1 / blocks of the rows and the token
    assert busiest_block_bytes(660, 100, 1, 132) == 100 * (2 * 5 + 2 * 1)
    # the split: 2 slices of 16 columns on 2 blocks each; then 4-byte partials written
    # (2 slices x 128 outputs) and read back with the sums' writes (3 x 128)
    assert split_block_bytes(64, 32, 8, 4, 2) == \
        busiest_block_bytes(64, 16, 8, 2) + 4.0 * 128 * 2 + 4.0 * 3 * 128


def test_an_ops_floor_is_its_slowest_of_l2_hbm_and_mma():
    g = cm.gpu("h200")
    f = matmul_floor("DOWN_RESIDUAL", 1024, 3072, 64, g, 132)
    assert f.l2_us == pytest.approx(busiest_block_bytes(1024, 3072, 64, 132) / (g.l2_bw / g.sms))
    assert f.hbm_us == pytest.approx(1024 * 3072 * 2 / g.hbm_bw)
    assert f.mma_us == pytest.approx(2 * 1024 * 3072 * 64 / (g.mma_tflops * 1e6))
    assert f.us == max(f.l2_us, f.hbm_us, f.mma_us) == f.l2_us  # B64 on Qwen3: the broadcast
    # the split only ever helps (s = 1 is among its choices), and at K = 3072 it does
    split = matmul_floor("DOWN_RESIDUAL", 1024, 3072, 64, g, 132, split=True)
    assert split.l2_us < 0.7 * f.l2_us and split.hbm_us == f.hbm_us


def test_the_step_floor_counts_every_layer_the_lm_heads_logits_and_the_kv():
    g = cm.gpu("h200")
    cfg = ModelConfig.from_name("qwen3-0.6b")
    short, per = step_floor(cfg, StepShape.decode(64, 16), g, 132)
    assert short == pytest.approx(sum(per.values()))
    long_, per_long = step_floor(cfg, StepShape.decode(64, 1024), g, 132)
    kv = 64 * 1025 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * 2
    assert per_long["ATTENTION"] == pytest.approx(kv / g.hbm_bw)
    assert long_ - short == pytest.approx(per_long["ATTENTION"] - per["ATTENTION"])
    # a prompt chunk that needs no logits has no LM head; the last one has one row's
    assert step_floor(cfg, StepShape.chunk(0, 128, False), g, 132)[1]["RMS_LM_HEAD"] == 0
    one_row = step_floor(cfg, StepShape.chunk(0, 128, True), g, 132)[1]["RMS_LM_HEAD"]
    assert one_row == pytest.approx(cfg.vocab_size * cfg.hidden_size * 2 / g.hbm_bw)


def _tc_program(name, input_slices=True):
    """A 2-layer tensor-core program of the shape, as `plan` predicts it (132 blocks, 128
    tokens a step; its input slices as the executor chooses them, or ``input_slices``)."""
    from monokernel.kernel.schedule import MAX_STEP_TOKENS
    from monokernel.tools.plan import _tokens_design, _tokens_program

    cfg = ModelConfig.from_name(name).replace(num_layers=2)
    prog = _tokens_program(cfg, 132, 2048, None, None, MAX_STEP_TOKENS, input_slices)
    return prog, _tokens_design(None, prog)


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"])
def test_the_built_designs_predictions_stay_above_the_floor(name):
    """The design built tiles as the floor assumes and pays hops and fixed work besides: a
    prediction under the floor has lost a cost. With the input split the floor is lower
    still (the lever the built tiling leaves)."""
    prog, d = _tc_program(name)
    g = cm.gpu("h200")
    for shape in (StepShape.decode(64, 16), StepShape.decode(64, 1024),
                  StepShape.chunk(512, 128, True), StepShape.decode(8, 300)):
        p = cm.predict(prog, g, d, static=cm.Static(prog, shape.max_context, g, d, shape))
        floor, _ = step_floor(prog.config, shape, g, prog.num_blocks)
        split, _ = step_floor(prog.config, shape, g, prog.num_blocks, split=True)
        assert split <= floor < p.step_us, (shape, split, floor, p.step_us)


def test_plan_prints_the_floor_of_the_batch_and_of_the_prompt(capsys):
    assert main(["plan", "--shape", "smollm2-135m", "--blocks", "32", "--context", "64",
                 "--predict", "h200", "--batch", "8", "--prompt", "300"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("floor on h200")]
    assert len(lines) == 2
    g, cfg = cm.gpu("h200"), ModelConfig.from_name("smollm2-135m")
    us = [step_floor(cfg, StepShape.decode(8, 64), g, 32, split)[0] for split in (False, True)]
    got = [float(x) for x in re.findall(r"(\d+) us/step", lines[0])]
    assert got == [pytest.approx(u, abs=0.5) for u in us]
    from monokernel.kernel.costmodel.tokens import prefill_shapes
    from monokernel.kernel.schedule import MAX_STEP_TOKENS  # the chunks --prompt predicts

    ms = [sum(step_floor(cfg, s, g, 32, split)[0]
              for s in prefill_shapes(300, MAX_STEP_TOKENS)) / 1e3
          for split in (False, True)]
    got = [float(x) for x in re.findall(r"([\d.]+) ms", lines[1])]
    assert got == [pytest.approx(m, abs=0.005) for m in ms]
    # the floor is printed before the prediction, which stays the last line of its report
    assert out.index(lines[1]) < out.index("predicted time to first token")
    assert np.isfinite(us).all()


def test_the_spread_split_cuts_o_proj_and_down_only_and_beats_the_last_drawers_reduction():
    """Design v6-mma-split (predicted): O_PROJ's and DOWN's input split where it pays, the
    reduction spread over the row group; the RMS ops keep their rows whole (their norm), and
    the same split reduced by one last drawer (tile_2d's) would cost more."""
    from monokernel.kernel.costmodel.tokens import _tile_us

    prog, built = _tc_program("qwen3-0.6b", input_slices=1)  # the design's own split on it
    split = built.replace(input_slices_spread=True)
    g = cm.gpu("h200")
    shape = StepShape.decode(64, 16)
    st = cm.Static(prog, 17, g, split, shape)
    assert st.tiles["RMS_QKV_ROPE"][1] == st.tiles["RMS_GATE_UP"][1] == 1
    assert st.tiles["DOWN_RESIDUAL"][1] > 1  # K = 3072 (O_PROJ's K = 2048 splits in 2x groups)
    assert st.tiles["DOWN_RESIDUAL"][0] == cm.Static(prog, 17, g, built, shape).tiles[
        "DOWN_RESIDUAL"][0]  # the program's token groups kept
    before = cm.predict(prog, g, built, static=cm.Static(prog, 17, g, built, shape))
    after = cm.predict(prog, g, split, static=st)
    busy = [{r["op"]: r["busy_mean_us"] for r in p.op_rows()} for p in (before, after)]
    assert busy[1]["DOWN_RESIDUAL"] < 0.95 * busy[0]["DOWN_RESIDUAL"]
    # (equal but for the float sums' order: busy_us' lead follows DOWN's end)
    assert busy[1]["RMS_GATE_UP"] == pytest.approx(busy[0]["RMS_GATE_UP"], rel=1e-9)
    assert after.step_us < before.step_us
    for s in (2, 4, 8):
        spread = _tile_us(8, 3072, 64, 2, s, g, split)
        drawer = _tile_us(8, 3072, 64, 2, s, g, built)
        assert spread[0] == drawer[0] and spread[2] < drawer[2]
        # the spread charges the group's other rows whole (c - 1) x n x K, not over K / s
        assert spread[1] == pytest.approx(8 * 3072 * 2.0 / (g.l2_bw / g.sms))
    assert cm.design("v6-mma-split").input_slices_spread


def test_the_residual_copy_pass_is_charged_to_o_proj_and_down_only():
    """The built design charges store_residual_in (megakernel.cu) to O_PROJ and DOWN,
    unsliced (a sliced op stores it in its sum's loop): at head_dim 128 a pass after the
    mat-mul, one more round and 6 bytes an output; at 64 (SmolLM2: MK_RES_IN_EPI) the copy in
    the epilogue, 2 bytes an output and no round. Nothing else changes."""
    prog, built = _tc_program("smollm2-135m", input_slices=1)
    g = cm.gpu("h200")
    shape = StepShape.decode(64, 16)
    assert built.residual_copy_pass and built.residual_copy_epilogue
    without = built.replace(residual_copy_pass=False)
    in_pass = built.replace(residual_copy_epilogue=False)
    busy = [{r["op"]: r["busy_mean_us"] for r in cm.predict(
        prog, g, d, static=cm.Static(prog, 17, g, d, shape)).op_rows()}
        for d in (without, in_pass, built)]
    for op in busy[0]:
        if op in ("O_PROJ_RESIDUAL", "DOWN_RESIDUAL"):
            assert busy[1][op] > busy[0][op] + g.l2_latency * 0.9, op
            assert busy[0][op] < busy[2][op] < busy[0][op] + g.l2_latency * 0.5, op
        else:  # (the LM head's busy follows its L2 prefetch's lead, which DOWN's end moves
            # a little: busy_us' lead; 0.014 % on this step)
            assert busy[1][op] == pytest.approx(busy[0][op], rel=1e-3), op
            assert busy[2][op] == pytest.approx(busy[0][op], rel=1e-3), op
