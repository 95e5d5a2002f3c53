"""Logprobs and "one seed, one text" on every CPU backend, on the tiny synthetic model.

- The NumPy backend's logprobs and prompt_logprobs equal a from-scratch log-softmax of a full
  forward of the sequence (no KV cache) within float32 rounding.
- The emulator (the CUDA kernel on a CPU) gives the same tokens and the same logprobs within
  tolerance: it reads the logits back and samples on the host from the kernel's Gumbel stream.
- The same seed gives the same tokens whether the kernel samples (the LM head's ticket), the
  host samples from the kernel's logits (logprobs asked for), or the NumPy backend samples.
"""

from __future__ import annotations

import numpy as np
import pytest

from monokernel import LLM, SamplingParams
from monokernel.kernel.base import DeviceSample
from monokernel.model.reference import ReferenceModel

from helpers.kernel import MAX_SEQ  # the emulator build of this shape is shared
HOT = 10.0  # the tiny model is very peaked at T=1; T=10 makes seeds matter
PROMPT = [5, 6, 7, 300, 41]
# Logprob tolerances are relative to the magnitude of the logits they come from. The tiny model
# is very peaked (|logit| up to ~110) and its float32 residual stream cancels large terms, so two
# correct forwards that sum the same float32 products in another order (one token at a time
# through the KV cache, or the whole sequence at once; BLAS and the kernel each pick their own
# blocking) differ in proportion to the logits' magnitude: measured up to 7.8e-5 x max|logit|
# between the cached and the from-scratch forward (numpy 2.4.6, OpenBLAS), 3.2e-4 on a logprob
# of -50. A wrong position, token or temperature moves a logprob by whole units.
LOGIT_RTOL = 3e-4


def logprob_tol(*values) -> float:
    """Absolute tolerance for logprobs taken from logits of this magnitude (see LOGIT_RTOL)."""
    return LOGIT_RTOL * max(1.0, max(float(np.max(np.abs(v))) for v in values))


def reference_log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True))
                                                 .sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def np_llm(synth_dir):
    return LLM(synth_dir("tiny"), backend="numpy", max_seq_len=MAX_SEQ, progress=False)


@pytest.fixture(scope="module")
def emu_llm(synth_dir):
    return LLM(synth_dir("tiny"), backend="emulator", blocks=2, max_seq_len=MAX_SEQ,
               progress=False)


def full_forward_logprobs(llm: LLM, seq: list[int]) -> np.ndarray:
    ref = ReferenceModel(llm.config, llm.model.weights, MAX_SEQ)
    return reference_log_softmax(ref.forward(seq, 0))


def test_logprobs_are_the_models_log_softmax(np_llm):
    p = SamplingParams(max_tokens=6, temperature=HOT, seed=4, logprobs=5, prompt_logprobs=3,
                       ignore_eos=True)
    c = np_llm.generate(PROMPT, p)
    seq = PROMPT + c.token_ids
    want = full_forward_logprobs(np_llm, seq)  # want[i]: distribution of token i + 1
    assert len(c.logprobs) == 6 and len(set(c.token_ids)) > 2
    for k, tl in enumerate(c.logprobs):
        row = want[len(PROMPT) - 1 + k]
        assert tl.token_id == c.token_ids[k]
        assert tl.token == np_llm.detokenize([tl.token_id])
        np.testing.assert_allclose(tl.logprob, row[tl.token_id], rtol=0, atol=logprob_tol(row))
        assert len(tl.top) == 5
        assert [t[0] for t in tl.top] == list(np.argsort(-row, kind="stable")[:5])
        np.testing.assert_allclose([t[2] for t in tl.top], np.sort(row)[::-1][:5], rtol=0,
                                   atol=logprob_tol(row))
        assert all(t[1] == np_llm.detokenize([t[0]]) for t in tl.top)
    assert c.outputs[0].cumulative_logprob == pytest.approx(sum(t.logprob for t in c.logprobs))
    # prompt logprobs: None for the first token, then the prompt token's own logprob
    assert len(c.prompt_logprobs) == len(PROMPT) and c.prompt_logprobs[0] is None
    for i in range(1, len(PROMPT)):
        tl = c.prompt_logprobs[i]
        assert tl.token_id == PROMPT[i]
        np.testing.assert_allclose(tl.logprob, want[i - 1][PROMPT[i]], rtol=0,
                                   atol=logprob_tol(want[i - 1]))
        assert [t[0] for t in tl.top] == list(np.argsort(-want[i - 1], kind="stable")[:3])
    # logprobs=0: the sampled token's logprob only
    c0 = np_llm.generate(PROMPT, p.replace(logprobs=0, prompt_logprobs=None))
    assert c0.token_ids == c.token_ids and c0.prompt_logprobs is None
    assert [t.top for t in c0.logprobs] == [[]] * 6
    # equal bit for bit: the prefill for prompt logprobs makes the calls of a plain prefill,
    # and the second run reuses only K/V that a fresh prefill computes alike
    assert [t.logprob for t in c0.logprobs] == [t.logprob for t in c.logprobs]
    # no logprobs asked: none given
    assert np_llm.generate(PROMPT, p.replace(logprobs=None, prompt_logprobs=None)).logprobs \
        is None


