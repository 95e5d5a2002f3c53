"""The mat-muls on tensor cores (issue 17, slice 6a: backend option ``tensor_cores``,
megakernel.cu MK_MMA) on the CPU emulator, whose mma is the warp-level twin of
kernel/emulator/cuda_cpu_mma.h.

Oracles: the NumPy reference in its ``bf16_inputs`` mode (every matrix product's input rounded
to bf16, as the kernel feeds mma) within a tolerance; the same sequence run alone on the same
kernel, bit for bit (batch invariance); the Engine's solo texts.

The tolerance. The kernel and the reference compute a mat-mul's fp32 input (a normed residual,
attention's output, the FFN's h) in different orders, so their last bits differ, and where an
element lies next to a bf16 rounding boundary the two round it to neighbouring bf16 values:
that product term moves by 2^-8 of itself. Attention's softmax on the synthetic models
amplifies such flips (measured: K rows of a later layer differing by one bf16 ulp in a few
elements, the logits of the rows after them by up to 1.7e-3 of their largest logit; rows whose
inputs had no flip agree to ~1e-5, the fp32 accumulation's order). So every row is held to
4e-3 of its largest logit and most rows to 1e-4, where the fp32 reference (the negative
control: a kernel that did not round its inputs) is 2e-3 to 5e-3 away on most rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.batch import PAGE, prompt_of, round_robin
from monokernel.errors import KernelError
from monokernel.kernel.base import DeviceSample, StepTable
from monokernel.kernel.executor import KernelExecutor
from monokernel.kernel.schedule import MAX_STEP_TOKENS
from monokernel.model.reference import ReferenceModel
from monokernel.runtime import Engine
from monokernel.sampling import Sampler, SamplingParams

MAX_SEQ = 48
ROW_TOL = 4e-3    # every row, of its largest logit (see the module's docstring)
CLOSE_TOL = 1e-4  # most rows: those no bf16 flip reached
HOT = 25.0        # the synthetic models' draws vary from position to position at this temperature


def tc_executor(model, slots: int, blocks: int = 3, **kw) -> KernelExecutor:
    ex = KernelExecutor(model, MAX_SEQ, blocks=blocks, slots=slots, page_size=PAGE,
                        tensor_cores=True, **kw)
    ex.poison()
    return ex


def prefill_all(ex: KernelExecutor, prompts: list[list[int]], draws=None):
    """One step of every prompt's rows, each slot on its own pages: the table's logits."""
    free = list(ex.add_pages(ex.slots * ex.slot_pages))
    pages = {s: [free.pop(0) for _ in range(-(-len(p) // PAGE))] for s, p in enumerate(prompts)}
    rows = [(t, s, pos, True, True) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
    return ex.run_table(StepTable.of(rows, pages, draws or {}))


def row_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)


# late q/k with GQA (Qwen3), plain Llama, q/k/v bias (Qwen2), tied embeddings (the LM head is
# the embedding table)
ARCHS = ["qwen3-gqa-tiny", "llama3-tiny", "qwen2-tiny", "tiny"]


# (arch, blocks, attention splits): one split (every row finished by its unit); splits fixed
# by absolute position (C = MAX_SEQ / splits positions each): 6 of 8 (rows 0-7 of one split,
# 8-10 of two, merged by ticket in the same step; qwen3-gqa-tiny's 2 KV groups over 6
# blocks), 12 of 4 (up to 3 splits) and 24 of 2 (up to 6: the ticket's one pass with 1 and 2
# lanes per output chunk)
MIXED_CASES = [(a, 3, None) for a in ARCHS] + [
    ("qwen3-gqa-tiny", 6, 6), ("llama3-tiny", 3, 12), ("llama3-tiny", 3, 24)]


@pytest.mark.parametrize("arch,blocks,splits", MIXED_CASES,
                         ids=ARCHS + ["qwen3-gqa-tiny-6-splits", "llama3-tiny-12-splits",
                                      "llama3-tiny-24-splits"])
def test_a_mixed_step_agrees_with_the_bf16_reference(synth_model, arch, blocks, splits):
    """Three prompts of 11, 5 and 3 rows in one step of 19 rows (3 token groups of 8, the
    last one partial; the third sequence's rows straddle two groups): every row's logits
    against the bf16-inputs reference run on its sequence alone."""
    model = synth_model(arch)
    ex = tc_executor(model, slots=3, step_tokens=24, blocks=blocks, attn_splits=splits)
    if splits:
        assert ex.program.attn_min_chunk == MAX_SEQ // splits  # fixed by absolute position
    prompts = [prompt_of(model, 11, 1), prompt_of(model, 5, 2), prompt_of(model, 3, 3)]
    got = prefill_all(ex, prompts).logits
    assert np.isfinite(got).all()
    want = {bf: np.concatenate([ReferenceModel(model.config, model.weights, MAX_SEQ,
                                               bf16_inputs=bf).forward(p, 0) for p in prompts])
            for bf in (True, False)}
    err = row_errors(got, want[True])
    assert err.max() <= ROW_TOL, f"{arch}: worst row {err.argmax()}: {err.max():.3g}"
    assert np.mean(err <= CLOSE_TOL) >= 0.6, f"{arch}: rows within {CLOSE_TOL}: {err}"
    # the negative control: the fp32 reference is not what this kernel computes
    fp32 = row_errors(got, want[False])
    assert np.mean(fp32 <= CLOSE_TOL) < 0.3, f"{arch}: the fp32 reference is as close: {fp32}"


def test_a_step_of_the_most_tokens_agrees_with_the_bf16_reference(synth_model):
    """One step of MAX_STEP_TOKENS rows (prompts of 48, 48 and 32: two fill the cache to its
    last slot), the mat-muls in the token groups chosen for 128 tokens: the same judge."""
    model = synth_model("llama3-tiny")
    ex = tc_executor(model, slots=3, step_tokens=MAX_STEP_TOKENS)
    assert ex.program.tokens == MAX_STEP_TOKENS == 128
    assert any(i.group is not None for q in ex.program.queues for i in q)
    prompts = [prompt_of(model, n, seed) for n, seed in ((48, 4), (48, 5), (32, 6))]
    got = prefill_all(ex, prompts).logits
    assert got.shape[0] == MAX_STEP_TOKENS and np.isfinite(got).all()
    want = np.concatenate([ReferenceModel(model.config, model.weights, MAX_SEQ,
                                          bf16_inputs=True).forward(p, 0) for p in prompts])
    err = row_errors(got, want)
    assert err.max() <= ROW_TOL, f"worst row {err.argmax()}: {err.max():.3g}"
    assert np.mean(err <= CLOSE_TOL) >= 0.6, f"rows within {CLOSE_TOL}: {err}"


def test_o_proj_and_down_read_bf16_inputs_their_producers_store(synth_model):
    """A tensor-core build stores attn and ffn_h as bf16 (isa.BF16_INPUTS: the precision
    block_mma rounds them to, half the bytes O_PROJ and DOWN read): buffers of 2 bytes an
    element; after a step of 19 rows (rows of one split finished by their unit and rows of
    up to three merged by ticket) every element of the step's rows is written and none of the
    rows past it (the poison, bf16 NaN, stays). The numbers themselves are held by the mixed
    steps above against the reference."""
    from monokernel.kernel.executor import BF16_INPUTS

    model = synth_model("llama3-tiny")
    ex = tc_executor(model, slots=3, step_tokens=24, attn_splits=12)
    c = model.config
    width = {"attn": c.q_dim, "ffn_h": c.intermediate_size}
    assert set(BF16_INPUTS) == set(width)
    for name, n in width.items():
        assert ex.buffers[name].dtype == np.uint16 and ex.buffers[name].size == 24 * n, name
        assert np.isnan(ex.read_buffer(name)).all(), f"{name} was not poisoned"
    prompts = [prompt_of(model, 11, 1), prompt_of(model, 5, 2), prompt_of(model, 3, 3)]
    assert np.isfinite(prefill_all(ex, prompts).logits).all()
    for name, n in width.items():
        got = ex.read_buffer(name).reshape(24, n)
        assert np.isfinite(got[:19]).all(), f"{name}: a step's element was not written"
        assert np.isnan(got[19:]).all(), f"{name}: a row past the step's was written"
    # a build without tensor cores keeps them fp32
    plain = KernelExecutor(model, MAX_SEQ, blocks=3, slots=3, page_size=PAGE, step_tokens=24,
                           merge_ticket_min=1)
    assert all(plain.buffers[name].dtype == np.float32 for name in width)


def test_awkward_sizes_agree_with_the_bf16_reference(tmp_path):
    """Input widths that are not whole 32-column chunks (hidden 104, FFN 168: a lane's last
    8 columns past the end), a q width other than the hidden size (96), a vocabulary of 1003
    (the LM head's last row group partial): the same judge as above."""
    import dataclasses

    from monokernel.model.config import ModelConfig
    from monokernel.model.loader import load_model
    from monokernel.model.synth import write_synthetic

    cfg = dataclasses.replace(ModelConfig.from_name("llama3-tiny"), hidden_size=104,
                              intermediate_size=168, vocab_size=1003)
    model = load_model(write_synthetic(cfg, tmp_path / "awkward", seed=0), progress=False)
    ex = tc_executor(model, slots=3, step_tokens=24)
    prompts = [prompt_of(model, 11, 1), prompt_of(model, 5, 2), prompt_of(model, 3, 3)]
    got = prefill_all(ex, prompts).logits
    want = np.concatenate([ReferenceModel(model.config, model.weights, MAX_SEQ,
                                          bf16_inputs=True).forward(p, 0) for p in prompts])
    err = row_errors(got, want)
    assert err.max() <= ROW_TOL, f"worst row {err.argmax()}: {err.max():.3g}"
    assert np.mean(err <= CLOSE_TOL) >= 0.6, err


def test_the_device_draws_what_the_host_sampler_would(synth_model):
    """The LM head on tensor cores keeps each row's best score over its tile (a thread per row
    of a token group): slot 0 greedy, slot 1 at a high temperature, all 16 prompt rows drawn
    (two token groups); each draw is the host sampler's from that row's logits, read back from
    the same step run with the host sampling."""
    model = synth_model("llama3-tiny")
    prompts = [prompt_of(model, 9, 5), prompt_of(model, 7, 6)]
    draws = {0: DeviceSample(0.0, 0), 1: DeviceSample(HOT, 11)}
    ex = tc_executor(model, slots=2, step_tokens=16)
    drawn = prefill_all(ex, prompts, draws).tokens
    host = prefill_all(tc_executor(model, slots=2, step_tokens=16), prompts).logits
    rows = [(s, pos) for s, p in enumerate(prompts) for pos in range(len(p))]
    want = [Sampler(SamplingParams(temperature=draws[s].temperature, seed=draws[s].seed),
                    draws[s].seed)(lg, [0] * (pos + 1)) for (s, pos), lg in zip(rows, host)]
    assert drawn.tolist() == want
    assert len(set(want[9:])) > 1  # the hot slot's draws are not all one token


def test_the_engine_batches_on_tensor_cores(synth_model):
    """``Engine`` on a kernel of 2 slots with tensor cores: three seeded requests (the third
    joining when a slot frees) each get the text they get alone on the same kernel, drawn on
    the device, many steps a launch."""
    model = synth_model("llama3-tiny")
    ids = [prompt_of(model, n, 40 + n) for n in (5, 12, 3)]
    params = [SamplingParams(max_new_tokens=m, temperature=0.8, seed=7 + m, ignore_eos=True)
              for m in (6, 3, 5)]
    ex = KernelExecutor(model, MAX_SEQ, blocks=2, slots=2, step_tokens=4, page_size=PAGE,
                        tensor_cores=True)
    eng = Engine(ex, max_num_seqs=8)
    solo = [[s.token for s in eng.generate(p, sp)] for p, sp in zip(ids, params)]
    got = round_robin(iter(eng.generate(p, sp)) for p, sp in zip(ids, params))
    assert got == solo
    assert ex.logits_rows_read == 0
    assert ex.steps_run > ex.launches


def test_the_options_are_checked(synth_model):
    """As backend options, before a model loads (ParameterError); on the executor itself,
    KernelError, and a schedule that cannot merge every step's attention by ticket is named."""
    from monokernel.errors import ParameterError
    from monokernel.runtime import backend_options

    for backend, given in (("emulator", {"tensor_cores": True}),
                           ("emulator-multi", {"tensor_cores": True, "slots": 2})):
        with pytest.raises(ParameterError, match="tensor_cores=True is for the persistent"):
            backend_options(backend, given)
    assert backend_options("emulator", {"tensor_cores": True, "slots": 2}).tensor_cores
    model = synth_model("llama3-tiny")
    with pytest.raises(KernelError, match="slots >= 2"):
        KernelExecutor(model, MAX_SEQ, blocks=2, tensor_cores=True)
    with pytest.raises(KernelError, match="multi=True"):
        KernelExecutor(model, MAX_SEQ, blocks=2, slots=2, multi=True, tensor_cores=True)
    with pytest.raises(KernelError, match="merge_ticket_min=2"):
        KernelExecutor(model, MAX_SEQ, blocks=2, slots=2, merge_ticket_min=2,
                       tensor_cores=True)
    # 2 KV heads x 4 splits over 3 blocks: the middle block holds units of both KV groups
    with pytest.raises(KernelError, match="one KV group"):
        KernelExecutor(synth_model("qwen3-gqa-tiny"), MAX_SEQ, blocks=3, slots=2,
                       attn_splits=4, tensor_cores=True)
