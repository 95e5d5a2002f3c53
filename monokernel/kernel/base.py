"""What every executor is, declared: the interface the Engine (runtime.py) drives, the small
types they exchange, and the validated options every backend family takes.

An executor runs one sequence of one model. The Engine needs, by name and nothing else:
``reset()``; ``run_steps(tokens, start_pos, sample, ...)`` (feed a prompt, then yield one
generated token per step); ``launches`` (kernel launches so far); ``cache_token()`` (changes
whenever the K/V cache was touched); ``last_launch`` (where the last ``run_steps`` ended: which
positions hold K/V); and two declared capabilities, ``device_sampling`` and ``multi_step``.
``run_steps`` is implemented here with one ``step`` per generated token, so the NumPy reference
(runtime.py) and a one-step-per-launch kernel go through the same Engine loop as the
many-steps-per-launch kernel (executor.py), which overrides it.
"""

from __future__ import annotations

import dataclasses
import difflib
import time
import types
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Mapping

import numpy as np

from ..errors import KernelError, ParameterError
from ..model.config import ModelConfig
from ..model.loader import LoadedModel
from .isa import StopReason


@dataclass
class DeviceSample:
    """What the kernel's in-kernel sampling needs: temperature 0 is greedy (argmax), otherwise
    Gumbel-max with a counter-based RNG keyed by (seed, position)."""

    temperature: float
    seed: int


@dataclass
class StepResult:
    token: int | None  # the sampled next token, when the executor sampled on the device
    logits: np.ndarray | None  # float32 [vocab], when the host samples


@dataclass
class LaunchEnd:
    """How the last ``run_steps`` ended (for a kernel: its last launch or launches): the
    position the next step would take (positions before it hold K/V), the tokens the steps at
    positions ``first``.. chose (``tokens[i]`` is the token at position ``first + 1 + i``), and
    why it stopped."""

    first: int
    end_pos: int
    tokens: list[int]
    reason: StopReason


# Positions per K/V page of a batched executor (numpy, a kernel of slots): option page_size.
DEFAULT_PAGE_SIZE = 16


@dataclass
class StepTable:
    """One step of a batched executor: T rows, each a token fed at a position of a sequence
    slot, and whether its logits are wanted; and each slot's block table (the K/V pages of its
    positions, in order: page j holds positions [j * page_size, (j + 1) * page_size)). Decoding
    B sequences is a step of B rows; a prompt chunk is several rows of one slot, in position
    order; a step may mix both. ``draws`` (an executor with ``table_draws``): the slots whose
    rows with logits the device samples (DeviceSample: greedy or Gumbel-max keyed by the seed
    and the row's position), their logits not read back. ``steps`` > 1 (every row with logits
    drawn): the launch goes on for up to that many steps, each drawn row becoming its slot's
    decode row of the next step until the slot draws one of its ``stops`` tokens or reaches its
    stop position (``stops[slot] = (stop ids, stop position)``: the token at the stop position
    is the slot's last). ``run_table`` returns a TableResult."""

    tokens: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    logits: np.ndarray  # bool [T]
    prompt_rows: np.ndarray  # bool [T]: the token is a prompt's (else a fed-back decode token)
    block_tables: dict[int, list[int]]  # slot -> page ids
    draws: dict[int, "DeviceSample"] = dataclasses.field(default_factory=dict)
    steps: int = 1
    stops: dict[int, tuple[frozenset[int], int]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, rows: list[tuple[int, int, int, bool, bool]],
           block_tables: dict[int, list[int]],
           draws: dict[int, "DeviceSample"] | None = None, steps: int = 1,
           stops: dict[int, tuple[frozenset[int], int]] | None = None) -> "StepTable":
        """From (token, slot, position, needs logits, is a prompt token) rows."""
        t, s, p, g, q = zip(*rows) if rows else ((), (), (), (), ())
        return cls(np.array(t, np.int64), np.array(s, np.int64), np.array(p, np.int64),
                   np.array(g, bool), np.array(q, bool), block_tables, dict(draws or {}),
                   steps, dict(stops or {}))

    @property
    def drawn(self) -> np.ndarray:
        """bool [T]: the rows whose next token the device draws."""
        return self.logits & np.isin(self.slots, list(self.draws))

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class TableResult:
    """What one step of a StepTable gives back, each in row order: the logits of the rows that
    want them and are not drawn on the device (the host samples them), and the tokens the
    device drew (-1: the row's logits held a NaN); with ``steps`` > 1, each drawn slot's tokens
    of the later steps, in order (its last one a stop token, or the one at its stop position,
    or the launch's last)."""

    logits: np.ndarray  # float32 [rows, vocab]
    tokens: np.ndarray  # int64 [drawn rows]
    later: dict[int, list[int]] = dataclasses.field(default_factory=dict)


