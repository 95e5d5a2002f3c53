"""Many decode steps per launch (``KernelExecutor.run_steps``, issue 8 R6) on the CPU emulator:
one launch feeds the prompt from a device buffer and decodes until the kernel itself sees a stop
(stop token, stop position / context end, step budget, the host's stop request), and the host
takes the tokens from mapped memory while the launch runs.

What must hold: the tokens are exactly those of one launch per step (greedy and Gumbel-max, every
architecture, awkward grids), greedy ones are the reference's argmax, every
stop condition stops at the right step with the right K/V bookkeeping, the Engine and the LLM use
it (launches counted, stop strings and cancels stop the kernel), and samplers the kernel cannot
do fall back to one step per launch.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from monokernel.errors import KernelError, NumericalError
from monokernel.kernel.base import DeviceSample
from monokernel.kernel.devices.emulator import EmulatorDevice
from monokernel.kernel.executor import KernelExecutor
from monokernel.kernel.isa import State, StopReason
from monokernel.model.reference import ReferenceModel
from monokernel.runtime import Engine
from monokernel.sampling import SamplingParams

MAX_SEQ = 64
PROMPT = [1, 999, 5, 0, 517, 998, 77]
HOT = 25.0  # a temperature at which the synthetic models' tokens vary from step to step


@pytest.fixture(scope="module")
def model(synth_model):
    """``model("qwen3-tiny")`` -> the seeded synthetic checkpoint (conftest.synth_model)."""
    return synth_model


def per_step(ex: KernelExecutor, prompt: list[int], n: int, sample: DeviceSample,
             start: int = 0) -> list[int]:
    """n sampled tokens with one launch per step (prompt steps included), fed back."""
    toks = []
    tok, pos = prompt[0], start
    for i in range(len(prompt) + n - 1):
        if i < len(prompt):
            tok = prompt[i]
        res = ex.step(tok, pos, sample)
        pos += 1
        if i >= len(prompt) - 1:
            toks.append(res.token)
            tok = res.token
    return toks


CASES = [("tiny", 1), ("tiny", 3), ("tiny", 8), ("llama3-tiny", 3), ("qwen2-tiny", 2),
         ("qwen3-tiny", 8), ("qwen3-tiny", 3)]


@pytest.mark.parametrize("arch,blocks", CASES, ids=[f"{a}-b{b}" for a, b in CASES])
def test_one_launch_makes_the_tokens_of_one_launch_per_step(model, arch, blocks):
    ex = KernelExecutor(model(arch), MAX_SEQ, blocks=blocks)
    n = 20
    for sample in (DeviceSample(0.0, 0), DeviceSample(HOT, 77)):
        ex.reset()
        want = per_step(ex, PROMPT, n, sample)
        want_logits = ex.logits()  # of the last step
        ex.reset()
        ex.poison()  # NaN in every activation: the launch must write what its last step reads
        l0 = ex.launches
        got = list(ex.run_steps(PROMPT, 0, sample, stop_pos=len(PROMPT) + n - 1))
        assert got == want, f"{arch} T={sample.temperature}"
        # bitwise: the same last step (prompt steps skip the LM head, the rest is identical)
        assert np.array_equal(ex.logits().view(np.uint32), want_logits.view(np.uint32))
        assert ex.launches - l0 == 1
        end = ex.last_launch
        assert end.reason == StopReason.POSITION and end.end_pos == len(PROMPT) + n - 1
        assert end.tokens == got
        # the kernel's own bookkeeping: state and step count as after the per-step run
        control = ex.read_buffer("control")
        assert int(control[State.POS]) == end.end_pos
        assert int(control[State.STEP]) == end.end_pos
        if sample.temperature > 0:  # the test could not tell sampling from argmax otherwise
            assert len(set(got)) >= 5, got


def test_greedy_tokens_are_the_references_argmax(model):
    m = model("llama3-tiny")
    ex = KernelExecutor(m, MAX_SEQ, blocks=3)
    ex.reset()
    got = list(ex.run_steps(PROMPT, 0, DeviceSample(0.0, 0), stop_pos=len(PROMPT) + 11))
    ref = ReferenceModel(m.config, m.weights, MAX_SEQ)
    seq = list(PROMPT)
    logits = ref.forward(seq, 0)[-1]
    for i, tok in enumerate(got):
        assert tok == int(np.argmax(logits)), f"token {i}"
        seq.append(tok)
        logits = ref.forward([tok], len(seq) - 1)[0]


def test_a_prefix_in_the_cache_is_continued(model):
    """start_pos > 0: positions before it keep the K/V of an earlier launch."""
    ex = KernelExecutor(model("qwen2-tiny"), MAX_SEQ, blocks=3)
    s = DeviceSample(HOT, 5)
    ex.reset()
    want = per_step(ex, PROMPT, 10, s)
    ex.reset()
    list(ex.run_steps(PROMPT[:4], 0, s, stop_pos=4))  # the first four positions only
    assert ex.last_launch.end_pos == 4
    got = list(ex.run_steps(PROMPT[4:], 4, s, stop_pos=len(PROMPT) + 9))
    assert got == want


def test_a_stop_token_ends_the_launch_and_is_yielded_last(model):
    ex = KernelExecutor(model("tiny"), MAX_SEQ, blocks=3)
    s = DeviceSample(HOT, 9)
    ex.reset()
    free = list(ex.run_steps(PROMPT, 0, s, stop_pos=len(PROMPT) + 29))
    k = next(i for i in range(3, len(free)) if free[i] not in free[:i])  # first seen at k
    ex.reset()
    got = list(ex.run_steps(PROMPT, 0, s, stop_ids={free[k], 10**9}))
    assert got == free[:k + 1]
    end = ex.last_launch
    assert end.reason == StopReason.TOKEN and end.end_pos == len(PROMPT) + k
    # stop ids among the prompt tokens do not stop the prompt
    ex.reset()
    got = list(ex.run_steps(PROMPT, 0, s, stop_ids={PROMPT[2]} - set(free[:8]),
                            stop_pos=len(PROMPT) + 7))
    assert got == free[:8]


def test_the_context_end_uses_the_last_cache_slot(model):
    """Default stop position: the last step is at MAX_SEQ - 2 and makes the token of the last
    slot; the step budget splits it into launches that still make the same tokens."""
    ex = KernelExecutor(model("tiny"), MAX_SEQ, blocks=2)
    s = DeviceSample(HOT, 3)
    ex.reset()
    one = list(ex.run_steps(PROMPT, 0, s))
    assert len(one) == MAX_SEQ - len(PROMPT) and ex.last_launch.end_pos == MAX_SEQ - 1
    assert ex.last_launch.reason == StopReason.POSITION
    ex.steps_per_launch = 16
    ex.reset()
    l0 = ex.launches
    again = list(ex.run_steps(PROMPT, 0, s))
    assert again == one
    assert ex.launches - l0 == -(-(MAX_SEQ - 1) // 16)
    with pytest.raises(KernelError, match="stop position"):
        list(ex.run_steps(PROMPT, 0, s, stop_pos=MAX_SEQ))
    with pytest.raises(ValueError, match="steps_per_launch"):
        KernelExecutor(model("tiny"), MAX_SEQ, blocks=2, steps_per_launch=-1)


def test_tokens_arrive_while_the_launch_runs(model):
    """Streaming: the first token is taken from mapped memory long before the launch ends
    (57 steps to the context end; the first token comes after the 7 prompt steps)."""
    ex = KernelExecutor(model("tiny"), MAX_SEQ, blocks=2)
    ex.reset()
    it = ex.run_steps(PROMPT, 0, DeviceSample(HOT, 2))
    next(it)
    running = not ex._running.done()
    rest = list(it)
    assert running, "the launch had ended before its first token was taken"
    assert len(rest) == MAX_SEQ - len(PROMPT) - 1 and ex.launches == 1


def test_closing_early_stops_the_kernel(model):
    ex = KernelExecutor(model("qwen3-tiny"), MAX_SEQ, blocks=3)
    s = DeviceSample(HOT, 4)
    ex.reset()
    free = list(ex.run_steps(PROMPT, 0, s))
    ex.reset()
    it = ex.run_steps(PROMPT, 0, s)
    taken = [next(it) for _ in range(3)]
    it.close()
    end = ex.last_launch
    assert taken == free[:3]
    assert end.reason == StopReason.HOST
    # the kernel stopped within a few steps of the request, not at the context end
    assert len(PROMPT) + 2 <= end.end_pos < MAX_SEQ - 1
    assert end.tokens == free[:len(end.tokens)]
    # the executor is usable at once, and a per-step launch after it is right
    assert ex.step(free[end.end_pos - len(PROMPT)], end.end_pos, s).token == \
        free[end.end_pos - len(PROMPT) + 1]


def test_a_cancel_from_another_thread_stops_the_kernel(model):
    ex = KernelExecutor(model("tiny"), MAX_SEQ, blocks=2)
    ex.reset()
    flag = threading.Event()
    it = ex.run_steps(PROMPT, 0, DeviceSample(HOT, 1), should_stop=flag.is_set)
    next(it)
    flag.set()
    rest = list(it)  # ends by itself: the kernel saw the request
    assert ex.last_launch.reason == StopReason.HOST
    assert len(rest) < MAX_SEQ - len(PROMPT) - 1


def test_a_launch_that_makes_no_progress_is_an_error_not_a_hang(model, monkeypatch):
    """A launch that never finishes a step (here: a stand-in that never runs) fails after the
    progress deadline with the position it was at; the host does not wait forever."""
    from monokernel.kernel import executor as exmod

    class Stuck:
        finished = False

        def done(self):
            return self.finished

        def finish(self):
            self.finished = True

    ex = KernelExecutor(model("tiny"), MAX_SEQ, blocks=2, watchdog_ms=100,
                        device=EmulatorDevice(timeout_s=0.5))
    monkeypatch.setattr(exmod, "PROGRESS_GRACE_S", 0.2)
    monkeypatch.setattr(ex.device, "start", lambda fn: Stuck())
    ex.reset()
    t0 = time.perf_counter()
    with pytest.raises(KernelError, match="no step done for 0 s at position 0"):
        list(ex.run_steps(PROMPT, 0, DeviceSample(0.0, 0)))
    assert time.perf_counter() - t0 < 5
    assert ex.buffers["host_flags"][0] == 1  # it asked the kernel to stop


def test_nan_logits_stop_the_launch(model):
    import dataclasses

    m = model("tiny")
    w = dict(m.weights)
    w["model.norm.weight"] = np.full_like(np.asarray(w["model.norm.weight"]), np.nan)
    ex = KernelExecutor(dataclasses.replace(m, weights=w), MAX_SEQ, blocks=3)
    ex.reset()
    assert list(ex.run_steps(PROMPT, 0, DeviceSample(0.0, 0))) == [-1]
    assert ex.last_launch.reason == StopReason.NAN
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    with pytest.raises(NumericalError, match="NaN in the logits at position 6"):
        list(Engine(ex).generate_ids(PROMPT, params))


# ================================================================================================
# The Engine and the LLM
# ================================================================================================
def test_engine_uses_one_launch_for_64_greedy_tokens(model):
    m = model("llama3-tiny")
    ex = KernelExecutor(m, 128, blocks=3)
    one = KernelExecutor(m, 128, blocks=3, multi_step=False)
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    eng = Engine(ex, prefix_caching=False)
    got = [t for t, _ in eng.generate_ids(PROMPT, params)]
    assert len(got) == 64
    st = eng.stats
    assert st.launches == 1 and st.launches / st.generated_tokens <= 1 / 16
    ref = Engine(one, prefix_caching=False)
    assert [t for t, _ in ref.generate_ids(PROMPT, params)] == got
    assert ref.stats.launches == len(PROMPT) + 63  # one per step
    # a bounded launch: still the same tokens, launches = steps / budget
    ex.steps_per_launch = 16
    assert [t for t, _ in eng.generate_ids(PROMPT, params)] == got
    assert eng.stats.launches == -(-(len(PROMPT) + 63) // 16)


def test_engine_falls_back_to_one_step_per_launch_for_host_samplers(model):
    ex = KernelExecutor(model("tiny"), MAX_SEQ, blocks=2)
    eng = Engine(ex, prefix_caching=False)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=5, seed=3, ignore_eos=True)
    toks = list(eng.generate_ids(PROMPT, params))
    assert len(toks) == 6 and eng.stats.launches == len(PROMPT) + 5


def test_engine_prefix_cache_after_an_early_stop(model):
    """A generation closed early leaves K/V for the tokens the kernel made past the last one
    taken; the next prompt that shares the prefix must reuse only what the cache holds."""
    m = model("qwen2-tiny")
    params = SamplingParams(max_new_tokens=12, temperature=HOT, seed=8, ignore_eos=True)
    fresh = Engine(KernelExecutor(m, MAX_SEQ, blocks=3), prefix_caching=False)
    eng = Engine(KernelExecutor(m, MAX_SEQ, blocks=3))
    g = eng.generate(PROMPT, params)
    first = [next(g).token for _ in range(4)]
    g.close()
    follow = PROMPT + first + [3, 4]
    got = [t for t, _ in eng.generate_ids(follow, params)]
    assert eng.stats.reused_tokens > len(PROMPT)
    assert got == [t for t, _ in fresh.generate_ids(follow, params)]


@pytest.fixture(scope="module")
def tiny_llm(synth_dir):
    from monokernel import LLM

    return LLM(str(synth_dir("llama3-tiny")), backend="emulator", blocks=3, max_seq_len=MAX_SEQ,
               progress=False)


def test_llm_stream_stop_string_stops_the_kernel(tiny_llm):
    llm = tiny_llm
    params = SamplingParams(max_new_tokens=40, temperature=HOT, seed=2, ignore_eos=True)
    full = llm.generate(PROMPT, params)
    assert full.outputs[0].token_ids and len(full.outputs[0].token_ids) == 40
    assert full.launches == 1  # the prompt and 40 tokens in one launch
    text = full.outputs[0].text
    stop = text[len(text) // 3:len(text) // 3 + 2]
    assert stop.strip(), text
    cut = llm.generate(PROMPT, params.replace(stop=(stop,)))
    out = cut.outputs[0]
    assert out.finish_reason == "stop" and out.text == text[:text.index(stop)]
    ex = llm.engine.executor
    assert llm.engine.stats.launches == 1
    assert ex.last_launch.reason == StopReason.HOST
    assert ex.last_launch.end_pos < len(PROMPT) + 39  # it did not run to max_new_tokens


def test_llm_stream_close_from_another_thread(tiny_llm):
    llm = tiny_llm
    params = SamplingParams(max_new_tokens=50, temperature=HOT, seed=6, ignore_eos=True)
    stream = llm.stream(PROMPT, params)
    pieces = []
    t0 = time.perf_counter()
    for piece in stream:
        pieces.append(piece)
        if len(pieces) == 2:
            threading.Thread(target=stream.close).start()
            time.sleep(0.2)
    assert time.perf_counter() - t0 < 30
    assert stream.completion.outputs[0].finish_reason == "abort"
    assert len(pieces) < 50
    # the engine is free: the next generation runs
    assert len(llm.generate(PROMPT, params.replace(max_new_tokens=3)).outputs[0].token_ids) == 3
