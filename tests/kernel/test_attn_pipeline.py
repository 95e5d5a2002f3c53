"""Attention's units in a pipeline (megakernel.cu segment_pass, MK_ATTN_PIPE; header
attn_pipeline): the next unit's first K/V tile copied into a second tile buffer while a unit
computes. Where it is built, the shared memory it takes, the logits bit for bit those of the
kernel without it (the same tiles in other shared memory), with a negative control, and the
cost model's reading of it."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.batch import run_steps
from helpers.kernel import mutate_kernel_source
from monokernel.kernel import executor, header
from monokernel.kernel.isa import NUM_THREADS, T_TILE
from monokernel.kernel.schedule import schedule, tensor_core_splits
from monokernel.model.config import ModelConfig

MAX_SEQ = 64
TOKENS = 32
# a tile's successor, as megakernel.cu segment_pass takes it (the pass's next tile, else the
# next unit's first)
COPY = "own ? SegTile{slot, gk, base + SEG_TILE, min(SEG_TILE, t1 - base - SEG_TILE), pos0}"
# the next unit's first tile, as the rolling prefetch finds it and segment_pass recomputes it
NEXT = "return {row_slot(st, tok), u / splits, t0,"


@pytest.mark.parametrize("name,tile", [("smollm2-135m", 128), ("llama-3.2-1b", 128),
                                       ("qwen3-0.6b", 64)])
def test_every_shape_pipelines_in_tiles_that_fit_the_cap(name, tile):
    """Two K/V tile buffers of T_TILE positions at head_dim 64 keep dynamic shared memory
    under DYN_SMEM_CAP; at head_dim 128 (Qwen3) two of half that do, in less shared memory
    than its one buffer of T_TILE took before (its L1 kept)."""
    cfg = ModelConfig.from_name(name)
    assert header.segment_tile(cfg) == tile and header.attn_pipeline(cfg)
    buffer = 2 * tile * (cfg.head_dim + 8) * 2
    assert header._segment_bytes(cfg) == header._segment_bytes(cfg, 1) + buffer
    assert header._segment_bytes(cfg) <= header.DYN_SMEM_CAP
    if tile < T_TILE:
        assert header._segment_bytes(cfg, 2, T_TILE) > header.DYN_SMEM_CAP
        assert header._segment_bytes(cfg) < header._segment_bytes(cfg, 1, T_TILE)
    for tokens in (64, 128):
        assert header.dynamic_shared_bytes(cfg, tokens, True) <= header.DYN_SMEM_CAP
        src = executor.kernel_source(cfg, 2048, tokens, 128, 16, mma=True)
        assert "#define MK_ATTN_PIPE 1\n" in src and f"#define MK_SEG_TILE {tile}\n" in src


def _program(cfg, blocks, max_seq=MAX_SEQ, tokens=TOKENS, splits=None):
    splits, min_chunk = tensor_core_splits(cfg, blocks, max_seq, splits)
    return schedule(cfg, blocks, max_seq, splits, min_chunk, merge_ticket_min=1, tokens=tokens,
                    token_groups=False, tensor_cores=True)


def _run(model, monkeypatch, pipelined: bool, edit=None, tile=None, blocks=3, max_seq=MAX_SEQ,
         tokens=TOKENS, splits=None, **steps):
    """run_steps's steps (by default its mixed steps on 3 blocks: several units an
    instruction, chunks of 2 to 4 m-tiles and decode rows), the kernel with or without the
    pipeline, in tiles of ``tile`` positions (default segment_tile's), ``edit`` a source
    mutation (old, new)."""
    monkeypatch.setattr(header, "attn_pipeline", lambda cfg: pipelined)
    if tile is not None:
        monkeypatch.setattr(header, "segment_tile", lambda cfg: tile)
    if edit is not None:
        mutate_kernel_source(monkeypatch, edit, "the pipeline's code")
    src = executor.kernel_source(model.config, max_seq, tokens, 6, 8, mma=True)
    assert f"#define MK_ATTN_PIPE {int(pipelined)}\n" in src
    try:
        prog = _program(model.config, blocks, max_seq, tokens, splits)
        return run_steps(model, prog, blocks, max_seq, tokens, **steps)
    finally:
        monkeypatch.undo()


def _differing(want, got, finite: bool = True) -> list:
    """The rows whose logits differ (``finite``: every row written and finite; a negative
    control may read the pages' NaN poison)."""
    assert want.keys() == got.keys()
    assert not finite or all(np.isfinite(v).all() for v in got.values())
    return [k for k in want if not np.array_equal(got[k], want[k])]


@pytest.mark.parametrize("arch", ["llama3-tiny", "qwen3-gqa-tiny"])
def test_pipelined_units_leave_every_logit_bitwise(synth_model, monkeypatch, arch):
    """Every row of steps of 4 to 32 rows: logits bit for bit the same with the pipeline as
    without (late q/k too: the copies stop before the segment's own keys, which its pass
    norms into the tile), and every row written."""
    model = synth_model(arch)
    want = _run(model, monkeypatch, False)
    got = _run(model, monkeypatch, True)
    assert len(want) == 98
    bad = _differing(want, got)
    assert not bad, f"{arch}: rows {bad[:5]} differ"


def test_negative_control_a_wrong_next_tile_changes_the_logits(synth_model, monkeypatch):
    """The pipeline copying the next unit's tile one position late: the units that take a
    copied tile compute on the wrong K/V, so rows differ (the copied tiles are used)."""
    model = synth_model("llama3-tiny")
    want = _run(model, monkeypatch, False)
    got = _run(model, monkeypatch, True,
               edit=(NEXT, NEXT.replace("t0,", "t0 + 1,")))
    bad = _differing(want, got, finite=False)
    assert len(bad) > len(want) // 4, bad


# the tile's copies land before the barrier that shows them to the block (attention_segment)
TILE_WAIT = "cp_async_wait();\n      __syncthreads();  // the tiles (and the query tiles) are in"


@pytest.mark.parametrize("pipelined", [False, True])
def test_negative_control_a_tile_read_before_its_copies_land_changes_the_logits(
        synth_model, monkeypatch, pipelined):
    """The emulator's cp.async lands a copy at its thread's cp_async_wait, not before (its
    destination reads as 0xff bytes, NaN, until then: emulator/cuda_cpu_mma.h): without the
    tile's wait every copied tile is read unlanded, so rows differ and turn NaN, with or
    without the pipeline. (The GPU's copies may land early; a kernel that passes only because
    they did is wrong there.)"""
    model = synth_model("llama3-tiny")
    want = _run(model, monkeypatch, False)
    got = _run(model, monkeypatch, pipelined,
               edit=(TILE_WAIT, TILE_WAIT.replace("cp_async_wait();", "")))
    bad = _differing(want, got, finite=False)
    assert len(bad) > len(want) // 2, bad
    assert any(not np.isfinite(got[k]).all() for k in bad)


# Units of many tiles and passes (megakernel.cu attention_segment, segment_pass): a block a KV
# group, one split, so a unit is a whole row's context. The third step's slot-1 decode row copies
# slot 0's first tile; slot 0's 52 rows at positions 96..147 are 52 GROUP queries over 148
# positions (tiles of 128 and 20: the second's copies land under the first), on llama3-tiny
# 156 queries (10 m-tiles: passes of 8 and 2, the second restaging tile 0, the buffers holding
# the first pass's tiles); on qwen3-gqa-tiny (late q/k) the rows' own keys normed into both
# tiles, the second's after its copies. The fourth step's slot-0 decode row (the split mode)
# runs two tiles too.
LONG = {"prompts": (148, 5, 7),
        "steps": ({0: 48, 1: 5, 2: 7}, {0: 48, 1: 1, 2: 1}, {1: 1, 0: 52, 2: 1},
                  {0: 1, 1: 1, 2: 1})}
LONG_KERNEL = {"max_seq": 256, "tokens": 64, "splits": 1}
# the pass's flag for the copied tile, as attention_segment passes it
FIRST_PASS = "pre && mt0 == 0, mt0 + NWARPS >= mtiles"


def _long(model, monkeypatch, pipelined, **kw):
    assert 148 > T_TILE  # two tiles
    got = _run(model, monkeypatch, pipelined, blocks=model.config.num_kv_heads, **LONG_KERNEL,
               **LONG, **kw)
    assert len(got) == 149 + 8 + 10
    return got


@pytest.mark.parametrize("arch", ["llama3-tiny", "qwen3-gqa-tiny"])
def test_units_of_many_tiles_and_passes_pipelined_leave_every_logit_bitwise(synth_model,
                                                                            monkeypatch, arch):
    """The long units' logits bit for bit the same with the pipeline as without."""
    model = synth_model(arch)
    want = _long(model, monkeypatch, False)
    bad = _differing(want, _long(model, monkeypatch, True))
    assert not bad, f"{arch}: rows {bad[:5]} differ"


def test_negative_controls_of_units_of_many_tiles_and_passes(synth_model, monkeypatch):
    """The copied first tile taken by every pass (the second computes on the first's last
    tile), or a unit's next tile copied one position late: slot 0's rows of that step
    differ, and no other row."""
    model = synth_model("llama3-tiny")
    assert 52 * model.config.group_size > 16 * (NUM_THREADS // 32)  # two passes
    want = _long(model, monkeypatch, False)
    for edit in ((FIRST_PASS, FIRST_PASS.replace(" && mt0 == 0", "")),
                 (COPY, COPY.replace("base + SEG_TILE,", "base + SEG_TILE + 1,"))):
        bad = _differing(want, _long(model, monkeypatch, True, edit=edit), finite=False)
        assert bad and {s for s, p in bad} == {0} and min(p for _, p in bad) >= 96, (edit, bad)


def test_tiles_of_half_the_positions_leave_every_logit_bitwise(synth_model, monkeypatch):
    """qwen3-tiny (head_dim 128: segment_tile 64, sub-tiles of 32, as Qwen3-0.6B; late q/k):
    the long units in three pipelined tiles of 64 positions give the logits of the kernel of
    one buffer of T_TILE, bit for bit (the online softmax steps by the same sub-tiles either
    way); and the mixed steps too."""
    model = synth_model("qwen3-tiny")
    assert header.segment_tile(model.config) == 64 < T_TILE
    want = _long(model, monkeypatch, False, tile=T_TILE)
    bad = _differing(want, _long(model, monkeypatch, True))
    assert not bad, f"rows {bad[:5]} differ"
    want = _run(model, monkeypatch, False, tile=T_TILE)
    bad = _differing(want, _run(model, monkeypatch, True))
    assert not bad, f"rows {bad[:5]} differ"


def test_the_cost_model_overlaps_units_after_the_first():
    """v6-mma-pipe's ATTENTION at B64 context 1024: the same stream, the work of every unit
    but the first beside it (Phases.compute), so the step is faster and the dependent trips
    are unchanged."""
    from monokernel.kernel import costmodel as cm
    from monokernel.kernel.costmodel.tokens import StepShape
    from monokernel.kernel.ops import attention
    from monokernel.kernel.costmodel.simulate import _batches
    from monokernel.kernel.isa import Op

    cfg = ModelConfig.from_name("smollm2-135m")
    splits, min_chunk = tensor_core_splits(cfg, 132, 2048)
    prog = schedule(cfg, 132, 2048, splits, min_chunk, merge_ticket_min=1, tokens=64,
                    token_groups=True, tensor_cores=True)
    g, shape = cm.gpu("h200"), StepShape.decode(64, 1024)
    seg, pipe = cm.design("v6-mma-seg"), cm.design("v6-mma-pipe")
    _, batch = _batches(prog, 1024, shape)[Op.ATTENTION]
    a, b = attention.cost(batch, g, seg), attention.cost(batch, g, pipe)
    assert np.array_equal(a.l2_trips, b.l2_trips) and np.array_equal(a.stream_bytes,
                                                                      b.stream_bytes)
    assert np.allclose(a.other_us, b.other_us + b.compute)
    assert (b.compute > 0).any() and (b.other_us <= a.other_us).all()
    slow, fast = (cm.predict(prog, g, d, shape=shape).total_us for d in (seg, pipe))
    assert fast < 0.9 * slow


def test_the_cost_model_overlaps_every_tile_but_the_first_by_tiles():
    """v6-mma-tiles against v6-mma-pipe at B64: where a unit is one tile (a program of 2048
    positions: splits of 128) the same ATTENTION; where a unit is four (8192 positions: splits
    of 512, context 4096) the unit pipeline overlaps one tile a unit and the pipeline by tiles
    every tile but the instruction's first: the same stream and trips, more work beside it."""
    from monokernel.kernel import costmodel as cm
    from monokernel.kernel.costmodel.simulate import _batches
    from monokernel.kernel.costmodel.tokens import StepShape
    from monokernel.kernel.isa import Op
    from monokernel.kernel.ops import attention

    cfg = ModelConfig.from_name("llama-3.2-1b")
    g = cm.gpu("h200")
    pipe, tiles = cm.design("v6-mma-pipe"), cm.design("v6-mma-tiles")
    for max_seq, context, per_unit in ((2048, 1024, 1), (8192, 4096, 4)):
        splits, min_chunk = tensor_core_splits(cfg, 132, max_seq)
        assert max(min_chunk, -(-max_seq // splits)) == per_unit * T_TILE
        prog = schedule(cfg, 132, max_seq, splits, min_chunk, merge_ticket_min=1, tokens=64,
                        token_groups=True, tensor_cores=True)
        _, batch = _batches(prog, context, StepShape.decode(64, context))[Op.ATTENTION]
        a, b = attention.cost(batch, g, pipe), attention.cost(batch, g, tiles)
        assert np.array_equal(a.l2_trips, b.l2_trips)
        assert np.array_equal(a.stream_bytes, b.stream_bytes)
        assert np.allclose(a.other_us + a.compute, b.other_us + b.compute)
        if per_unit == 1:
            assert np.allclose(a.compute, b.compute)
        else:
            busy = a.compute > 0
            assert busy.any() and (b.compute[busy] > 2 * a.compute[busy]).all()
