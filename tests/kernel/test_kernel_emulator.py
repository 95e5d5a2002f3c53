"""The megakernel (megakernel.cu, scheduled by schedule.py) on the CPU emulator, against the NumPy
reference: logits at every step, every architecture, grids of 1, 2, 3 and 8 blocks, explicit
attention splits, the last KV-cache slot, bitwise determinism, device sampling (greedy and
Gumbel-max), NaN detection and poisoned activation buffers.

Every step runs on buffers poisoned with NaN first (``KernelExecutor.poison``), so an element the
kernel forgot to write shows up as NaN instead of as a stale value from the previous step.
Prompts are fed one token per step (the kernel is decode-only), then the reference's greedy
token is fed back for the decode steps, so kernel and reference see the same tokens throughout.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from monokernel.errors import KernelError, NumericalError
from monokernel.kernel.isa import STATE_WORDS, Err, ErrCode, State
from monokernel.kernel.executor import ACTIVATIONS, KernelExecutor
from monokernel.model.loader import BF16
from monokernel.model.reference import bf16_round
from monokernel.kernel.base import DeviceSample
from monokernel.runtime import Engine
from monokernel.kernel.schedule import default_attn_splits
from monokernel.sampling import SamplingParams, gumbel_noise

from helpers.kernel import (MAX_SEQ, RTOL_OF_MAX, assert_logits_match, reference_run,
                            relative_error, run_kernel, split_ranges)

POISON_BITS = np.array(np.nan, np.float32).view(np.uint32)  # what ex.poison() writes
PROMPT_LEN = 7  # fed one token per step
DECODE_STEPS = 24  # greedy tokens of the reference fed back: positions 0..30 in all


# ================================================================================================
# Reference functions
# ================================================================================================
def mix32(h: np.ndarray) -> np.ndarray:
    """megakernel.cu mix32 (the murmur3 finalizer), uint32 arithmetic with wraparound; used here
    only to check which hash a (seed, position, token) has, independently of sampling.py."""
    h = np.asarray(h, np.uint32).copy()
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def gumbel_max_scores(logits: np.ndarray, temperature: float, seed: int, pos: int) -> np.ndarray:
    """The kernel's sampling score of every token, logit / T + g, in float32 as the kernel
    computes it; g from the host mirror of the kernel's hash (sampling.gumbel_noise)."""
    g = gumbel_noise(seed, pos, len(logits))
    return (logits.astype(np.float32) / np.float32(temperature) + g).astype(np.float64)


# ================================================================================================
# Fixtures
# ================================================================================================
@pytest.fixture(scope="module")
def model(synth_model):
    """``model("qwen3-tiny")`` -> the seeded synthetic checkpoint (conftest.synth_model)."""
    return synth_model


@pytest.fixture(scope="module")
def reference(model):
    """``reference(arch, n_steps)`` -> (fed tokens, reference logits), computed once per arch."""
    cache: dict[tuple, tuple] = {}

    def get(arch: str, n_steps: int = PROMPT_LEN + DECODE_STEPS):
        key = (arch, n_steps)
        if key not in cache:
            m = model(arch)
            # an awkward prompt: ids spread over the vocabulary, first and last rows included
            prompt = [1, 999, 5, 0, 517, 998, 77][:PROMPT_LEN]
            fed, logits, _ = reference_run(m, prompt, n_steps, MAX_SEQ)
            cache[key] = (fed, logits)
        return cache[key]

    return get


# ================================================================================================
# Logits at every step vs the reference
# ================================================================================================
# (arch, blocks, attn_splits or None for the scheduler's default). Every arch and every grid
# occurs, tiny with every grid; explicit splits 3 and 5: more attention units than blocks (one
# block runs several units) and fewer (5 units on 8 blocks: 3 blocks have no attention work).
CASES = [
    ("tiny", 1, None), ("tiny", 2, None), ("tiny", 3, None), ("tiny", 8, None),
    ("tiny", 2, 5), ("tiny", 8, 3),
    ("llama3-tiny", 3, None), ("llama3-tiny", 8, 5),
    ("qwen2-tiny", 2, None), ("qwen2-tiny", 3, 5),
    ("qwen3-tiny", 1, 3), ("qwen3-tiny", 8, None), ("qwen3-gqa-tiny", 3, None),
]


