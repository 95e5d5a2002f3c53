"""SamplingParams (aliases, validation, generation_config defaults) and the host Sampler on
hand-built logits: top-k, top-p, repetition penalty with HF semantics, non-finite logits."""

from __future__ import annotations

import numpy as np
import pytest

from monokernel.errors import NumericalError, ParameterError
from monokernel.sampling import (Sampler, SamplingParams, gumbel_noise, log_softmax,
                                 top_logprobs)


def final_probs(params: SamplingParams, logits, history=()) -> np.ndarray:
    return Sampler(params).distribution(np.asarray(logits, np.float32), list(history))


def logits_for(probs) -> np.ndarray:
    return np.log(np.asarray(probs, np.float64)).astype(np.float32)


# ==== top-p =====================================================================================

# token ids in shuffled order so that "the most likely" is not simply "the first"
PROBS = np.array([0.05, 0.30, 0.01, 0.50, 0.10, 0.04])  # sorted: 3, 1, 4, 0, 5, 2


@pytest.mark.parametrize("top_p, kept", [
    (0.3, {3}),            # the top token alone reaches 0.3
    (0.7, {3, 1}),         # 0.5 < 0.7 <= 0.8
    (0.85, {3, 1, 4}),     # 0.8 < 0.85 <= 0.9
    (0.93, {3, 1, 4, 0}),  # 0.9 < 0.93 <= 0.95
    (0.999, {3, 1, 4, 0, 5, 2}),
])
def test_top_p_keeps_smallest_set_reaching_p(top_p, kept):
    p = final_probs(SamplingParams(temperature=1.0, top_p=top_p), logits_for(PROBS))
    assert set(np.flatnonzero(p > 0)) == kept
    # the kept tokens are renormalized in proportion
    idx = sorted(kept)
    np.testing.assert_allclose(p[idx], PROBS[idx] / PROBS[idx].sum(), rtol=1e-5)


def test_top_p_applies_after_temperature():
    # at temperature 0.5 the distribution sharpens: 0.5^2 : 0.3^2 ... the top token alone
    # holds 0.5^2 / sum(p^2) = 0.71, so top_p 0.6 keeps only it (at T=1 it would keep two)
    p = final_probs(SamplingParams(temperature=0.5, top_p=0.6), logits_for(PROBS))
    assert set(np.flatnonzero(p > 0)) == {3}
    p = final_probs(SamplingParams(temperature=1.0, top_p=0.6), logits_for(PROBS))
    assert set(np.flatnonzero(p > 0)) == {3, 1}


def test_top_k():
    p = final_probs(SamplingParams(temperature=1.0, top_k=3), logits_for(PROBS))
    assert set(np.flatnonzero(p > 0)) == {3, 1, 4}
    np.testing.assert_allclose(p[[1, 3, 4]], PROBS[[1, 3, 4]] / 0.9, rtol=1e-5)


def test_top_k_then_top_p():
    # top_k 4 keeps {3, 1, 4, 0} (mass 0.95, renormalized 0.526, 0.316, 0.105, 0.053); top_p
    # 0.8 then needs two of them (0.526 + 0.316 = 0.842 >= 0.8), as transformers renormalizes
    p = final_probs(SamplingParams(temperature=1.0, top_k=4, top_p=0.8), logits_for(PROBS))
    assert set(np.flatnonzero(p > 0)) == {3, 1}


def test_sampled_frequencies_follow_the_distribution():
    # one draw per position: the noise is keyed by (seed, position)
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.85, seed=1))
    lg = logits_for(PROBS)
    draws = np.bincount([s(lg, [0] * k) for k in range(1, 3001)], minlength=len(PROBS))
    assert draws[[0, 2, 5]].sum() == 0
    np.testing.assert_allclose(draws[[3, 1, 4]] / 3000, PROBS[[3, 1, 4]] / 0.9, atol=0.04)


# ==== repetition penalty ========================================================================

def test_repetition_penalty_divides_positive_logits():
    lg = np.array([2.0, 1.9, -1.0, 0.5], np.float32)
    assert Sampler(SamplingParams())(lg, [0]) == 0
    # 2.0 / 1.2 = 1.67 < 1.9: the repeated token loses its lead
    assert Sampler(SamplingParams(repetition_penalty=1.2))(lg, [0]) == 1


def test_repetition_penalty_multiplies_negative_logits():
    lg = np.array([-1.0, -1.1, -5.0], np.float32)
    # HF: a negative score is multiplied (-1.2 < -1.1). Dividing it (-0.83) would keep token 0.
    assert Sampler(SamplingParams(repetition_penalty=1.2))(lg, [0]) == 1
    # a penalty below 1 rewards repetition: -1.1 * 0.5 = -0.55 > -1.0
    assert Sampler(SamplingParams(repetition_penalty=0.5))(lg, [1]) == 1