# Picks the next token from float32 logits [vocab] (the host's sampler).
Choose = Callable[[np.ndarray], int]


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


class Executor(ABC):
    """Runs one sequence of one model. Subclasses implement ``reset``, ``step`` and
    ``cache_token``; ``prefill`` defaults to one step per prompt token (what a decode-only kernel
    does) and ``run_steps`` to one ``step`` per generated token.

    Capabilities, declared rather than probed:
    - ``device_sampling``: ``step(token, pos, sample)`` with a DeviceSample returns the token
      the device drew (StepResult.token) instead of logits;
    - ``multi_step``: ``run_steps`` with a DeviceSample runs many steps per launch, the kernel
      stopping by itself at a stop token, at ``stop_pos`` or when asked (StopReason)."""

    name = "abstract"
    device_sampling = False
    # A prefill cuts its positions at the multiples of this many, and only the K/V of whole
    # chunks equal, bit for bit, what a fresh prefill computes (the Engine reuses only those).
    # 1: a prompt runs one step per token, so every position, a fed-back token's too, is computed
    # alike. (The NumPy executor batches prompt tokens, which round differently.)
    prefill_chunk = 1
    multi_step = False
    launches = 0  # kernel launches the host made (a CUDA graph replay is one); 0: no kernel
    # Batching: how many sequences ``run_table`` takes at once. 1: one sequence at a time
    # through ``run_steps`` (a kernel built without ``slots``); more: the Engine
    # schedules steps of many sequences (``add_pages``, ``run_table``).
    max_num_seqs = 1
    page_size = 0  # positions per K/V page of a batched executor
    max_step_rows: int | None = None  # the most rows run_table takes (None: any number)
    # run_table draws the tokens of the slots a table names (StepTable.draws) on the device
    table_draws = False
    max_pages: int | None = None  # the most K/V pages add_pages hands out (None: any number)
    max_table_steps = 1  # the most steps one run_table may run (StepTable.steps)

    def add_pages(self, n: int) -> range:
        """Room for ``n`` K/V pages of ``page_size`` positions for block tables; their ids."""
        raise NotImplementedError(f"{self.name} runs one sequence at a time (max_num_seqs 1)")

    def run_table(self, table: "StepTable",
                  should_stop: Callable[[], bool] | None = None) -> "TableResult":
        """Run one step of a batched executor (TableResult); a launch of ``table.steps`` > 1
        ends after its current step once ``should_stop()`` (polled while it runs) is true."""
        raise NotImplementedError(f"{self.name} runs one sequence at a time (max_num_seqs 1)")

    def __init__(self, model: LoadedModel, max_seq_len: int):
        self.model = model
        self.config: ModelConfig = model.config
        self.max_seq_len = max_seq_len
        self.last_launch: LaunchEnd | None = None

    @abstractmethod
    def reset(self) -> None:
        """Start a new sequence. The K/V cache is kept (every position is written before it is
        read), so the Engine may reuse the cache of a shared prefix."""

    @abstractmethod
    def step(self, token: int, pos: int, sample: DeviceSample | None = None) -> StepResult:
        """Feed ``token`` at position ``pos``: the device's token (``sample`` given and
        ``device_sampling``) or the logits of the next position."""

    @abstractmethod
    def cache_token(self) -> Hashable | None:
        """A value that changes whenever this executor's K/V cache may have been written (a
        step, a prefill, a reset); None while a launch in flight is still writing it. The
        Engine keeps a prefix only while the token is the one it saw after its own last step."""

    def prefill(self, tokens: list[int], start_pos: int = 0) -> np.ndarray:
        """float32 logits [vocab] of the last of ``tokens``, fed at positions start_pos.."""
        res = None
        for i, t in enumerate(tokens):
            res = self.step(t, start_pos + i)
        assert res is not None and res.logits is not None
        return res.logits

    def prefill_all(self, tokens: list[int], start_pos: int = 0) -> np.ndarray:
        """float32 logits [len(tokens), vocab] of every prompt position (prompt logprobs)."""
        return np.stack([np.asarray(self.step(t, start_pos + i).logits, np.float32)
                         for i, t in enumerate(tokens)])

    def run_steps(self, tokens: list[int], start_pos: int, sample: DeviceSample | None = None,
                  *, choose: Choose = greedy,
                  prompt_logits: Callable[[np.ndarray], None] | None = None,
                  stop_ids: set[int] | frozenset[int] = frozenset(),
                  stop_pos: int | None = None,
                  should_stop: Callable[[], bool] | None = None) -> Iterator[int]:
        """Feed ``tokens`` at positions ``start_pos``.. and go on decoding; yield each
        generated token, from the one after the last fed token on, up to the token at
        ``stop_pos`` (default: the cache's last position). Tokens the device does not draw
        (the first one after a prefill, all of them without ``sample``) come from
        ``choose(logits)``, which must draw what the device would (sampling.Sampler does).
        ``prompt_logits`` gets the logits of every prompt position before the first token.

        Here one step runs per token asked for, so a stop token or a cancel needs nothing from
        the executor: the Engine stops asking. ``stop_ids`` and ``should_stop`` are for an
        executor that runs ahead of the consumer (``multi_step``), which overrides this.
        ``last_launch`` follows the steps as they run, so after an error or an early close it
        still says which positions hold K/V (its reason stays NONE unless ``stop_pos`` ended
        the run)."""
        first = self.check_run(tokens, start_pos, stop_pos)
        stop_pos = self.max_seq_len - 1 if stop_pos is None else stop_pos
        end = self.last_launch = LaunchEnd(first, start_pos, [], StopReason.NONE)
        return self._one_step_per_token(list(tokens), start_pos, sample, choose, prompt_logits,
                                        stop_pos, end)

    def _one_step_per_token(self, tokens, start_pos, sample, choose, prompt_logits, stop_pos,
                            end: LaunchEnd) -> Iterator[int]:
        if prompt_logits is not None:
            every = self.prefill_all(tokens, start_pos)
            prompt_logits(every)
            logits = every[-1]
        else:
            logits = self.prefill(tokens, start_pos)
        pos = end.end_pos = start_pos + len(tokens)
        tok = choose(logits)
        while True:
            end.tokens.append(tok)
            yield tok
            if pos >= stop_pos:
                end.reason = StopReason.POSITION
                return
            res = self.step(tok, pos, sample)
            pos = end.end_pos = pos + 1
            tok = res.token if res.token is not None else choose(res.logits)

    def check_run(self, tokens: list[int], start_pos: int, stop_pos: int | None) -> int:
        """The position of the last fed token, or KernelError when ``tokens`` at
        ``start_pos``.. and ``stop_pos`` do not fit the cache in that order."""
        n, first = len(tokens), start_pos + len(tokens) - 1
        stop = self.max_seq_len - 1 if stop_pos is None else stop_pos
        if n == 0 or start_pos < 0 or not first < stop <= self.max_seq_len - 1:
            raise KernelError(f"{self.name}: run_steps needs tokens at positions "
                              f"[{start_pos}, {start_pos + n}) and a stop position after "
                              f"them within the cache ({stop}, max {self.max_seq_len - 1})")
        return first


