"""Attention's units in a pipeline (megakernel.cu segment_pass, MK_ATTN_PIPE; header
attn_pipeline): the next unit's first K/V tile copied into a second tile buffer while a unit
computes. Where it is built, the shared memory it takes, the logits bit for bit those of the
kernel without it (the same tiles in other shared memory), with a negative control, and the
cost model's reading of it."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.batch import run_steps
from monokernel.kernel import executor, header
from monokernel.kernel.isa import NUM_THREADS, T_TILE
from monokernel.kernel.schedule import schedule, tensor_core_splits
from monokernel.model.config import ModelConfig

MAX_SEQ = 64
TOKENS = 32
# the next unit's copies, as megakernel.cu issues them
COPY = "segment_stage(P, next.slot, P.k_cache + kv_n, P.v_cache + kv_n, next.base, next.cnt,"


@pytest.mark.parametrize("name,pipelined", [("smollm2-135m", True), ("llama-3.2-1b", True),
                                            ("qwen3-0.6b", False)])
def test_the_pipeline_is_built_where_two_buffers_fit_the_cap(name, pipelined):
    """Two K/V tile buffers at head_dim 64 keep dynamic shared memory under DYN_SMEM_CAP;
    Qwen3's head_dim 128 would pass it (its L1 would shrink), so it keeps one buffer and
    the shared memory it had."""
    cfg = ModelConfig.from_name(name)
    assert header.attn_pipeline(cfg) is pipelined
    tile = 2 * T_TILE * (cfg.head_dim + 8) * 2
    assert header._segment_bytes(cfg) == header._segment_bytes(cfg, 1) + pipelined * tile
    for tokens in (64, 128):
        assert header.dynamic_shared_bytes(cfg, tokens, True) <= max(
            header.DYN_SMEM_CAP, header._segment_bytes(cfg, 1))
        src = executor.kernel_source(cfg, 2048, tokens, 128, 16, mma=True)
        assert f"#define MK_ATTN_PIPE {int(pipelined)}\n" in src


def _program(cfg, blocks, max_seq=MAX_SEQ, tokens=TOKENS, splits=None):
    splits, min_chunk = tensor_core_splits(cfg, blocks, max_seq, splits)
    return schedule(cfg, blocks, max_seq, splits, min_chunk, merge_ticket_min=1, tokens=tokens,
                    token_groups=False, tensor_cores=True)


def _run(model, monkeypatch, pipelined: bool, edit=None, blocks=3, max_seq=MAX_SEQ,
         tokens=TOKENS, splits=None, **steps):
    """run_steps's steps (by default its mixed steps on 3 blocks: several units an
    instruction, chunks of 2 to 4 m-tiles and decode rows), the kernel with or without the
    pipeline (``edit``: a source mutation (old, new))."""
    monkeypatch.setattr(header, "attn_pipeline", lambda cfg: pipelined)
    if edit is not None:
        real = executor.kernel_source

        def mutated(*a, **k):
            src = real(*a, **k)
            assert src.count(edit[0]) == 1, "the pipeline's code is not where this test expects"
            return src.replace(*edit)

        monkeypatch.setattr(executor, "kernel_source", mutated)
    src = executor.kernel_source(model.config, max_seq, tokens, 6, 8, mma=True)
    assert f"#define MK_ATTN_PIPE {int(pipelined)}\n" in src
    try:
        prog = _program(model.config, blocks, max_seq, tokens, splits)
        return run_steps(model, prog, blocks, max_seq, tokens, **steps)
    finally:
        monkeypatch.undo()


def _differing(want, got) -> list:
    assert want.keys() == got.keys()
    assert all(np.isfinite(v).all() for v in got.values())
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
               edit=(COPY, COPY.replace("next.base, next.cnt,", "next.base + 1, next.cnt,")))
    bad = _differing(want, got)
    assert len(bad) > len(want) // 4, bad


# A unit of two tiles and two passes taking a copied first tile (megakernel.cu
# attention_segment): llama3-tiny (3 queries a KV head) on one block with one split, so a unit
# is a whole row's context. The third step's slot-1 decode row copies slot 0's first tile; slot
# 0's 52 rows at positions 96..147 are 156 queries (10 m-tiles: passes of 8 and 2) over 148
# positions (tiles of 128 and 20); its second pass must restage tile 0, the buffer holding
# tile 1 of the first pass.
LONG = {"prompts": (148, 5, 7),
        "steps": ({0: 48, 1: 5, 2: 7}, {0: 48, 1: 1, 2: 1}, {1: 1, 0: 52, 2: 1})}
LONG_KERNEL = {"blocks": 1, "max_seq": 256, "tokens": 64, "splits": 1}
# the pass's flag for the copied tile, as attention_segment passes it
FIRST_PASS = "pre && mt0 == 0, mt0 + NWARPS >= mtiles"


def test_a_unit_of_many_tiles_and_passes_restages_its_first_tile(synth_model, monkeypatch):
    """The long unit's logits bit for bit the same with the pipeline as without; negative
    control: the copied tile taken by every pass (its second pass computes on tile 1 twice)
    changes slot 0's rows of that step."""
    model = synth_model("llama3-tiny")
    cfg = model.config
    assert 52 * cfg.group_size > 16 * (NUM_THREADS // 32) and 148 > T_TILE  # passes, tiles
    want = _run(model, monkeypatch, False, **LONG_KERNEL, **LONG)
    got = _run(model, monkeypatch, True, **LONG_KERNEL, **LONG)
    assert len(want) == 148 + 7 + 9
    bad = _differing(want, got)
    assert not bad, f"rows {bad[:5]} differ"
    got = _run(model, monkeypatch, True, edit=(FIRST_PASS, FIRST_PASS.replace(" && mt0 == 0", "")),
               **LONG_KERNEL, **LONG)
    bad = _differing(want, got)
    assert bad and {s for s, p in bad} == {0} and min(p for _, p in bad) >= 96, bad


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
