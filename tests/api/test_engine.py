"""The executor interface (kernel/base.py) and the Engine's one generation loop over it
(runtime.py), and the validated backend options (one frozen dataclass per backend family).

What must hold: every executor class implements the declared interface; the one loop gives
the tokens of the plainest possible generation loop (the whole sequence through reference.py at
every step, the host sampler) on the NumPy executor and on the emulator, one launch per step or
many; the stop rule ends a generation at a stop token, at max_new_tokens, at the context's end
and on a cancel; a misspelt, unknown or mistyped backend option is a ParameterError naming it,
through ``LLM(...)``, ``make_executor`` and the command line, before any model is loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from monokernel import LLM
from monokernel.errors import ParameterError
from monokernel.kernel.base import DeviceSample, Executor, StepResult
from monokernel.kernel.executor import KernelExecutor
from monokernel.kernel.isa import StopReason
from monokernel.model.reference import ReferenceModel
from monokernel.runtime import Engine, NumpyExecutor, StopRule, make_executor
from monokernel.sampling import Sampler, SamplingParams

MAX_SEQ = 64  # the kernel builds of test_multi_step.py use the same length: one build
PROMPT = [1, 999, 5, 0, 517, 998, 77]
HOT = 25.0  # a temperature at which the synthetic models' tokens vary from step to step
REPO = Path(__file__).resolve().parents[2]

# backend, options: the NumPy reference, the persistent kernel with many steps per launch and
# its one-launch-per-step twin
# numpy with prefill_chunk=1: every position reusable, as on the kernels (the default chunks of
# 32 reuse only whole chunks of a prompt: tests/api/test_prefix_reuse.py)
EXECUTORS = [("numpy", {"prefill_chunk": 1}), ("emulator", {"blocks": 3}),
             ("emulator", {"blocks": 3, "multi_step": False})]
IDS = ["numpy", "emulator", "emulator-1step"]
# the one-sequence executors: the Engine keeps the previous sequence's prefix by the cache
# token (numpy batches: its prefix cache is the page pool, tests/api/test_batching.py)
ONE_SEQ_IDS = IDS[1:]


def reference_generate(model, prompt: list[int], params: SamplingParams, seed: int,
                       stops: set[int]) -> list[int]:
    """The plainest generation loop: the whole sequence through reference.py at every step (no
    K/V reuse), the host sampler, stop after a stop token, at max_new_tokens or when the
    context is full."""
    ref = ReferenceModel(model.config, model.weights, MAX_SEQ)
    sampler = Sampler(params, seed, prompt_len=len(prompt), stop_ids=stops)
    seq, out = list(prompt), []
    while len(out) < params.max_new_tokens and len(seq) < MAX_SEQ:
        tok = sampler(ref.forward(seq, 0)[-1], seq)
        out.append(tok)
        seq.append(tok)
        if tok in stops:
            break
    return out


@pytest.fixture(scope="module")
def engines(synth_model):
    """backend id -> Engine on llama3-tiny, built once for the module."""
    m = synth_model("llama3-tiny")
    return {i: Engine(make_executor(b, m, MAX_SEQ, **o)) for i, (b, o) in zip(IDS, EXECUTORS)}


# ================================================================================================
# The interface
# ================================================================================================
def test_the_interface_is_declared_and_enforced():
    assert Executor.__abstractmethods__ == {"reset", "step", "cache_token"}

    class NoCacheToken(Executor):  # forgets one method the Engine needs
        def reset(self):
            pass

        def step(self, token, pos, sample=None):
            return StepResult(None, np.zeros(4, np.float32))

    with pytest.raises(TypeError, match="cache_token"):
        NoCacheToken(None, 8)


@pytest.mark.parametrize("ident", IDS)
def test_every_executor_implements_it(engines, ident):
    ex = engines[ident].executor
    assert isinstance(ex, Executor)
    assert isinstance(ex, NumpyExecutor if ident == "numpy" else KernelExecutor)
    assert not Executor.__abstractmethods__ & set(type(ex).__abstractmethods__)
    assert isinstance(ex.device_sampling, bool) and isinstance(ex.multi_step, bool)
    assert isinstance(ex.launches, int)
    assert ex.device_sampling == (ident != "numpy")
    assert ex.multi_step == (ident == "emulator")
    ex.reset()
    before = ex.cache_token()
    assert before is not None
    ex.prefill(PROMPT[:2], 0)
    assert ex.cache_token() != before  # a prefill touched the cache


# ================================================================================================
# The one loop
# ================================================================================================
@pytest.mark.parametrize("ident", IDS)
@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
    SamplingParams(max_new_tokens=8, temperature=HOT, seed=4, ignore_eos=True),
    SamplingParams(max_new_tokens=6, temperature=HOT, seed=5, top_k=7, ignore_eos=True),
    SamplingParams(max_new_tokens=100, temperature=HOT, seed=6, ignore_eos=True),
], ids=["greedy", "gumbel", "host-top-k", "context-end"])
def test_the_one_loop_gives_the_plain_loops_tokens(engines, synth_model, ident, params):
    eng = engines[ident]
    got = [t for t, _ in eng.generate_ids(PROMPT, params)]
    want = reference_generate(synth_model("llama3-tiny"), PROMPT, params, params.seed or 0,
                              set())
    assert got == want
    assert len(got) == min(params.max_new_tokens, MAX_SEQ - len(PROMPT))
    launches = eng.stats.launches
    if ident == "numpy":
        assert launches == 0
    elif ident == "emulator" and params.kernel_samplable:
        assert launches == 1  # the prompt and every token in one launch
    else:  # one launch per prompt token run (the rest came from the cache) and fed-back token
        assert launches == eng.stats.prefill_tokens + len(got) - 1


@pytest.mark.parametrize("ident", IDS)
def test_a_stop_token_ends_the_generation_on_every_executor(engines, synth_model, ident):
    m = synth_model("llama3-tiny")
    free = reference_generate(m, PROMPT, SamplingParams(max_new_tokens=12, temperature=HOT,
                                                        seed=9, ignore_eos=True), 9, set())
    stop = free[5]
    k = free.index(stop)
    params = SamplingParams(max_new_tokens=12, temperature=HOT, seed=9, ignore_eos=True,
                            stop_token_ids=[stop])
    got = list(engines[ident].generate_ids(PROMPT, params))
    assert got == [(t, False) for t in free[:k]] + [(stop, True)]  # yielded last, marked


@pytest.mark.parametrize("ident", ONE_SEQ_IDS)
def test_the_engine_keeps_a_prefix_only_while_the_cache_token_holds(engines, ident):
    eng = engines[ident]
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    first = [t for t, _ in eng.generate_ids(PROMPT, params)]
    list(eng.generate_ids(PROMPT + first[:2], params))
    assert eng.stats.reused_tokens == len(PROMPT) + 1  # the prompt and the token fed back
    eng.executor.step(5, 0, None)  # the cache touched behind the Engine's back
    again = [t for t, _ in eng.generate_ids(PROMPT, params)]
    assert eng.stats.reused_tokens == 0 and again == first


@pytest.mark.parametrize("ident", ONE_SEQ_IDS)
def test_a_cancel_between_tokens_ends_the_generation(engines, ident):
    eng = engines[ident]
    g = eng.generate(PROMPT, SamplingParams(max_new_tokens=30, temperature=HOT, seed=2,
                                            ignore_eos=True))
    taken = [next(g).token for _ in range(3)]
    g.cancelled = True  # what close() from another thread sets
    assert list(g) == [] and eng.stats.generated_tokens == 3
    # the K/V of what ran is still known: the prompt and the two tokens fed back are reused
    list(eng.generate_ids(PROMPT + taken[:2], SamplingParams(max_new_tokens=1)))
    assert eng.stats.reused_tokens == len(PROMPT) + 1


def test_the_stop_rule():
    params = SamplingParams(max_new_tokens=5, stop_token_ids=[7], ignore_eos=False)

    class Config:
        eos_token_ids = (2,)

    rule = StopRule.of(params, Config, prompt_len=10, max_seq_len=100)
    assert rule.stop_ids == {2, 7} and rule.stop_pos == 14
    assert rule.reason(7, 0) == StopReason.TOKEN
    assert rule.reason(2, 1) == StopReason.TOKEN
    assert rule.reason(3, 3) is None
    assert rule.reason(3, 4) == StopReason.POSITION  # the 5th token is the last
    # the context's end comes first: positions 10..11 only
    assert StopRule.of(params, Config, 10, 12).reason(3, 1) == StopReason.POSITION
    ignored = StopRule.of(params.replace(ignore_eos=True), Config, 10, 100)
    assert ignored.stop_ids == {7}
    # the text view sees every token but a stop token, the last one too
    seen = []
    text = StopRule.of(params, Config, 10, 100, lambda t: seen.append(t) or t == 9)
    assert [text.reason(t, i) for i, t in enumerate([3, 7, 4, 9])] == [
        None, StopReason.TOKEN, None, StopReason.HOST]
    assert text.reason(5, 4) == StopReason.POSITION and seen == [3, 4, 9, 5]


@pytest.mark.parametrize("ident", IDS)
def test_a_stop_string_ends_the_generation_and_the_launch(engines, ident):
    """``text_stop`` (the LLM's stop strings) ends the generation with the token that made
    the text stop, on every executor; a multi-step launch is asked to stop then."""
    eng = engines[ident]
    params = SamplingParams(max_new_tokens=100, temperature=HOT, seed=12, ignore_eos=True)
    free = [t for t, _ in eng.generate_ids(PROMPT, params)]
    told = []
    g = eng.generate(PROMPT, params, text_stop=lambda t: told.append(t) or len(told) == 4)
    assert [s.token for s in g] == free[:4] and told == free[:4]
    if ident == "emulator":
        assert eng.executor.last_launch.reason == StopReason.HOST


def test_run_steps_one_step_per_token_keeps_the_kv_bookkeeping(engines):
    """The base class's run_steps (numpy, one-step kernels): ``last_launch`` says which
    positions hold K/V however the run ended."""
    ex = engines["numpy"].executor
    ex.reset()
    run = ex.run_steps(PROMPT, 0, None, stop_pos=len(PROMPT) + 4)
    assert ex.last_launch.end_pos == 0  # nothing ran yet
    toks = [next(run) for _ in range(3)]
    assert ex.last_launch.end_pos == len(PROMPT) + 2  # the prompt and two tokens fed back
    assert ex.last_launch.tokens == toks
    rest = list(run)
    assert len(toks + rest) == 5 and ex.last_launch.reason == StopReason.POSITION
    assert ex.last_launch.end_pos == len(PROMPT) + 4
    with pytest.raises(Exception, match="run_steps needs tokens"):
        ex.run_steps(PROMPT, 0, None, stop_pos=len(PROMPT) - 1)


# ================================================================================================
# Backend options
# ================================================================================================
def test_a_misspelt_option_is_named_with_the_closest_before_the_model_loads(tmp_path):
    nowhere = tmp_path / "no-model-here"  # the options fail before the model would
    with pytest.raises(ParameterError) as e:
        LLM(nowhere, backend="emulator", bloks=8, progress=False)
    msg = str(e.value)
    assert "backend 'emulator' has no option 'bloks'" in msg
    assert "did you mean 'blocks'?" in msg and "watchdog_ms" in msg and "sanitize" in msg
    with pytest.raises(ParameterError, match="no option 'devce_id'.*did you mean 'device_id'"):
        LLM(nowhere, backend="cuda", devce_id=0, progress=False)  # no GPU needed to check
    with pytest.raises(ParameterError,
                       match="no option 'dtype' \\(its options: threads, prefill_chunk, "
                       "batch_invariant, page_size\\)$"):
        LLM(nowhere, backend="numpy", dtype="bf16", progress=False)  # nothing close: no guess
    with pytest.raises(ParameterError, match="emulator-multi sets multi itself"):
        LLM(nowhere, backend="emulator-multi", multi=False, progress=False)


@pytest.mark.parametrize("backend, option, value, expected", [
    ("emulator", "blocks", "8", "an integer >= 1"),
    ("emulator", "blocks", True, "an integer >= 1"),
    ("emulator", "multi_step", 1, "True or False"),
    ("emulator", "sanitize", 1, "a string or None"),
    ("emulator", "program", "v2", "a Program or None"),
    ("emulator-multi", "steps_per_launch", -1, "an integer >= 0"),
    ("cuda", "blocks", 0, "an integer >= 1 or None"),
    ("numpy", "threads", 1.5, "an integer >= 1 or None"),
])
def test_a_wrong_type_names_the_option_and_the_type(tmp_path, backend, option, value,
                                                   expected):
    with pytest.raises(ParameterError) as e:
        LLM(tmp_path / "no-model-here", backend=backend, progress=False, **{option: value})
    assert f"option {option} must be {expected}, got {value!r}" in str(e.value)


def test_make_executor_validates_keywords_too(synth_model):
    with pytest.raises(ParameterError, match="no option 'watchdog'.*did you mean 'watchdog_ms'"):
        make_executor("emulator", synth_model("tiny"), MAX_SEQ, watchdog=5)


def monokernel(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "monokernel", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_the_command_line_takes_any_option_and_names_a_bad_one(synth_dir, tmp_path):
    model = str(synth_dir("tiny"))
    r = monokernel("generate", "x", "--model", model, "--backend", "emulator",
                   "--option", "bloks=8")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "backend 'emulator' has no option 'bloks'" in r.stderr
    assert "did you mean 'blocks'?" in r.stderr
    r = monokernel("generate", "x", "--model", model, "--backend", "emulator", "-o",
                   "blocks=eight")
    assert r.returncode == 2 and "option blocks must be an integer >= 1, got 'eight'" \
        in r.stderr, r.stderr
    r = monokernel("generate", "x", "--model", model, "--backend", "numpy", "-o", "threads")
    assert r.returncode == 2 and "--option wants NAME=VALUE" in r.stderr, r.stderr
    # a good one takes effect
    r = monokernel("generate", "the", "--model", model, "--backend", "numpy", "-o", "threads=1",
                   "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert "numpy backend: 1 BLAS thread " in r.stderr
    # the server refuses it before it loads anything or listens
    r = monokernel("serve", "--model", str(tmp_path / "no-model-here"), "--backend",
                   "emulator", "-o", "watchdog=100", "--port", "0")
    assert r.returncode == 2 and "did you mean 'watchdog_ms'?" in r.stderr, r.stderr


def test_option_values_read_from_text():
    from monokernel.backend_args import option_value

    assert [option_value(t) for t in ("8", "-1", "1.5", "true", "False", "none", "address")] \
        == [8, -1, 1.5, True, False, None, "address"]
    assert type(option_value("8")) is int and type(option_value("true")) is bool


def test_a_one_step_and_a_many_step_kernel_run_the_same_steps(engines):
    """A DeviceSample given to the one-step kernel is drawn on the device after the first
    token; the many-steps kernel draws every one: the same tokens."""
    one, many = engines["emulator-1step"].executor, engines["emulator"].executor
    s = DeviceSample(HOT, 11)
    sampler = Sampler(SamplingParams(temperature=HOT), 11)
    one.reset()
    a = list(one.run_steps(PROMPT, 0, s, choose=lambda lg: sampler(lg, PROMPT),
                           stop_pos=len(PROMPT) + 5))
    many.reset()
    b = list(many.run_steps(PROMPT, 0, s, stop_pos=len(PROMPT) + 5))
    assert a == b and len(a) == 6
