"""Tiny GGUF files for the model wing's tests (test_gguf, test_kquants, test_tokenizer,
test_sentencepiece, test_progress): a one-layer model written with the gguf package, with a
byte-level (GPT-2) or a SentencePiece vocabulary, and the small comparisons those tests share."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # absent on the GPU machine: skip, never break collection
T = gguf.GGMLQuantizationType

# ==== llama.cpp's Q/K permutation and bf16 bits ====================================================


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to HF's q_proj/k_proj rows."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint16), b.view(np.uint16))



# ==== tiny GGUF files ==============================================================================

BYTE_CHARS = [chr(c) for c in sorted(
    set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1))
    | set(range(ord("®"), ord("ÿ") + 1)))]
# GPT-2's byte->unicode table: printable bytes map to themselves, the rest to 256+n.
_rest = [b for b in range(256) if chr(b) not in BYTE_CHARS]
BYTE_CHARS = BYTE_CHARS + [chr(256 + i) for i in range(len(_rest))]
TINY_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "1 2"]
TINY_TOKENS = (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"] + BYTE_CHARS
               + ["Ġt", "he", "Ġthe", "in", "Ġa", "12"])
TINY_TYPES = [3, 3, 3, 4] + [1] * (len(TINY_TOKENS) - 4)
TINY = dict(hidden=64, heads=2, kv_heads=1, head_dim=32, ffn=96, layers=1)

# A SentencePiece (tokenizer.ggml.model "llama") vocabulary laid out as llama.cpp writes one:
# <unk>, <s>, </s>, the 256 byte tokens, merged pieces best score first, single characters last.
SPM_PIECES = ["▁t", "he", "▁the", "in", "▁a", "▁▁", "▁▁▁▁", "er", "ll", "▁h", "▁he", "llo",
              "▁hello", "12", "de", "def", "▁def", "re", "ur", "urn", "ret", "return", "▁return",
              "▁x", "()", "):", "▁w", "or", "▁wor", "ld", "▁world", "▁▁▁", "▁1", "23", "▁c", "af",
              "▁caf", "▁in", "▁▁▁▁▁▁▁▁"]
SPM_CHARS = list("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?()[]{}=+-*/"
                 "#'\"_<>|é日本\t\n")
SPM_TOKENS = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
              + SPM_CHARS + ["<|im_start|>", "<|im_end|>", "<think>"])
SPM_TYPES = [2, 3, 3] + [6] * 256 + [1] * (len(SPM_PIECES) + len(SPM_CHARS)) + [3, 3, 4]
SPM_SCORES = ([0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]
              + [-1000.0 - i for i in range(len(SPM_CHARS))] + [0.0] * 3)


def tiny_gguf(path: Path, *, arch: str = "qwen2", types: dict[str, T] | None = None,
              seed: int = 0, pre: str | None = "qwen2", theta: float | None = 1e4,
              untied: bool = False, add_bos: bool = False, extra: dict[str, tuple] | None = None,
              hf_weights: dict[str, np.ndarray] | None = None,
              kv: dict[str, int] | None = None, tokenizer: str = "gpt2",
              dims: dict[str, int] | None = None, raw: dict[str, tuple] | None = None,
              meta: dict[str, object] | None = None) -> dict[str, np.ndarray]:
    """Write a one-layer model; return the float32 weights as written, in GGUF row order.

    ``types`` picks a tensor type per GGUF name (default F32), quantized by the gguf package;
    ``raw`` gives a weight as ready (bytes, type) blocks instead (types it cannot quantize);
    ``extra`` adds raw (bytes, type) tensors; ``hf_weights`` overrides values by GGUF name;
    ``kv`` adds uint32 keys; ``tokenizer`` is tokenizer.ggml.model: "llama" writes the
    SentencePiece vocabulary above, anything else the byte-level one under that name; ``dims``
    overrides TINY's sizes; ``meta`` sets tokenizer.ggml.* keys (add_space_prefix, add_eos_token:
    bool) or, with value None, leaves them out.
    """
    rng = np.random.default_rng(seed)
    d = dict(TINY, **(dims or {}))
    vocab = SPM_TOKENS if tokenizer == "llama" else TINY_TOKENS
    h, f, v = d["hidden"], d["ffn"], len(vocab)
    q, kvd = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,),
              "blk.0.attn_norm.weight": (h,), "blk.0.ffn_norm.weight": (h,),
              "blk.0.attn_q.weight": (q, h), "blk.0.attn_k.weight": (kvd, h),
              "blk.0.attn_v.weight": (kvd, h), "blk.0.attn_output.weight": (h, q),
              "blk.0.ffn_gate.weight": (f, h), "blk.0.ffn_up.weight": (f, h),
              "blk.0.ffn_down.weight": (h, f)}
    if arch == "qwen2":
        shapes.update({"blk.0.attn_q.bias": (q,), "blk.0.attn_k.bias": (kvd,),
                       "blk.0.attn_v.bias": (kvd,)})
    if untied:
        shapes["output.weight"] = (v, h)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(d["layers"])
    w.add_context_length(256)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv_heads"])
    if d["head_dim"] != h // d["heads"]:
        w.add_key_length(d["head_dim"])
        w.add_value_length(d["head_dim"])
    if theta is not None:
        w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(tokenizer)
    meta = dict(meta or {})
    if tokenizer == "llama":
        w.add_token_list(SPM_TOKENS)
        w.add_token_types(SPM_TYPES)
        w.add_token_scores(SPM_SCORES)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        meta.setdefault("add_bos_token", add_bos)
    else:
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(TINY_TOKENS)
        w.add_token_types(TINY_TYPES)
        w.add_token_merges(TINY_MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(0)
        meta.setdefault("add_bos_token", add_bos)
    for key, value in meta.items():
        if value is not None:
            w.add_bool(f"tokenizer.ggml.{key}", value)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}")
    for key, value in (kv or {}).items():
        w.add_uint32(key, value)
    written = {}
    for name, shape in shapes.items():
        x = (rng.standard_normal(shape) * 0.5).astype(np.float32)
        if hf_weights and name in hf_weights:
            x = hf_weights[name]
        qt = (types or {}).get(name, T.F32)
        if raw and name in raw:  # rows of ready blocks: the type's byte shape, not the values'
            block_bytes, qt = raw[name]
            w.add_tensor(name, np.asarray(block_bytes, np.uint8).reshape(shape[0], -1),
                         raw_dtype=qt)
            continue
        written[name] = x
        if qt == T.F32:
            w.add_tensor(name, x)
        elif qt == T.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)
    for name, (raw, qt) in (extra or {}).items():
        w.add_tensor(name, raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def raw_tensor(path: Path, name: str):
    return next(t for t in gguf.GGUFReader(path).tensors if t.name == name)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith((".tmp-", ".old-")))