def test_repetition_penalty_counts_each_token_once():
    lg = np.array([3.0, 2.4, 0.0], np.float32)
    # 3.0 / 1.2 = 2.5 > 2.4 once; applying it per occurrence (2.08) would flip the choice
    assert Sampler(SamplingParams(repetition_penalty=1.2))(lg, [0, 0, 0]) == 0


def test_repetition_penalty_matches_transformers():
    torch = pytest.importorskip("torch")
    gen = pytest.importorskip("transformers.generation.logits_process")

    rng = np.random.default_rng(7)
    lg = rng.standard_normal(111).astype(np.float32) * 3
    hist = [5, 17, 17, 99, 110, 0, 42]
    want = gen.RepetitionPenaltyLogitsProcessor(1.3)(
        torch.tensor([hist]), torch.tensor(lg[None].copy()))[0].numpy()
    p = final_probs(SamplingParams(temperature=1.0, repetition_penalty=1.3), lg, hist)
    want_p = np.exp(want - want.max())
    np.testing.assert_allclose(p, want_p / want_p.sum(), rtol=1e-5)


# ==== greedy, seeds, non-finite logits ==========================================================

def test_greedy_ignores_seed_and_top_k():
    lg = np.random.default_rng(0).standard_normal(500).astype(np.float32)
    best = int(np.argmax(lg))
    for params in (SamplingParams(), SamplingParams(seed=3, top_k=50),
                   SamplingParams(temperature=0.7, top_k=1, seed=9)):
        assert Sampler(params)(lg, []) == best


def test_seed_reproducible_and_seeds_differ():
    lg = np.zeros(989, np.float32) + np.linspace(0, 1, 989, dtype=np.float32)

    def draw(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [s(lg, [0] * k) for k in range(1, 17)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_logits_raise(bad):
    lg = np.ones(500, np.float32)
    lg[111] = bad
    for params in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)):
        with pytest.raises(NumericalError, match="111"):
            Sampler(params)(lg, [])


# ==== SamplingParams ============================================================================

def test_defaults():
    p = SamplingParams()
    assert p.greedy and p.kernel_samplable and p.max_new_tokens == 256 and p.stop == ()


def test_aliases():
    assert SamplingParams(max_tokens=7).max_new_tokens == 7
    assert SamplingParams(max_tokens=7, max_new_tokens=7).max_new_tokens == 7
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=7, max_new_tokens=8)
    assert SamplingParams(temperature=0.9, do_sample=False).greedy
    assert SamplingParams(do_sample=True).temperature == 1.0
    assert SamplingParams(do_sample=True, temperature=0.3).temperature == 0.3
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[4, 5]).stop_token_ids == (4, 5)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_tokens": -1}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"max_tokens": 3.0}, "max_new_tokens"),
    ({"max_tokens": True}, "max_new_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"seed": 1.5}, "seed"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"n": 0}, "n"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
    ({"stop": [3]}, "stop"),
    ({"stop_token_ids": ["x"]}, "stop_token_ids"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": ["ok", ""]}, "stop"),
])
def test_validation(kwargs, field):
    with pytest.raises(ParameterError, match=field) as e:
        SamplingParams(**kwargs)
    assert isinstance(e.value, ValueError)  # what Python callers expect
    v = next(iter(kwargs.values()))
    shown = v[-1] if isinstance(v, list) else v
    assert repr(shown) in str(e.value) or str(shown) in str(e.value)  # the value is named


FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty")


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_refused_in_every_float(name, bad):
    with pytest.raises(ParameterError, match=f"{name} must be a finite number, got "
                                             f"{bad}".replace("-", "-?")):
        SamplingParams(**{name: bad})


def test_vllm_conventions():
    assert SamplingParams(top_k=-1).top_k == 0 == SamplingParams(top_k=0).top_k
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=7).seed == 7
    assert SamplingParams(temperature=1e-9).greedy  # below 1e-5 is greedy, as in vLLM
    assert not SamplingParams(temperature=1e-4).greedy
    assert SamplingParams(seed=np.int64(3), max_tokens=np.int32(4)).max_new_tokens == 4