@pytest.mark.parametrize("multi", [False, True], ids=["emulator", "emulator-multi"])
@pytest.mark.parametrize("arch,blocks,splits", CASES,
                         ids=[f"{a}-b{b}-s{s or 'default'}" for a, b, s in CASES])
def test_logits_every_step_match_reference(model, reference, arch, blocks, splits, multi):
    fed, ref = reference(arch)
    # min chunk 1: every split boundary is crossed within the few positions run here (the
    # default min chunk, one round of K/V loads, is covered by test_attention_context.py)
    ex = KernelExecutor(model(arch), MAX_SEQ, blocks=blocks, attn_splits=splits, multi=multi,
                        attn_min_chunk=1)
    S = ex.program.attn_splits
    assert S == (splits or default_attn_splits(ex.config, blocks, MAX_SEQ))
    # the positions must cross every split boundary: fewer positions than splits (empty
    # splits), exactly S, and chunks of several sizes, with some empty trailing splits
    n_pos = np.arange(1, len(fed) + 1)
    assert (n_pos < S).any() or S == 1
    assert (n_pos == S).any() and (n_pos > S).any()
    assert len({-(-n // S) for n in n_pos}) >= 3
    if S > 2:
        assert any(split_ranges(n, S)[-1][0] >= n for n in n_pos if n > S)
    worst = assert_logits_match(run_kernel(ex, fed), ref, ex.name)
    print(f"{ex.name} {arch} blocks={blocks} splits={S}: max error {worst:.2e} of max|ref|")


# The GPU check's shapes cut to one layer and 384 tokens (config.one_layer_copy): the kernel's
# template instantiations of the real hidden size, FFN, head_dim and GQA group, so none of them
# runs for the first time on a GPU. A few steps on a few blocks keep them cheap: (shape, blocks,
# splits, merge_ticket_min, multi); the megakernel merges by ticket from 2 used splits (the real
# grid does from 8), the multi-kernel baseline runs the per-block merge.
FIRST_RUN = [("smollm2-135m-1layer", 3, 4, 2, False), ("smollm2-135m-1layer", 2, None, None, True),
             ("qwen3-0.6b-1layer", 4, 4, 2, False), ("qwen3-0.6b-1layer", 3, None, None, True),
             ("llama-3.2-1b-1layer", 4, 4, 2, False), ("llama-3.2-1b-1layer", 2, None, None, True)]
FIRST_RUN_SEQ = 16


@pytest.mark.parametrize("shape,blocks,splits,ticket,multi", FIRST_RUN,
                         ids=[f"{s}-b{b}-{'multi' if m else 'mega'}" for s, b, _, _, m in FIRST_RUN])
def test_gpu_shapes_run_first_on_the_emulator(model, shape, blocks, splits, ticket, multi):
    m = model(shape)
    fed, ref, _ = reference_run(m, [1, 383, 5, 200], 5, FIRST_RUN_SEQ)
    ex = KernelExecutor(m, FIRST_RUN_SEQ, blocks=blocks, attn_splits=splits, multi=multi,
                        attn_min_chunk=1, merge_ticket_min=ticket)
    worst = assert_logits_match(run_kernel(ex, fed), ref, f"{ex.name} {shape}")
    print(f"{ex.name} {shape} blocks={blocks} splits={ex.program.attn_splits}: max error "
          f"{worst:.2e} of max|ref|")


def test_attention_chunk_longer_than_a_score_tile(model, reference):
    """One split over 151 positions: the kernel scores T_TILE = 128 positions per pass, so the
    online softmax must rescale the first pass's output by the second pass's max."""
    n = 151
    fed, ref = reference("tiny", n)
    ex = KernelExecutor(model("tiny"), MAX_SEQ, blocks=2, attn_splits=1)
    assert ex.program.attn_splits == 1
    worst = assert_logits_match(run_kernel(ex, fed), ref, ex.name)
    print(f"one split over {n} positions: max error {worst:.2e}")


TWO_SHAPES_SCRIPT = r"""
import sys
import numpy as np
from monokernel.kernel.executor import KernelExecutor
from monokernel.model.loader import load_model
from monokernel.model.reference import ReferenceModel

for path in sys.argv[1:]:  # smallest shared memory first
    m = load_model(path, progress=False)
    ex = KernelExecutor(m, 160, blocks=2)  # MAX_SEQ: the builds of the tests above
    ref = ReferenceModel(m.config, m.weights, 160)
    ex.reset()
    for pos, tok in enumerate([3, 14, 15, 92]):
        ex.poison()
        got, want = ex.step(tok, pos).logits, ref.forward([tok], pos)[0]
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= 2e-3, (path, pos, err)
print("ok")
"""


def test_two_shapes_in_one_process(synth_dir):
    """Each shape is its own emulator .so with the same symbol names. g++ made the static
    `__shared__` storage STB_GNU_UNIQUE, which ld.so binds to the first loaded definition for the
    whole process: qwen3-tiny (head_dim 128) then ran in tiny's smaller shared memory and crashed.
    A fresh process fixes the load order: tiny first."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", TWO_SHAPES_SCRIPT, str(synth_dir("tiny")),
                           str(synth_dir("qwen3-tiny"))], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# ================================================================================================
# The last slot of the KV cache
# ================================================================================================
@pytest.mark.parametrize("multi", [False, True], ids=["emulator", "emulator-multi"])
def test_last_cache_slot_and_one_past_it(model, multi):
    max_seq = 13  # awkward: positions 0..12, the last one fills the cache
    m = model("qwen2-tiny")
    fed, ref_logits, ref = reference_run(m, [4, 900, 33], max_seq, max_seq)
    ex = KernelExecutor(m, max_seq, blocks=3, attn_splits=5, multi=multi)
    kernel = run_kernel(ex, fed)
    assert_logits_match(kernel, ref_logits, f"{ex.name} max_seq_len={max_seq}")
    # every slot of both caches, the last included, holds the reference's bf16 K/V: equal, or
    # one bf16 rounding step apart where the float32 sums straddle a rounding boundary; where
    # RoPE's difference of products cancels to a value far below the head's scale, the float32
    # summation order (kernel vs NumPy) shows through: allowed up to 2^-16 of the head's max
    for name, want in (("k_cache", ref.k_cache), ("v_cache", ref.v_cache)):
        got = (ex.read_buffer(name).astype(np.uint32) << 16).view(np.float32)
        assert np.abs(want[:, -1]).min() > 0  # the reference wrote the last slot (never zeros)
        assert np.array_equal(want, bf16_round(want))
        head_max = np.abs(want).max(axis=-1, keepdims=True)
        off = np.abs(got - want) > 2.0 ** -8 * np.abs(want) + 2.0 ** -16 * head_max
        assert not off.any(), f"{name}: {int(off.sum())} elements differ by more than a bf16 step"
        assert (got != want).mean() < 0.01, f"{name}: {(got != want).mean():.1%} differ"
    # position max_seq_len has no slot: a clear error, before anything runs
    with pytest.raises(KernelError, match=rf"position {max_seq} is outside the KV cache \[0, {max_seq}\)"):
        ex.step(fed[-1], max_seq)
    # ... and the executor is still usable (nothing was launched)
    ex.reset()
    ex.poison()
    again = ex.step(fed[0], 0).logits
    assert relative_error(again, ref_logits[0]) <= RTOL_OF_MAX


# ================================================================================================
# Determinism
# ================================================================================================
@pytest.mark.parametrize("multi", [False, True], ids=["emulator", "emulator-multi"])
def test_bitwise_deterministic_over_ten_runs(model, reference, multi):
    fed, _ = reference("llama3-tiny")
    fed = fed[:8]
    ex = KernelExecutor(model("llama3-tiny"), MAX_SEQ, blocks=8, attn_splits=5, multi=multi)
    first = run_kernel(ex, fed)
    first_k = ex.read_buffer("k_cache")
    for run in range(9):
        again = run_kernel(ex, fed)  # run_kernel resets counters and state first
        assert np.array_equal(again.view(np.uint32), first.view(np.uint32)), f"run {run + 2} differs"
        assert np.array_equal(ex.read_buffer("k_cache"), first_k), f"run {run + 2}: K cache differs"


# ================================================================================================
# The bundled SmolLM2-135M: greedy tokens through the public API
# ================================================================================================
@pytest.mark.slow
def test_smollm2_greedy_tokens_match_numpy(bundled_dir, bundled_llm):
    """3 prompts x 8 tokens. The emulator runs SmolLM2 at ~0.55 s per step on 2 cores (2 blocks
    is the fastest grid there), and the kernel is decode-only, so every prompt token is a step
    too: short prompts (2-3 tokens), 29 steps, ~20 s. Several tokens, never only the first: a
    wrong layer or a wrong RoPE often keeps the first token right."""
    from monokernel import LLM

    emu = LLM(backend="emulator", blocks=2, max_seq_len=64, progress=False)
    assert emu.backend == "emulator"
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    for prompt in ["Paris is", "def fib(", "Once upon a"]:
        want = bundled_llm.generate(prompt, params)
        got = emu.generate(prompt, params)
        assert len(want.token_ids) == 8
        assert got.token_ids == want.token_ids, f"{prompt!r}: {got.text!r} != {want.text!r}"


# ================================================================================================
# Sampling on the device
# ================================================================================================
def sample_on_device(ex: KernelExecutor, first: int, n: int, temperature: float, seed: int):
    """Feed each sampled token back; returns (tokens, logits of each step)."""
    ex.reset()
    toks, logits = [], []
    tok = first
    for pos in range(n):
        ex.poison()
        res = ex.step(tok, pos, DeviceSample(temperature, seed))
        assert res.logits is None and res.token is not None
        tok = res.token
        toks.append(tok)
        logits.append(ex.logits())
    return toks, logits


def test_greedy_on_device_is_argmax(model, reference):
    fed, ref = reference("qwen3-tiny")
    ex = KernelExecutor(model("qwen3-tiny"), MAX_SEQ, blocks=3)
    ex.reset()
    for pos, tok in enumerate(fed[:PROMPT_LEN + 4]):
        ex.poison()
        res = ex.step(tok, pos, DeviceSample(0.0, 0))
        logits = ex.logits()
        assert res.token == int(np.argmax(logits)) == int(np.argmax(ref[pos]))
        assert int(ex.read_buffer("out_tokens")[pos]) == res.token


@pytest.mark.parametrize("multi", [False, True], ids=["emulator", "emulator-multi"])
@pytest.mark.parametrize("blocks,temperature", [(1, 10.0), (3, 15.0), (8, 40.0)])
def test_gumbel_max_matches_numpy_mirror(model, blocks, temperature, multi):
    ex = KernelExecutor(model("tiny"), MAX_SEQ, blocks=blocks, multi=multi)
    seed = 20240 + blocks
    toks, logits = sample_on_device(ex, 7, 16, temperature, seed)
    not_greedy = 0
    for pos, (tok, lg) in enumerate(zip(toks, logits)):
        assert np.isfinite(lg).all()
        scores = gumbel_max_scores(lg, temperature, seed & 0x7FFFFFFF, pos)
        top2 = np.sort(scores)[-2:]
        want = int(np.argmax(scores))
        # NumPy's float32 log and the kernel's logf may differ by an ulp: a near-tie could flip
        assert tok == want or (top2[1] - top2[0] < 1e-5 and scores[tok] == top2[0]), (
            f"position {pos}: kernel sampled {tok}, the mirror's argmax is {want}")
        not_greedy += tok != int(np.argmax(lg))
    # the noise must matter, or this test could not tell Gumbel-max from argmax
    assert not_greedy >= 3, f"only {not_greedy} of 16 sampled tokens differ from the argmax"


# (seed, position, token) whose hash has all of its top 24 bits set, found by a search with mix32
# above. The kernel's u used to be ((h >> 8) + 0.5f) / 2^24, which rounds up to exactly 1.0f there,
# so the token's noise -log(-log(u)) was +inf and it was sampled whatever its logit (on a
# 49152-token vocabulary: at ~0.3% of sampled steps). Now u = ((h >> 9) + 0.5f) / 2^23 < 1.
SATURATED_HASH = (166, 41, 644)


def test_gumbel_noise_is_finite_where_the_hash_saturates(model):
    seed, pos, token = SATURATED_HASH
    s = mix32(np.uint32(seed) ^ np.uint32(0x9E3779B9))
    assert int(mix32(mix32(s ^ np.uint32(pos)) ^ np.uint32(token)) >> np.uint32(8)) == (1 << 24) - 1
    g = gumbel_noise(seed, pos, 1000)
    assert np.isfinite(g).all() and g[token] == g.max()  # the largest noise, but finite
    ex = KernelExecutor(model("tiny"), MAX_SEQ, blocks=3)
    ex.reset()
    ex.poison()
    res = ex.step(5, pos, DeviceSample(1.0, seed))  # the cache below pos holds zeros: finite
    logits = ex.logits()
    # the token is hopeless (p ~ e^-66 at T = 1): even its 1-in-2^23 noise (16.6) cannot lift it
    assert logits.max() - logits[token] > 40
    assert res.token != token
    assert res.token == int(np.argmax(gumbel_max_scores(logits, 1.0, seed, pos)))


def test_seeds_reproduce_and_differ(model):
    ex = KernelExecutor(model("qwen2-tiny"), MAX_SEQ, blocks=3)
    a, _ = sample_on_device(ex, 11, 16, 15.0, seed=1)
    b, _ = sample_on_device(ex, 11, 16, 15.0, seed=1)
    c, _ = sample_on_device(ex, 11, 16, 15.0, seed=2)
    assert a == b
    assert a != c


# ================================================================================================
# NaN in the logits
# ================================================================================================
def with_weight(m, name: str, fn):
    """A copy of LoadedModel ``m`` whose tensor ``name`` is replaced by fn(float32 copy)."""
    w = dict(m.weights)
    w[name] = fn(np.asarray(m.weights[name], np.float32).copy()).astype(BF16)
    return dataclasses.replace(m, weights=w)


@pytest.mark.parametrize("multi", [False, True], ids=["emulator", "emulator-multi"])
def test_nan_final_norm_raises_on_device_and_host(model, multi):
    m = with_weight(model("tiny"), "model.norm.weight", lambda a: np.full_like(a, np.nan))
    ex = KernelExecutor(m, MAX_SEQ, blocks=3, multi=multi)
    for sample in (DeviceSample(0.0, 0), DeviceSample(0.8, 5)):
        ex.reset()
        with pytest.raises(NumericalError, match="NaN in the logits at position 0"):
            ex.step(3, 0, sample)
        assert int(ex.read_buffer("control")[State.TOKEN]) == -1
    # host sampling (top-k is not a kernel sampler): the host's sampler sees the NaN logits
    ex.reset()
    res = ex.step(3, 0)
    assert np.isnan(res.logits).all()
    params = SamplingParams(max_new_tokens=4, temperature=0.8, top_k=5, seed=1)
    with pytest.raises(NumericalError, match="NaN"):
        list(Engine(ex).generate_ids([3, 4], params))


@pytest.mark.parametrize("multi", [False, True], ids=["emulator", "emulator-multi"])
def test_a_nan_steps_token_is_never_embedded(model, multi):
    """A NaN step leaves -1 in the state (the host's sign of the NaN); the step launched again
    as it is (the bench replays launches without the host) must not read the embedding table
    at row -1: EMBED records BAD_TOKEN and every block stops."""
    m = with_weight(model("tiny"), "model.norm.weight", lambda a: np.full_like(a, np.nan))
    ex = KernelExecutor(m, MAX_SEQ, blocks=3, multi=multi)
    ex.reset()
    with pytest.raises(NumericalError):
        ex.step(3, 0, DeviceSample(0.0, 0))
    assert int(ex.read_buffer("control")[State.TOKEN]) == -1
    with pytest.raises(KernelError, match=r"EMBED.* was given token -1, outside the vocabulary "
                                          rf"\[0, {m.config.vocab_size}\)"):
        ex.step(-1, 1, DeviceSample(0.0, 0))  # the state on the device as the NaN step left it
    control = ex.read_buffer("control")
    assert int(control[STATE_WORDS + Err.CODE]) == ErrCode.BAD_TOKEN


@pytest.mark.parametrize("blocks,row", [(1, 0), (3, 999), (8, 500)])
@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_one_nan_logit_is_detected_on_device(model, blocks, row, temperature):
    """A single NaN row of the (untied) LM head: exactly one NaN logit, in the first, last or a
    middle tile; the tile's partial and the ticket's reduction must both let it through."""
    def nan_row(a):
        a[row] = np.nan
        return a

    m = with_weight(model("llama3-tiny"), "lm_head.weight", nan_row)
    ex = KernelExecutor(m, MAX_SEQ, blocks=blocks)
    ex.reset()
    ex.poison()
    with pytest.raises(NumericalError):
        ex.step(9, 0, DeviceSample(temperature, 3))
    logits = ex.logits()
    assert np.flatnonzero(np.isnan(logits)).tolist() == [row]


# ================================================================================================
# Poisoned activation buffers: every element a step should write is written
# ================================================================================================
@pytest.mark.parametrize("arch,blocks,splits", [("tiny", 8, 5), ("qwen3-tiny", 3, None),
                                                ("qwen2-tiny", 2, 3)])
@pytest.mark.parametrize("multi", [False, True], ids=["emulator", "emulator-multi"])
def test_every_activation_element_is_written(model, reference, arch, blocks, splits, multi):
    fed, ref = reference(arch)
    ex = KernelExecutor(model(arch), MAX_SEQ, blocks=blocks, attn_splits=splits, multi=multi)
    c, S, B = ex.config, ex.program.attn_splits, ex.blocks
    # sizes from the config, independently of the program's own buffer_sizes()
    expect = {"residual": c.hidden_size, "q": c.num_heads * c.head_dim,
              "attn_o": c.num_kv_heads * S * c.group_size * c.head_dim,
              "attn_ml": c.num_kv_heads * S * c.group_size * 2,
              "ffn_h": c.intermediate_size, "logits": c.vocab_size, "lm_part": 2 * B}
    if c.qk_norm:  # late q/k: the step's raw keys
        expect["k_raw"] = c.num_kv_heads * c.head_dim
    # attn: the merged attention output, written only by a step that merges by ticket
    # (tests/kernel/test_merge_ticket.py; never in these tiny programs)
    # (residual_in, the residual's bf16 copy, exists in tensor-core builds only:
    # test_tensor_cores.py test_mat_muls_read_bf16_inputs_their_producers_store; partials,
    # the input slices' sums, in sliced tensor-core programs only: test_input_slices.py)
    assert ex.program.merge_ticket_min == 0 and "residual_in" not in ex.buffers
    assert "partials" not in ex.buffers
    assert set(expect) <= set(ACTIVATIONS)
    assert set(ACTIVATIONS) - set(expect) <= {"k_raw", "attn", "residual_in", "partials"}
    ex.reset()
    for pos, tok in enumerate(fed[:S + 3]):  # positions below, at and past the split count
        ex.poison()
        for name in expect:
            assert np.isnan(ex.read_buffer(name)).all(), f"{name} was not poisoned"
        res = ex.step(tok, pos)
        buf = {name: ex.read_buffer(name) for name in expect}
        for name, n in expect.items():
            assert buf[name].shape == (n,), name
            # lm_part's odd words are int32 token ids (an empty tile's -1 has NaN bits), so
            # compare bit patterns with the poison instead of testing for NaN
            nan = np.flatnonzero(buf[name].view(np.uint32) == POISON_BITS)
            assert not len(nan), (f"{ex.name} position {pos}: {name} has {len(nan)} unwritten "
                                  f"(NaN) elements, first at {nan[0]}")
        for name in ("residual", "q", "attn_o", "ffn_h", "logits"):
            assert not np.isnan(buf[name]).any(), name
            assert np.isfinite(buf[name]).all(), name
        # attention partials: (max, sum) per (KV head, split, query head); an empty split has
        # max = -inf and sum 0, a non-empty one is finite with sum >= 1 (its max term is 1)
        ml = buf["attn_ml"].reshape(c.num_kv_heads, S, c.group_size, 2)
        for s, (t0, t1) in enumerate(split_ranges(pos + 1, S, ex.program.attn_min_chunk)):
            if t1 <= t0:
                assert (ml[:, s, :, 0] == -np.inf).all() and (ml[:, s, :, 1] == 0).all()
            else:
                assert np.isfinite(ml[:, s]).all() and (ml[:, s, :, 1] >= 1).all()
        # LM-head partials: each block's (best logit, its id as float bits) over its vocab tile
        part = buf["lm_part"].reshape(B, 2)
        ids = part[:, 1].copy().view(np.int32)
        for b in range(B):
            lm = ex.program.queues[b][-1]  # the LM head ends every queue
            assert lm.op.name == "RMS_LM_HEAD" and lm.arg("slot") == b
            lo, hi = lm.tile
            if hi > lo:
                assert ids[b] == lo + int(np.argmax(res.logits[lo:hi]))
                assert part[b, 0] == res.logits[ids[b]]
            else:
                assert ids[b] == -1 and part[b, 0] == -np.inf
        assert relative_error(res.logits, ref[pos]) <= RTOL_OF_MAX
        assert int(ex.read_buffer("out_tokens")[pos]) == int(np.argmax(res.logits))
        assert math.isfinite(float(np.max(res.logits)))
