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
    """Prefill and decode with a KV cache. ``forward(tokens, start_pos)`` returns float32 logits
    [len(tokens), vocab] (None with ``logits=False``: only the K/V were wanted); the cache then
    holds positions [0, start_pos + len(tokens)).

    A row's numbers depend on the rows computed with it: BLAS runs one row as a matrix-vector
    product and several as a matrix-matrix product, which round differently (SmolLM2's logits
    moved by up to 5e-3). Callers that need the same numbers twice (prefix reuse) make the
    same calls: see NumpyExecutor.prefill_all."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray],
                 max_seq_len: int | None = None):
        self.cfg = c = config
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
        shape = (c.num_layers, self.max_seq_len, c.num_kv_heads, c.head_dim)
        self.k_cache = np.zeros(shape, np.float32)
        self.v_cache = np.zeros(shape, np.float32)

    def reset(self) -> None:
        self.k_cache[:] = 0
        self.v_cache[:] = 0

    def forward(self, tokens, start_pos: int, logits: bool = True) -> np.ndarray | None:
        c = self.cfg
        tokens = np.asarray(tokens, dtype=np.int64)
        n = len(tokens)
        end = start_pos + n
        if end > self.max_seq_len:
            raise ValueError(f"positions up to {end} exceed the cache of {self.max_seq_len}")
        x = self.embed[tokens]  # [n, H]
        cos, sin = self.cos[start_pos:end], self.sin[start_pos:end]
        scale = np.float32(1.0 / np.sqrt(c.head_dim))
        # causal mask over [n queries, end keys]
        qpos = np.arange(start_pos, end)[:, None]
        kpos = np.arange(end)[None, :]
        mask = np.where(kpos <= qpos, np.float32(0), np.float32(-np.inf))
        for li, L in enumerate(self.layers):
            h = rms_norm(x, L["in_norm"], c.rms_norm_eps)
            qkv = h @ L["wqkv"].T
            if c.attention_bias:
                qkv = qkv + L["bqkv"]
            q = qkv[:, :c.q_dim].reshape(n, c.num_heads, c.head_dim)
            k = qkv[:, c.q_dim:c.q_dim + c.kv_dim].reshape(n, c.num_kv_heads, c.head_dim)
            v = qkv[:, c.q_dim + c.kv_dim:].reshape(n, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q = rms_norm(q, L["q_norm"], c.rms_norm_eps)
                k = rms_norm(k, L["k_norm"], c.rms_norm_eps)
            q = rope(q, cos, sin)
            k = rope(k, cos, sin)
            self.k_cache[li, start_pos:end] = bf16_round(k)
            self.v_cache[li, start_pos:end] = bf16_round(v)
            K = self.k_cache[li, :end]  # [end, kvh, d]
            V = self.v_cache[li, :end]
            qg = q.reshape(n, c.num_kv_heads, c.group_size, c.head_dim)
            scores = np.einsum("nkgd,tkd->nkgt", qg, K) * scale + mask[:, None, None, :]
            scores = scores - scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p = p / p.sum(axis=-1, keepdims=True)
            attn = np.einsum("nkgt,tkd->nkgd", p, V).reshape(n, c.q_dim)
            x = x + attn @ L["wo"].T
            h = rms_norm(x, L["post_norm"], c.rms_norm_eps)
            x = x + (silu(h @ L["wg"].T) * (h @ L["wu"].T)) @ L["wd"].T
        if not logits:
            return None
        h = rms_norm(x, self.final_norm, c.rms_norm_eps)
        return (h @ self.lm_head.T).astype(np.float32)


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
