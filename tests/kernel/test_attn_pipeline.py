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
    tile = 2 * 128 * (cfg.head_dim + 8) * 2
    assert header._segment_bytes(cfg) == header._segment_bytes(cfg, 1) + pipelined * tile
    for tokens in (64, 128):
        assert header.dynamic_shared_bytes(cfg, tokens, True) <= max(
            header.DYN_SMEM_CAP, header._segment_bytes(cfg, 1))
        src = executor.kernel_source(cfg, 2048, tokens, 128, 16, mma=True)
        assert f"#define MK_ATTN_PIPE {int(pipelined)}\n" in src


def _program(cfg, blocks):
    splits, min_chunk = tensor_core_splits(cfg, blocks, MAX_SEQ)
    return schedule(cfg, blocks, MAX_SEQ, splits, min_chunk, merge_ticket_min=1, tokens=TOKENS,
                    token_groups=False, tensor_cores=True)


def _run(model, monkeypatch, pipelined: bool, edit=None):
    """run_steps's mixed steps on 3 blocks (several units an instruction, chunks of 2 to 4
    m-tiles and decode rows), the kernel with or without the pipeline (``edit``: a source
    mutation)."""
    monkeypatch.setattr(header, "attn_pipeline", lambda cfg: pipelined)
    if edit is not None:
        real = executor.kernel_source

        def mutated(*a, **k):
            src = real(*a, **k)
            assert src.count(edit[0]) == 1, "the pipeline's copy is not where this test expects"
            return src.replace(*edit)

        monkeypatch.setattr(executor, "kernel_source", mutated)
    src = executor.kernel_source(model.config, MAX_SEQ, TOKENS, 6, 8, mma=True)
    assert f"#define MK_ATTN_PIPE {int(pipelined)}\n" in src
    try:
        return run_steps(model, _program(model.config, 3), 3, MAX_SEQ, TOKENS)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("arch", ["llama3-tiny", "qwen3-gqa-tiny"])
def test_pipelined_units_leave_every_logit_bitwise(synth_model, monkeypatch, arch):
    """Every row of steps of 4 to 32 rows: logits bit for bit the same with the pipeline as
    without (late q/k too: the copies stop before the segment's own keys, which its pass
    norms into the tile), and every row written."""
    model = synth_model(arch)
    want = _run(model, monkeypatch, False)
    got = _run(model, monkeypatch, True)
    assert len(got) == len(want) == 98
    assert all(np.isfinite(v).all() for v in got.values())
    bad = [k for k in want if not np.array_equal(got[k], want[k])]
    assert not bad, f"{arch}: rows {bad[:5]} differ"


def test_negative_control_a_wrong_next_tile_changes_the_logits(synth_model, monkeypatch):
    """The pipeline copying the next unit's tile one position late: the units that take a
    copied tile compute on the wrong K/V, so rows differ (the copied tiles are used)."""
    model = synth_model("llama3-tiny")
    want = _run(model, monkeypatch, False)
    got = _run(model, monkeypatch, True,
               edit=(COPY, COPY.replace("next.base, next.cnt,", "next.base + 1, next.cnt,")))
    bad = [k for k in want if not np.array_equal(got[k], want[k])]
    assert len(bad) > len(want) // 4, bad


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