def spy_device_samples(monkeypatch, llm):
    """What each launch was asked to sample with: one entry per ``step`` (None: the host
    samples) and per ``run_steps`` (many steps in one launch: the kernel samples)."""
    ex = llm.engine.executor
    real_step, real_run = ex.step, ex.run_steps
    seen = []

    def step(token, pos, sample=None):
        seen.append(sample)
        return real_step(token, pos, sample)

    def run_steps(tokens, start_pos, sample, **kw):
        seen.append(sample)
        return real_run(tokens, start_pos, sample, **kw)

    monkeypatch.setattr(ex, "step", step)
    monkeypatch.setattr(ex, "run_steps", run_steps)
    return seen


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=6, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=HOT, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=HOT, seed=2**31 + 9, ignore_eos=True),
], ids=["greedy", "seed7", "seed-past-31-bits"])
def test_one_seed_one_text_on_every_sampler(np_llm, emu_llm, monkeypatch, params):
    assert params.kernel_samplable
    host_np = np_llm.generate(PROMPT, params)
    seen = spy_device_samples(monkeypatch, emu_llm)
    device = emu_llm.generate(PROMPT, params)
    assert seen and all(isinstance(s, DeviceSample) for s in seen)  # the kernel sampled
    assert len(seen) == 1 and device.launches == 1  # the prompt and 6 tokens: one launch
    seen.clear()
    host_emu = emu_llm.generate(PROMPT, params.replace(logprobs=3))
    assert seen and all(s is None for s in seen)  # the host sampled from the kernel's logits
    assert device.token_ids == host_emu.token_ids == host_np.token_ids
    if not params.greedy:
        assert len(set(device.token_ids)) > 2


def test_host_only_samplers_agree_across_backends(np_llm, emu_llm):
    p = SamplingParams(max_tokens=5, temperature=HOT, seed=3, top_k=40, top_p=0.9,
                       presence_penalty=0.5, ignore_eos=True)
    assert not p.kernel_samplable
    assert emu_llm.generate(PROMPT, p).token_ids == np_llm.generate(PROMPT, p).token_ids


def test_logprobs_equal_across_backends(np_llm, emu_llm):
    p = SamplingParams(max_tokens=4, temperature=HOT, seed=5, logprobs=4, prompt_logprobs=2,
                       ignore_eos=True)
    a, b = np_llm.generate(PROMPT, p), emu_llm.generate(PROMPT, p)
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs + a.prompt_logprobs[1:], b.logprobs + b.prompt_logprobs[1:]):
        assert x.token_id == y.token_id
        # kernel and reference agree to float32 rounding in the logits, relative to their
        # magnitude (the row's is at least that of its lowest top logprob)
        tol = logprob_tol(x.logprob, [t[2] for t in x.top])
        np.testing.assert_allclose(x.logprob, y.logprob, rtol=0, atol=tol)
        assert [t[0] for t in x.top] == [t[0] for t in y.top]
        np.testing.assert_allclose([t[2] for t in x.top], [t[2] for t in y.top], rtol=0,
                                   atol=tol)
    assert b.prompt_logprobs[0] is None