# =========================================================================================# Backend options: one frozen dataclass per backend family, validated at the edge
# =========================================================================================@dataclass(frozen=True)
class BackendOptions:
    """Base of a backend family's options (``LLM(backend=..., **options)``, the CLI's
    ``--option NAME=VALUE``). Subclasses are frozen dataclasses; each field's annotation is
    the type a user must give, ``field(metadata={"min": n})`` a lower bound and ``"max"`` an
    upper one.
    ``from_user`` is the one check: an unknown or misspelt name, a wrong type or a value out
    of range is a ParameterError naming the option, never a TypeError from a constructor."""

    @classmethod
    def from_user(cls, backend: str, given: Mapping[str, Any],
                  fixed: Mapping[str, Any] | None = None) -> "BackendOptions":
        """The options of ``backend`` from a user's keywords; ``fixed``: the options the
        backend sets itself (``emulator-multi``: multi=True), which a user may not give."""
        fixed = dict(fixed or {})
        valid = [f.name for f in dataclasses.fields(cls) if f.name not in fixed]
        hints = typing.get_type_hints(cls)
        for name, value in given.items():
            if name not in valid:
                msg = (f"backend {backend!r} has no option {name!r} (its options: "
                       f"{', '.join(valid) or 'none'})")
                close = difflib.get_close_matches(name, valid, n=1)
                if name in fixed:
                    msg += f"; {backend} sets {name} itself"
                elif close:
                    msg += f"; did you mean {close[0]!r}?"
                raise ParameterError(msg)
            meta = cls.__dataclass_fields__[name].metadata
            bound, top = meta.get("min"), meta.get("max")
            if not _accepts(hints[name], value) or value is not None and (
                    (bound is not None and value < bound) or (top is not None and value > top)):
                raise ParameterError(
                    f"backend {backend!r}: option {name} must be "
                    f"{_describe(hints[name], bound, top)}, got {value!r} "
                    f"({type(value).__name__})")
        return cls(**given, **fixed)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def batch_limits(self) -> tuple[int | None, int | None]:
        """(most sequences, most rows per step) the executor these options build takes at
        once, None: no limit of its own (checked before a model loads: batching.batch_options)."""
        return None, None


