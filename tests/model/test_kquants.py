"""K-quants (Q2_K...Q6_K) and Q5_0/Q5_1: the gguf package's dequantizers, which the converter uses,
against decoders written here element by element from ggml's block structs (ggml-common.h) and its
dequantize_row_q*_K loops (ggml-quants.c), on random blocks; then a whole model written as K-quant
blocks, converted, and run greedily against the NumPy reference on weights decoded here.

The gguf package cannot quantize K-quants, so their blocks are random bytes with the f16 scales
(d, dmin) set to sizes that give weights of a usual magnitude: every bit pattern of the other
fields is a valid block.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # absent on the GPU machine: skip, never break collection
T = gguf.GGMLQuantizationType
from safetensors.numpy import load_file

from monokernel.model.config import ModelConfig  # noqa: E402
from monokernel.model.gguf_import import convert_gguf  # noqa: E402
from helpers.gguf import bf16, leftovers, llamacpp_permute, same_bits, tiny_gguf

QK_K = 256


# ==== reference decoders: one formula per value, indexed as in ggml's loops ========================

def _f16(b: np.ndarray, off: int) -> np.ndarray:
    """f16 field at byte ``off`` of every block, as float32 [n, 1]."""
    return b[:, off:off + 2].copy().view(np.float16).astype(np.float32)


E = np.arange(QK_K)  # value index within a super-block


def ref_q2_k(raw: np.ndarray) -> np.ndarray:
    """84 bytes: scales[16] (low nibble scale, high nibble min), qs[64] (2 bits), f16 d, f16 dmin.
    Value e: sub-block e//16; 2-bit q in qs[32*(e//128) + e%32] at shift 2*((e%128)//32);
    x = (d * scale) * q - (dmin * min)."""
    b = np.ascontiguousarray(raw).reshape(-1, 84)
    scales, qs, d, dmin = b[:, 0:16], b[:, 16:80], _f16(b, 80), _f16(b, 82)
    sub = scales[:, E // 16]
    q = (qs[:, 32 * (E // 128) + E % 32] >> (2 * ((E % 128) // 32))) & 3
    return ((d * (sub & 0xF).astype(np.float32)) * q.astype(np.float32)
            - dmin * (sub >> 4).astype(np.float32)).reshape(-1)


def _q3_k_scale(scales: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Sub-block j's 6-bit scale: low 4 bits from byte j (j < 8) or the high nibble of byte j - 8,
    high 2 bits from byte 8 + j % 4 at shift 2 * (j // 4); stored plus 32."""
    low = np.where(j < 8, scales[:, j % 8] & 0xF, scales[:, j % 8] >> 4)
    high = (scales[:, 8 + j % 4] >> (2 * (j // 4))) & 3
    return (low | (high << 4)).astype(np.int32) - 32


def ref_q3_k(raw: np.ndarray) -> np.ndarray:
    """110 bytes: hmask[32], qs[64] (low 2 bits), scales[12] (16 x 6 bits), f16 d.
    Value e: low bits as Q2_K; the high bit is bit 4*(e//128) + (e%128)//32 of hmask[e%32], and a
    clear bit means minus 4; x = (d * scale) * q."""
    b = np.ascontiguousarray(raw).reshape(-1, 110)
    hmask, qs, scales, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], _f16(b, 108)
    low = (qs[:, 32 * (E // 128) + E % 32] >> (2 * ((E % 128) // 32))) & 3
    bit = (hmask[:, E % 32] >> (4 * (E // 128) + (E % 128) // 32)) & 1
    q = low.astype(np.int32) - np.where(bit == 1, 0, 4)
    return ((d * _q3_k_scale(scales, E // 16).astype(np.float32)) * q.astype(np.float32)).reshape(-1)


def _k4_scale_min(scales: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4: 8 (scale, min) pairs of 6 bits packed in 12 bytes."""
    lo = j < 4
    jj = j % 4
    sc = np.where(lo, scales[:, jj] & 63, (scales[:, jj + 8] & 0xF) | ((scales[:, jj] >> 6) << 4))
    mn = np.where(lo, scales[:, jj + 4] & 63, (scales[:, jj + 8] >> 4) | ((scales[:, jj + 4] >> 6) << 4))
    return sc.astype(np.float32), mn.astype(np.float32)


def ref_q4_k(raw: np.ndarray) -> np.ndarray:
    """144 bytes: f16 d, f16 dmin, scales[12], qs[128]. Value e: sub-block e//32; nibble
    (e//32)%2 of qs[32*(e//64) + e%32]; x = (d * scale) * q - (dmin * min)."""
    b = np.ascontiguousarray(raw).reshape(-1, 144)
    d, dmin, scales, qs = _f16(b, 0), _f16(b, 2), b[:, 4:16], b[:, 16:144]
    sc, mn = _k4_scale_min(scales, E // 32)
    q = (qs[:, 32 * (E // 64) + E % 32] >> (4 * ((E // 32) % 2))) & 0xF
    return ((d * sc) * q.astype(np.float32) - dmin * mn).reshape(-1)


def ref_q5_k(raw: np.ndarray) -> np.ndarray:
    """176 bytes: f16 d, f16 dmin, scales[12], qh[32], qs[128]. As Q4_K, plus a fifth bit:
    bit e//32 of qh[e%32]."""
    b = np.ascontiguousarray(raw).reshape(-1, 176)
    d, dmin, scales, qh, qs = _f16(b, 0), _f16(b, 2), b[:, 4:16], b[:, 16:48], b[:, 48:176]
    sc, mn = _k4_scale_min(scales, E // 32)
    low = (qs[:, 32 * (E // 64) + E % 32] >> (4 * ((E // 32) % 2))) & 0xF
    q = low | (((qh[:, E % 32] >> (E // 32)) & 1) << 4)
    return ((d * sc) * q.astype(np.float32) - dmin * mn).reshape(-1)


def ref_q6_k(raw: np.ndarray) -> np.ndarray:
    """210 bytes: ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], f16 d.
    Value e = 128n + 32k + l: low nibble k//2 of ql[64n + 32*(k%2) + l], high bits at shift 2k of
    qh[32n + l], scale e//16; x = (d * scale) * (q - 32)."""
    b = np.ascontiguousarray(raw).reshape(-1, 210)
    ql, qh, d = b[:, 0:128], b[:, 128:192], _f16(b, 208)
    scales = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    n, k, lane = E // 128, (E % 128) // 32, E % 32
    low = (ql[:, 64 * n + 32 * (k % 2) + lane] >> (4 * (k // 2))) & 0xF
    high = (qh[:, 32 * n + lane] >> (2 * k)) & 3
    q = (low | (high << 4)).astype(np.int32) - 32
    return ((d * scales[:, E // 16]) * q.astype(np.float32)).reshape(-1)


J = np.arange(32)


def _q5_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 value j: nibble j//16 of qs[j%16], fifth bit j of the little-endian uint32 qh."""
    word = qh.copy().view("<u4").astype(np.int64)
    return ((qs[:, J % 16] >> (4 * (J // 16))) & 0xF) | (((word >> J) & 1).astype(np.uint8) << 4)


def ref_q5_0(raw: np.ndarray) -> np.ndarray:
    """22 bytes / 32 values: f16 d, qh[4], qs[16]; x = d * (q - 16)."""
    b = np.ascontiguousarray(raw).reshape(-1, 22)
    q = _q5_bits(b[:, 2:6], b[:, 6:22]).astype(np.int32) - 16
    return (_f16(b, 0) * q.astype(np.float32)).reshape(-1)


def ref_q5_1(raw: np.ndarray) -> np.ndarray:
    """24 bytes / 32 values: f16 d, f16 m, qh[4], qs[16]; x = d * q + m."""
    b = np.ascontiguousarray(raw).reshape(-1, 24)
    q = _q5_bits(b[:, 4:8], b[:, 8:24])
    return (_f16(b, 0) * q.astype(np.float32) + _f16(b, 2)).reshape(-1)


REF = {T.Q2_K: ref_q2_k, T.Q3_K: ref_q3_k, T.Q4_K: ref_q4_k, T.Q5_K: ref_q5_k, T.Q6_K: ref_q6_k,
       T.Q5_0: ref_q5_0, T.Q5_1: ref_q5_1}


# ==== random blocks ================================================================================

# (offset of each f16 field, its range; a negative low end means either sign) per type. The
# ranges make weights of magnitude ~0.1-1 (Q4_K: d * 63 * 15 ~ 1).
F16_FIELDS = {
    T.Q2_K: [(80, 0.01, 0.04), (82, 0.005, 0.02)],
    T.Q3_K: [(108, -0.008, 0.002)],
    T.Q4_K: [(0, 0.0005, 0.002), (2, 0.002, 0.012)],
    T.Q5_K: [(0, 0.0003, 0.001), (2, 0.002, 0.012)],
    T.Q6_K: [(208, -3e-4, 1e-4)],
    T.Q5_0: [(0, -0.05, 0.01)],
    T.Q5_1: [(0, 0.01, 0.04), (2, -0.6, -0.2)],
}


def random_blocks(qt: T, n_values: int, rng: np.random.Generator) -> np.ndarray:
    """Valid ``qt`` blocks for ``n_values`` values: random bytes, f16 scales set in range."""
    block, size = gguf.GGML_QUANT_SIZES[qt]
    b = rng.integers(0, 256, (n_values // block, size), dtype=np.uint8)
    for off, lo, hi in F16_FIELDS[qt]:
        if lo < 0 and hi > 0:  # sign either way, magnitude in [hi, -lo]
            v = rng.uniform(hi, -lo, len(b)) * rng.choice([-1.0, 1.0], len(b))
        else:
            v = rng.uniform(lo, hi, len(b))
        b[:, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b


# ==== the gguf package's dequantizers against the decoders here ====================================

@pytest.mark.parametrize("qt", list(REF), ids=lambda t: t.name)
@pytest.mark.parametrize("n_blocks", [1, 37])
def test_gguf_dequantize_matches_block_decoder(qt, n_blocks):
    block, _ = gguf.GGML_QUANT_SIZES[qt]
    raw = random_blocks(qt, n_blocks * block, np.random.default_rng(n_blocks + int(qt)))
    ours = REF[qt](raw)
    theirs = gguf.quants.dequantize(raw, qt).reshape(-1)
    assert ours.shape == theirs.shape == (n_blocks * block,)
    assert np.isfinite(ours).all() and 0.05 < np.abs(ours).mean() < 2, np.abs(ours).mean()
    # the same float32 operations in the same order as ggml's loops: equal to the last bit
    np.testing.assert_array_equal(theirs, ours)


@pytest.mark.parametrize("qt", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_decoders_see_every_bit(qt):
    """Flip one bit of one byte (every byte outside d/dmin, three bits each) in 8 random blocks:
    both decoders still agree, and some value changes (no field is ignored). Eight blocks, since
    in one block a zero scale can hide a flipped quant."""
    raw = random_blocks(qt, 8 * QK_K, np.random.default_rng(int(qt)))
    base = REF[qt](raw)
    f16_bytes = {o + i for o, _, _ in F16_FIELDS[qt] for i in (0, 1)}
    for byte in sorted(set(range(raw.shape[1])) - f16_bytes):
        for bit in (0, 3, 7):
            flipped = raw.copy()
            flipped[:, byte] ^= np.uint8(1 << bit)
            ours = REF[qt](flipped)
            theirs = gguf.quants.dequantize(flipped, qt).reshape(-1)
            np.testing.assert_array_equal(theirs, ours)
            assert not np.array_equal(ours, base), (qt.name, byte, bit)


@pytest.mark.hf
@pytest.mark.parametrize("qt", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_block_decoder_matches_transformers_torch_dequantizer(qt):
    """A third implementation: transformers' own (torch) GGUF dequantizer, bit for bit."""
    torch = pytest.importorskip("torch")
    dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    raw = random_blocks(qt, 19 * QK_K, np.random.default_rng(int(qt) + 100))
    theirs = dequant.dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(qt)).numpy()
    np.testing.assert_array_equal(theirs, REF[qt](raw))


# ==== the converter on each type ===================================================================

KQ = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, layers=1)
KQ_TYPES = {  # one weight per type, and a mix like llama.cpp's Q4_K_M
    "token_embd.weight": T.Q6_K,
    "output.weight": T.Q6_K,
    "blk.0.attn_q.weight": T.Q4_K,
    "blk.0.attn_k.weight": T.Q5_K,
    "blk.0.attn_v.weight": T.Q3_K,
    "blk.0.attn_output.weight": T.Q2_K,
    "blk.0.ffn_gate.weight": T.Q5_0,
    "blk.0.ffn_up.weight": T.Q5_1,
    "blk.0.ffn_down.weight": T.Q4_K,
}
HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
    "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
    "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
    "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
}


def kquant_gguf(path: Path, arch: str = "llama", seed: int = 0) -> dict[str, np.ndarray]:
    """A one-layer model (hidden 256) whose weights are random K-quant / Q5 blocks; returns the
    HF-order float32 weights decoded here (Q/K rows un-permuted for arch llama), norms included."""
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": None, "output.weight": None,
              "blk.0.attn_q.weight": (KQ["heads"] * KQ["head_dim"], KQ["hidden"]),
              "blk.0.attn_k.weight": (KQ["kv_heads"] * KQ["head_dim"], KQ["hidden"]),
              "blk.0.attn_v.weight": (KQ["kv_heads"] * KQ["head_dim"], KQ["hidden"]),
              "blk.0.attn_output.weight": (KQ["hidden"], KQ["heads"] * KQ["head_dim"]),
              "blk.0.ffn_gate.weight": (KQ["ffn"], KQ["hidden"]),
              "blk.0.ffn_up.weight": (KQ["ffn"], KQ["hidden"]),
              "blk.0.ffn_down.weight": (KQ["hidden"], KQ["ffn"])}
    from helpers.gguf import TINY_TOKENS

    shapes["token_embd.weight"] = shapes["output.weight"] = (len(TINY_TOKENS), KQ["hidden"])
    raw, decoded = {}, {}
    for name, shape in shapes.items():
        qt = KQ_TYPES[name]
        blocks = random_blocks(qt, shape[0] * shape[1], rng)
        raw[name] = (blocks, qt)
        decoded[name] = REF[qt](blocks).reshape(shape)
    norms = {n: (1 + 0.1 * rng.standard_normal(KQ["hidden"])).astype(np.float32)
             for n in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight")}
    tiny_gguf(path, arch=arch, pre="llama-bpe" if arch == "llama" else "qwen2", untied=True,
              dims=KQ, raw=raw, hf_weights=norms)
    decoded.update(norms)
    if arch == "llama":  # the file holds llama.cpp's row order; HF's is its inverse
        for name, n in (("blk.0.attn_q.weight", KQ["heads"]), ("blk.0.attn_k.weight", KQ["kv_heads"])):
            order = llamacpp_permute(np.arange(decoded[name].shape[0]), n)
            hf = np.empty_like(decoded[name])
            hf[order] = decoded[name]
            decoded[name] = hf
    return decoded


def test_converter_writes_decoded_bits_for_each_type(tmp_path):
    src = tmp_path / "kq.gguf"
    want = kquant_gguf(src, arch="llama")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(src).tensors}
    assert {types[n] for n in KQ_TYPES} == set(REF)  # every type is in the file
    st = load_file(str(convert_gguf(src, tmp_path / "hf", progress=False) / "model.safetensors"))
    for gname, hname in HF.items():
        assert st[hname].dtype == ml_dtypes.bfloat16
        assert same_bits(st[hname], bf16(want[gname])), gname
    assert leftovers(tmp_path) == []


def test_q5_quantized_by_gguf_round_trips(tmp_path):
    """Q5_0/Q5_1 can be quantized by the gguf package: the converted weights are close to the
    float32 written (the quantization is real: not equal), and equal the decoders' output."""
    src = tmp_path / "q5.gguf"
    types = {"blk.0.ffn_gate.weight": T.Q5_0, "blk.0.ffn_up.weight": T.Q5_1}
    written = tiny_gguf(src, types=types)
    st = load_file(str(convert_gguf(src, tmp_path / "hf", progress=False) / "model.safetensors"))
    reader = {t.name: t for t in gguf.GGUFReader(src).tensors}
    for gname, qt in types.items():
        got = st[HF[gname]].astype(np.float32)
        ref = REF[qt](np.asarray(reader[gname].data)).reshape(got.shape)
        assert same_bits(st[HF[gname]], bf16(ref)), gname
        err = np.abs(got - written[gname]).max()
        assert 1e-3 < err < 0.12, (gname, err)  # 5 bits over a block's range of ~3


@pytest.mark.parametrize("qt", [T.Q4_K, T.Q6_K, T.Q5_0], ids=lambda t: t.name)
def test_corrupt_scale_is_refused_by_name(tmp_path, qt):
    """An f16 scale of inf in one block: the converter names the tensor, writes nothing."""
    from monokernel.errors import GGUFError

    shape = (KQ["ffn"], KQ["hidden"])
    blocks = random_blocks(qt, shape[0] * shape[1], np.random.default_rng(9))
    off = F16_FIELDS[qt][0][0]
    blocks[5, off:off + 2] = np.array([np.inf], np.float16).view(np.uint8)
    src = tmp_path / "inf.gguf"
    tiny_gguf(src, dims=KQ, raw={"blk.0.ffn_up.weight": (blocks, qt)})
    with pytest.raises(GGUFError, match=rf"inf\.gguf: tensor 'blk\.0\.ffn_up\.weight' "
                                        rf"\({qt.name}\) dequantizes to \d+ non-finite"):
        convert_gguf(src, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []


# ==== a K-quant model, converted, run greedily =====================================================

def _greedy(cfg: ModelConfig, weights: dict[str, np.ndarray], prompt: list[int], n: int):
    from monokernel.model.reference import ReferenceModel

    ref = ReferenceModel(cfg, weights, max_seq_len=64)
    logits, pos, out = ref.forward(prompt, 0), len(prompt), []
    for _ in range(n):
        out.append(int(np.argmax(logits[-1])))
        logits = ref.forward([out[-1]], pos)
        pos += 1
    return out, logits[-1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_kquant_model_greedy_12_tokens_match_reference_on_decoded_weights(tmp_path, arch):
    """LLM on the converted folder (numpy backend) against the NumPy reference fed the weights
    decoded here: 12 greedy tokens equal, and the last logits agree."""
    from monokernel.llm import LLM
    from monokernel.sampling import SamplingParams

    src = tmp_path / f"kq-{arch}.gguf"
    decoded = kquant_gguf(src, arch=arch, seed=1)
    out = convert_gguf(src, tmp_path / "hf", progress=False)
    cfg = ModelConfig.from_hf(out)
    assert (cfg.arch, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.tie_word_embeddings) == (arch, 256, 4, 2, 64, 512, False)
    weights = {HF[g]: bf16(w) for g, w in decoded.items()}
    if arch == "qwen2":  # the biases tiny_gguf writes as F32
        reader = {t.name: t for t in gguf.GGUFReader(src).tensors}
        for p in ("q", "k", "v"):
            weights[f"model.layers.0.self_attn.{p}_proj.bias"] = bf16(
                np.asarray(reader[f"blk.0.attn_{p}.bias"].data))
    prompt = [40, 7, 100, 250, 3 + 256]
    want, want_logits = _greedy(cfg, weights, prompt, 12)
    assert len(set(want)) >= 4, want  # a run that goes somewhere, not one token repeated

    llm = LLM(out, backend="numpy", progress=False)
    got = llm.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert got.token_ids == want
    _, got_logits = _greedy(llm.config, llm.model.weights, prompt, 12)
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=1e-4)
    if arch == "llama":  # negative control: the run notices Q/K rows left in llama.cpp's order
        raw = convert_gguf(src, tmp_path / "raw", unpermute=False, progress=False)
        bad = LLM(raw, backend="numpy", progress=False).generate(
            prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
        assert bad.token_ids != want
