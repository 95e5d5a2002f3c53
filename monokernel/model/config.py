"""ModelConfig: the one carrier of a model's hyperparameters.

Everything else (the scheduler's tiles, the kernel's constants, the reference's shapes) is derived
from it. Read from a Hugging Face ``config.json`` with :meth:`ModelConfig.from_hf`, or from the
table of known shapes with :meth:`ModelConfig.from_name`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, UnsupportedArchitectureError

# HF architecture name -> our short name.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.x frequency scaling ("llama3" rope type)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES.values():
            raise UnsupportedArchitectureError(f"unknown architecture {self.arch!r}")
        for f in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "vocab_size", "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{self.name}: {f} must be positive, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.name}: num_heads {self.num_heads} is not a multiple of "
                              f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"{self.name}: head_dim {self.head_dim} must be even for RoPE")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConfigError(f"{self.name}: rope_theta must be a positive number")

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        return self.q_dim + 2 * self.kv_dim

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def param_count(self) -> int:
        h, f = self.hidden_size, self.intermediate_size
        per_layer = h * self.qkv_dim + self.q_dim * h + 3 * h * f + 2 * h
        if self.attention_bias:
            per_layer += self.qkv_dim
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    def weight_bytes_per_token(self) -> int:
        """bf16 bytes a decode step must read at least once: every weight but the embedding
        table, of which only one row is read (with tied embeddings the LM head reads it all)."""
        h = self.hidden_size
        n = self.param_count() - self.vocab_size * h * (0 if self.tie_word_embeddings else 1)
        return 2 * n + (0 if self.tie_word_embeddings else 2 * h)

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies, float64 [head_dim/2], llama3 scaling applied."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        s = self.rope_scaling
        if s is not None:
            low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
            high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
            wavelen = 2 * math.pi / inv
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor)
            scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
            mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
            inv = np.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
        return inv

    def rope_table(self, positions: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin, float32 [positions, head_dim/2], computed as HF does (float32 angles)."""
        inv = self.inv_freq().astype(np.float32)
        ang = np.arange(positions, dtype=np.float32)[:, None] * inv[None, :]
        return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "custom") -> "ModelConfig":
        archs = d.get("architectures") or []
        if not archs:
            raise ConfigError(f"{name}: config.json has no 'architectures' field")
        if archs[0] not in ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"{name}: architecture {archs[0]!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})")
        arch = ARCHITECTURES[archs[0]]

        def need(key: str) -> Any:
            if key not in d or d[key] is None:
                raise ConfigError(f"{name}: config.json is missing required field {key!r}")
            return d[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        theta, scaling = _read_rope(d, name)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        bias = bool(d.get("attention_bias", arch == "qwen2"))
        return cls(
            arch=arch, hidden_size=hidden, intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")), num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim, vocab_size=int(need("vocab_size")),
            max_position_embeddings=int(d.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(need("rms_norm_eps")), rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias, qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids, name=name)

    @classmethod
    def from_hf(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: not found")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, name=Path(model_dir).name)

    def to_hf_dict(self) -> dict[str, Any]:
        arch_name = {v: k for k, v in ARCHITECTURES.items()}[self.arch]
        d: dict[str, Any] = {
            "architectures": [arch_name],
            "model_type": self.arch,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
        }
        if self.arch in ("llama", "qwen3"):
            d["attention_bias"] = self.attention_bias
        if self.arch == "llama":
            d["mlp_bias"] = False
        if self.rope_scaling is not None:
            s = self.rope_scaling
            d["rope_scaling"] = {
                "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = (self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                                 else list(self.eos_token_ids))
        return d

    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        key = name.lower()
        if key not in KNOWN_SHAPES:
            raise ConfigError(f"unknown model shape {name!r} (known: {', '.join(KNOWN_SHAPES)})")
        return KNOWN_SHAPES[key]

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _read_rope(d: dict[str, Any], name: str) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from ``rope_parameters`` (transformers v5) or
    ``rope_scaling`` + ``rope_theta`` (v4). A missing theta is an error, not a default."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and ({"rope_theta", "rope_type", "type"} & params.keys()):
        # the scaling lives in rope_parameters even when theta is left at the top level
        theta = params.get("rope_theta", d.get("rope_theta"))
        scaling = params
    else:
        theta = d.get("rope_theta")
        scaling = d.get("rope_scaling")
    if theta is None:
        raise ConfigError(f"{name}: config.json gives no rope_theta "
                          "(neither in rope_parameters nor at top level)")
    rtype = None
    if isinstance(scaling, dict):
        rtype = scaling.get("rope_type") or scaling.get("type")
    if rtype in (None, "default"):
        return float(theta), None
    if rtype == "llama3":
        try:
            return float(theta), RopeScaling(
                factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
        except KeyError as e:
            raise ConfigError(f"{name}: llama3 rope scaling is missing {e.args[0]!r}") from None
    raise ConfigError(f"{name}: rope type {rtype!r} is not supported (default and llama3 are)")


KNOWN_SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        arch="llama", hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
        eos_token_ids=(2,), name="smollm2-135m"),
    "qwen3-0.6b": ModelConfig(
        arch="qwen3", hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
        num_kv_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, qk_norm=True,
        bos_token_id=None, eos_token_ids=(151645,), name="qwen3-0.6b"),
    "llama-3.2-1b": ModelConfig(
        arch="llama", hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), tie_word_embeddings=True,
        bos_token_id=128000, eos_token_ids=(128001, 128008, 128009), name="llama-3.2-1b"),
    "qwen2-tiny": ModelConfig(
        arch="qwen2", hidden_size=96, intermediate_size=160, num_layers=2, num_heads=3,
        num_kv_heads=1, head_dim=32, vocab_size=1000, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=True, tie_word_embeddings=False,
        bos_token_id=None, eos_token_ids=(2,), name="qwen2-tiny"),
    "tiny": ModelConfig(
        arch="llama", hidden_size=96, intermediate_size=160, num_layers=2, num_heads=3,
        num_kv_heads=1, head_dim=32, vocab_size=1000, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1,
        eos_token_ids=(2,), name="tiny"),
    "llama3-tiny": ModelConfig(
        arch="llama", hidden_size=96, intermediate_size=160, num_layers=2, num_heads=3,
        num_kv_heads=1, head_dim=32, vocab_size=1000, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64),
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,), name="llama3-tiny"),
    "qwen3-tiny": ModelConfig(
        arch="qwen3", hidden_size=96, intermediate_size=160, num_layers=2, num_heads=3,
        num_kv_heads=1, head_dim=128, vocab_size=1000, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True, tie_word_embeddings=True,
        bos_token_id=None, eos_token_ids=(2,), name="qwen3-tiny"),
    # several KV groups of two query heads (the tiny shapes above have one KV head): attention
    # units of different groups, the merge by ticket per group
    "qwen3-gqa-tiny": ModelConfig(
        arch="qwen3", hidden_size=96, intermediate_size=160, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True, tie_word_embeddings=True,
        bos_token_id=None, eos_token_ids=(2,), name="qwen3-gqa-tiny"),
}


def one_layer_copy(name: str, vocab_size: int = 384) -> ModelConfig:
    """A real shape cut to one layer and a small vocabulary, everything else kept (hidden size,
    FFN, head_dim, heads and GQA group, norms, RoPE, biases, tying): the same kernel template
    instantiations as the real shape, cheap enough for the CPU emulator, so none of them runs
    for the first time on a GPU (tests/kernel/test_kernel_emulator.py). Token ids 0..2 are
    special, as in every synthetic vocabulary."""
    return KNOWN_SHAPES[name].replace(num_layers=1, vocab_size=vocab_size, bos_token_id=1,
                                      eos_token_ids=(2,), name=f"{name}-1layer")


# The GPU check's three shapes, one layer each: ``--shape smollm2-135m-1layer`` etc.
for _name in ("smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"):
    KNOWN_SHAPES[f"{_name}-1layer"] = one_layer_copy(_name)
del _name