@pytest.mark.parametrize("change", [
    {"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}, {"repetition_penalty": 1.1},
    {"presence_penalty": 0.5}, {"frequency_penalty": -0.5}, {"min_tokens": 2}])
def test_kernel_samplable_only_without_host_steps(change):
    base = SamplingParams(temperature=0.7, seed=1, logprobs=3, stop="x", n=2, max_tokens=9)
    assert base.kernel_samplable
    assert not base.replace(**change).kernel_samplable


def test_from_dict():
    p = SamplingParams.from_dict({"max_tokens": 5, "temperature": 0.5, "top_k": -1})
    assert (p.max_new_tokens, p.temperature, p.top_k) == (5, 0.5, 0)
    with pytest.raises(ParameterError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ParameterError, match="list"):
        SamplingParams.from_dict([("temperature", 0.5)])


def test_replace_revalidates():
    p = SamplingParams(temperature=0.5, stop="x", seed=3)
    q = p.replace(top_k=4)
    assert (q.temperature, q.stop, q.seed, q.top_k) == (0.5, ("x",), 3, 4)
    with pytest.raises(ValueError, match="top_p"):
        p.replace(top_p=2.0)


def test_from_generation_config():
    # transformers: without do_sample the temperature is ignored (greedy)
    p = SamplingParams.from_generation_config({"temperature": 0.6, "top_p": 0.9})
    assert p.greedy and p.top_p == 0.9
    p = SamplingParams.from_generation_config(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "max_new_tokens": 33})
    assert (p.temperature, p.top_k, p.max_new_tokens) == (0.6, 20, 33)
    p = SamplingParams.from_generation_config({"do_sample": True, "temperature": 0.6},
                                              temperature=0.0)
    assert p.greedy


# ==== Gumbel stream, penalties, min-p, min_tokens, logprobs =====================================

def test_host_draw_is_the_kernels_gumbel_max():
    """The kernel scores logit / T + gumbel(seed, pos, token) in float32 and takes the first
    maximum; the host sampler must pick the same token for every (seed, position)."""
    rng = np.random.default_rng(3)
    lg = (rng.standard_normal(989) * 2).astype(np.float32)
    for seed, hist_len, t in [(0, 1, 1.0), (12345, 7, 0.7), (2**31 + 5, 500, 1.3)]:
        want = int(np.argmax(lg / np.float32(t) + gumbel_noise(seed & 0x7FFFFFFF,
                                                               hist_len - 1, 989)))
        got = Sampler(SamplingParams(temperature=t, seed=seed))(lg, [1] * hist_len)
        assert got == want
    # the draw follows softmax(lg / T): Gumbel-max over many positions
    s = Sampler(SamplingParams(temperature=1.0, seed=4))
    small = logits_for(PROBS)
    draws = np.bincount([s(small, [0] * k) for k in range(1, 4001)], minlength=6) / 4000
    np.testing.assert_allclose(draws, PROBS, atol=0.03)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    lg = np.array([1.0, 0.9, 0.8, 0.0], np.float32)
    # prompt [0, 0]; output [1, 1, 2]: vLLM subtracts freq * count + presence * (count > 0)
    p = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    x = Sampler(p, prompt_len=2).scores(lg, [0, 0, 1, 1, 2])
    np.testing.assert_allclose(x, [1.0, 0.9 - 0.5 - 0.5, 0.8 - 0.25 - 0.5, 0.0], rtol=1e-6)
    # negative penalties reward repetition
    q = SamplingParams(presence_penalty=-1.5)
    assert Sampler(q, prompt_len=0)(lg, [3]) == 3
    assert Sampler(q, prompt_len=1)(lg, [3]) == 0  # token 3 is in the prompt only


def test_min_p_keeps_tokens_at_least_min_p_times_the_top():
    # PROBS: top 0.5; min_p 0.19 keeps p >= 0.095: {3, 1, 4} (0.05 and below go)
    p = final_probs(SamplingParams(temperature=1.0, min_p=0.19), logits_for(PROBS))
    assert set(np.flatnonzero(p > 0)) == {3, 1, 4}
    np.testing.assert_allclose(p[[3, 1, 4]], PROBS[[3, 1, 4]] / 0.9, rtol=1e-5)


def test_min_tokens_masks_stop_ids_until_reached():
    lg = np.array([0.0, 5.0, 1.0], np.float32)  # token 1 (a stop id) is the greedy choice
    s = Sampler(SamplingParams(min_tokens=2), prompt_len=3, stop_ids=[1])
    assert s(lg, [9, 9, 9]) == 2  # 0 generated
    assert s(lg, [9, 9, 9, 2]) == 2  # 1 generated
    assert s(lg, [9, 9, 9, 2, 2]) == 1  # 2 generated: the stop may come


def test_log_softmax_and_top_logprobs():
    lg = np.array([1.0, 3.0, 3.0, -2.0, 0.5], np.float32)
    lp = log_softmax(lg)
    np.testing.assert_allclose(np.exp(lp).sum(), 1.0, rtol=1e-12)
    np.testing.assert_allclose(lp, lg - np.log(np.exp(lg.astype(np.float64)).sum()), rtol=1e-12)
    top = top_logprobs(lp, 3)
    assert [i for i, _ in top] == [1, 2, 0]  # best first, ties by lower id
    assert top_logprobs(lp, 0) == [] and len(top_logprobs(lp, 99)) == 5
