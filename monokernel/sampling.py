"""Sampling parameters and the host-side sampler.

One seed, one text: every sampled token is a Gumbel-max draw from the kernel's counter-based
noise stream (``gumbel_noise`` mirrors megakernel.cu bit for bit), keyed by (seed, position).
The kernel's in-kernel sampling (greedy, or plain temperature) and this host sampler therefore pick the
same token from the same logits, so the same seed and parameters give the same tokens on every
backend, whichever of the two samplers ran. Top-k, top-p, min-p, the penalties and min_tokens
only run here: they mask or shift the logits before the same Gumbel-max draw.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from .errors import NumericalError, ParameterError

# Below this temperature sampling is greedy (as in vLLM): logits / 1e-30 overflow float32 to
# +-Inf, and then every tied Inf would "win" by its token id, not by its logit.
MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # top alternatives per position, as OpenAI's top_logprobs and vLLM allow


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _int(name: str, v: Any, lo: int | None = None) -> int:
    if not _is_int(v):
        raise ParameterError(f"{name} must be an integer, got {v!r}")
    v = int(v)
    if lo is not None and v < lo:
        raise ParameterError(f"{name} must be >= {lo}, got {v}")
    return v


def _float(name: str, v: Any) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer,
                                                             np.floating)):
        raise ParameterError(f"{name} must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise ParameterError(f"{name} must be a finite number, got {v}")
    return v


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token; vLLM's and Hugging Face's names are accepted.

    - ``max_new_tokens`` (alias ``max_tokens``): tokens to generate at most (>= 1).
    - ``temperature``: 0 (or below 1e-5) is greedy. ``do_sample=False`` forces greedy,
      ``do_sample=True`` without a temperature means 1.0 (Hugging Face's meaning).
    - ``top_k``: keep the k most likely tokens; 0 or -1 mean off (stored as 0).
    - ``top_p`` in (0, 1]: keep the smallest set whose probability reaches top_p.
    - ``min_p`` in [0, 1]: drop tokens less likely than min_p x the most likely one.
    - ``repetition_penalty`` > 0 (HF/vLLM): divides positive / multiplies negative logits of every
      token seen in the prompt or the output. ``presence_penalty`` and ``frequency_penalty`` in
      [-2, 2] (OpenAI/vLLM): subtracted once / per occurrence for tokens of the output only.
    - ``seed``: None or < 0 means random (stored as None); otherwise the draw is a pure function
      of (seed mod 2**31, position, logits), identical on every backend.
    - ``stop`` (strings, cut from the text), ``stop_token_ids`` (besides the model's EOS, unless
      ``ignore_eos``), ``min_tokens``: neither EOS, stop ids nor stop strings end the output
      before this many tokens.
    - ``logprobs`` (0..20 or None): per generated token, its log-probability and the top-N
      alternatives; ``prompt_logprobs``: the same for every prompt token after the first.
      Log-probabilities are of the model's raw distribution (log-softmax of the logits, before
      temperature, penalties and filters), as vLLM returns by default.
    - ``n``: completions per prompt; ``LLM.generate`` runs them one after another (sample i
      uses seed + i); streaming takes n = 1 only.

    Every bad value raises :class:`~monokernel.errors.ParameterError` (a ValueError) naming the
    parameter and the value; NaN and Inf are refused in every float.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    n: int = 1

    def __init__(self, max_new_tokens: int | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None,
                 repetition_penalty: float | None = None, seed: int | None = None,
                 stop: str | Iterable[str] | None = None,
                 stop_token_ids: Iterable[int] | None = None, ignore_eos: bool = False,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 min_p: float = 0.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, min_tokens: int = 0, n: int = 1, *,
                 do_sample: bool | None = None, max_tokens: int | None = None) -> None:
        if max_tokens is not None:
            if max_new_tokens is not None and max_new_tokens != max_tokens:
                raise ParameterError(f"give max_new_tokens or max_tokens, not both "
                                     f"(got {max_new_tokens} and {max_tokens})")
            max_new_tokens = max_tokens
        if do_sample is False:
            temperature = 0.0
        elif do_sample is True and temperature in (None, 0.0):
            temperature = 1.0
        s = object.__setattr__
        s(self, "max_new_tokens",
          256 if max_new_tokens is None else _int("max_new_tokens", max_new_tokens, 1))
        t = 0.0 if temperature is None else _float("temperature", temperature)
        if t < 0:
            raise ParameterError(f"temperature must be >= 0, got {t}")
        s(self, "temperature", 0.0 if t < MIN_TEMPERATURE else t)
        k = 0 if top_k is None else _int("top_k", top_k)
        if k < -1:
            raise ParameterError(f"top_k must be >= 1, or 0 or -1 for off, got {k}")
        s(self, "top_k", max(k, 0))
        s(self, "top_p", 1.0 if top_p is None else _float("top_p", top_p))
        s(self, "repetition_penalty",
          1.0 if repetition_penalty is None else _float("repetition_penalty",
                                                        repetition_penalty))
        if seed is not None:
            seed = _int("seed", seed)
        s(self, "seed", None if seed is None or seed < 0 else seed)
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop or ())
        for x in stop:
            if not isinstance(x, str):
                raise ParameterError(f"stop must be a string or a list of strings, got {x!r}")
        s(self, "stop", stop)
        s(self, "stop_token_ids",
          tuple(_int("stop_token_ids", t, 0) for t in (stop_token_ids or ())))
        s(self, "ignore_eos", bool(ignore_eos))
        for name, v in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if v is not None:
                v = _int(name, v, 0)
                if v > MAX_LOGPROBS:
                    raise ParameterError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")
            s(self, name, v)
        s(self, "min_p", _float("min_p", min_p))
        s(self, "presence_penalty", _float("presence_penalty", presence_penalty))
        s(self, "frequency_penalty", _float("frequency_penalty", frequency_penalty))
        s(self, "min_tokens", _int("min_tokens", min_tokens, 0))
        s(self, "n", _int("n", n, 1))
        self._check()

    def _check(self) -> None:
        if not 0 < self.top_p <= 1:
            raise ParameterError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ParameterError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ParameterError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ParameterError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.min_tokens > self.max_new_tokens:
            raise ParameterError(f"min_tokens ({self.min_tokens}) must be <= max_new_tokens "
                                 f"({self.max_new_tokens})")
        if any(s == "" for s in self.stop):
            raise ParameterError("stop strings must not be empty (got '')")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def kernel_samplable(self) -> bool:
        """True when the kernel's sampling (argmax of logits / T + Gumbel noise) computes
        exactly this choice: no filter, no penalty, no stop-token masking."""
        return (self.top_k == 0 and self.top_p == 1.0 and self.min_p == 0.0
                and self.repetition_penalty == 1.0 and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0 and self.min_tokens == 0)

    def replace(self, **changes: Any) -> "SamplingParams":
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - set(d) - {"max_tokens", "do_sample"})
        if unknown:
            raise ParameterError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        if "max_tokens" in changes:
            d.pop("max_new_tokens")
        d.update(changes)
        return SamplingParams(**d)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SamplingParams":
        """``SamplingParams(**d)`` with an unknown key named in a ParameterError."""
        if not isinstance(d, Mapping):
            raise ParameterError(f"sampling parameters must be SamplingParams or a dict, "
                                 f"got {type(d).__name__}")
        return cls().replace(**dict(d)) if d else cls()

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


def random_seed() -> int:
    return int(np.random.SeedSequence().entropy % (1 << 31))


class Sampler:
    """Host sampler for one request. ``seed`` (a random one when None) keys the Gumbel noise;
    ``prompt_len`` separates the prompt from the output in the history (presence and frequency
    penalties count output tokens only); ``stop_ids`` are masked while fewer than
    ``min_tokens`` tokens were generated."""

    def __init__(self, params: SamplingParams, seed: int | None = None, prompt_len: int = 0,
                 stop_ids: Iterable[int] = ()):
        self.p = params
        seed = params.seed if seed is None else seed
        self.seed = (random_seed() if seed is None else seed) & 0x7FFFFFFF
        self.prompt_len = prompt_len
        self.stop_ids = np.array(sorted(set(stop_ids)), np.int64)

    def scores(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        """The logits after penalties, masking, temperature and the top-k / top-p / min-p
        filters (-Inf where filtered): the token is argmax(scores + Gumbel noise), or
        argmax(scores) when greedy. float32 when no host-only step applies (so that it equals
        the kernel's logit / T bit for bit), float64 otherwise."""
        if not np.all(np.isfinite(logits)):
            bad = np.flatnonzero(~np.isfinite(logits))
            raise NumericalError(f"logits hold {len(bad)} NaN/Inf values "
                                 f"(first at token id {int(bad[0])})")
        p = self.p
        if p.kernel_samplable:
            x = np.asarray(logits, np.float32)
            return x if p.greedy else x / np.float32(p.temperature)
        x = logits.astype(np.float64)
        if p.repetition_penalty != 1.0 and history:
            idx = np.unique(np.asarray(history, dtype=np.int64))
            idx = idx[idx < len(x)]
            v = x[idx]
            x[idx] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        out = history[self.prompt_len:]
        if (p.presence_penalty or p.frequency_penalty) and out:
            ids, counts = np.unique(np.asarray(out, np.int64), return_counts=True)
            keep = ids < len(x)
            ids, counts = ids[keep], counts[keep]
            x[ids] -= p.frequency_penalty * counts + p.presence_penalty
        if len(out) < p.min_tokens and len(self.stop_ids):
            x[self.stop_ids[self.stop_ids < len(x)]] = -np.inf
        if p.greedy:
            return x
        x = x / p.temperature
        if p.min_p > 0:
            # prob >= min_p * max prob  <=>  score >= max score + log(min_p)
            x = np.where(x < x.max() + math.log(p.min_p), -np.inf, x)
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
        return x

    def distribution(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        """The probabilities the draw follows (one-hot when greedy); for tests and tools."""
        x = np.asarray(self.scores(logits, history), np.float64)
        if self.p.greedy:
            out = np.zeros(len(x))
            out[int(np.argmax(x))] = 1.0
            return out
        probs = np.exp(x - x.max())
        return probs / probs.sum()

    def __call__(self, logits: np.ndarray, history: list[int]) -> int:
        """The token after ``history`` (prompt + output so far): it sits at position
        len(history), so the noise is the kernel's for position len(history) - 1."""
        x = self.scores(logits, history)
        if self.p.greedy:
            return int(np.argmax(x))
        g = gumbel_noise(self.seed, len(history) - 1, len(x))
        return int(np.argmax(x + g.astype(x.dtype)))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities of float32 logits [..., vocab]."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def top_logprobs(lp: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n (token id, logprob) pairs of highest logprob, best first (ties: lower id first)."""
    if n <= 0:
        return []
    n = min(n, len(lp))
    idx = np.argpartition(-lp, n - 1)[:n]
    idx = idx[np.lexsort((idx, -lp[idx]))]
    return [(int(i), float(lp[i])) for i in idx]


def rank_of(lp: np.ndarray, token: int) -> int:
    """``token``'s 1-based rank in the distribution ``lp``: 1 + the tokens strictly more likely
    (vLLM's rule, so ties share a rank)."""
    return int(np.count_nonzero(lp > lp[token])) + 1


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
