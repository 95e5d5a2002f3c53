"""The reference model's batched forward over a paged K/V cache (issue 17): one step of rows
from many sequences, each row attending to its own sequence's pages up to its own position.

What it must keep: the numbers of the old contiguous one-sequence forward (a thin case of it),
and batch invariance, bit for bit, whenever a step has two rows or more (OpenBLAS's
matrix-matrix product rounds a row alike for any number of rows >= 2; attention reduces each
row over its own context, padded to a length its position fixes): a sequence's logits are
the same beside 1, 5 or 15 others, at any chunk split and in any page layout.
"""

from __future__ import annotations

import numpy as np
import pytest

from monokernel.model.reference import ReferenceModel, bf16_round, rms_norm, rope, silu


def contiguous_forward(ref: ReferenceModel, tokens, start: int, k_cache, v_cache):
    """The forward pass as it was before pages: one sequence, a contiguous cache, attention
    with a causal mask over [queries, keys] (what the paged one must equal to float32
    rounding)."""
    c = ref.cfg
    tokens = np.asarray(tokens)
    n, end = len(tokens), start + len(tokens)
    x = ref.embed[tokens]
    cos, sin = ref.cos[start:end], ref.sin[start:end]
    mask = np.where(np.arange(end)[None, :] <= np.arange(start, end)[:, None], np.float32(0),
                    np.float32(-np.inf))
    scale = np.float32(1 / np.sqrt(c.head_dim))
    for li, L in enumerate(ref.layers):
        h = rms_norm(x, L["in_norm"], c.rms_norm_eps)
        qkv = h @ L["wqkv"].T + (L["bqkv"] if c.attention_bias else 0)
        q = qkv[:, :c.q_dim].reshape(n, c.num_heads, c.head_dim)
        k = qkv[:, c.q_dim:c.q_dim + c.kv_dim].reshape(n, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_dim + c.kv_dim:].reshape(n, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = rms_norm(q, L["q_norm"], c.rms_norm_eps)
            k = rms_norm(k, L["k_norm"], c.rms_norm_eps)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k_cache[li, start:end], v_cache[li, start:end] = bf16_round(k), bf16_round(v)
        K, V = k_cache[li, :end], v_cache[li, :end]
        qg = q.reshape(n, c.num_kv_heads, c.group_size, c.head_dim)
        s = np.einsum("nkgd,tkd->nkgt", qg, K) * scale + mask[:, None, None]
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("nkgt,tkd->nkgd", p, V).reshape(n, c.q_dim) @ L["wo"].T
        h = rms_norm(x, L["post_norm"], c.rms_norm_eps)
        x = x + (silu(h @ L["wg"].T) * (h @ L["wu"].T)) @ L["wd"].T
    return rms_norm(x, ref.final_norm, c.rms_norm_eps) @ ref.lm_head.T


@pytest.mark.parametrize("shape", ["tiny", "qwen2-tiny", "qwen3-gqa-tiny"])
def test_the_paged_forward_equals_the_contiguous_one(synth_model, shape):
    m = synth_model(shape)
    c = m.config
    ref = ReferenceModel(c, m.weights, 40, page_size=4)
    kc = np.zeros((c.num_layers, 40, c.num_kv_heads, c.head_dim), np.float32)
    vc = np.zeros_like(kc)
    rng = np.random.default_rng(1)
    ids = rng.integers(3, c.vocab_size, 23).tolist()
    for start, stop in ((0, 11), (11, 12), (12, 23)):  # a chunk, a decode step, a chunk
        got = ref.forward(ids[start:stop], start)
        want = contiguous_forward(ref, ids[start:stop], start, kc, vc)
        # float32 rounding, amplified where it moves a K/V value across a bf16 rounding
        # boundary (one bf16 step is 2**-8 of the value)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
        assert got.dtype == np.float32 and (np.argmax(got, -1) == np.argmax(want, -1)).all()
    # the contiguous view of forward()'s own pages holds the same K/V
    np.testing.assert_allclose(ref.k_cache[:, :23], kc[:, :23], rtol=0, atol=1e-2)


def _sequences(c, n: int, rng) -> list[list[int]]:
    return [rng.integers(3, c.vocab_size, int(rng.integers(3, 20))).tolist() for _ in range(n)]


def _run(ref: ReferenceModel, pages: range, seqs: list[list[int]], chunk: int,
         shuffle_pages: bool, rng) -> list[np.ndarray]:
    """Every sequence's logits at every position, computed in steps of up to ``chunk`` rows per
    sequence, all sequences side by side in each step: [len(seq), vocab] each."""
    ps = ref.page_size
    free = list(pages)
    if shuffle_pages:
        rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-len(s) // ps))] for s in seqs]
    out = [[] for _ in seqs]
    done = [0] * len(seqs)
    while any(d < len(s) for d, s in zip(done, seqs)):
        toks, pos, who = [], [], []
        for i, s in enumerate(seqs):
            stop = min(done[i] + chunk, len(s))
            toks += s[done[i]:stop]
            pos += range(done[i], stop)
            who += [i] * (stop - done[i])
            done[i] = stop
        logits = ref.forward_rows(toks, pos, who, tables)
        for row, i in enumerate(who):
            out[i].append(logits[row])
    return [np.stack(o) for o in out]


@pytest.mark.parametrize("shape", ["tiny", "qwen3-gqa-tiny"])
def test_a_sequence_s_logits_do_not_depend_on_its_batch(synth_model, shape):
    """Sequence 0 alone (chunks of 5: every step has two rows or more but its last one, padded),
    then beside 1, 5 and 15 others, in chunks of 1 (decode-like steps), 3 and 32 (whole
    prompts), in shuffled pages: its logits are bitwise the same every time."""
    m = synth_model(shape)
    ref = ReferenceModel(m.config, m.weights, 32, page_size=4)
    pages = ref.add_pages(16 * 8)
    rng = np.random.default_rng(2)
    seqs = _sequences(m.config, 16, rng)
    alone = _run(ref, pages, seqs[:1], 5, False, rng)[0]
    for others, chunk in ((1, 1), (5, 3), (15, 32), (15, 1)):
        got = _run(ref, pages, seqs[:1 + others], chunk, True, rng)
        assert np.array_equal(got[0], alone), (others, chunk)
        if others == 15 and chunk == 32:
            many = got
    # every other sequence too: alone equals beside 15 others
    for i in (3, 15):
        assert np.array_equal(_run(ref, pages, [seqs[i]], 2, False, rng)[0], many[i])


@pytest.mark.parametrize("pad, gather", [(8, 16), (16, 16)])
def test_attention_in_groups_keeps_a_row_s_numbers(synth_model, monkeypatch, pad, gather):
    """ReferenceModel._attend pads a row's context to a multiple of ATTN_PAD and gathers the
    pages of single rows ATTN_GATHER positions at a time. At a pad of 8 (contexts of up to 150
    in 19 lengths, a chunk's rows in one or two groups) and gathers of 16 (two decode rows a
    gather at T = 8, one past it), and at the default pad (16) with a row a gather:
    the groups cover every row once, each over a multiple of the pad past its position; a
    sequence's logits alone equal the contiguous forward's and are bitwise the same beside 3
    and 15 others in chunks of 1 and 4, and beside a row at position 149 in every step (it has
    100 tokens). Negative control: a T set by the step's last position instead fails on that
    last run (numpy's pairwise sum over more than 128 positions splits them elsewhere); the
    runs side by side do not show it (their rows keep pace, and up to 128 positions zeros
    past a row's own add in place)."""
    import monokernel.model.reference as reference

    monkeypatch.setattr(reference, "ATTN_PAD", pad)
    monkeypatch.setattr(reference, "ATTN_GATHER", gather)
    m = synth_model("qwen3-gqa-tiny")
    c = m.config
    ref = ReferenceModel(c, m.weights, 160, page_size=4)
    pages = ref.add_pages(16 * 40)
    rng = np.random.default_rng(4)
    seqs = _sequences(c, 16, rng)
    seqs[0] = rng.integers(3, c.vocab_size, 100).tolist()
    seqs[1] = rng.integers(3, c.vocab_size, 150).tolist()
    positions = np.array([0, 7, 8, 19, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    owners = np.array([0, 1, 2, 3] + [4] * 10)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(5)]
    groups = ref._attention_groups(positions, owners, tables)
    assert sorted(r for rs, _, _, _ in groups for r in rs.tolist()) == list(range(14))
    for rs, pidx, T, mask in groups:
        assert T % pad == 0 and (positions[rs] < T).all() and (positions[rs] >= T - pad).all()
        assert len(pidx) == 1 or len(pidx) * T <= gather, (len(pidx), T)
        assert mask.shape == (len(rs), 1, 1, T) and (mask.sum(-1).ravel() == T - 1 -
                                                      positions[rs]).all()
    alone = _run(ref, pages, seqs[:1], 5, False, rng)[0]
    kc = np.zeros((c.num_layers, 160, c.num_kv_heads, c.head_dim), np.float32)
    want = contiguous_forward(ref, seqs[0], 0, kc, np.zeros_like(kc))
    np.testing.assert_allclose(alone, want, rtol=0, atol=1e-3 * np.abs(want).max())
    for others, chunk in ((3, 1), (15, 4), (15, 1)):
        got = _run(ref, pages, seqs[:1 + others], chunk, True, rng)
        assert np.array_equal(got[0], alone), (others, chunk)
    # beside a row far ahead of it: position 149 of another sequence, in every step
    tables = [list(pages[:25]), list(pages[25:63])]
    far = []
    for start in range(0, 100, 4):
        toks = seqs[0][start:start + 4]
        rows = range(start, start + len(toks))
        got = ref.forward_rows(toks + [seqs[1][0]], [*rows, 149], [0] * len(toks) + [1], tables)
        far.append(got[:len(toks)])
    assert np.array_equal(np.concatenate(far), alone)


def test_a_lone_row_is_padded_unless_asked_not_to(synth_model):
    """One row alone is a matrix-vector product, which rounds otherwise: padded (the default)
    it equals the batched row bit for bit; unpadded (a lone decode step) to ~1e-5 of the
    logits' scale."""
    m = synth_model("tiny")
    ref = ReferenceModel(m.config, m.weights, 16, page_size=4)
    pages = list(ref.add_pages(8))
    ids = [5, 9, 300, 41, 7]
    tables = [pages[:2], pages[2:4]]
    both = ref.forward_rows(ids[:4] + ids[:4], list(range(4)) * 2, [0] * 4 + [1] * 4, tables)
    pair = ref.forward_rows([ids[4], ids[4]], [4, 4], [0, 1], tables)
    padded = ref.forward_rows([ids[4]], [4], [0], tables)
    assert np.array_equal(both[:4], both[4:]) and np.array_equal(padded[0], pair[0])
    lone = ref.forward_rows([ids[4]], [4], [0], tables, pad_lone=False)
    np.testing.assert_allclose(lone[0], pair[0], rtol=0, atol=1e-4 * np.abs(pair).max())
    assert ref.forward_rows([ids[4]], [4], [0], tables, logit_rows=[]) is None


class _PositionalBLAS:
    """A weight whose product rounds a row by its position in calls of more than ``alike``
    rows (as OpenBLAS's Haswell sgemm does past 8 rows), never by the other rows' values."""

    __array_ufunc__ = None  # x @ this: numpy defers to __rmatmul__

    def __init__(self, n: int, k: int, alike: int):
        self.shape, self.alike = (n, k), alike
        self.w = np.random.default_rng(5).standard_normal((n, k)).astype(np.float32)

    @property
    def T(self):
        return self

    def __rmatmul__(self, x):
        out = x @ self.w.T
        if x.shape[-2] > self.alike:  # position i of the call: its last bits moved
            out = out * (1 + 1e-6 * np.arange(x.shape[-2], dtype=np.float32)[:, None])
        return out


def test_products_run_in_blocks_whose_rows_round_alike(synth_model):
    """ReferenceModel.row_block probes the largest of ROW_BLOCKS whose call gives every
    position the same numbers: 8 on a BLAS that rounds by position past 8 rows, 1 (a call a
    row) on one that does from 2; and on this machine's BLAS, whatever it probes, a row of
    ``blocked`` is bitwise the same whatever rows come with it (alone, with 3, 16 or 39
    others, at any offset), for the tiny model's and SmolLM2's shapes."""
    m = synth_model("tiny")
    ref = ReferenceModel(m.config, m.weights, 16, page_size=4)
    assert ref.row_block(_PositionalBLAS(96, 96, 8)) == 8
    assert ReferenceModel(m.config, m.weights, 16).row_block(_PositionalBLAS(96, 96, 1)) == 1
    rng = np.random.default_rng(7)
    for n, k in ((96, 96), (1536, 576), (576, 1536)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        x = rng.standard_normal((40, k)).astype(np.float32)
        whole = ref.blocked(x, w)
        assert ref.row_block(w) in ReferenceModel.ROW_BLOCKS + (1,)
        for lo, hi in ((0, 1), (3, 7), (5, 21), (39, 40), (1, 40)):
            assert np.array_equal(ref.blocked(x[lo:hi], w), whole[lo:hi]), (n, k, lo, hi)
