"""Steps of several tokens (issue 17, slice 2: a prompt in chunks of up to ``step_tokens``
positions, megakernel.cu MK_T_MAX) on the CPU emulator.

The oracle is the same kernel built for one token per step: a chunk runs every token with the
one-token step's arithmetic, so every position's K/V, the last step's logits and every token
must be bitwise equal, for every architecture (late q/k: the chunk's keys kept in shared memory;
q/k/v bias; GQA), for chunks that cross attention-split boundaries, a prompt that ends on a chunk
boundary or one past it, a prefill after a reused prefix and a prompt that fills the cache to its
last slot. Also: the step count (one step per chunk), the greedy token against the NumPy
reference, the Engine's seeded text, and the option's validation.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.kernel import assert_logits_match
from monokernel.errors import ParameterError, ProgramError
from monokernel.kernel import costmodel as cm
from monokernel.kernel.base import DeviceSample
from monokernel.kernel.executor import KernelExecutor
from monokernel.kernel.schedule import MAX_STEP_TOKENS, schedule
from monokernel.model.config import ModelConfig
from monokernel.model.reference import ReferenceModel
from monokernel.runtime import Engine, backend_options
from monokernel.sampling import SamplingParams

MAX_SEQ = 64
HOT = 25.0  # the synthetic models' tokens vary from step to step at this temperature


def prompt_of(model, n: int, seed: int = 1) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(1, model.config.vocab_size, n)]


def run(model, tokens_per_step: int, prompt: list[int], stop_pos: int, blocks: int,
        sample: DeviceSample, start: int = 0, ex: KernelExecutor | None = None,
        max_seq: int = MAX_SEQ):
    """(tokens, last logits, K cache, V cache of positions < stop_pos, steps) of one
    multi-step run on NaN-poisoned activations."""
    if ex is None:
        ex = KernelExecutor(model, max_seq, blocks=blocks, step_tokens=tokens_per_step)
        ex.reset()
    ex.poison()
    steps0 = ex.steps_run
    toks = list(ex.run_steps(prompt, start, sample, stop_pos=stop_pos))
    k = ex.read_buffer("k_cache")[:, :stop_pos].copy()
    v = ex.read_buffer("v_cache")[:, :stop_pos].copy()
    return toks, ex.logits().copy(), k, v, ex.steps_run - steps0


def assert_bitwise(got, want, what: str) -> None:
    toks, logits, k, v, _ = got
    assert toks == want[0], f"{what}: tokens"
    assert np.array_equal(logits.view(np.uint32), want[1].view(np.uint32)), f"{what}: logits"
    assert np.array_equal(k, want[2]), f"{what}: K cache"
    assert np.array_equal(v, want[3]), f"{what}: V cache"


# (architecture, tokens per step, prompt length, blocks): chunks of 3 over 17 positions (the
# last chunk of 2), a prompt on a chunk boundary (16 = 2 x 8), GQA with late q/k and one
# position past a boundary (17 = 2 x 8 + 1), q/k/v bias, chunks longer than an attention split
CASES = [("llama3-tiny", 3, 17, 3), ("qwen3-tiny", 8, 16, 4), ("qwen3-gqa-tiny", 8, 17, 3),
         ("qwen2-tiny", 5, 9, 2), ("tiny", 17, 40, 4)]


@pytest.mark.parametrize("arch,T,n,blocks", CASES, ids=[f"{a}-t{t}-p{n}" for a, t, n, _ in CASES])
def test_a_chunked_prompt_is_bitwise_the_one_token_steps(synth_model, arch, T, n, blocks):
    model = synth_model(arch)
    prompt = prompt_of(model, n)
    stop = n + 6  # six tokens after the prompt's
    for sample in (DeviceSample(0.0, 0), DeviceSample(HOT, 7)):
        want = run(model, 1, prompt, stop, blocks, sample)
        got = run(model, T, prompt, stop, blocks, sample)
        assert_bitwise(got, want, f"{arch} T={T} temperature {sample.temperature}")
        # one step per chunk, then one per generated token
        assert want[4] == stop and got[4] == -(-n // T) + stop - n


@pytest.mark.parametrize("arch", ["llama3-tiny", "qwen3-tiny"])
def test_the_largest_step(synth_model, arch):
    """A chunk of MAX_STEP_TOKENS (256; on qwen3-tiny, late q/k at head_dim 128, its keys fill
    64 KB of dynamic shared memory: megakernel.cu chunk_keys), then one of 3, then decode:
    bitwise the one-token steps; one more token a step is refused."""
    model = synth_model(arch)
    T = MAX_STEP_TOKENS
    prompt = prompt_of(model, T + 3, seed=8)
    stop, seq = T + 5, T + 8
    sample = DeviceSample(HOT, 5)
    want = run(model, 1, prompt, stop, 2, sample, max_seq=seq)
    got = run(model, T, prompt, stop, 2, sample, max_seq=seq)
    assert_bitwise(got, want, f"{arch} T={T}")
    assert got[4] == 2 + stop - len(prompt)
    with pytest.raises(ProgramError, match=f"tokens per step must be in \\[1, {T}\\]"):
        KernelExecutor(model, seq, blocks=2, step_tokens=T + 1)


def test_a_chunk_after_a_reused_prefix(synth_model):
    """The Engine reuses a cached prefix and prefills from start_pos > 0: the chunks start
    there (not at a multiple of T) and still equal one token per step."""
    model = synth_model("qwen3-gqa-tiny")
    prompt = prompt_of(model, 20, seed=3)
    sample = DeviceSample(HOT, 11)
    want = run(model, 1, prompt, 26, 3, sample)
    ex = KernelExecutor(model, MAX_SEQ, blocks=3, step_tokens=6)
    ex.reset()
    list(ex.run_steps(prompt[:5], 0, sample, stop_pos=5))  # positions 0..4 cached
    got = run(model, 6, prompt[5:], 26, 3, sample, start=5, ex=ex)
    assert_bitwise(got, want, "from position 5")


def test_a_prompt_to_the_last_cache_slot(synth_model):
    model = synth_model("llama3-tiny")
    prompt = prompt_of(model, MAX_SEQ - 1, seed=4)
    sample = DeviceSample(0.0, 0)
    want = run(model, 1, prompt, MAX_SEQ - 1, 3, sample)
    got = run(model, 16, prompt, MAX_SEQ - 1, 3, sample)
    assert_bitwise(got, want, "a full cache")
    assert len(got[0]) == 1 and got[4] == -(-(MAX_SEQ - 1) // 16)


def test_the_chunks_greedy_token_is_the_references(synth_model):
    model = synth_model("qwen3-gqa-tiny")
    prompt = prompt_of(model, 19, seed=5)
    toks, logits, *_ = run(model, 8, prompt, len(prompt), 3, DeviceSample(0.0, 0))
    ref = ReferenceModel(model.config, model.weights, MAX_SEQ).forward(prompt, 0)[-1]
    assert_logits_match(logits[None], ref[None], "chunked prompt's last position")
    assert toks == [int(np.argmax(logits))]


def test_the_engine_text_is_the_same_in_chunks(synth_model):
    model = synth_model("llama3-tiny")
    params = SamplingParams(max_new_tokens=6, temperature=0.8, seed=12, ignore_eos=True)
    ids = prompt_of(model, 13, seed=6)
    texts = []
    for T in (1, 4):
        eng = Engine(KernelExecutor(model, MAX_SEQ, blocks=3, step_tokens=T))
        texts.append([s.token for s in eng.generate(ids, params)])
        assert eng.stats.prefill_tokens == len(ids)
    assert texts[0] == texts[1] and len(texts[0]) == 6


def test_the_option_is_validated():
    for bad in (0, MAX_STEP_TOKENS + 1, "8", 2.0):
        with pytest.raises(ParameterError, match="step_tokens"):
            backend_options("emulator", {"step_tokens": bad})
    assert backend_options("emulator", {"step_tokens": 8}).step_tokens == 8
    with pytest.raises(ProgramError, match="tokens per step"):
        schedule(ModelConfig.from_name("tiny"), 2, 32, tokens=0)
    assert schedule(ModelConfig.from_name("qwen3-tiny"), 2, 32, tokens=MAX_STEP_TOKENS).tokens \
        == MAX_STEP_TOKENS


def test_the_program_sizes_its_token_rows_and_the_design_follows():
    cfg = ModelConfig.from_name("qwen3-tiny")
    one, eight = schedule(cfg, 3, 32), schedule(cfg, 3, 32, tokens=8)
    assert eight.tokens == 8 and one.tokens == 1
    a, b = one.buffer_sizes(), eight.buffer_sizes()
    for name in ("residual", "q", "k_raw", "attn_o", "attn_ml", "ffn_h"):
        assert b[name] == 8 * a[name], name
    for name in ("logits", "lm_part", "out_tokens"):  # one row: the step's last token's
        assert b[name] == a[name], name
    assert one.fingerprint() != eight.fingerprint()
    assert cm.design_for(one) is cm.V6
    d = cm.design_for(eight)
    assert d.token_loop and d.prefill_chunk == 8 and d.name == "v6-t8"