def test_stream_deltas_carry_the_logprobs(emu_llm):
    p = SamplingParams(max_tokens=4, logprobs=1, ignore_eos=True)
    s = emu_llm.stream(PROMPT, p)
    deltas = list(s.deltas())
    got = [lp for d in deltas for lp in d.logprobs]
    assert got == s.completion.logprobs and len(got) == 4
    assert [g.token_id for g in got] == s.completion.token_ids
    assert all(g.top[0][0] == g.token_id for g in got)  # greedy: the top-1 is the token


@pytest.mark.gpu  # conftest skips it without a device, and fails it with MONOKERNEL_REQUIRE_GPU=1
def test_one_seed_one_text_on_the_gpu(np_llm, synth_dir):
    """The GPU's logf may differ from NumPy's log in the last bit; the tokens must not."""
    gpu = LLM(synth_dir("tiny"), backend="cuda", max_seq_len=MAX_SEQ, progress=False)
    for seed in (1, 7, 2**31 + 9):
        p = SamplingParams(max_tokens=8, temperature=HOT, seed=seed, ignore_eos=True)
        want = np_llm.generate(PROMPT, p)
        assert gpu.generate(PROMPT, p).token_ids == want.token_ids
        got = gpu.generate(PROMPT, p.replace(logprobs=2))
        assert got.token_ids == want.token_ids
        ref = np_llm.generate(PROMPT, p.replace(logprobs=2))
        want_lp = [t.logprob for t in ref.logprobs]
        np.testing.assert_allclose([t.logprob for t in got.logprobs], want_lp, rtol=0,
                                   atol=logprob_tol(want_lp, [t[2] for r in ref.logprobs
                                                              for t in r.top]))


def test_vllm_shaped_logprobs(np_llm, monkeypatch):
    """``output.logprobs[i][token_id].logprob``, as vLLM users index them (a dict of token id
    -> Logprob(logprob, rank, decoded_token) per position), beside the attributes. Checked
    against the very distributions the engine computed (a spy on its log_softmax)."""
    from monokernel import Logprob, runtime

    rows, real = [], runtime.log_softmax

    def spy(x):
        out = real(x)
        rows.append(np.array(out))
        return out

    monkeypatch.setattr(runtime, "log_softmax", spy)
    p = SamplingParams(max_tokens=5, temperature=HOT, seed=4, logprobs=3, ignore_eos=True)
    out = np_llm.generate([PROMPT], p)[0].outputs[0]
    assert len(rows) == len(out.logprobs) == 5
    for tok, entry, row in zip(out.token_ids, out.logprobs, rows):
        lp = entry[tok]
        assert isinstance(lp, Logprob) and lp.logprob == entry.logprob  # the attribute still works
        assert lp.rank == 1 + int(np.sum(row > row[tok])) == entry.rank  # in the whole vocabulary
        assert lp.decoded_token == np_llm.detokenize([tok]) == entry.token
        best = [int(t) for t in np.argsort(-row, kind="stable")[:3]]
        assert list(entry) == list(dict.fromkeys([tok] + best)) and len(entry) == len(list(entry))
        for r, t in enumerate(best, start=1):
            assert t in entry and entry[t] == Logprob(float(row[t]), r, np_llm.detokenize([t]))
        assert {k: v.logprob for k, v in entry.items()}[tok] == entry.logprob
    assert any(e.rank > 3 for e in out.logprobs)  # HOT samples outside the top 3 too
    missing = next(t for t in range(np_llm.config.vocab_size) if t not in out.logprobs[0])
    with pytest.raises(KeyError, match="nor among its top 3"):
        out.logprobs[0][missing]
    # prompt logprobs too: None first, then a dict per prompt token
    rows.clear()
    plp = np_llm.generate([PROMPT], p.replace(prompt_logprobs=2))[0].prompt_logprobs
    first = rows[0][0]  # the prompt's rows come in one call, before the sampled tokens'
    assert plp[0] is None and plp[1][PROMPT[1]].logprob == plp[1].logprob
    assert plp[1][PROMPT[1]].rank == 1 + int(np.sum(first > first[PROMPT[1]]))
