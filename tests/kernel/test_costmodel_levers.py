"""The throughput levers of issue 17 (kernel/costmodel/levers.py; designs v8 and v8-cluster):
v7 keeps every lever off; each knob moves the prediction the way, and by about the amount, its
own arithmetic says; a knob meant for steps of many tokens leaves batch 1 alone; `plan
--design v8 --batch` prints v8's figures. Every number here is a prediction."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from helpers.kernel import program
from monokernel.cli import main
from monokernel.kernel import costmodel as cm
from monokernel.kernel.costmodel import levers
from monokernel.kernel.costmodel.tokens import StepShape, _tile_us
from monokernel.kernel.isa import Op

V7 = cm.design("v7")
LEVERS = {"fused_ffn": False, "kv_copy_rate": False, "weights_copy_rate": False,
          "input_multicast": 1, "data_flag_hops": 0}


def small():
    """A 3-layer SmolLM2 on an H200's 132 blocks: quick to schedule and to simulate, every op
    present, each block's share of the weights and the mma as on the whole model."""
    return program("smollm2-135m", 132, 300, num_layers=3)


def knobs_changed(a, b) -> set[str]:
    return {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}


def test_v7_has_every_lever_off_and_v8_is_v7_plus_named_levers():
    for knob, off in LEVERS.items():
        assert getattr(V7, knob) == off, knob
    assert knobs_changed(V7, cm.design("v8")) == {"name", "kv_copy_rate", "weights_copy_rate",
                                                  "data_flag_hops"}
    assert knobs_changed(cm.design("v8"), cm.design("v8-cluster")) == {"name",
                                                                       "input_multicast"}


def test_data_flag_hops_save_the_release_and_the_input_trip_of_every_hop():
    """Per hop on the critical path: the signal loses its release (the barrier stays) and the
    consumer's first L2 trip merges into the poll: about hops x (release + L2 latency)."""
    prog, g = small(), cm.gpu("h200")
    flags = V7.replace(name="flags", data_flag_hops=16)
    assert cm.hop_parts(g, flags)["signal"] == g.bar_sync
    a, b = cm.predict(prog, g, V7, 16), cm.predict(prog, g, flags, 16)
    expected = a.critical_hops * (g.release + g.l2_latency)
    saved = a.total_us - b.total_us
    assert 0.6 * expected < saved < 1.2 * expected, (saved, expected)


def test_data_flags_stop_at_their_token_count_and_cost_their_bytes_beyond():
    prog, g = small(), cm.gpu("h200")
    flags = V7.replace(name="flags", data_flag_hops=16)
    # above the threshold the kernel takes the counters: v7 to the bit
    for shape in (StepShape.decode(17, 16), StepShape.decode(64, 200)):
        assert cm.predict(prog, g, flags, shape=shape).total_us == \
            cm.predict(prog, g, V7, shape=shape).total_us
    assert cm.predict(prog, g, flags, shape=StepShape.decode(16, 16)).total_us < \
        cm.predict(prog, g, V7, shape=StepShape.decode(16, 16)).total_us
    # flags at any batch: every waited-on input of a mat-mul moves LL words, twice its bytes
    always = V7.replace(name="always", data_flag_hops=10 ** 6)
    shape = StepShape.decode(64, 16)
    plain, ll = (cm.Static(prog, 16, g, d, shape) for d in (V7, always))
    gate = [(b, i) for b, q in enumerate(prog.queues) for i, ins in enumerate(q)
            if ins.op == Op.RMS_GATE_UP and not ins.empty]
    bi = tuple(np.array(gate).T)
    assert np.all(ll.fields["other"][bi] > plain.fields["other"][bi])
    assert levers.flag_factor(always) == 2.0 and levers.flag_factor(V7) == 1.0


def test_kv_at_the_copy_rate_saves_the_rate_difference_on_the_kv_bytes():
    """Per layer, the busiest ATTENTION instruction's K/V bytes x (1 / gemv_bw - 1 / hbm_bw) at
    its SM's share of each rate (the program deals the (KV head, split) units once, the same
    for every row: the instructions holding the used splits carry every row's K/V)."""
    prog, g = small(), cm.gpu("h200")
    copy = V7.replace(name="copy", kv_copy_rate=True)
    batch, ctx = 64, 256
    shape = StepShape.decode(batch, ctx)
    fields = cm.Static(prog, ctx, g, V7, shape).fields
    busiest: dict[int, float] = {}
    for b, q in enumerate(prog.queues):
        for i, ins in enumerate(q):
            if ins.op == Op.ATTENTION and not ins.empty:
                busiest[ins.layer] = max(busiest.get(ins.layer, 0.0), fields["bytes"][b, i])
    share = min(prog.num_blocks, g.sms)
    expected = sum(busiest.values()) * share * (1 / g.gemv_bw - 1 / g.hbm_bw)
    assert len(busiest) == prog.config.num_layers and expected > 0
    saved = cm.predict(prog, g, V7, shape=shape).total_us - \
        cm.predict(prog, g, copy, shape=shape).total_us
    assert 0.6 * expected < saved < 1.1 * expected, (saved, expected)
    # at the copy rate's end of the GEMV band there is nothing to gain
    same = g.replace(gemv_bw=g.hbm_bw)
    assert cm.predict(prog, same, copy, shape=shape).total_us == \
        pytest.approx(cm.predict(prog, same, V7, shape=shape).total_us)


