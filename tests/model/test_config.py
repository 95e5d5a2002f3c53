"""ModelConfig from HF config dicts (transformers v4 and v5 RoPE styles), its errors, and its
derived numbers (inverse frequencies, parameter count) against transformers where installed."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from monokernel.model.config import KNOWN_SHAPES, ModelConfig, RopeScaling
from monokernel.errors import ConfigError, UnsupportedArchitectureError

# ==== HF config dicts, as the hub ships them (trimmed to what matters) ==========================

SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "rope_scaling": None,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}
QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "bos_token_id": 151643, "eos_token_id": 151645,
}
QWEN3 = {  # head_dim 128 is explicit and differs from hidden / heads = 64
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "attention_bias": False, "tie_word_embeddings": True, "eos_token_id": [151645, 151643],
}
LLAMA3_SCALING = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
LLAMA32_V4 = {  # transformers v4: rope_theta + rope_scaling at top level
    "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING}, "tie_word_embeddings": True,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}
LLAMA32_V5 = {k: v for k, v in LLAMA32_V4.items() if k not in ("rope_theta", "rope_scaling")}
LLAMA32_V5["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING}


def test_llama_smollm2():
    c = ModelConfig.from_hf_dict(SMOLLM2, name="smol")
    assert (c.arch, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        "llama", 576, 30, 9, 3)
    assert c.head_dim == 64 and c.q_dim == 576 and c.kv_dim == 192 and c.group_size == 3
    assert c.rope_theta == 1e5 and c.rope_scaling is None
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    # the known shape says the same thing
    assert c.replace(name="smollm2-135m") == KNOWN_SHAPES["smollm2-135m"]


def test_qwen2_has_bias_without_saying_so():
    c = ModelConfig.from_hf_dict(QWEN2)
    assert c.arch == "qwen2" and c.attention_bias and not c.qk_norm
    assert c.head_dim == 64 and c.num_kv_heads == 2 and c.eos_token_ids == (151645,)


def test_qwen3_explicit_head_dim_and_qk_norm():
    c = ModelConfig.from_hf_dict(QWEN3)
    assert c.arch == "qwen3" and c.qk_norm and not c.attention_bias
    assert c.head_dim == 128 and c.q_dim == 2048 and c.kv_dim == 1024
    assert c.eos_token_ids == (151645, 151643)
    assert c.rope_theta == 1e6 and isinstance(c.rope_theta, float)


def test_kv_heads_default_to_heads():
    d = dict(SMOLLM2)
    del d["num_key_value_heads"]
    assert ModelConfig.from_hf_dict(d).num_kv_heads == 9


@pytest.mark.parametrize("d", [LLAMA32_V4, LLAMA32_V5], ids=["rope_scaling", "rope_parameters"])
def test_llama3_rope_both_styles(d):
    c = ModelConfig.from_hf_dict(d, name="llama-3.2-1b")
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert c == KNOWN_SHAPES["llama-3.2-1b"]


def test_rope_parameters_default_type():
    d = {k: v for k, v in SMOLLM2.items() if k not in ("rope_theta", "rope_scaling")}
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 12345.0}
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 12345.0 and c.rope_scaling is None


def test_rope_parameters_type_with_top_level_theta():
    """A v5 rope_parameters dict without its own theta, theta at top level: the scaling must
    still be read from rope_parameters, not silently dropped."""
    d = {k: v for k, v in LLAMA32_V4.items() if k != "rope_scaling"}
    d["rope_parameters"] = {"rope_type": "llama3", **LLAMA3_SCALING}
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 500000.0 and c.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)


def test_v4_rope_scaling_old_type_key():
    d = dict(LLAMA32_V4, rope_scaling={"type": "llama3", **LLAMA3_SCALING})
    assert ModelConfig.from_hf_dict(d).rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize("d", [
    {k: v for k, v in SMOLLM2.items() if k != "rope_theta"},
    {k: v for k, v in LLAMA32_V5.items()} | {"rope_parameters": {"rope_type": "llama3",
                                                                  **LLAMA3_SCALING}},
    SMOLLM2 | {"rope_theta": None},
], ids=["v4-absent", "v5-absent", "null"])
def test_missing_rope_theta_is_an_error(d):
    with pytest.raises(ConfigError, match="rope_theta"):
        ModelConfig.from_hf_dict(d, name="m")


def test_unsupported_rope_type_names_it():
    d = dict(SMOLLM2, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="yarn"):
        ModelConfig.from_hf_dict(d)


def test_llama3_scaling_missing_key_names_it():
    sc = {k: v for k, v in LLAMA3_SCALING.items() if k != "high_freq_factor"}
    d = dict(LLAMA32_V4, rope_scaling={"rope_type": "llama3", **sc})
    with pytest.raises(ConfigError, match="high_freq_factor"):
        ModelConfig.from_hf_dict(d)


def test_unknown_architecture_is_named():
    d = dict(SMOLLM2, architectures=["MistralForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="MistralForCausalLM"):
        ModelConfig.from_hf_dict(d)


def test_no_architectures_field():
    d = {k: v for k, v in SMOLLM2.items() if k != "architectures"}
    with pytest.raises(ConfigError, match="architectures"):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "vocab_size", "rms_norm_eps"])
def test_missing_field_is_named(field):
    d = {k: v for k, v in SMOLLM2.items() if k != field}
    with pytest.raises(ConfigError, match=field) as e:
        ModelConfig.from_hf_dict(d, name="mymodel")
    assert "mymodel" in str(e.value)
    assert not isinstance(e.value, UnsupportedArchitectureError)


@pytest.mark.parametrize("changes, word", [
    ({"num_key_value_heads": 4}, "multiple"),  # 9 heads over 4 KV heads
    ({"head_dim": 63}, "even"),
    ({"num_hidden_layers": 0}, "num_layers"),
    ({"rope_theta": -1.0}, "rope_theta"),
])
def test_inconsistent_values(changes, word):
    with pytest.raises(ConfigError, match=word):
        ModelConfig.from_hf_dict(SMOLLM2 | changes)


def test_from_hf_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    c = ModelConfig.from_hf(tmp_path)
    assert c.name == tmp_path.name and c.arch == "qwen3"


@pytest.mark.parametrize("name", sorted(KNOWN_SHAPES))
def test_to_hf_dict_round_trips(name):
    c = KNOWN_SHAPES[name]
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(c.to_hf_dict())), name=c.name) == c


def test_from_name():
    assert ModelConfig.from_name("Qwen3-0.6B") is KNOWN_SHAPES["qwen3-0.6b"]
    with pytest.raises(ConfigError, match="nosuch"):
        ModelConfig.from_name("nosuch")


def test_config_is_frozen():
    with pytest.raises(Exception):
        KNOWN_SHAPES["tiny"].hidden_size = 1  # type: ignore[misc]


# ==== RoPE frequencies ==========================================================================

def llama3_inv_freq(theta, d, factor, low, high, old_ctx):
    """The llama3 rule written out per frequency (Meta's apply_scaling in llama/model.py)."""
    out = []
    for i in range(0, d, 2):
        f = 1.0 / theta ** (i / d)
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            out.append(f)
        elif wavelen > old_ctx / low:
            out.append(f / factor)
        else:
            s = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return np.array(out)


def test_inv_freq_default():
    c = ModelConfig.from_hf_dict(SMOLLM2)
    inv = c.inv_freq()
    assert inv.shape == (32,)
    np.testing.assert_allclose(inv, 1e5 ** (-np.arange(0, 64, 2) / 64), rtol=1e-12)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama3-tiny"])
def test_inv_freq_llama3_rule(name):
    c = KNOWN_SHAPES[name]
    s = c.rope_scaling
    want = llama3_inv_freq(c.rope_theta, c.head_dim, s.factor, s.low_freq_factor,
                           s.high_freq_factor, s.original_max_position_embeddings)
    np.testing.assert_allclose(c.inv_freq(), want, rtol=1e-12)
    # all three regimes occur, so each branch is checked
    plain = 1.0 / c.rope_theta ** (np.arange(0, c.head_dim, 2) / c.head_dim)
    ratio = c.inv_freq() / plain
    assert np.any(ratio == 1) and np.any(np.isclose(ratio, 1 / s.factor))
    assert np.any((ratio < 1) & (ratio > 1 / s.factor + 1e-9))


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama3-tiny"])
def test_inv_freq_llama3_matches_transformers(name):
    pytest.importorskip("torch")
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    c = KNOWN_SHAPES[name]
    d = c.to_hf_dict()
    hf_cfg = LlamaConfig(**{k: v for k, v in d.items() if k != "architectures"})
    inv, attention_factor = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    assert attention_factor == 1.0
    # transformers computes in float32: agreement to float32 rounding
    np.testing.assert_allclose(inv.double().numpy(), c.inv_freq(), rtol=1e-6)


def test_rope_table_matches_angles():
    c = KNOWN_SHAPES["qwen3-tiny"]
    cos, sin = c.rope_table(333)
    assert cos.shape == sin.shape == (333, 64) and cos.dtype == np.float32
    ang = np.arange(333)[:, None] * c.inv_freq()[None, :]
    np.testing.assert_allclose(cos, np.cos(ang), atol=1e-4)
    np.testing.assert_allclose(sin, np.sin(ang), atol=1e-4)
    assert np.all(cos[0] == 1) and np.all(sin[0] == 0)


@pytest.mark.parametrize("name", ["tiny", "qwen2-tiny", "qwen3-tiny", "llama3-tiny"])
def test_param_count_matches_transformers(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    c = KNOWN_SHAPES[name]
    d = c.to_hf_dict()
    hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **{
        k: v for k, v in d.items() if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    n = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    assert c.param_count() == n
