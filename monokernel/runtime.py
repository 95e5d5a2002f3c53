"""The Engine: one generation loop over an executor.

An executor runs the model for one sequence: ``reset()``, ``prefill(ids, start)`` (logits of
the last prompt token) and ``step(token, pos, sample)`` (one decode step). The NumPy executor
runs reference.py; the kernel executors (emulator, cuda, and their multi-kernel baselines) share
one program and one set of buffers and differ only in how they allocate, copy and launch.

Two things the Engine relies on: ``reset()`` keeps the K/V cache (every position is written
before it is read), so a new sequence that shares a prefix with the previous one prefills only
its new tokens (past whole ``prefill_chunk``s of the shared prefix, so that the reused K/V are
bit for bit those a fresh prefill computes, and one seed gives one text with or without reuse);
and ``step(token, pos, None)`` returns the logits on every backend, so logprobs need no device
support: the host then samples from the kernel's own Gumbel stream (sampling.py), which picks
the token the kernel's SAMPLE op would have picked.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .errors import (BackendUnavailableError, MonokernelError, NumericalError, ParameterError,
                     PromptError)
from .kernel.base import DeviceSample, Executor, StepResult
from .model.loader import LoadedModel
from .sampling import Sampler, SamplingParams, log_softmax, rank_of, top_logprobs


class NumpyExecutor(Executor):
    """reference.py as an executor. ``reset()`` keeps the K/V cache: every position is written
    before it is read, and the Engine reuses the cache of a shared prompt prefix.

    ``threads``: the BLAS threads its matrix products use (default: the CPUs this process may
    run on). Set deliberately, through threadpoolctl, around every forward pass and said on
    stderr at start: OpenBLAS's own default spun its worker threads against other work on a
    busy 2-core machine and decode fell from 6-18 to 0.7-2.3 tokens/s, unnoticed.

    ``prefill_chunk``: a prompt runs in chunks that start at multiples of this many positions
    (default 32), so that a prefill from any such multiple makes exactly the calls a prefill from
    position 0 makes there, and reusing a cached prefix gives the same numbers, bit for bit, as
    prefilling it again. BLAS rounds a row differently by how many rows go with it (one row is a
    matrix-vector product), so the rows of other chunk shapes differ in the last bits: a decode
    step's K/V, or a shorter last chunk's, is not what a fresh prefill computes there, and the
    Engine reuses only whole chunks of a prompt. 1: every position alone, like a decode step
    (every position reusable, a chat reply's too, but prefill at decode speed); larger: faster
    prefill of long prompts (measured on SmolLM2, 256 tokens: 16 -> 1.9x, 32 -> 1.5x, 64 ->
    1.2x the time of one 256-row chunk), reuse in coarser steps."""

    name = "numpy"
    OPTIONS = ("threads", "prefill_chunk")
    DEFAULT_PREFILL_CHUNK = 32

    def __init__(self, model: LoadedModel, max_seq_len: int, *, threads: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, **options):
        if options:
            raise ParameterError(
                f"the numpy backend has no option {next(iter(options))!r} (its options: "
                f"{', '.join(self.OPTIONS)}; blocks and the like apply to the kernel backends)")
        asked = threads is not None
        source = "as asked"
        if threads is None:
            threads, source = default_threads()
        if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) \
                or threads < 1:
            raise ParameterError(f"threads must be an integer >= 1, got {threads!r}")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) \
                or prefill_chunk < 1:
            raise ParameterError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # a core dependency, but a machine without pip may lack it
            ThreadpoolController = None
            if asked:
                raise BackendUnavailableError(
                    "threads= needs the threadpoolctl package, which is not installed here: "
                    "pip install threadpoolctl") from None
        super().__init__(model, max_seq_len)
        from .model.reference import ReferenceModel

        self.threads = int(threads)
        self.prefill_chunk = int(prefill_chunk)
        self._blas = ThreadpoolController() if ThreadpoolController is not None else None
        self.ref = ReferenceModel(model.config, model.weights, max_seq_len)
        self.forward_calls = 0  # lets the Engine notice use of the KV cache behind its back
        if self._blas is None:
            self.threads = None
            print("monokernel: numpy backend: BLAS threads left as the library chose them "
                  "(threadpoolctl is not installed: pip install threadpoolctl)", file=sys.stderr)
            return
        libs = sorted({lib["internal_api"] for lib in self._blas.info()
                       if lib["user_api"] == "blas"}) or ["no BLAS library found"]
        print(f"monokernel: numpy backend: {self.threads} BLAS thread"
              f"{'s' if self.threads != 1 else ''} ({', '.join(libs)}, {source}; change with "
              f"--threads N or LLM(..., threads=N))", file=sys.stderr)

    def _forward(self, tokens: list[int], start_pos: int, **kw) -> np.ndarray | None:
        if self._blas is None:
            return self.ref.forward(tokens, start_pos, **kw)
        with self._blas.limit(limits=self.threads, user_api="blas"):
            return self.ref.forward(tokens, start_pos, **kw)

    def reset(self) -> None:
        self.forward_calls += 1

    def prefill(self, tokens: list[int], start_pos: int = 0) -> np.ndarray:
        return self._prefill(tokens, start_pos, every=False)[-1]

    def prefill_all(self, tokens: list[int], start_pos: int = 0) -> np.ndarray:
        """float32 logits [len(tokens), vocab] of every prompt position."""
        return self._prefill(tokens, start_pos, every=True)

    def _prefill(self, tokens: list[int], start_pos: int, every: bool) -> np.ndarray:
        """Positions [start_pos, start_pos + len(tokens)) in chunks cut at the multiples of
        ``prefill_chunk``; the logits of every chunk (``every``) or of the last one. The last
        chunk's logits are computed for all its rows either way, so that ``prefill`` and
        ``prefill_all`` give the last token the same logits."""
        self.forward_calls += 1
        c, end = self.prefill_chunk, start_pos + len(tokens)
        out, pos = [], start_pos
        while pos < end:
            stop = min((pos // c + 1) * c, end)
            last = stop == end
            logits = self._forward(tokens[pos - start_pos:stop - start_pos], pos,
                                   **({} if every or last else {"logits": False}))
            if logits is not None:
                out.append(logits)
            pos = stop
        if not out:  # no tokens: no rows
            return np.zeros((0, self.config.vocab_size), np.float32)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def step(self, token: int, pos: int, sample: DeviceSample | None = None) -> StepResult:
        self.forward_calls += 1
        return StepResult(token=None, logits=self._forward([token], pos)[0])


# Environment variables a user sets to choose BLAS threads; the first one set wins over the
# CPU count, as it would for NumPy itself.
THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def default_threads() -> tuple[int, str]:
    """(threads, where the number came from): a thread variable of the environment when one is
    set to a positive integer, else the CPUs this process may run on (its affinity mask, which
    a container or ``taskset`` narrows, not the machine's count)."""
    for var in THREAD_ENV:
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value), f"from {var}"
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity call
        n = os.cpu_count() or 1
    return max(1, n), "the CPUs this process may use"


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
    factory = EXECUTORS[backend]
    valid = getattr(factory, "OPTIONS", None)  # what the backend declares it takes
    unknown = [k for k in options if valid is not None and k not in valid]
    if unknown:
        raise ParameterError(
            f"backend {backend!r} has no option {unknown[0]!r} (its options: "
            f"{', '.join(valid) or 'none'})")
    return factory(model, max_seq_len, **options)


# Kernel executors live in kernel/; each module lists its factories in a BACKENDS dict. They are
# imported on first use, so that plain numpy use never pays for them (and kernel/ never imports
# this module: imports flow one way, face -> runtime -> kernel -> model).
KERNEL_BACKEND_MODULES = ("monokernel.kernel.executor", "monokernel.kernel.cuda_backend")


def _load_kernel_backends() -> None:
    import importlib

    for mod in KERNEL_BACKEND_MODULES:
        for name, factory in importlib.import_module(mod).BACKENDS.items():
            EXECUTORS.setdefault(name, factory)


# A generation whose engine started another one: the KV cache is not its own any more.
INVALIDATED = ("this stream was invalidated: another generation started on the same LLM (one "
               "sequence at a time)")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens run through the model (the rest came from the cache)
    reused_tokens: int = 0  # prompt tokens whose K/V were reused from the previous sequence
    prefill_s: float = 0.0
    decode_s: float = 0.0
    launches: int = 0  # kernel launches the host made (a CUDA graph replay is one; numpy: 0)

    @property
    def decode_tokens_per_s(self) -> float:
        n = max(self.generated_tokens - 1, 0)  # the first token comes out of prefill
        return n / self.decode_s if self.decode_s > 0 else float("nan")


@dataclass
class Sampled:
    """One generated token. ``stop``: it is a stop token (EOS or a stop id), yielded last and
    not part of the output. ``logprob``/``top``: its log-probability and the top-N
    (token id, logprob) alternatives, when the params asked for logprobs."""

    token: int
    stop: bool
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    rank: int | None = None  # 1-based, in the whole distribution (vLLM's Logprob.rank)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class Generation:
    """An iterator of :class:`Sampled` for one request on an Engine. ``prompt_logprobs`` is set
    once the prompt has run (before the first token comes out): one entry per prompt token,
    None for the first, else (logprob, top alternatives, rank). ``close()`` cancels it: at once when
    called between tokens, else before the next step (it may come from another thread)."""

    def __init__(self, engine: "Engine", ids: list[int], params: SamplingParams,
                 seed: int | None):
        self.engine = engine
        self.ids = ids
        self.params = params
        self.sampler_seed = seed
        self.prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
        self.stats = GenerationStats(prompt_tokens=len(ids))  # this generation's
        self.cancelled = False
        self._it = engine._run(self)

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> Sampled:
        return next(self._it)

    def close(self) -> None:
        self.cancelled = True
        try:
            self._it.close()
        except ValueError:  # running in another thread: it sees `cancelled` before its next step
            pass


class Engine:
    """The generation loop: validate, prefill, then sample and step until a stop condition.

    One sequence at a time. With ``prefix_caching`` the K/V cache of the longest common prefix
    of the previous sequence (prompt and fed tokens) and the new prompt is kept, and only the
    new tokens are prefilled (chat turns, repeated system prompts, server requests).

    Reuse is exact: only K/V that a fresh prefill of the new prompt would compute bit for bit
    are kept, so a seeded request gives the same text whether or not it reused a prefix. With an
    executor's ``prefill_chunk`` C > 1 (NumPy) those are the whole chunks of a prompt: the
    reused length is a multiple of C, and a fed-back token's K/V (a one-row decode step) is
    not reused."""

    def __init__(self, executor: Executor, *, prefix_caching: bool = True):
        self.executor = executor
        self.config = executor.config
        self.prefix_caching = prefix_caching
        self.stats = GenerationStats()
        self._active: object | None = None  # the generation that owns the KV cache
        # tokens at positions 0.. of the cache whose K/V are exactly a fresh prefill's
        self._kv_ids: list[int] = []
        self._kv_mark: object = None  # executor state when _kv_ids was last right

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

    def generate(self, ids: list[int], params: SamplingParams, *,
                 seed: int | None = None) -> Generation:
        """Start a generation (it runs as it is iterated). ``seed`` overrides params.seed."""
        self.check_prompt(ids)
        return Generation(self, list(ids), params, seed)

    def generate_ids(self, ids: list[int], params: SamplingParams) -> Iterator[tuple[int, bool]]:
        """Yield (token, is_stop_token). A stop token is yielded last and not part of the text."""
        for s in self.generate(ids, params):
            yield s.token, s.stop

    def _mark(self) -> object:
        ex = self.executor
        return (id(ex), getattr(ex, "forward_calls", None), getattr(ex, "_steps", None))

    def _reusable(self, ids: list[int]) -> int:
        if not self.prefix_caching or self._kv_mark != self._mark():
            return 0
        n = min(_common_prefix(self._kv_ids, ids), len(ids) - 1)  # the last one gives logits
        return n - n % self.executor.prefill_chunk  # the fresh prefill's chunks start there

    def _exact_kv(self, ids: list[int], fed: list[int]) -> list[int]:
        """The tokens of the cache whose K/V a fresh prefill would compute alike, after a
        prefill of ``ids`` and decode steps of ``fed``: all of them when the executor prefills
        one position at a time, else the prompt's whole chunks."""
        c = self.executor.prefill_chunk
        return list(ids) + list(fed) if c == 1 else list(ids[:len(ids) - len(ids) % c])

    def _prefill_all(self, ids: list[int]) -> np.ndarray:
        ex = self.executor
        if hasattr(ex, "prefill_all"):
            return ex.prefill_all(ids, 0)
        return np.stack([np.array(ex.step(t, i, None).logits, np.float32)
                         for i, t in enumerate(ids)])

    def _run(self, g: Generation) -> Iterator[Sampled]:
        ids, params = g.ids, g.params
        if g.cancelled:
            return
        ex = self.executor
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= set(self.config.eos_token_ids)
        sampler = Sampler(params, g.sampler_seed, prompt_len=len(ids), stop_ids=stops)
        nlp = params.logprobs
        # logprobs need the logits on the host; the host sampler then draws the same token
        # from the same noise as the kernel would
        device = ex.device_sampling and params.kernel_samplable and nlp is None
        dsample = DeviceSample(params.temperature, sampler.seed) if device else None

        def sampled(logits: np.ndarray, history: list[int]) -> Sampled:
            tok = sampler(logits, history)
            if nlp is None:
                return Sampled(tok, tok in stops)
            lp = log_softmax(logits)
            return Sampled(tok, tok in stops, float(lp[tok]), top_logprobs(lp, nlp),
                           rank_of(lp, tok))

        history = list(ids)
        self.stats = st = g.stats
        reuse = self._reusable(ids) if params.prompt_logprobs is None else 0
        self._active = me = object()
        self._kv_ids, self._kv_mark = [], None  # invalid until the prefill has run
        ex.reset()
        launches0 = getattr(ex, "launches", 0)
        if dsample is not None and getattr(ex, "multi_step", False) \
                and params.prompt_logprobs is None:
            try:
                yield from self._run_in_launches(g, ids, reuse, dsample, stops, me)
            finally:
                st.launches = getattr(ex, "launches", 0) - launches0
            return
        t0 = time.perf_counter()
        if params.prompt_logprobs is not None:
            all_logits = self._prefill_all(ids)
            logits = all_logits[-1]
            lps = log_softmax(all_logits[:-1])
            g.prompt_logprobs = [None] + [
                (float(lps[i, ids[i + 1]]), top_logprobs(lps[i], params.prompt_logprobs),
                 rank_of(lps[i], ids[i + 1]))
                for i in range(len(ids) - 1)]
        else:
            logits = ex.prefill(ids[reuse:], reuse)
        kv = self._exact_kv(ids, [])
        feeds_exact = ex.prefill_chunk == 1  # a decode step computes what a prefill would
        self._kv_ids, self._kv_mark = kv, self._mark()
        st.prefill_tokens, st.reused_tokens = len(ids) - reuse, reuse
        cur = sampled(logits, history)
        st.prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pos = len(ids)
        for i in range(params.max_new_tokens):
            st.generated_tokens += 1
            history.append(cur.token)
            st.decode_s = time.perf_counter() - t0
            yield cur
            if cur.stop or i + 1 == params.max_new_tokens or pos + 1 >= ex.max_seq_len:
                return
            if g.cancelled:
                return
            if self._active is not me:  # one sequence at a time: the KV cache is not ours now
                raise MonokernelError(INVALIDATED)
            self._kv_mark = None
            try:
                res = ex.step(cur.token, pos, dsample)
            except BaseException:  # Ctrl-C, a NaN: a step writes position pos only, so the
                self._kv_mark = self._mark()  # positions before it still hold kv
                raise
            if feeds_exact:
                kv.append(cur.token)
            self._kv_mark = self._mark()
            st.launches = getattr(ex, "launches", 0) - launches0
            pos += 1
            if res.token is not None:
                cur = Sampled(res.token, res.token in stops)
            else:
                cur = sampled(res.logits, history)

    def _run_in_launches(self, g: Generation, ids: list[int], reuse: int, dsample: DeviceSample,
                         stops: set[int], me: object) -> Iterator[Sampled]:
        """The prompt and the decode steps in as few kernel launches as the executor allows
        (``run_steps``): the kernel samples and stops by itself (stop tokens, max_new_tokens,
        the context end); closing this generator early (a stop string, a cancel) asks it to
        stop, and the K/V bookkeeping then follows what it actually ran."""
        ex, params, st = self.executor, g.params, g.stats
        stop_pos = min(len(ids) + params.max_new_tokens - 1, ex.max_seq_len - 1)
        st.prefill_tokens, st.reused_tokens = len(ids) - reuse, reuse
        t0 = time.perf_counter()
        run = ex.run_steps(ids[reuse:], reuse, dsample, stop_ids=stops, stop_pos=stop_pos,
                           should_stop=lambda: g.cancelled)
        try:
            for i, tok in enumerate(run):
                if tok < 0:
                    raise NumericalError(f"{ex.name}: NaN in the logits at position "
                                         f"{len(ids) + i - 1}")
                now = time.perf_counter()
                if i == 0:
                    st.prefill_s, t0 = now - t0, now
                st.generated_tokens += 1
                st.decode_s = now - t0
                cur = Sampled(tok, tok in stops)
                yield cur
                if cur.stop or i + 1 == params.max_new_tokens or g.cancelled:
                    return
                if self._active is not me:
                    raise MonokernelError(INVALIDATED)
        finally:
            try:
                run.close()  # ends the launch (asks it to stop first if it still runs)
            finally:
                end = ex.last_launch
                if end is not None and self._active is me:
                    # positions [0, end_pos) hold K/V: the prompt, then the tokens it fed back
                    self._kv_ids = self._exact_kv(
                        ids, end.tokens[:max(end.end_pos - len(ids), 0)])
                    self._kv_mark = self._mark()
