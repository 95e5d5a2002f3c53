"""What every executor is: ``reset()``, ``prefill(ids, start)`` (logits of the last prompt
token) and ``step(token, pos, sample)`` (one decode step), plus the small types they
exchange with the Engine. The NumPy reference executor (runtime.py) and the kernel
executors (executor.py, cuda_backend.py) implement it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..model.config import ModelConfig
from ..model.loader import LoadedModel

@dataclass
class DeviceSample:
    """What the in-kernel SAMPLE op needs: temperature 0 is greedy (argmax), otherwise
    Gumbel-max with a counter-based RNG keyed by (seed, position)."""

    temperature: float
    seed: int


@dataclass
class StepResult:
    token: int | None  # the sampled next token, when the executor sampled on the device
    logits: np.ndarray | None  # float32 [vocab], when the host samples


class Executor:
    """Runs one sequence of one model. Subclasses implement ``step``; ``prefill`` defaults to
    one step per prompt token, which is what a decode-only kernel does."""

    name = "abstract"
    device_sampling = False
    # A prefill cuts its positions at the multiples of this many, and only the K/V of whole
    # chunks equal, bit for bit, what a fresh prefill computes (the Engine reuses only those).
    # 1: a prompt runs one step per token, so every position, a fed-back token's too, is computed
    # alike. (The NumPy executor batches prompt tokens, which round differently.)
    prefill_chunk = 1

    def __init__(self, model: LoadedModel, max_seq_len: int):
        self.model = model
        self.config: ModelConfig = model.config
        self.max_seq_len = max_seq_len

    def reset(self) -> None:
        raise NotImplementedError

    def step(self, token: int, pos: int, sample: DeviceSample | None = None) -> StepResult:
        raise NotImplementedError

    def prefill(self, tokens: list[int], start_pos: int = 0) -> np.ndarray:
        res = None
        for i, t in enumerate(tokens):
            res = self.step(t, start_pos + i)
        assert res is not None and res.logits is not None
        return res.logits


def wall_times(fn: Callable[[], object], repeat: int) -> list[float]:
    """Host wall-clock seconds of each of ``repeat`` calls of ``fn`` (for CPU backends; GPU
    work is timed with CUDA events by the device)."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out
