"""ATTENTION at any context (issue 8): one decode step at position p over a KV cache that already
holds p positions, kernel (emulator) against the NumPy reference, for p + 1 in {1, 2, 127, 128,
129, 1024, 4096} - a tile of T_TILE = 128 positions, its boundary, long and very long contexts -
and for splits that put unit boundaries off the tile grid.

Filling 4096 positions by stepping the emulator would take minutes, so both caches are written
directly with the same random bf16 K/V (the emulator's device memory is host memory); the step
then writes position p itself, as in generation, and reads 0..p.
"""

from __future__ import annotations

import numpy as np
import pytest

from monokernel.kernel.executor import KernelExecutor
from monokernel.model.loader import load_model
from monokernel.model.reference import ReferenceModel, bf16_round

from helpers.kernel import RTOL_OF_MAX, used_splits

MAX_SEQ = 4096


@pytest.fixture(scope="module")
def tiny(synth_dir):
    return load_model(synth_dir("qwen2-tiny"), progress=False)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


@pytest.fixture(scope="module")
def gqa(synth_dir):
    return load_model(synth_dir("qwen3-gqa-tiny"), progress=False)


@pytest.mark.parametrize("n_pos", [1, 2, 127, 128, 129, 1024, 4096])
@pytest.mark.parametrize("splits,min_chunk", [(1, 1), (3, 1), (8, 1), (16, 128), (None, None)],
                         ids=["s1", "s3", "s8", "s16-min128", "default"])
def test_one_step_over_a_filled_cache(tiny, n_pos, splits, min_chunk):
    """min_chunk 128 with 16 splits: 129 positions use two splits, 4096 use 16 of 256; the
    default is the scheduler's policy for a 4096-position cache."""
    one_step_over_a_filled_cache(tiny, n_pos, splits, min_chunk, blocks=3)


@pytest.mark.parametrize("n_pos", [2, 129, 1024, 4096])
@pytest.mark.parametrize("splits,min_chunk", [(4, 1), (16, 64)], ids=["s4", "s16-min64"])
def test_one_step_over_a_filled_cache_merged_by_ticket(gqa, n_pos, splits, min_chunk):
    """Two KV groups on 4 blocks (2 or 8 units of one group per block), the splits merged by
    ticket from 2 used splits on (tests/kernel/test_merge_ticket.py): long contexts too."""
    one_step_over_a_filled_cache(gqa, n_pos, splits, min_chunk, blocks=4, merge_ticket_min=2)


def one_step_over_a_filled_cache(tiny, n_pos, splits, min_chunk, blocks, merge_ticket_min=None):
    cfg = tiny.config
    pos = n_pos - 1
    rng = np.random.default_rng(n_pos * 10 + (splits or 0))
    shape = (cfg.num_layers, MAX_SEQ, cfg.num_kv_heads, cfg.head_dim)
    k = bf16_round(rng.standard_normal(shape, dtype=np.float32))
    v = bf16_round(rng.standard_normal(shape, dtype=np.float32))
    ref = ReferenceModel(cfg, tiny.weights, MAX_SEQ)
    ref.k_cache[:] = k
    ref.v_cache[:] = v
    want = ref.forward([7], pos)[0]
    ex = KernelExecutor(tiny, MAX_SEQ, blocks=blocks, attn_splits=splits,
                        attn_min_chunk=min_chunk, merge_ticket_min=merge_ticket_min)
    assert ex.program.merge_ticket_min == (merge_ticket_min or 0)
    if min_chunk is None:
        assert ex.program.attn_min_chunk > 1  # the default policy reads whole rounds
    ex.reset()
    ex.poison()
    ex.buffers["k_cache"][...] = bf16_bits(k)
    ex.buffers["v_cache"][...] = bf16_bits(v)
    got = ex.step(7, pos).logits
    assert np.isfinite(got).all()
    if merge_ticket_min:  # the merged vector is written exactly when the ticket merges
        attn = ex.read_buffer("attn")
        ticket = used_splits(n_pos, splits, min_chunk) >= merge_ticket_min
        assert np.isfinite(attn).all() if ticket else np.isnan(attn).all()
    err = float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))
    assert err <= RTOL_OF_MAX, f"context {n_pos}, {splits} splits: rel error {err:.3g}"
    # the step wrote position pos of the cache as the reference did (within a bf16 step)
    got_k = (ex.read_buffer("k_cache").astype(np.uint32) << 16).view(np.float32)[:, pos]
    assert np.allclose(got_k, ref.k_cache[:, pos], rtol=2 ** -7, atol=1e-3)
