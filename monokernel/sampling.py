"""Sampling parameters and the host-side sampler.

Greedy and plain temperature sampling can run inside the kernel (SAMPLE op: argmax, or Gumbel-max
with a counter-based RNG); top-k, top-p and repetition penalty run here on the logits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from .errors import NumericalError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __init__(self, max_new_tokens: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None,
                 repetition_penalty: float | None = None, seed: int | None = None,
                 stop: str | Iterable[str] | None = None,
                 stop_token_ids: Iterable[int] | None = None, ignore_eos: bool = False, *,
                 do_sample: bool | None = None, max_tokens: int | None = None) -> None:
        """Accepts HF-style ``do_sample`` (False forces greedy) and vLLM-style ``max_tokens``."""
        if max_tokens is not None:
            if max_new_tokens is not None and max_new_tokens != max_tokens:
                raise ValueError("give max_new_tokens or max_tokens, not both")
            max_new_tokens = max_tokens
        if do_sample is False:
            temperature = 0.0
        elif do_sample is True and temperature in (None, 0.0):
            temperature = 1.0
        s = object.__setattr__
        s(self, "max_new_tokens", 256 if max_new_tokens is None else int(max_new_tokens))
        s(self, "temperature", 0.0 if temperature is None else float(temperature))
        s(self, "top_k", 0 if top_k is None else int(top_k))
        s(self, "top_p", 1.0 if top_p is None else float(top_p))
        s(self, "repetition_penalty",
          1.0 if repetition_penalty is None else float(repetition_penalty))
        s(self, "seed", seed)
        s(self, "stop", (stop,) if isinstance(stop, str) else tuple(stop or ()))
        s(self, "stop_token_ids", tuple(int(t) for t in (stop_token_ids or ())))
        s(self, "ignore_eos", bool(ignore_eos))
        self._check()

    def _check(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def kernel_samplable(self) -> bool:
        """True when the in-kernel SAMPLE op computes exactly this distribution."""
        return self.top_k == 0 and self.top_p == 1.0 and self.repetition_penalty == 1.0

    def replace(self, **changes: Any) -> "SamplingParams":
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update(changes)
        return SamplingParams(**d)

    @classmethod
    def from_generation_config(cls, gen: dict[str, Any], **overrides: Any) -> "SamplingParams":
        """Defaults from a generation_config.json, as transformers reads them."""
        keys = ("temperature", "top_k", "top_p", "repetition_penalty", "do_sample")
        d = {k: gen[k] for k in keys if gen.get(k) is not None}
        if "max_new_tokens" in gen:
            d["max_new_tokens"] = gen["max_new_tokens"]
        if not d.get("do_sample", False):
            d["temperature"] = 0.0  # transformers: no do_sample -> greedy, whatever temperature
        d.pop("do_sample", None)
        d.update(overrides)
        return cls(**d)


class Sampler:
    """Host sampler for one request; ``seed`` makes it reproducible."""

    def __init__(self, params: SamplingParams):
        self.p = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: list[int]) -> int:
        if not np.all(np.isfinite(logits)):
            bad = np.flatnonzero(~np.isfinite(logits))
            raise NumericalError(f"logits hold {len(bad)} NaN/Inf values "
                                 f"(first at token id {int(bad[0])})")
        p = self.p
        x = logits.astype(np.float64)
        if p.repetition_penalty != 1.0 and history:
            idx = np.unique(np.asarray(history, dtype=np.int64))
            idx = idx[idx < len(x)]
            v = x[idx]
            x[idx] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if p.greedy:
            return int(np.argmax(x))
        x = x / p.temperature
        if p.top_k and p.top_k < len(x):
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x = np.where(x < kth, -np.inf, x)
        if p.top_p < 1.0:
            order = np.argsort(-x, kind="stable")
            probs = np.exp(x[order] - x[order[0]])
            probs /= probs.sum()
            cum = np.cumsum(probs)
            # keep the smallest prefix whose mass reaches top_p (at least one token)
            cut = int(np.searchsorted(cum, p.top_p)) + 1
            x[order[cut:]] = -np.inf
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        return int(self.rng.choice(len(probs), p=probs))


def _mix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def gumbel_noise(seed: int, pos: int, vocab: int) -> np.ndarray:
    """Bit-for-bit mirror of the kernel's counter-based Gumbel noise (megakernel.cu ``gumbel``):
    float32 [vocab] for the token sampled after position ``pos``."""
    with np.errstate(over="ignore"):
        s = _mix32(np.array([seed & 0xFFFFFFFF], np.uint32) ^ np.uint32(0x9E3779B9))
        s = _mix32(s ^ np.uint32(pos & 0xFFFFFFFF))
        h = _mix32(s ^ np.arange(vocab, dtype=np.uint32))
    u = ((h >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 8388608.0)
    return -np.log(-np.log(u))
