"""SamplingParams (aliases, validation, generation_config defaults) and the host Sampler on
hand-built logits: top-k, top-p, repetition penalty with HF semantics, non-finite logits."""

from __future__ import annotations

import numpy as np
import pytest

from monokernel.errors import NumericalError
from monokernel.sampling import Sampler, SamplingParams


class RecordingRng:
    """Stands in for the sampler's Generator: records the final distribution, returns id 0."""

    def __init__(self):
        self.p = None

    def choice(self, n, p):
        self.p = np.asarray(p)
        assert len(self.p) == n
        return 0


def final_probs(params: SamplingParams, logits, history=()) -> np.ndarray:
    s = Sampler(params)
    s.rng = RecordingRng()
    s(np.asarray(logits, np.float32), list(history))
    assert s.rng.p is not None
    return s.rng.p


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
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.85, seed=1))
    lg = logits_for(PROBS)
    draws = np.bincount([s(lg, []) for _ in range(3000)], minlength=len(PROBS))
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
        return [s(lg, []) for _ in range(16)]

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
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": ["ok", ""]}, "stop"),
])
def test_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


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