def test_weights_at_the_copy_rate_only_in_steps_of_many_tokens():
    prog, g = small(), cm.gpu("h200")
    w = V7.replace(name="w", weights_copy_rate=True)
    for ctx in (16, 200):
        assert cm.predict(prog, g, w, ctx).total_us == cm.predict(prog, g, V7, ctx).total_us
    shape = StepShape.decode(64, 16)
    assert cm.predict(prog, g, w, shape=shape).total_us < \
        cm.predict(prog, g, V7, shape=shape).total_us


def test_input_multicast_multiplies_the_input_rate_up_to_the_fill_path():
    g = cm.gpu("h200")
    share = g.l2_bw / g.sms
    assert levers.input_rate(g, V7) == share
    assert levers.input_rate(g, V7.replace(input_multicast=2)) == 2 * share  # under l2_fill
    assert levers.input_rate(g, V7.replace(input_multicast=8)) == g.l2_fill
    t1 = _tile_us(16, 2048, 64, 2, 1, g, V7)
    t2 = _tile_us(16, 2048, 64, 2, 1, g, V7.replace(input_multicast=2))
    assert t2[0] == pytest.approx(t1[0] / 2) and t2[1:] == t1[1:]
    prog = small()
    mc = V7.replace(name="mc", input_multicast=2)
    assert cm.predict(prog, g, mc, 16).total_us == cm.predict(prog, g, V7, 16).total_us
    shape = StepShape.decode(64, 16)
    assert cm.predict(prog, g, mc, shape=shape).total_us < \
        cm.predict(prog, g, V7, shape=shape).total_us


def test_fused_ffn_drops_one_wait_per_layer_and_pays_atomics():
    prog, g = small(), cm.gpu("h200")
    fused = V7.replace(name="fused", fused_ffn=True)
    a, b = cm.predict(prog, g, V7, 16), cm.predict(prog, g, fused, 16)
    assert b.critical_hops == a.critical_hops - prog.config.num_layers
    assert b.total_us < a.total_us
    down = [(bb, i) for bb, q in enumerate(prog.queues) for i, ins in enumerate(q)
            if ins.op == Op.DOWN_RESIDUAL]
    bi = tuple(np.array(down).T)
    # no wait: ready right after the start (the prefetch's issue), never a counter's hop
    assert np.all(b.ready[bi] - b.start[bi] < g.l2_latency)
    # at 64 tokens each busy DOWN adds its partial of every residual row for its token group
    st = cm.Static(prog, 16, g, fused, StepShape.decode(64, 16))
    busy = np.array([not prog.queues[bb][i].empty for bb, i in down])
    c_groups = st.tiles["DOWN_RESIDUAL"][0]
    floor = levers.atomic_us(prog.config.hidden_size, 64 / c_groups, g)
    assert np.all(st.fields["other"][bi][busy] >= floor)


def test_v8_predicts_no_worse_than_v7_and_the_cluster_no_worse_than_v8():
    prog, g = small(), cm.gpu("h200")
    for shape in (StepShape.decode(1, 16), StepShape.decode(8, 200), StepShape.decode(64, 16),
                  StepShape.chunk(0, 256, True)):
        t = [cm.predict(prog, g, cm.design(n), shape=shape).total_us
             for n in ("v7", "v8", "v8-cluster")]
        assert t[2] <= t[1] <= t[0], (shape.tokens, t)


def test_plan_batch_prints_the_named_lever_design(capsys):
    argv = ["plan", "--shape", "smollm2-135m", "--blocks", "32", "--context", "16",
            "--predict", "h200", "--batch", "64", "--design", "v8-cluster"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "design v8-cluster (not built yet), 64 sequences at context 16" in out
    m = re.search(r"range: low (\d+) / nominal (\d+) / high (\d+) tokens/s", out)
    low, nominal, high = (int(x) for x in m.groups())
    assert low < nominal < high
    last = out.strip().splitlines()[-1]
    tps = float(re.match(r"predicted on h200: \d+ us/step, (\d+) tokens/s at batch 64$",
                         last).group(1))
    assert tps == nominal
    expected = cm.predict(program("smollm2-135m", 32, 2048), "h200", cm.design("v8-cluster"),
                          shape=StepShape.decode(64, 16)).tokens_per_s
    assert tps == pytest.approx(expected, abs=1)


def test_no_lever_beats_the_bytes_a_step_moves():
    """Weights once and every sequence's K/V once at the copy rate: every lever on at once
    (multicast 8, past the fill path) still predicts above that floor."""
    prog, g = small(), cm.gpu("h200")
    c = prog.config
    every = cm.design("v8-cluster").replace(name="every", input_multicast=8, fused_ffn=True)
    for batch, ctx in ((64, 256), (16, 256), (64, 16)):
        p = cm.predict(prog, g, every, shape=StepShape.decode(batch, ctx))
        kv = batch * (ctx + 1) * c.num_layers * c.kv_dim * 2 * 2
        assert p.step_us > (c.weight_bytes_per_token() + kv) / g.hbm_bw, (batch, ctx)