def _accepts(tp: Any, value: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_accepts(t, value) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, (bool, np.bool_))
    if isinstance(value, (bool, np.bool_)):  # True is an int to Python, not to a user
        return False
    if tp is int:
        return isinstance(value, (int, np.integer))
    if tp is float:
        return isinstance(value, (int, float, np.integer, np.floating))
    return isinstance(value, tp)


def _describe(tp: Any, bound: Any = None, top: Any = None) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_describe(t, bound, top) for t in typing.get_args(tp))
    if tp is type(None):
        return "None"
    text = {bool: "True or False", int: "an integer", float: "a number",
            str: "a string"}.get(tp, f"a {getattr(tp, '__name__', tp)}")
    if tp not in (int, float) or bound is None and top is None:
        return text
    if bound is not None and top is not None:
        return f"{text} in [{bound}, {top}]"
    return f"{text} >= {bound}" if bound is not None else f"{text} <= {top}"


@dataclass(frozen=True)
class Backend:
    """A backend by name: its options family, the options it sets itself, and the factory
    that builds its executor from validated options."""

    name: str
    options: type[BackendOptions]
    make: Callable[[LoadedModel, int, Any], Executor]
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def parse(self, given: Mapping[str, Any]) -> BackendOptions:
        return self.options.from_user(self.name, given, self.fixed)

    def user_options(self) -> tuple[str, ...]:
        return tuple(n for n in self.options.names() if n not in self.fixed)


def wall_times(fn: Callable[[], object], repeat: int) -> list[float]:
    """Host wall-clock seconds of each of ``repeat`` calls of ``fn`` (for CPU backends; GPU
    work is timed with CUDA events by the device)."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out
