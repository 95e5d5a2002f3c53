"""The Engine: one generation loop over the executor interface (kernel/base.py).

(A batched executor, the NumPy one, runs many generations at once through batching.py; the
rest of this docstring is the one-sequence path the kernel executors take.)

An executor runs the model for one sequence. The NumPy executor runs reference.py; the kernel
executors (emulator, cuda, and their multi-kernel baselines) share one program and one set of
buffers and differ only in how they allocate, copy and launch. The Engine drives every one of
them through ``run_steps`` and decides when a generation ends in one place (``StopRule``).

Two things the Engine relies on: ``reset()`` keeps the K/V cache (every position is written
before it is read), so a new sequence that shares a prefix with the previous one prefills only
its new tokens (past whole ``prefill_chunk``s of the shared prefix, so that the reused K/V are
bit for bit those a fresh prefill computes, and one seed gives one text with or without reuse);
and without a DeviceSample every backend hands the host the logits, so logprobs
need no device support: the host then samples from the kernel's own Gumbel stream
(sampling.py), which picks the token the kernel's sampling would have picked.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from .batching import Batcher, batch_options
from .errors import (BackendUnavailableError, MonokernelError, NumericalError, ParameterError,
                     PromptError)
from .kernel.base import (DEFAULT_PAGE_SIZE, Backend, BackendOptions, DeviceSample, Executor,
                          StepResult, StepTable, TableResult)
from .kernel.isa import StopReason
from .model.loader import LoadedModel
from .sampling import Sampler, SamplingParams, log_softmax, rank_of, top_logprobs


@dataclass(frozen=True)
class NumpyOptions(BackendOptions):
    """``threads``: the BLAS threads of the reference's matrix products (None: the CPUs this
    process may use, or a thread variable of the environment)."""

    threads: int | None = field(default=None, metadata={"min": 1})
    prefill_chunk: int = field(default=32, metadata={"min": 1})  # NumpyExecutor's docstring
    batch_invariant: bool = False  # NumpyExecutor.run_table
    page_size: int = field(default=DEFAULT_PAGE_SIZE, metadata={"min": 1})  # per K/V page


class NumpyExecutor(Executor):
    """reference.py as an executor. ``reset()`` keeps the K/V cache: every position is written
    before it is read, and the Engine reuses the cache of a shared prompt prefix.

    ``threads``: the BLAS threads its matrix products use (default: the CPUs this process may
    run on). Set deliberately, through threadpoolctl, around every forward pass and said on
    stderr at start: OpenBLAS's own default spun its worker threads against other work on a
    busy 2-core machine and decode fell from 6-18 to 0.7-2.3 tokens/s, unnoticed.

    The Engine drives it through ``run_table`` (batching.py: many sequences per step over a
    page pool; ``page_size`` positions per page; ``batch_invariant``: run_table's docstring).
    ``prefill_chunk`` is for its one-sequence calls (``prefill``, ``step``: tools, tests).

    ``prefill_chunk``: a prompt runs in chunks that start at multiples of this many positions
    (default 32), so that a prefill from any such multiple makes exactly the calls a prefill from
    position 0 makes there, and reusing a cached prefix gives the same numbers, bit for bit, as
    prefilling it again. A product of two rows or more runs in the reference's probed row
    blocks (a row's numbers the same at any offset and beside any rows), but one row alone is a
    matrix-vector product, which rounds otherwise: a decode step's K/V, or those of a last
    chunk of one row, are not what a prefill of more rows computes there, so the Engine reuses
    only whole chunks of a prompt. 1: every position alone, like a decode step
    (every position reusable, a chat reply's too, but prefill at decode speed); larger: faster
    prefill of long prompts (measured on SmolLM2, 256 tokens: 16 -> 1.9x, 32 -> 1.5x, 64 ->
    1.2x the time of one 256-row chunk), reuse in coarser steps."""

    name = "numpy"
    max_num_seqs = 256  # run_table takes any number; the Engine's max_num_seqs sets how many

    def __init__(self, model: LoadedModel, max_seq_len: int,
                 options: NumpyOptions = NumpyOptions()):
        threads = options.threads  # validated by NumpyOptions.from_user
        asked = threads is not None
        source = "as asked"
        if threads is None:
            threads, source = default_threads()
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
        self.prefill_chunk = options.prefill_chunk
        self.batch_invariant = options.batch_invariant
        self.page_size = options.page_size
        self._blas = ThreadpoolController() if ThreadpoolController is not None else None
        self.ref = ReferenceModel(model.config, model.weights, max_seq_len, self.page_size)
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

    def add_pages(self, n: int) -> range:
        return self.ref.add_pages(n)

    def run_table(self, table: StepTable, should_stop=None) -> TableResult:
        """One batched step (ReferenceModel.forward_rows). Every step of two rows or more is a
        matrix-matrix product in blocks of ReferenceModel.row_block rows, so a row's numbers
        are those of any other such step; a step of one prompt row runs as a block too, so
        that a prompt's K/V never depend on how it was cut (the prefix cache relies on it). A
        lone decode row stays a matrix-vector product, the fast batch-1 path: its logits
        differ from the batched ones in the last bits (~1e-5 of their scale), so a sequence
        decoding alone and beside others agree in greedy tokens and to that tolerance
        (``batch_invariant=True`` pads it too: bitwise, ~2x slower at batch 1). The host
        samples every row (no ``device_sampling``: no draws)."""
        if table.draws:
            raise MonokernelError(f"{self.name}: the host samples every row (no draws)")
        slots = sorted(table.block_tables)
        index = {s: i for i, s in enumerate(slots)}
        seqs = [index[int(s)] for s in table.slots]
        lone_decode = len(table) == 1 and not table.prompt_rows[0]
        kw = dict(logit_rows=np.flatnonzero(table.logits),
                  pad_lone=self.batch_invariant or not lone_decode)
        tables = [table.block_tables[s] for s in slots]
        self.forward_calls += 1
        if self._blas is None:
            out = self.ref.forward_rows(table.tokens, table.positions, seqs, tables, **kw)
        else:
            with self._blas.limit(limits=self.threads, user_api="blas"):
                out = self.ref.forward_rows(table.tokens, table.positions, seqs, tables, **kw)
        logits = np.zeros((0, self.config.vocab_size), np.float32) if out is None else out
        return TableResult(logits, np.zeros(0, np.int64))

    def reset(self) -> None:
        self.forward_calls += 1

    def cache_token(self):
        return (id(self), self.forward_calls)

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


# backend name -> Backend; the kernel backends are added on first use (_load_kernel_backends)
EXECUTORS: dict[str, Backend] = {"numpy": Backend("numpy", NumpyOptions, NumpyExecutor)}


def register_executor(backend: Backend) -> None:
    EXECUTORS[backend.name] = backend


def resolve_backend(backend: str) -> Backend:
    """The Backend of a name; ``auto`` picks ``cuda`` when a CUDA device is present, else
    ``numpy``, and says which. An unknown name is a BackendUnavailableError listing them."""
    if backend == "auto":
        backend = "cuda" if cuda_device_present() else "numpy"
        print(f"monokernel: backend auto -> {backend}", file=sys.stderr)
    if backend not in EXECUTORS:
        _load_kernel_backends()
    if backend not in EXECUTORS:
        raise BackendUnavailableError(
            f"unknown backend {backend!r} (available: auto, {', '.join(sorted(EXECUTORS))})")
    return EXECUTORS[backend]


def backend_options(backend: str | Backend, options: Mapping[str, Any]) -> BackendOptions:
    """A user's options of ``backend``, validated (ParameterError naming a bad one)."""
    spec = resolve_backend(backend) if isinstance(backend, str) else backend
    return spec.parse(options)


def make_executor(backend: str | Backend, model: LoadedModel, max_seq_len: int,
                  options: BackendOptions | None = None, **given) -> Executor:
    """The executor of ``backend`` with ``options`` (from ``backend_options``) or the
    keywords ``given``, validated here."""
    spec = resolve_backend(backend) if isinstance(backend, str) else backend
    if options is None:
        options = spec.parse(given)
    elif given:
        raise ParameterError("give make_executor validated options or keywords, not both")
    elif not isinstance(options, spec.options):
        raise ParameterError(f"backend {spec.name!r} takes {spec.options.__name__}, got "
                             f"{type(options).__name__}")
    return spec.make(model, max_seq_len, options)


# Kernel executors live in kernel/; each module lists its factories in a BACKENDS dict. They are
# imported on first use, so that plain numpy use never pays for them (and kernel/ never imports
# this module: imports flow one way, face -> runtime -> kernel -> model).
KERNEL_BACKEND_MODULES = ("monokernel.kernel.executor", "monokernel.kernel.cuda_backend")


def backend_names() -> list[str]:
    """Every backend a user may name, ``auto`` first, from the registries (help texts)."""
    _load_kernel_backends()
    return ["auto"] + sorted(EXECUTORS)


def _load_kernel_backends() -> None:
    import importlib

    for mod in KERNEL_BACKEND_MODULES:
        for name, spec in importlib.import_module(mod).BACKENDS.items():
            EXECUTORS.setdefault(name, spec)


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
    end: StopReason | None = None  # the generation ends with this token, and why


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
                 seed: int | None, text_stop: Callable[[int], bool] | None = None):
        self.engine = engine
        self.text_stop = text_stop
        self.ids = ids
        self.params = params
        self.sampler_seed = seed
        self.prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
        self.stats = GenerationStats(prompt_tokens=len(ids))  # this generation's
        self.cancelled = False
        self._seq = None
        if engine.batcher is not None:  # many at once: tokens come from the shared step loop
            rule = StopRule.of(params, engine.config, len(ids), engine.executor.max_seq_len,
                               text_stop)
            sampler = Sampler(params, seed, prompt_len=len(ids), stop_ids=rule.stop_ids)
            self._seq = engine.batcher.add(self, rule,
                                           _HostChoice(sampler, list(ids), params.logprobs))
            self._it = engine.batcher.pull(self._seq)
        else:
            self._it = engine._run(self)

    def __iter__(self) -> "Generation":
        return self

    def __next__(self) -> Sampled:
        return next(self._it)

    def ready(self) -> bool:
        """Whether ``next`` returns without running a step: a token waits in its queue, or it
        has ended (always True on a one-sequence executor, whose ``next`` runs the step)."""
        return self._seq is None or bool(self._seq.out) or self._seq.finished

    def close(self) -> None:
        self.cancelled = True
        if self._seq is not None:  # its slot and pages go back now (or at the step's end)
            self.engine.batcher.cancel(self._seq)
        try:
            self._it.close()
        except ValueError:  # running in another thread: it sees `cancelled` before its next step
            pass


class Engine:
    """The generation loop: validate, prefill, then sample and step until a stop condition.

    A batched executor (``max_num_seqs`` > 1: numpy, a kernel of slots) runs every generation
    through the Batcher's step loop (batching.py): many at once, up to ``max_num_seqs``, steps
    of at most ``max_num_batched_tokens`` rows, K/V in ``num_pages`` pages (default: a whole
    context per slot, or the executor's pool), prompt pages reused across requests. What
    follows is the one-sequence path of the other executors (the kernels without slots).

    One sequence at a time. With ``prefix_caching`` the K/V cache of the longest common prefix
    of the previous sequence (prompt and fed tokens) and the new prompt is kept, and only the
    new tokens are prefilled (chat turns, repeated system prompts, server requests).

    Reuse is exact: only K/V that a fresh prefill of the new prompt would compute bit for bit
    are kept, so a seeded request gives the same text whether or not it reused a prefix. With an
    executor's ``prefill_chunk`` C > 1 (NumPy) those are the whole chunks of a prompt: the
    reused length is a multiple of C, and a fed-back token's K/V (a one-row decode step) is
    not reused."""

    def __init__(self, executor: Executor, *, prefix_caching: bool = True,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 num_pages: int | None = None):
        self.executor = executor
        self.config = executor.config
        self.prefix_caching = prefix_caching
        self.stats = GenerationStats()
        batched = executor.max_num_seqs > 1
        seqs, tokens = batch_options(max_num_seqs, max_num_batched_tokens,
                                     executor.max_num_seqs if batched else None,
                                     executor.max_step_rows if batched else None)
        # a batched executor runs every generation through the step loop (batching.py); a
        # one-sequence executor runs them one at a time
        self.batcher = Batcher(self, seqs, tokens, num_pages) if batched else None
        self._active: object | None = None  # the generation that owns the KV cache
        # tokens whose K/V sit at positions 0..: (prompt, tokens made after it, end position)
        self._kv: tuple[list[int], list[int], int] = ([], [], 0)
        self._kv_mark: object = None  # executor's cache_token() when _kv was last right

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

    def generate(self, ids: list[int], params: SamplingParams, *, seed: int | None = None,
                 text_stop: Callable[[int], bool] | None = None) -> Generation:
        """Start a generation (it runs as it is iterated). ``seed`` overrides params.seed;
        ``text_stop(token)``: the caller's stop strings, told each generated token (not a stop
        token) as it is made, True when the text ends there (StopRule)."""
        self.check_prompt(ids)
        return Generation(self, list(ids), params, seed, text_stop)

    def generate_ids(self, ids: list[int], params: SamplingParams) -> Iterator[tuple[int, bool]]:
        """Yield (token, is_stop_token). A stop token is yielded last and not part of the text."""
        for s in self.generate(ids, params):
            yield s.token, s.stop

    def _reusable(self, ids: list[int]) -> int:
        """How many leading prompt tokens' K/V the cache still holds."""
        if not self.prefix_caching or self._kv_mark is None \
                or self._kv_mark != self.executor.cache_token():
            return 0
        prompt, made, end_pos = self._kv
        c = self.executor.prefill_chunk
        if c == 1:  # every position computed alike: the prompt and the tokens fed back
            held = (prompt + made[:max(end_pos - len(prompt), 0)])[:end_pos]
        else:  # the prompt's whole chunks (its last, shorter chunk rounds otherwise)
            held = prompt[:min(len(prompt) - len(prompt) % c, end_pos)]
        n = min(_common_prefix(held, ids), len(ids) - 1)  # the last one gives logits
        return n - n % c  # a fresh prefill's chunks start there

    def _note_cache(self, ids: list[int], me: object) -> None:
        """Record which tokens' K/V the cache holds after the run so far (the prompt, then the
        tokens fed back, at positions before ``last_launch.end_pos``; kept as parts, joined
        only when a next prompt asks), and the executor's cache token to check it by."""
        end = self.executor.last_launch
        if self._active is me and end is not None:
            self._kv = (ids, end.tokens, end.end_pos)  # tokens[:end_pos - len(ids)] stay put
            self._kv_mark = self.executor.cache_token()

    def _run(self, g: Generation) -> Iterator[Sampled]:
        """The one generation loop, the same for every executor: ``run_steps`` feeds the
        prompt and yields a token per step; the host samples the tokens the executor does not
        (``_HostChoice``) and ``StopRule`` says when to stop asking. The only choice made on
        the executor is the declared ``device_sampling``: whether the kernel draws tokens (and,
        with ``multi_step``, runs many steps per launch, stopping by the same rule itself)."""
        ids, params = g.ids, g.params
        if g.cancelled:
            return
        ex = self.executor
        rule = StopRule.of(params, self.config, len(ids), ex.max_seq_len, g.text_stop)
        sampler = Sampler(params, g.sampler_seed, prompt_len=len(ids), stop_ids=rule.stop_ids)
        # logprobs need the logits on the host; the host sampler then draws the same token
        # from the same noise as the kernel would
        device = ex.device_sampling and params.kernel_samplable and params.logprobs is None
        dsample = DeviceSample(params.temperature, sampler.seed) if device else None
        host = _HostChoice(sampler, list(ids), params.logprobs)
        def keep_prompt_logprobs(every: np.ndarray) -> None:
            g.prompt_logprobs = prompt_logprobs(ids, every, params.prompt_logprobs)
        prompt_logits = keep_prompt_logprobs if params.prompt_logprobs is not None else None

        self.stats = st = g.stats
        reuse = self._reusable(ids) if prompt_logits is None else 0
        self._active = me = object()
        self._kv, self._kv_mark = ([], [], 0), None  # invalid until the prefill has run
        ex.reset()
        launches0 = ex.launches
        st.prefill_tokens, st.reused_tokens = len(ids) - reuse, reuse
        t0 = time.perf_counter()
        run = ex.run_steps(ids[reuse:], reuse, dsample, choose=host,
                           prompt_logits=prompt_logits, stop_ids=rule.stop_ids,
                           stop_pos=rule.stop_pos, should_stop=lambda: g.cancelled)
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
                st.launches = ex.launches - launches0
                host.history.append(tok)
                self._note_cache(ids, me)
                ends = rule.reason(tok, i)  # known as the token is made: before it is handed on
                sampled = host.sampled(tok, rule)
                sampled.end = ends
                yield sampled
                if ends is not None or g.cancelled:  # a cancel: while the consumer had it
                    return
                if self._active is not me:  # one sequence at a time: the KV cache is not ours
                    raise MonokernelError(INVALIDATED)
        finally:
            try:
                run.close()  # a launch still running is asked to stop, and ended
            finally:
                st.launches = ex.launches - launches0
                self._note_cache(ids, me)


@dataclass(frozen=True)
class StopRule:
    """When a generation ends, decided here for every executor, as each token is made: a stop
    token (EOS unless ignored, the request's stop ids), a stop string (``text_stop``, the
    caller's text view: llm.py's TextStream), ``max_new_tokens`` or the context's end; and a
    cancel (``Generation.close``) between tokens. A multi-step kernel is handed the same
    ``stop_ids`` and ``stop_pos`` and ends its launch by itself (StopReason TOKEN, POSITION;
    HOST when the host asks: a stop string, a cancel), so it never runs past what this rule
    takes."""

    stop_ids: frozenset[int]
    prompt_len: int
    stop_pos: int  # the position of the last token that may be generated
    text_stop: Callable[[int], bool] | None = field(default=None, compare=False)

    @classmethod
    def of(cls, params: SamplingParams, config, prompt_len: int, max_seq_len: int,
           text_stop: Callable[[int], bool] | None = None) -> "StopRule":
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= set(config.eos_token_ids)
        return cls(frozenset(stops), prompt_len,
                   min(prompt_len + params.max_new_tokens - 1, max_seq_len - 1), text_stop)

    def is_stop(self, token: int) -> bool:
        return token in self.stop_ids

    def reason(self, token: int, index: int) -> StopReason | None:
        """Why the generation ends with its ``index``-th token ``token``, or None. Called once
        per token: the text view sees every token but a stop token, the last one included."""
        if token in self.stop_ids:
            return StopReason.TOKEN
        if self.text_stop is not None and self.text_stop(token):
            return StopReason.HOST
        if self.prompt_len + index >= self.stop_pos:
            return StopReason.POSITION
        return None


def prompt_logprobs(ids: list[int], every: np.ndarray, n: int
                    ) -> list[tuple[float, list[tuple[int, float]], int] | None]:
    """Generation.prompt_logprobs from the logits of every prompt position: None for the
    first token, then (logprob, top ``n`` alternatives, rank) of each next one."""
    lps = log_softmax(every[:-1])
    return [None] + [(float(lps[i, ids[i + 1]]), top_logprobs(lps[i], n),
                      rank_of(lps[i], ids[i + 1])) for i in range(len(ids) - 1)]


class _HostChoice:
    """The host's sampler as ``run_steps``'s ``choose``: draws a token from logits given the
    history, keeping its logprobs when the request asked for them."""

    def __init__(self, sampler: Sampler, history: list[int], logprobs: int | None):
        self.sampler, self.history, self.logprobs = sampler, history, logprobs
        self.last: tuple[int, float, list, int] | None = None

    def __call__(self, logits: np.ndarray) -> int:
        tok = self.sampler(logits, self.history)
        if self.logprobs is not None:
            lp = log_softmax(logits)
            self.last = (tok, float(lp[tok]), top_logprobs(lp, self.logprobs), rank_of(lp, tok))
        return tok

    prompt_logprobs = staticmethod(prompt_logprobs)  # for the Batcher, which has no import

    def sampled(self, tok: int, rule: StopRule) -> Sampled:
        if self.logprobs is None:
            return Sampled(tok, rule.is_stop(tok))
        assert self.last is not None and self.last[0] == tok  # logprobs: the host chose it
        return Sampled(tok, rule.is_stop(tok), *self.last[1:])
