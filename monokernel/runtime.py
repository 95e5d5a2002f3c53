"""The Engine: one generation loop over an executor.

An executor runs the model for one sequence: ``reset()``, ``prefill(ids, start)`` (logits of
the last prompt token) and ``step(token, pos, sample)`` (one decode step). The NumPy executor
runs reference.py; the kernel executors (emulator, cuda, and their multi-kernel baselines) share
one program and one set of buffers and differ only in how they allocate, copy and launch.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .errors import BackendUnavailableError, MonokernelError, PromptError
from .kernel.base import DeviceSample, Executor, StepResult
from .model.loader import LoadedModel
from .sampling import Sampler, SamplingParams


class NumpyExecutor(Executor):
    name = "numpy"

    def __init__(self, model: LoadedModel, max_seq_len: int, **options):
        if options:
            raise ValueError(f"the numpy backend takes no options (got {', '.join(options)}); "
                             "blocks and the like apply to the kernel backends")
        super().__init__(model, max_seq_len)
        from .model.reference import ReferenceModel

        self.ref = ReferenceModel(model.config, model.weights, max_seq_len)

    def reset(self) -> None:
        self.ref.reset()

    def prefill(self, tokens: list[int], start_pos: int = 0) -> np.ndarray:
        return self.ref.forward(tokens, start_pos)[-1]

    def step(self, token: int, pos: int, sample: DeviceSample | None = None) -> StepResult:
        return StepResult(token=None, logits=self.ref.forward([token], pos)[0])


def cuda_device_present() -> bool:
    try:
        import cupy  # noqa: F401

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# backend name -> factory(model, max_seq_len, **options); kernel backends register here
EXECUTORS: dict[str, Callable[..., Executor]] = {"numpy": NumpyExecutor}


def register_executor(name: str, factory: Callable[..., Executor]) -> None:
    EXECUTORS[name] = factory


def make_executor(backend: str, model: LoadedModel, max_seq_len: int, **options) -> Executor:
    """``auto`` picks ``cuda`` when a CUDA device is present, else ``numpy``, and says which."""
    if backend == "auto":
        backend = "cuda" if cuda_device_present() else "numpy"
        print(f"monokernel: backend auto -> {backend}", file=sys.stderr)
    if backend not in EXECUTORS:
        _load_kernel_backends()
    if backend not in EXECUTORS:
        raise BackendUnavailableError(
            f"unknown backend {backend!r} (available: auto, {', '.join(sorted(EXECUTORS))})")
    return EXECUTORS[backend](model, max_seq_len, **options)


# Kernel executors live in kernel/; each module lists its factories in a BACKENDS dict. They are
# imported on first use, so that plain numpy use never pays for them (and kernel/ never imports
# this module: imports flow one way, face -> runtime -> kernel -> model).
KERNEL_BACKEND_MODULES = ("monokernel.kernel.executor", "monokernel.kernel.cuda_backend")


def _load_kernel_backends() -> None:
    import importlib

    for mod in KERNEL_BACKEND_MODULES:
        for name, factory in importlib.import_module(mod).BACKENDS.items():
            EXECUTORS.setdefault(name, factory)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = max(self.generated_tokens - 1, 0)  # the first token comes out of prefill
        return n / self.decode_s if self.decode_s > 0 else float("nan")


class Engine:
    """The generation loop: validate, prefill, then sample and step until a stop condition."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.config = executor.config
        self.stats = GenerationStats()
        self._active: object | None = None  # the generation that owns the KV cache

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise PromptError("the prompt is empty (no tokens)")
        v = self.config.vocab_size
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < v]
        if bad:
            i, t = bad[0]
            raise PromptError(f"token id {t} at prompt position {i} is outside the "
                              f"vocabulary [0, {v})")
        if len(ids) >= self.executor.max_seq_len:
            raise PromptError(f"the prompt has {len(ids)} tokens; the context holds "
                              f"{self.executor.max_seq_len} (no room to generate)")

    def generate_ids(self, ids: list[int], params: SamplingParams) -> Iterator[tuple[int, bool]]:
        """Yield (token, is_stop_token). A stop token is yielded last and not part of the text."""
        self.check_prompt(ids)
        ex = self.executor
        sampler = Sampler(params)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= set(self.config.eos_token_ids)
        device = (ex.device_sampling and params.kernel_samplable)
        seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy
                                                                 % (1 << 31))
        dsample = DeviceSample(params.temperature, seed) if device else None
        history = list(ids)
        self.stats = st = GenerationStats(prompt_tokens=len(ids))
        self._active = me = object()
        ex.reset()
        t0 = time.perf_counter()
        logits = ex.prefill(ids, 0)
        tok = sampler(logits, history)
        st.prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pos = len(ids)
        for i in range(params.max_new_tokens):
            st.generated_tokens += 1
            history.append(tok)
            st.decode_s = time.perf_counter() - t0
            if tok in stops:
                yield tok, True
                return
            yield tok, False
            if i + 1 == params.max_new_tokens or pos + 1 >= ex.max_seq_len:
                return
            if self._active is not me:  # one sequence at a time: the KV cache is not ours now
                raise MonokernelError("this stream was invalidated: another generation started "
                                      "on the same LLM (one sequence at a time)")
            res = ex.step(tok, pos, dsample)
            pos += 1
            tok = res.token if res.token is not None else sampler(res.logits, history)
