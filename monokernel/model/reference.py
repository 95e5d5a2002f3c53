"""NumPy forward pass: the golden model every backend is compared against.

Same numerics as the kernel: weights are the bf16 values (upcast once to float32), activations
and the residual stream float32, K and V rounded to bf16 when written to the cache, all math in
float32. Llama, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig
from .loader import BF16


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bf16 (ties to even) -> float32, as the kernel stores K/V."""
    return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


def bf16_near_midpoint(x: np.ndarray, window: float = 1e-3) -> np.ndarray:
    """Where x lies within ``window`` of a bf16 ulp of a rounding midpoint: values whose bf16
    rounding the last fp32 bits decide (an oracle that sums in another order than the kernel
    may round them to the other neighbour)."""
    w = np.abs(np.asarray(x, np.float32)).astype(np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(w, 1e-30))) - 7)
    return np.abs((w / ulp) % 1 - 0.5) < window


def as_float32(a, out: np.ndarray | None = None) -> np.ndarray:
    """The float32 values of a weight, written into ``out`` if given. bf16 -> float32 is exact:
    the bf16 bits are the float32's high half, so it is a shift of the bits (what ml_dtypes'
    cast computes), straight into the output with no temporary."""
    a = np.asarray(a)
    if a.dtype != BF16:
        if out is None:
            return np.asarray(a, dtype=np.float32)
        out[...] = a
        return out
    if out is None:
        out = np.empty(a.shape, np.float32)
    np.left_shift(a.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
    return out


def concat_float32(parts) -> np.ndarray:
    """``np.concatenate`` of the parts' float32 values, each converted into its rows."""
    parts = [np.asarray(x) for x in parts]
    out = np.empty((sum(len(x) for x in parts),) + parts[0].shape[1:], np.float32)
    row = 0
    for x in parts:
        as_float32(x, out[row:row + len(x)])
        row += len(x)
    return out


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(var + np.float32(eps))) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1) + np.exp(-x))


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE (HF layout). x [n, heads, d]; cos/sin [n, d/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


class ReferenceModel:
    """Prefill and decode over a paged K/V cache, one sequence or many at once.

    ``forward_rows(tokens, positions, seqs, tables)`` runs one step of rows: row i feeds token
    ``tokens[i]`` at position ``positions[i]`` of sequence ``seqs[i]``, whose K/V live in the
    pages ``tables[seqs[i]]`` of the pool (page j holds positions [j * page_size, (j + 1) *
    page_size)). Every linear layer is one matrix product over all rows (the weights are read
    once per step), attention runs each row over its own sequence up to its own position
    (causal inside a chunk, GQA). ``forward(tokens, start_pos)`` is its one-sequence case, on
    pages of its own: float32 logits [len(tokens), vocab] (None with ``logits=False``); the
    cache then holds positions [0, start_pos + len(tokens)).

    Batch invariance: BLAS sums a row of ``X @ W.T`` in an order that can depend on where the
    row sits in the call and on how many rows the call has, never on the other rows' values
    (OpenBLAS 0.3.31 sgemm on SkylakeX: any 16 rows or more alike; on Haswell, which AMD EPYC
    runs too: rows at positions 0-5 and 6-11 of every 12 in two orders, the last M % 12 in a
    third, so a row moves by ~1e-7 of its scale with the rows beside it). So every product of
    two rows or more runs in blocks of ``row_block`` rows, one BLAS call of the same shape per
    block (zero rows pad the last), where row_block is the largest of ROW_BLOCKS whose call
    gives every position the same numbers, probed once per weight shape on this machine's BLAS
    (``row_block``); and attention reduces each row over its own context padded to a length
    its position alone fixes, in calls of that shape whatever else is in the step (_attend):
    a row's numbers then depend on nothing but its sequence. One row alone is a
    matrix-vector product (another kernel, ~4e-5 relative); ``pad_lone`` runs it as a block
    too (about 2-3x the cost of the matrix-vector product, so a lone decode step may skip it:
    NumpyExecutor). tests/model/test_batched_reference.py checks it bit for bit."""

    ROW_BLOCKS = (64, 32, 16, 8, 4, 2)  # the row blocks row_block tries, largest first

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray],
                 max_seq_len: int | None = None, page_size: int = 16,
                 bf16_inputs: bool = False, attn_chunk: int | None = None):
        """``bf16_inputs``: every matrix product's input (the normed residual, attention's
        output, the FFN's h) rounded to bf16 first, and the residual itself before each RMS
        norm (the norms read its bf16 copy, residual_in), as a kernel built with tensor
        cores (``tensor_cores=1``) feeds them to mma; its judge. That kernel runs attention on mma
        too (megakernel.cu attention_segment): the query (normed and roped first, with late
        q/k) is rounded to bf16, and the probabilities, exp(score - the running max) over
        seg_sub(head_dim) positions at a time within each split of ``attn_chunk`` positions
        (the program's attn_min_chunk; None: one split), before their product with V; the splits
        merged in fp32 (_attention_mma). The default fp32 inputs are the judge against
        Hugging Face and of the CUDA-core kernel."""
        self.cfg = c = config
        self.bf16_inputs = bool(bf16_inputs)
        self.attn_chunk = attn_chunk
        self._row_blocks: dict[tuple, int] = {}  # row_block per weight shape
        self.max_seq_len = max_seq_len or min(c.max_position_embeddings, 4096)
        f32 = lambda name: as_float32(weights[name])  # noqa: E731
        self.embed = f32("model.embed_tokens.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else f32("lm_head.weight")
        self.final_norm = f32("model.norm.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            L = {
                "in_norm": f32(p + "input_layernorm.weight"),
                "post_norm": f32(p + "post_attention_layernorm.weight"),
                "wqkv": concat_float32(weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"),
                "wo": f32(p + "self_attn.o_proj.weight"),
                "wg": f32(p + "mlp.gate_proj.weight"),
                "wu": f32(p + "mlp.up_proj.weight"),
                "wd": f32(p + "mlp.down_proj.weight"),
            }
            if c.attention_bias:
                L["bqkv"] = concat_float32(weights[p + f"self_attn.{x}_proj.bias"] for x in "qkv")
            if c.qk_norm:
                L["q_norm"] = f32(p + "self_attn.q_norm.weight")
                L["k_norm"] = f32(p + "self_attn.k_norm.weight")
            self.layers.append(L)
        self.cos, self.sin = c.rope_table(self.max_seq_len)
        self.page_size = int(page_size)
        # forward()'s own sequence: the first pages of the pool, in order
        self.own_table = np.arange(-(-self.max_seq_len // self.page_size))
        self._pool(0)

    def _pool(self, extra_pages: int) -> None:
        """The pool [layers, pages, page_size, kv_heads, head_dim] (float32 holding bf16
        values): forward()'s own pages, then ``extra_pages`` for callers' block tables.
        np.zeros maps untouched pages lazily, so memory follows the positions written."""
        c = self.cfg
        shape = (c.num_layers, len(self.own_table) + extra_pages, self.page_size,
                 c.num_kv_heads, c.head_dim)
        self.k_pages = np.zeros(shape, np.float32)
        self.v_pages = np.zeros(shape, np.float32)

    def add_pages(self, n: int) -> range:
        """Make room for ``n`` pages beside forward()'s own (once, before any step that uses
        them; forward()'s cache is emptied): their ids in the pool."""
        self._pool(n)
        return range(len(self.own_table), len(self.own_table) + n)

    @property
    def k_cache(self) -> np.ndarray:
        """forward()'s K cache [layers, max_seq_len, kv_heads, head_dim] (a view)."""
        return self._own(self.k_pages)

    @property
    def v_cache(self) -> np.ndarray:
        return self._own(self.v_pages)

    def _own(self, pool: np.ndarray) -> np.ndarray:
        c, n = self.cfg, len(self.own_table)
        return pool[:, :n].reshape(c.num_layers, n * self.page_size, c.num_kv_heads,
                                   c.head_dim)[:, :self.max_seq_len]

    def row_block(self, w: np.ndarray) -> int:
        """The rows one BLAS call of a product with ``w`` (x @ w.T) takes: the largest of
        ROW_BLOCKS for which a call of that many identical rows gives every row the same
        numbers (one product; the order a row is summed in depends on its position, not on the
        other rows' values), else 1 (a call per row). Probed once per shape, under the BLAS
        threads of the first product (the numpy backend sets them around every forward)."""
        key = w.shape
        if key not in self._row_blocks:
            x = np.random.default_rng(0).standard_normal(w.shape[1]).astype(np.float32)
            block = 1
            for rows in self.ROW_BLOCKS:
                out = np.tile(x, (1, rows, 1)) @ w.T
                if (out == out[0, 0]).all():
                    block = rows
                    break
            self._row_blocks[key] = block
        return self._row_blocks[key]

    def blocked(self, h: np.ndarray, w: np.ndarray) -> np.ndarray:
        """h @ w.T in blocks of row_block(w) rows, one BLAS call of the same shape each (zero
        rows pad the last): every row's numbers its own, whatever rows come with it."""
        block = self.row_block(w)
        n = len(h)
        m = -(-n // block) * block
        if m != n:
            h = np.concatenate([h, np.zeros((m - n, h.shape[1]), h.dtype)])
        return (h.reshape(m // block, block, h.shape[1]) @ w.T).reshape(m, -1)[:n]

    def _attention_groups(self, positions: np.ndarray, seqs: np.ndarray, tables) -> list:
        """How _attend covers a step's rows (once a step; every layer runs the same): groups
        (rows, the pool pages each gathers [1 or rows, pages], T, the mask of positions past
        each row's own [rows, 1, 1, T]). A row at position p attends over T = p + 1 rounded up
        to a multiple of ATTN_PAD positions. A sequence's rows of one T (a prompt chunk) share
        one gather of its pages; the single rows of many sequences (decode) gather theirs
        together, at most ATTN_GATHER positions at a time. Past the end of its table a row
        gathers its first page again: masked, like every position past its own."""
        by_t: dict[int, dict[int, list[int]]] = {}
        for r, (p, s) in enumerate(zip(positions.tolist(), seqs.tolist())):
            by_t.setdefault((p // ATTN_PAD + 1) * ATTN_PAD, {}).setdefault(s, []).append(r)
        groups = []
        for T, by_seq in by_t.items():
            n_pages = -(-T // self.page_size)

            def pages(s: int) -> list[int]:
                table = [int(x) for x in tables[s][:n_pages]]
                return table + [table[0]] * (n_pages - len(table))

            lone = [rows[0] for rows in by_seq.values() if len(rows) == 1]
            parts = [(rows, [pages(s)]) for s, rows in by_seq.items() if len(rows) > 1]
            step = max(1, ATTN_GATHER // T)
            parts += [(lone[i:i + step], [pages(int(seqs[r])) for r in lone[i:i + step]])
                      for i in range(0, len(lone), step)]
            for rows, pidx in parts:
                rs = np.array(rows, np.int64)
                mask = np.arange(T) > positions[rs][:, None, None, None]
                groups.append((rs, np.array(pidx, np.int64), T, mask))
        return groups

    def _attend(self, li: int, q: np.ndarray, groups: list, scale: np.float32,
                out: np.ndarray) -> None:
        """fp32 attention of a step's rows (q [n, kvh, g, d], roped) into ``out`` [n, kvh, g,
        d], in a few stacked products per group of _attention_groups rather than a call per
        row. A row attends over T positions, those past its own masked to -inf before the
        softmax (they add exact zeros), so its numbers come from calls whose shapes, (g x d) @
        (d x T) and (g x T) @ (T x d) per head and sums over T, depend on its position alone:
        the same whatever rows share the step (a stacked matmul is a BLAS call per head and
        row)."""
        c = self.cfg
        for rs, pidx, T, mask in groups:
            K = self.k_pages[li][pidx].reshape(len(pidx), -1, c.num_kv_heads, c.head_dim)
            V = self.v_pages[li][pidx].reshape(len(pidx), -1, c.num_kv_heads, c.head_dim)
            sc = np.matmul(q[rs], K[:, :T].transpose(0, 2, 3, 1)) * scale  # [rows, kvh, g, T]
            sc = np.where(mask, np.float32(-np.inf), sc)
            sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
            sc = sc / sc.sum(axis=-1, keepdims=True)
            out[rs] = np.matmul(sc, V[:, :T].transpose(0, 2, 1, 3))  # [rows, kvh, g, d]

    def reset(self) -> None:
        self.k_pages[:] = 0
        self.v_pages[:] = 0

    def forward(self, tokens, start_pos: int, logits: bool = True) -> np.ndarray | None:
        n = len(tokens)
        end = start_pos + n
        if end > self.max_seq_len:
            raise ValueError(f"positions up to {end} exceed the cache of {self.max_seq_len}")
        # one row alone stays a matrix-vector product (the fast decode step, as before)
        return self.forward_rows(tokens, np.arange(start_pos, end), np.zeros(n, np.int64),
                                 [self.own_table], None if logits else [], pad_lone=False)

    def forward_rows(self, tokens, positions, seqs, tables, logit_rows=None, *,
                     pad_lone: bool = True) -> np.ndarray | None:
        """One step of rows (see the class). ``tables[s]``: the pool pages of sequence s, in
        position order, covering every row's position. Rows of one sequence come in position
        order; each row reads the K/V of its own sequence at positions <= its own (written by
        this step or an earlier one). ``logit_rows``: the rows whose logits are returned
        (float32 [len(logit_rows), vocab]; None: every row; empty: none, returns None)."""
        c = self.cfg
        tokens = np.asarray(tokens, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        seqs = np.asarray(seqs, dtype=np.int64)
        n, ps = len(tokens), self.page_size
        if n == 0:
            raise ValueError("a step needs at least one row")
        if positions.min() < 0 or positions.max() >= self.max_seq_len:
            raise ValueError(f"positions up to {positions.max() + 1} exceed the cache of "
                             f"{self.max_seq_len}")
        def norm_in(x: np.ndarray) -> np.ndarray:
            """An RMS op's input: the residual, as bf16 in bf16_inputs mode (residual_in)."""
            return bf16_round(x) if self.bf16_inputs else x

        def linear(h: np.ndarray, w: np.ndarray) -> np.ndarray:
            if self.bf16_inputs:
                h = bf16_round(h)
            if len(h) == 1 and not pad_lone:  # the matrix-vector product (see the class)
                return h @ w.T
            return self.blocked(h, w)

        pages = np.array([tables[s][p // ps] for s, p in zip(seqs, positions)], np.int64)
        offs = positions % ps
        if self.bf16_inputs:  # attention per row, as the tensor-core kernel rounds it
            order = list(dict.fromkeys(seqs.tolist()))  # sequences in order of first row
            rows_of = {s: np.flatnonzero(seqs == s) for s in order}
        else:  # fp32 attention over groups of rows (_attend)
            groups = self._attention_groups(positions, seqs, tables)
        x = self.embed[tokens]  # [n, H]
        cos, sin = self.cos[positions], self.sin[positions]
        scale = np.float32(1.0 / np.sqrt(c.head_dim))
        attn = np.empty((n, c.num_kv_heads, c.group_size, c.head_dim), np.float32)
        for li, L in enumerate(self.layers):
            h = rms_norm(norm_in(x), L["in_norm"], c.rms_norm_eps)
            qkv = linear(h, L["wqkv"])
            if c.attention_bias:
                qkv = qkv + L["bqkv"]
            q = qkv[:, :c.q_dim].reshape(n, c.num_heads, c.head_dim)
            k = qkv[:, c.q_dim:c.q_dim + c.kv_dim].reshape(n, c.num_kv_heads, c.head_dim)
            v = qkv[:, c.q_dim + c.kv_dim:].reshape(n, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = rms_norm(q, L["q_norm"], c.rms_norm_eps)
                k = rms_norm(k, L["k_norm"], c.rms_norm_eps)
            q = rope(q, cos, sin).reshape(n, c.num_kv_heads, c.group_size, c.head_dim)
            k = rope(k, cos, sin)
            self.k_pages[li, pages, offs] = bf16_round(k)
            self.v_pages[li, pages, offs] = bf16_round(v)
            if not self.bf16_inputs:
                self._attend(li, q, groups, scale, attn)
            else:
                for s, rows in rows_of.items():
                    # the sequence's positions [0, its last row's], gathered once per layer
                    top = int(positions[rows[-1]]) + 1
                    used = np.asarray(tables[s][:-(-top // ps)])
                    K = self.k_pages[li, used].reshape(-1, c.num_kv_heads, c.head_dim)
                    V = self.v_pages[li, used].reshape(-1, c.num_kv_heads, c.head_dim)
                    for r in rows:  # each row over exactly its own context, as the kernel
                        t = int(positions[r]) + 1
                        attn[r] = _attention_mma(q[r], K[:t], V[:t], scale,
                                                 self.attn_chunk or t)
            x = x + linear(attn.reshape(n, c.q_dim), L["wo"])
            h = rms_norm(norm_in(x), L["post_norm"], c.rms_norm_eps)
            x = x + linear(silu(linear(h, L["wg"])) * linear(h, L["wu"]), L["wd"])
        if logit_rows is not None:
            logit_rows = np.asarray(logit_rows, dtype=np.int64)
            if len(logit_rows) == 0:
                return None
            x = x[logit_rows]
        h = rms_norm(norm_in(x), self.final_norm, c.rms_norm_eps)
        return linear(h, self.lm_head).astype(np.float32)


# fp32 attention (ReferenceModel._attend): a row's context is padded to a multiple of ATTN_PAD
# positions; one gather of single rows' pages covers at most ATTN_GATHER positions, so that what
# a group's products read stays in a small CPU's L2 (at 32 decode rows of context 64-128, 16 and
# 1024 took a third off the attention of 64 and 32768: benchmarks/NOTES.md, "The CPU serving
# ratio at 64 tokens")
ATTN_PAD = 16
ATTN_GATHER = 1024


# Positions of one online-softmax step of the tensor-core attention at head_dim D (isa.seg_sub,
# which the kernel's header takes; the reference stays free of the kernel's imports).
def seg_sub(head_dim: int) -> int:
    return 64 if head_dim <= 64 else 32


def _attention_mma(q: np.ndarray, K: np.ndarray, V: np.ndarray, scale: np.float32,
                   chunk: int, ties: np.ndarray | None = None) -> np.ndarray:
    """One row's attention as the tensor-core kernel rounds it (ReferenceModel bf16_inputs
    without late q/k): q [kvh, g, d] against its context's K, V [t, kvh, d]. ``ties`` (bool
    [kvh, g], the tests): set where a head's bf16 query or probabilities lie next to a
    rounding midpoint (bf16_near_midpoint), so the kernel's own sums may round them the other
    way and its output differ from this one's in more than the last bits."""
    t = len(K)
    if ties is not None:
        ties |= bf16_near_midpoint(q).any(axis=-1)
    sc = np.matmul(bf16_round(q), K.transpose(1, 2, 0)) * scale  # [kvh, g, t]
    parts = []
    sub = seg_sub(q.shape[-1])
    for t0 in range(0, t, chunk):  # a split: running (max, sum, outputs) per sub-tile
        t1 = min(t, t0 + chunk)
        m = np.full(sc.shape[:2] + (1,), -np.inf, np.float32)
        l = np.zeros_like(m)
        o = np.zeros(q.shape, np.float32)
        for b0 in range(t0, t1, sub):
            s = sc[..., b0:min(t1, b0 + sub)]
            mn = np.maximum(m, s.max(axis=-1, keepdims=True))
            corr = np.exp(m - mn)
            p = np.exp(s - mn)
            if ties is not None:
                ties |= bf16_near_midpoint(p).any(axis=-1)
            l = l * corr + p.sum(axis=-1, keepdims=True)
            o = o * corr + np.matmul(bf16_round(p), V[b0:b0 + s.shape[-1]].transpose(1, 0, 2))
            m = mn
        parts.append((m, l, o))
    M = np.max([m for m, _, _ in parts], axis=0)
    w = [np.exp(m - M) for m, _, _ in parts]
    return (sum(o * x for (_, _, o), x in zip(parts, w))
            / sum(l * x for (_, l, _), x in zip(parts, w))).astype(np.float32)


def greedy_reference_run(model, tokens: list[int], n_steps: int, *,
                         cache: bool = True) -> tuple[list[int], np.ndarray]:
    """Feed ``tokens`` one per step, then the reference's own greedy token, for ``n_steps``
    steps: (the token fed at each step, the logits [n_steps, vocab]).

    A pure function of the checkpoint, the tokens and this module; the GPU check computes it
    once in its prepare step (building the float32 model of a 1B checkpoint touches ~5 GB) and
    its later processes read it back from $MONOKERNEL_CACHE/reference/. The key covers the
    config, each weight file's name, size and modification time, the tokens, the steps and the
    source of this file and of the loader, so a changed checkpoint or reference is recomputed."""
    import hashlib
    import json
    from pathlib import Path

    path = None
    if cache and getattr(model, "path", None) is not None:
        from .cache import cache_dir

        folder = Path(model.path)
        h = hashlib.sha256()
        for src in (Path(__file__), Path(__file__).with_name("loader.py")):
            h.update(src.read_bytes())
        h.update(json.dumps(model.config.to_hf_dict(), sort_keys=True).encode())
        for f in sorted(folder.glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        h.update(repr((list(map(int, tokens)), int(n_steps))).encode())
        path = cache_dir() / "reference" / f"{h.hexdigest()[:32]}.npz"
        if path.is_file():
            try:
                with np.load(path) as z:
                    return [int(t) for t in z["fed"]], z["logits"]
            except (OSError, ValueError, KeyError):
                pass  # unreadable: recompute and rewrite
    ref = ReferenceModel(model.config, model.weights, max(n_steps, 1))
    fed, logits = [], []
    tok = int(tokens[0])
    for pos in range(n_steps):
        if pos < len(tokens):
            tok = int(tokens[pos])
        fed.append(tok)
        logits.append(ref.forward([tok], pos)[0])
        tok = int(np.argmax(logits[-1]))
    out = np.stack(logits)
    if path is not None:
        import os

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.npz")
            np.savez(tmp, fed=np.array(fed, np.int64), logits=out)
            tmp.replace(path)  # atomic: a reader never sees half a file
        except OSError:
            pass  # an unwritable cache costs the next process the run again
    return fed, out
