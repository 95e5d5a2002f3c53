"""Kernel executors: one program, one set of buffers, several ways to launch.

``KernelExecutor`` owns the Program, the weights laid out for the kernel, the activation
buffers and the step loop. A ``Device`` only allocates, copies, compiles and launches: the CPU
emulator here, CuPy in cuda_backend.py. ``multi=True`` runs the same program as one launch per op
(the multi-kernel baseline) instead of one persistent launch per step; ``pdl=True`` builds those
thin kernels with MK_PDL=1 and asks the device for programmatic dependent launches.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
import time
from typing import Callable, Iterator

import numpy as np

from ..model.config import ModelConfig
from ..errors import KernelError, NumericalError, ParameterError
from .isa import (BF16_INPUTS, ERROR_WORDS, HOST_FLAG_WORDS, NUM_THREADS, PARAMS, ROW_WORDS,
                  STATE_WORDS, TRACE_WORDS, Err, ErrCode, HostFlag, Op, RowWord, State,
                  StopReason, params_dtype)
from .header import dynamic_shared_bytes, kernel_source, slot_pages, stop_mask_words
from ..model.loader import LoadedModel
from .base import (Backend, BackendOptions, Choose, DeviceSample, Executor, LaunchEnd,
                   DEFAULT_PAGE_SIZE, StepResult, StepTable, TableResult, greedy, wall_times)
from .devices.emulator import EmulatorDevice
from .program import Program
from .group_picks import tensor_core_program
from .schedule import MAX_STEP_TOKENS, schedule, tensor_core_splits

KERNEL_NAMES = ["megakernel"] + [f"op_{op.name}" for op in Op if op != Op.NOOP]
# Buffers the kernel writes during a step; poisoned with NaN by tests.
ACTIVATIONS = ("residual", "residual_in", "q", "k_raw", "attn_o", "attn_ml", "attn", "ffn_h",
               "partials", "logits", "lm_part")
# bf16 quiet NaN: the poison of a bf16 buffer (isa.BF16_INPUTS), a NaN once read as float32
BF16_NAN = 0x7FC0
# out_tokens before the kernel writes them: the host's poll tells "not yet" from any token (-1
# is a NaN step)
NO_TOKEN = -2
# A multi-step launch that finishes no step for this long beyond the kernel's watchdog is hung.
PROGRESS_GRACE_S = 5.0
# Decode steps one launch of a kernel of slots runs at most (option steps_per_launch): requests
# waiting to join wait at most this many steps for the launch to end.
DEFAULT_TABLE_STEPS = 8


def stop_mask(ids, vocab_size: int) -> np.ndarray:
    """The stop-token bitmap the kernel reads (megakernel.cu stop_token) of the ids in the
    vocabulary (others can never be drawn)."""
    mask = np.zeros(stop_mask_words(vocab_size), np.uint32)
    ids = np.array(sorted(t for t in ids if 0 <= t < vocab_size), np.int64)
    np.bitwise_or.at(mask, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
    return mask


def kernel_build(cfg: ModelConfig, max_seq_len: int, *, prefetch: bool = True,
                 trace: bool = False, pdl: bool = False,
                 sync: int | None = None, tokens: int = 1, slots: int = 0,
                 page_size: int = 0, pool_pages: int = 0,
                 mma: bool = False, slices: tuple[int, int] = (1, 1)
                 ) -> tuple[str, dict[str, str]]:
    """(source, -D defines) of the kernel an executor with these options compiles: the one
    place that decides them, so the GPU check's prepare step (tools/prepare.py) compiles
    exactly what the executors will ask for."""
    defines = {"MK_PREFETCH": "1" if prefetch else "0"}
    if trace:
        defines["MK_TRACE"] = "1"
    if pdl:
        defines["MK_PDL"] = "1"
    if sync is not None:  # the hop (megakernel.cu MK_SYNC; default 2: release/acquire)
        defines["MK_SYNC"] = str(sync)
    return (kernel_source(cfg, max_seq_len, tokens, slots, page_size, pool_pages, mma, slices),
            defines)


# kernel_weights() per live model: every executor of one model uploads the same stacked arrays
# (the GPU check builds a dozen; stacking a 1B model's layers takes seconds each time).
_STACKED: dict[int, dict[str, np.ndarray]] = {}


def kernel_weights(model: LoadedModel) -> dict[str, np.ndarray]:
    """The checkpoint as the kernel reads it: bf16 bits (uint16), per-layer tensors stacked.
    Computed once per model object and kept while it lives; callers must not write into it."""
    hit = _STACKED.get(id(model))
    if hit is None:
        hit = _STACKED[id(model)] = _stack_weights(model)
        weakref.finalize(model, _STACKED.pop, id(model), None)
    return hit


def _stack_weights(model: LoadedModel) -> dict[str, np.ndarray]:
    """Each per-layer tensor (q, k and v concatenated along rows) is written into its slice of
    one array allocated once: no per-layer temporaries, no np.stack copy. The tensors the
    WeightStore hands out map the file, so the stacked arrays are the only new memory."""
    c = model.config
    w = model.weights
    bits = lambda a: np.asarray(a).view(np.uint16)  # noqa: E731

    def stacked(*names: str) -> np.ndarray:
        """[layers, rows of names[0] + names[1] + ..., ...] of ``model.layers.{i}.<name>``."""
        out = None
        for i in range(c.num_layers):
            parts = [bits(w[f"model.layers.{i}.{name}"]) for name in names]
            if out is None:
                rows = sum(len(x) for x in parts)
                out = np.empty((c.num_layers, rows) + parts[0].shape[1:], np.uint16)
            row = 0
            for x in parts:
                out[i, row:row + len(x)] = x
                row += len(x)
        return out

    qkv = lambda kind: [f"self_attn.{x}_proj.{kind}" for x in "qkv"]  # noqa: E731
    out = {
        "embed": np.array(bits(w["model.embed_tokens.weight"])),  # a copy, not the file's map
        "final_norm": np.array(bits(w["model.norm.weight"])),
        "in_norm": stacked("input_layernorm.weight"),
        "post_norm": stacked("post_attention_layernorm.weight"),
        "wqkv": stacked(*qkv("weight")),
        "wo": stacked("self_attn.o_proj.weight"),
        "wg": stacked("mlp.gate_proj.weight"),
        "wu": stacked("mlp.up_proj.weight"),
        "wd": stacked("mlp.down_proj.weight"),
    }
    out["lm_head"] = (out["embed"] if c.tie_word_embeddings
                      else np.array(bits(w["lm_head.weight"])))
    if c.attention_bias:
        out["bqkv"] = stacked(*qkv("bias"))
    if c.qk_norm:
        out["q_norm"] = stacked("self_attn.q_norm.weight")
        out["k_norm"] = stacked("self_attn.k_norm.weight")
    return out


@dataclass
class KernelErrorRecord:
    code: int
    block: int
    instr: int
    op: int
    counter: int
    expected: int
    seen: int


# ================================================================================================
# The executor
# ================================================================================================
class KernelExecutor(Executor):
    device_sampling = True

    def __init__(self, model: LoadedModel, max_seq_len: int, *, device=None, blocks: int = 4,
                 multi: bool = False, graph: bool = False, pdl: bool = False,
                 prefetch: bool = True,
                 attn_splits: int | None = None, watchdog_ms: int = 20000,
                 trace: bool = False, program: Program | None = None, name: str | None = None,
                 attn_min_chunk: int | None = None,
                 multi_step: bool = True, steps_per_launch: int = 0,
                 sync: int | None = None, merge_ticket_min: int | None = None,
                 step_tokens: int = 1, slots: int = 1, page_size: int = DEFAULT_PAGE_SIZE,
                 kv_pages: int | None = None, tensor_cores: bool = False):
        super().__init__(model, max_seq_len)
        if tensor_cores:
            # the mat-muls on tensor cores (MK_MMA; docs/tensor-cores.md): a kernel of slots,
            # whose O_PROJ reads every row's attention merged by ticket (one input for all rows)
            if slots < 2 or multi:
                raise KernelError("tensor_cores=True is for the persistent kernel of slots "
                                  f"(slots >= 2, multi=False), got slots={slots}"
                                  + (", multi=True" if multi else ""))
            if merge_ticket_min not in (None, 1):
                raise KernelError("tensor_cores=True merges every step's attention by ticket "
                                  f"(merge_ticket_min 1), got merge_ticket_min={merge_ticket_min}")
            merge_ticket_min = 1
            if program is None:  # the splits fixed by absolute position
                attn_splits, attn_min_chunk = tensor_core_splits(
                    model.config, blocks, max_seq_len, attn_splits, attn_min_chunk)
        self.tensor_cores = bool(tensor_cores)
        if merge_ticket_min == 1 and slots < 2:
            # megakernel.cu unit_finishes: a row of one split is finished by its unit in a
            # kernel of slots only (the one-sequence kernel does not build it)
            raise KernelError("merge_ticket_min=1 is for a kernel of slots (slots >= 2); the "
                              "one-sequence kernel merges by ticket from 2 splits "
                              "(merge_ticket_min >= 2, or 0: never)")
        # slots > 1: steps of many sequences from a token table, K/V in pages (run_table; the
        # Engine batches on it); 1: the one-sequence kernel of many steps per launch
        self.table = slots > 1
        if self.table:
            self.table_draws = True
            if program is not None and program.tokens < slots:
                raise KernelError(f"a kernel of {slots} slots needs a program of at least "
                                  f"{slots} tokens per step, got {program.tokens}")
            step_tokens = max(step_tokens, slots)  # every slot decodes a row per step
            self.slots, self.page_size = slots, page_size
            self.max_num_seqs, self.max_step_rows = slots, step_tokens
            self.slot_pages = slot_pages(max_seq_len, page_size)
            self.max_table_steps = steps_per_launch or DEFAULT_TABLE_STEPS
            self._stop_masks = np.zeros((slots + 1) * stop_mask_words(self.config.vocab_size),
                                        np.uint32)
            # the pool's pages for the slots (beside the one-sequence calls' own): a context
            # each by default; fewer make memory follow the tokens in use (the Batcher admits
            # a request only when the pages it may need are free)
            self.max_pages = self.slots * self.slot_pages if kv_pages is None else kv_pages
            self.device_sampling = False  # step(): logits for the host (run_table draws)
            multi_step = False  # one step per launch: the host writes each step's table
        self.device = device or EmulatorDevice()
        if pdl and not multi:
            raise KernelError("pdl=True is for the multi-kernel baseline (multi=True): the "
                              "persistent megakernel is one launch for many steps")
        self.multi = multi
        # many steps per launch (the persistent kernel only; the baseline is one op a launch):
        # ``steps_per_launch`` bounds a launch (0: until a stop), ``multi_step=False`` is the
        # one-launch-per-step A/B twin
        self.multi_step = multi_step and not multi
        if steps_per_launch < 0:
            raise ValueError(f"steps_per_launch must be >= 0 (0: no bound), got {steps_per_launch}")
        self.steps_per_launch = steps_per_launch
        self.launches = 0  # host-side launch calls (a graph replay is one)
        self._running = None  # the multi-step launch in flight, if any
        self._stop_key: frozenset | None = None
        self.last_launch: LaunchEnd | None = None
        self.graph = graph and multi
        self.pdl = pdl
        self._graph = None
        self.name = name or (self.device.name + ("-multi" if multi else "")
                             + ("-graph" if self.graph else "") + ("-pdl" if pdl else ""))
        self.watchdog_ms = watchdog_ms
        self.trace_enabled = trace
        c = self.config
        # a tensor-core kernel's mat-muls share rows in token groups in big steps, as many
        # members as the cost model picks (token_groups.py, group_picks.py), and split
        # O_PROJ's and DOWN's input where it says it pays (input_slices.py); the CUDA-core
        # kernels run row tiles only
        if program is None and tensor_cores:
            program = tensor_core_program(c, blocks, max_seq_len, attn_splits, attn_min_chunk,
                                          step_tokens)
        self.program = program or schedule(c, blocks, max_seq_len, attn_splits,
                                           attn_min_chunk=attn_min_chunk,
                                           merge_ticket_min=merge_ticket_min,
                                           tokens=step_tokens)
        if not tensor_cores and any(i.group is not None for q in self.program.queues
                                    for i in q):
            raise KernelError("a program with token groups (schedule(token_groups=...)) is for "
                              "a tensor-core kernel (tensor_cores=True): the CUDA-core kernels "
                              "run row tiles only")
        if bool(tensor_cores) != self.program.tensor_cores:
            raise KernelError(
                "a tensor-core kernel (tensor_cores=True) stores the residual's bf16 copy "
                "(residual_in) for its RMS ops, and its program must declare it: schedule(..., "
                "tensor_cores=True) for it, and only for it" if tensor_cores else
                "this program is for a tensor-core kernel (schedule(tensor_cores=True)): "
                "pass tensor_cores=True, or schedule it without")
        if tensor_cores and self.program.merge_ticket_min != 1:
            raise KernelError(
                f"tensor_cores=True needs a program whose ATTENTION merges every step by ticket "
                f"(merge_ticket_min 1), which needs each block's attention units in one KV "
                f"group; this one's is {self.program.merge_ticket_min} ({self.program.num_blocks} "
                f"blocks, {self.program.attn_splits} splits of {c.num_kv_heads} KV heads): "
                f"choose blocks or attn_splits so that they are")
        self.blocks = self.program.num_blocks
        source, defines = kernel_build(c, max_seq_len, prefetch=prefetch, trace=trace, pdl=pdl,
                                       sync=sync, tokens=self.program.tokens,
                                       slots=slots if self.table else 0,
                                       page_size=page_size if self.table else 0,
                                       pool_pages=self.max_pages if self.table else 0,
                                       mma=self.tensor_cores,
                                       slices=(self.program.slices_of(Op.O_PROJ_RESIDUAL),
                                               self.program.slices_of(Op.DOWN_RESIDUAL)))
        self.source = source  # as compiled, but for the -D defines (strict mode rebuilds it)
        self.module = self.device.compile(source, KERNEL_NAMES, defines)
        # every launch passes the kernel's dynamic shared memory (late q/k's chunk keys, the
        # tensor-core kernel's staged K and V)
        self.shared_bytes = dynamic_shared_bytes(c, self.program.tokens, self.tensor_cores)
        self._alloc_buffers(model)
        self._broken: str | None = None
        self._state_on_device: tuple | None = None
        self._last_logits: np.ndarray | None = None  # a table step's logits rows
        self.logits_rows_read = 0  # logits rows read back by table steps (the host's samples)
        # a table step's kernel stores the logits of the host's rows only (State.HOST_LOGITS);
        # True: of the rows drawn on the device too, after them in `logits` (tests and
        # inspection: the host still reads back its own rows only)
        self.drawn_logits = False
        self.reset()

    # ---- buffers --------------------------------------------------------------------------
    def _alloc_buffers(self, model: LoadedModel) -> None:
        c, p, dev = self.config, self.program, self.device
        b: dict = {}
        for name, arr in kernel_weights(model).items():
            b[name] = dev.upload(arr)
        cos, sin = c.rope_table(self.max_seq_len)
        b["rope_cos"], b["rope_sin"] = dev.upload(cos), dev.upload(sin)
        b["program"] = dev.upload(p.words())
        # the program's counters, then the step counter (State.STEP_COUNTER)
        b["counters"] = dev.alloc((p.num_counters + 1,), np.int32)
        # state and error record share one buffer, so a step reads back both in one copy
        b["control"] = dev.alloc((STATE_WORDS + ERROR_WORDS,), np.int32)
        b["trace"] = dev.alloc((p.num_blocks, p.max_len, TRACE_WORDS), np.uint64)
        sizes = p.buffer_sizes()
        for name, n in sizes.items():
            if name == "out_tokens":  # the host polls it while a launch runs
                b[name] = dev.alloc_mapped((n * (self.slots + 1 if self.table else 1),),
                                           np.int32)
            elif name in ("logits", "lm_part") and self.table:  # each row's own
                b[name] = dev.alloc((p.tokens * n,), np.float32)
            elif name in BF16_INPUTS and self.tensor_cores:  # stored as bf16 (mk_in_t)
                b[name] = dev.alloc((n,), np.uint16)
            else:
                b[name] = dev.alloc((n,), np.float32)
        b["feed"] = dev.alloc((self.max_seq_len,), np.int32)
        masks = self.slots + 1 if self.table else 1  # a kernel of slots: one per slot
        b["stop_mask"] = dev.alloc((masks * stop_mask_words(c.vocab_size),), np.uint32)
        b["host_flags"] = dev.alloc_mapped((HOST_FLAG_WORDS,), np.int32)
        kv_rows = self.max_seq_len
        if self.table:
            # pages [0, slot_pages): the one-sequence calls' own (block table row `slots`, the
            # identity); then a context for each slot, handed out by add_pages
            kv_rows = (self.slot_pages + self.max_pages) * self.page_size
            b["rows"] = dev.alloc((p.tokens * ROW_WORDS,), np.int32)
            b["row_tokens"] = dev.alloc((p.tokens,), np.int32)
            bt = np.zeros((self.slots + 1, self.slot_pages), np.int32)
            bt[self.slots] = np.arange(self.slot_pages)
            b["block_table"] = dev.upload(bt)
            self._block_table = bt
        kv = (c.num_layers, kv_rows, c.num_kv_heads, c.head_dim)
        b["k_cache"] = dev.alloc(kv, np.uint16)
        b["v_cache"] = dev.alloc(kv, np.uint16)
        self.buffers = b
        ptrs = {name: dev.ptr(buf) for name, buf in b.items()}
        ptrs["state"] = ptrs["control"]
        ptrs["error"] = ptrs["control"] + 4 * STATE_WORDS
        dt = params_dtype()
        self.params = np.zeros(1, dt)
        for name, ctype, _ in PARAMS:
            if ctype.endswith("*"):
                self.params[name] = ptrs.get(name, 0)  # absent optional weights stay null
        self.params["begin"], self.params["end"] = 0, p.max_len
        self._op_params = []  # multi-kernel baseline: one argument struct per slot range
        for op, layer, begin, end in p.slots():
            pp = self.params.copy()
            pp["begin"], pp["end"] = begin, end
            self._op_params.append((f"op_{op.name}", pp))

    def poison(self) -> None:
        """Fill every activation buffer with NaN (tests: unwritten elements must show)."""
        for name in ACTIVATIONS:
            if name in self.buffers:  # k_raw and attn exist only where the kernel uses them
                bf16 = self.buffers[name].dtype == np.uint16  # isa.BF16_INPUTS
                self.device.fill(self.buffers[name], BF16_NAN if bf16 else np.nan)

    # ---- steps ----------------------------------------------------------------------------
    def reset(self) -> None:
        self._end_running()
        self.check_usable()
        self.device.fill(self.buffers["counters"], 0)
        self.device.fill(self.buffers["control"], 0)
        self._steps = 0
        self._state_on_device = None

    def cache_token(self):
        """(this executor, steps run): every step writes K/V and counts; None while a
        multi-step launch is in flight (it is still writing the cache)."""
        return None if self._running is not None else (id(self), self._steps)

    @property
    def steps_run(self) -> int:
        """Decode steps run since ``reset`` (the step counter the kernel's waits target)."""
        return self._steps

    def check_usable(self) -> None:
        """KernelError once a kernel error has made this executor unusable."""
        if getattr(self, "_broken", None):
            raise KernelError(f"{self.name}: the executor is unusable after an earlier kernel "
                              f"error ({self._broken}); create a new LLM")

    def state_words(self, token: int, pos: int, sample: DeviceSample | None,
                    step: int | None = None) -> np.ndarray:
        """The control words (state + a clear error record) of one step that feeds ``token``
        at ``pos`` as step ``step`` (default: the next one), for the kernel's ``control``
        buffer or a strict-mode run (emulator/strict.py)."""
        st = np.zeros(STATE_WORDS + ERROR_WORDS, np.int32)
        st[State.TOKEN], st[State.POS] = token, pos
        st[State.STEP] = self._steps if step is None else step
        temp = sample.temperature if sample else 0.0
        st[State.TEMPERATURE] = np.float32(temp).view(np.int32)
        st[State.SEED] = (sample.seed if sample else 0) & 0x7FFFFFFF
        st[State.WATCHDOG_MS] = self.watchdog_ms
        st[State.PROGRAM_LEN] = self.program.max_len
        st[State.STEP_COUNTER] = self.program.num_counters
        st[State.NTOK] = 1  # run_steps feeds a prompt in chunks of up to program.tokens
        return st

    def launch_step(self, token: int, pos: int, sample: DeviceSample | None) -> np.ndarray:
        """Run one decode step; return the control words (state + error record) after it."""
        self._end_running()
        self.check_usable()
        if not 0 <= pos < self.max_seq_len:
            raise KernelError(f"position {pos} is outside the KV cache [0, {self.max_seq_len})")
        key = (token, pos, self._steps, sample.temperature if sample else 0.0,
               sample.seed if sample else 0)
        if self._state_on_device != key:  # the kernel advanced the state itself otherwise
            self.device.write(self.buffers["control"], self.state_words(token, pos, sample))
        try:
            self.run_launches()
            control = self.device.read(self.buffers["control"])
        except KernelError as e:
            self._broken = str(e).splitlines()[0]
            raise KernelError(f"{self.name}: decode step at position {pos} (step {self._steps}) "
                              f"failed: {e}") from None
        self.check_error(control)
        self._steps += 1
        nxt = int(control[State.TOKEN])
        self._state_on_device = (nxt, pos + 1, self._steps, key[3], key[4])
        return control

    def run_launches(self) -> None:
        """The device work of one step: one cooperative launch of the megakernel, or one launch
        per op (replayed from a captured graph when ``graph``). Reads everything it needs
        (token, position, step) from device memory, so it can be repeated as it is."""
        self.launches += len(self._op_params) if self.multi and not self.graph else 1
        if not self.multi:
            self.device.launch(self.module, "megakernel", self.blocks, self.params,
                               cooperative=True, shared_bytes=self.shared_bytes)
        elif self.graph:
            if self._graph is None:
                self._graph = self.device.capture(self._launch_ops)
            self.device.replay(self._graph)
        else:
            self._launch_ops()

    def _launch_ops(self) -> None:
        for name, pp in self._op_params:
            self.device.launch(self.module, name, self.blocks, pp, cooperative=False,
                               pdl=self.pdl, shared_bytes=self.shared_bytes)

    # ---- many steps per launch ----------------------------------------------------------------
    def run_steps(self, tokens: list[int], start_pos: int, sample: DeviceSample | None = None,
                  *, choose: Choose = greedy,
                  prompt_logits: Callable[[np.ndarray], None] | None = None,
                  stop_ids: set[int] | frozenset[int] = frozenset(),
                  stop_pos: int | None = None,
                  should_stop: Callable[[], bool] | None = None) -> Iterator[int]:
        """Executor.run_steps; with ``multi_step``, a DeviceSample and no ``prompt_logits``
        (the host needs no logits), in as few launches as ``steps_per_launch`` allows,
        yielding each sampled token as the kernel makes it, from the one after the last fed
        token on (``choose`` is then unused). The kernel stops by itself after a token in
        ``stop_ids`` (yielded), a NaN (-1, yielded), or the step at ``stop_pos - 1`` (default:
        the cache's last but one position, so the last token still has a position). Closing
        the iterator early asks the kernel to stop after its current step and waits for it;
        ``last_launch`` then says where it ended (tokens past the ones taken may have been made
        and their K/V written). ``should_stop`` (polled while waiting for a token, from another
        thread's cancel) asks the kernel to stop the same way."""
        self._end_running()
        self.check_usable()
        if sample is None or not self.multi_step or prompt_logits is not None:
            return super().run_steps(tokens, start_pos, sample, choose=choose,
                                     prompt_logits=prompt_logits, stop_ids=stop_ids,
                                     stop_pos=stop_pos, should_stop=should_stop)
        n, first = len(tokens), self.check_run(tokens, start_pos, stop_pos)
        stop_pos = self.max_seq_len - 1 if stop_pos is None else stop_pos
        dev, b = self.device, self.buffers
        feed = np.zeros(self.max_seq_len, np.int32)
        feed[start_pos:start_pos + n] = tokens
        dev.write(b["feed"], feed)
        key = frozenset(int(t) for t in stop_ids)
        if key != self._stop_key:
            dev.write(b["stop_mask"], stop_mask(key, self.config.vocab_size))
            self._stop_key = key
        out, flags = b["out_tokens"], b["host_flags"]
        out[start_pos:] = NO_TOKEN
        flags[:] = 0
        words = self.state_words(int(tokens[0]), start_pos, sample)
        words[State.FEED_END] = start_pos + n
        words[State.NTOK] = min(self.program.tokens, n)  # the prompt's first chunk
        words[State.STOP_POS] = stop_pos
        most = stop_pos - start_pos  # steps to the stop position
        words[State.STEPS] = min(self.steps_per_launch, most) if self.steps_per_launch else most
        dev.write(b["control"], words)
        self._state_on_device = None
        self.last_launch = LaunchEnd(first, start_pos, [], StopReason.NONE)
        return self._run_in_launches(first, start_pos, stop_pos, should_stop)

    def _run_in_launches(self, first: int, start_pos: int, stop_pos: int,
                         should_stop: Callable[[], bool] | None) -> Iterator[int]:
        """The launches of run_steps, whose control words are written: yield the tokens."""
        dev, b = self.device, self.buffers
        out, flags = b["out_tokens"], b["host_flags"]
        # every step writes out_tokens[its position] (a prompt step: the next fed token), so
        # the host sees progress through the prompt too; tokens are yielded from `first` on
        p, seen, reason = first, start_pos, StopReason.BUDGET
        # no step done for this long is a hang: the kernel's watchdog bounds its waits, and on
        # the emulator, where one step of a big model can take long, its launch timeout
        patience = max(self.watchdog_ms / 1000 + PROGRESS_GRACE_S,
                       float(getattr(dev, "timeout_s", 0.0)))
        try:
            while reason == StopReason.BUDGET:
                self._running = dev.start(self.run_launches)
                last, pause = time.monotonic(), 0.0
                while True:
                    while seen < stop_pos and int(out[seen]) != NO_TOKEN:
                        seen += 1
                        last, pause = time.monotonic(), 0.0
                    if p < seen:
                        p += 1
                        yield int(out[p - 1])
                        continue
                    if self._running.done():
                        if seen < stop_pos and int(out[seen]) != NO_TOKEN:
                            continue  # written just before the launch ended
                        break
                    if should_stop is not None and not flags[HostFlag.STOP] and should_stop():
                        flags[HostFlag.STOP] = 1  # the kernel ends after its current step
                    if time.monotonic() - last > patience:
                        flags[HostFlag.STOP] = 1
                        raise KernelError(f"{self.name}: no step done for {patience:.0f} s at "
                                          f"position {seen} of a multi-step launch")
                    pause = min(pause * 2 or 20e-6, 1e-3)
                    time.sleep(pause)
                control = self._end_running()
                reason = StopReason(int(control[State.STOP_REASON]))
        finally:
            self._end_running()

    def _end_running(self) -> np.ndarray | None:
        """End the multi-step launch in flight, if any (asking it to stop after its current
        step), and check how it ended; return its control words."""
        run, self._running = self._running, None
        if run is None:
            return None
        b = self.buffers
        if not run.done():
            b["host_flags"][HostFlag.STOP] = 1
        try:
            run.finish()
            control = self.device.read(b["control"])
        except KernelError as e:
            self._broken = str(e).splitlines()[0]
            raise KernelError(f"{self.name}: multi-step launch failed: {e}") from None
        self.check_error(control)
        self._steps = int(control[State.STEP])
        end = int(control[State.POS])
        ll = self.last_launch
        if ll is not None:
            toks = b["out_tokens"][ll.first:end]
            ll.end_pos, ll.tokens = end, [int(t) for t in toks]
            ll.reason = StopReason(int(control[State.STOP_REASON]))
        return control

    def absorb_control(self, control: np.ndarray) -> None:
        """Take over the control words of a step run outside this executor on its buffers
        (a strict-mode run, emulator/strict.py): check its error record, take its step count,
        and write fresh control words before the next launch."""
        self.check_error(control)
        self._steps = int(control[State.STEP])
        self._state_on_device = None

    def prepare_decode_launch(self, steps: int) -> None:
        """Make the next ``run_launches()`` one launch of ``steps`` decode steps that go on
        from where the last launch ended, feeding each sampled token back, with no feed, stop
        token or stop position (the benchmark times such a launch: tools/bench.py)."""
        if not self.multi_step:
            raise KernelError(f"{self.name}: runs one step per launch")
        words = self.read_buffer("control")
        words[State.STEPS], words[State.STOP_POS], words[State.FEED_END] = steps, 0, 0
        self.device.write(self.buffers["control"], words)
        self._state_on_device = None

    def check_error(self, control: np.ndarray) -> None:
        """Raise KernelError describing the error record in ``control`` (the words read back
        from the ``control`` buffer after a launch) if the kernel recorded one; the executor
        is then unusable."""
        e = control[STATE_WORDS:]
        if e[Err.CODE] == ErrCode.OK:
            return
        rec = KernelErrorRecord(*(int(e[w]) for w in (Err.CODE, Err.BLOCK, Err.INSTR, Err.OP,
                                                      Err.COUNTER, Err.EXPECTED, Err.SEEN)))
        self._broken = f"kernel error code {rec.code}"
        raise KernelError(self.describe_error(rec))

    def describe_error(self, r: KernelErrorRecord) -> str:
        p = self.program
        try:
            ins = p.queues[r.block][r.instr]
            where = ins.label(r.block, r.instr)
        except IndexError:
            where = f"block {r.block} instruction #{r.instr}"
        if r.code == ErrCode.WATCHDOG:
            cname = p.counter_names[r.counter] if 0 <= r.counter < p.num_counters else "?"
            if r.counter == p.num_counters:
                cname, where = "step", f"block {r.block} between two steps"
            return (f"{self.name}: watchdog: {where} waited {self.watchdog_ms} ms for counter "
                    f"{r.counter} ({cname}) to reach {r.expected}, saw {r.seen}; "
                    "every block stopped")
        if r.code == ErrCode.BAD_TOKEN:
            return (f"{self.name}: {where} was given token {r.seen}, outside the vocabulary "
                    f"[0, {r.expected}) (-1: the previous step's logits were NaN); every block "
                    "stopped")
        if r.code == ErrCode.BAD_OPCODE:
            return (f"{self.name}: bad opcode {r.seen} in block {r.block} instruction #{r.instr} "
                    f"(the program scheduled {where} there); every block stopped")
        return f"{self.name}: kernel error code {r.code} at {where}"

    # ---- steps of many sequences (slots > 1) ---------------------------------------------------
    def add_pages(self, n: int) -> range:
        """Page ids [slot_pages, slot_pages + n) of the pool (a context per slot): a later
        Engine on this executor takes them over (Batcher.pages_owner)."""
        if not self.table:
            return super().add_pages(n)
        most = self.max_pages
        if not 0 < n <= most:
            raise KernelError(f"{self.name}: the K/V pool holds {most} pages of "
                              f"{self.page_size} positions for {self.slots} slots (option "
                              f"kv_pages); asked for {n}")
        return range(self.slot_pages, self.slot_pages + n)

    def run_table(self, table: StepTable,
                  should_stop: Callable[[], bool] | None = None) -> TableResult:
        """One step of the rows of ``table`` (one launch): the logits of the rows that want
        them, but for the ones the device draws (``table.draws``: their tokens), in row order.
        Each row runs the one-token step's arithmetic at its own position over its own slot's
        pages, so a sequence's numbers, and its draws, do not depend on the other rows. A
        launch of many steps ends after its current step once ``should_stop()`` is true
        (polled while it runs: a request waiting to join, a cancel), through the host's stop
        flag as read at the LM head, so at most one step later."""
        self._check_table(table)
        return self._table_step(table.tokens, table.slots, table.positions, table.logits,
                                table.block_tables, table.drawn, table.draws, table.steps,
                                table.stops, should_stop)

    def _check_table(self, t: StepTable) -> None:
        """KernelError naming what is wrong before anything is written to the device (the
        kernel trusts the table: a bad page or row order would read another sequence's K/V)."""
        n = len(t)
        where = f"{self.name}: step table"
        if not 1 <= n <= self.max_step_rows:
            raise KernelError(f"{where} has {n} rows; this kernel takes 1 to "
                              f"{self.max_step_rows} (step_tokens)")
        if np.any((t.slots < 0) | (t.slots >= self.slots)):
            raise KernelError(f"{where}: slots must be in [0, {self.slots}), got "
                              f"{sorted(set(int(x) for x in t.slots))}")
        if np.any((t.positions < 0) | (t.positions >= self.max_seq_len)):
            raise KernelError(f"{where}: positions must be in [0, {self.max_seq_len})")
        self._check_tokens(t.tokens, f"{where}: tokens")
        seen = set()
        for i in range(n):
            s = int(t.slots[i])
            if i and s == t.slots[i - 1]:
                if t.positions[i] != t.positions[i - 1] + 1:
                    raise KernelError(f"{where}: slot {s}'s rows {i - 1} and {i} are at "
                                      f"positions {t.positions[i - 1]} and {t.positions[i]}; "
                                      "a slot's rows must be consecutive positions")
                continue
            if s in seen:
                raise KernelError(f"{where}: slot {s}'s rows are not consecutive")
            seen.add(s)
            pages = t.block_tables.get(s)
            last = int(t.positions[i:][t.slots[i:] == s].max())
            if pages is None or len(pages) <= last // self.page_size:
                raise KernelError(f"{where}: slot {s}'s block table does not reach position "
                                  f"{last} (pages of {self.page_size})")
            lo, hi = self.slot_pages, self.slot_pages + self.max_pages
            if len(pages) > self.slot_pages or any(not lo <= p < hi for p in pages):
                raise KernelError(f"{where}: slot {s}'s pages must be ids from add_pages, "
                                  f"at most {self.slot_pages} of them")
        if not 1 <= t.steps <= self.max_table_steps:
            raise KernelError(f"{where}: steps must be in [1, {self.max_table_steps}] "
                              f"(steps_per_launch), got {t.steps}")
        if t.steps > 1:
            drawn = t.drawn
            if np.any(t.logits & ~drawn):
                raise KernelError(f"{where}: a launch of {t.steps} steps needs every row with "
                                  "logits drawn on the device (draws)")
            for s, p in zip(t.slots[drawn], t.positions[drawn]):
                last = min(int(p) + t.steps - 1, t.stops.get(int(s), ((), self.max_seq_len))[1] - 1,
                           self.max_seq_len - 1)  # the last position the slot may feed
                if len(t.block_tables[int(s)]) <= last // self.page_size:
                    raise KernelError(f"{where}: slot {s}'s block table does not reach position "
                                      f"{last}, which {t.steps} steps may write")
        # a page the step writes belongs to its slot alone (shared prefix pages are only read):
        # another slot reading it would see this step's K/V in its context
        written = {(int(s), t.block_tables[int(s)][int(p) // self.page_size])
                   for s, p in zip(t.slots, t.positions)}
        for s, p in zip(t.slots[t.drawn], t.positions[t.drawn]):  # and the later steps'
            stop = t.stops.get(int(s), ((), self.max_seq_len))[1]
            for q in range(int(p) + 1, min(int(p) + t.steps, stop, self.max_seq_len)):
                written.add((int(s), t.block_tables[int(s)][q // self.page_size]))
        for s, page in sorted(written):
            other = sorted(o for o in seen if o != s and page in t.block_tables[o])
            if other:
                raise KernelError(f"{where}: page {page}, which slot {s} writes, is also in "
                                  f"slot {other[0]}'s block table")

    def write_table(self, table: StepTable) -> np.ndarray:
        """Check ``table`` and write its rows and block tables to the device; return the
        control words of its step (for a launch, or a strict-mode run: emulator/strict.py)."""
        self._check_table(table)
        return self._write_rows(table.tokens, table.slots, table.positions, table.logits,
                                table.block_tables, table.drawn, table.draws, table.steps,
                                table.stops)

    def _check_tokens(self, tokens: np.ndarray, what: str) -> None:
        """KernelError before the launch (EMBED would stop every block at a token outside the
        vocabulary, leaving the executor unusable)."""
        if np.any((tokens < 0) | (tokens >= self.config.vocab_size)):
            raise KernelError(f"{what} must be in [0, {self.config.vocab_size})")

    def _write_rows(self, tokens, slots, positions, want, tables: dict, drawn=None,
                    draws=None, steps: int = 1, stops=None) -> np.ndarray:
        n = len(tokens)
        rows = np.zeros((self.program.tokens, ROW_WORDS), np.int32)
        rows[:n, RowWord.TOKEN], rows[:n, RowWord.SLOT] = tokens, slots
        rows[:n, RowWord.POS] = positions
        new_seg = np.ones(n, bool)
        new_seg[1:] = np.asarray(slots[1:]) != np.asarray(slots[:-1])
        rows[:n, RowWord.SEG] = np.maximum.accumulate(np.where(new_seg, np.arange(n), 0))
        want = np.asarray(want, bool)
        drawn = np.zeros(n, bool) if drawn is None else np.asarray(drawn, bool)
        # logits rows: the host's rows first (read back), then the drawn ones (not read)
        host = want & ~drawn
        order = np.concatenate([np.flatnonzero(host), np.flatnonzero(drawn)])
        rows[:n, RowWord.LOGITS] = -1
        rows[order, RowWord.LOGITS] = np.arange(len(order))
        for s, d in (draws or {}).items():
            mine = np.flatnonzero(np.asarray(slots) == s)
            rows[mine, RowWord.TEMPERATURE] = np.float32(d.temperature).view(np.int32)
            rows[mine, RowWord.SEED] = d.seed & 0x7FFFFFFF
        rows[:n, RowWord.STOP_POS] = self.max_seq_len
        W = stop_mask_words(self.config.vocab_size)
        masks = self._stop_masks
        for s, (ids, stop_pos) in (stops or {}).items():
            rows[:n][np.asarray(slots) == s, RowWord.STOP_POS] = stop_pos
            masks[s * W:(s + 1) * W] = stop_mask(ids, self.config.vocab_size)
        # the drawn rows' slots: their out_tokens row from the first step's position on
        out = self.buffers["out_tokens"]
        for s, p in zip(np.asarray(slots)[drawn], np.asarray(positions)[drawn]):
            out[s * self.max_seq_len + p:(s + 1) * self.max_seq_len] = NO_TOKEN
        bt = self._block_table
        for s, pages in tables.items():
            bt[s, :len(pages)] = pages
        dev, b = self.device, self.buffers
        dev.write(b["rows"], rows.reshape(-1))
        dev.write(b["block_table"], bt)
        if stops:
            dev.write(b["stop_mask"], masks)
        words = self.state_words(0, 0, None)
        words[State.NTOK], words[State.STEPS] = n, steps
        words[State.HOST_LOGITS] = len(order) if self.drawn_logits else \
            int(np.count_nonzero(host))
        return words

    def _table_step(self, tokens, slots, positions, want, tables: dict, drawn=None,
                    draws=None, steps: int = 1, stops=None,
                    should_stop: Callable[[], bool] | None = None) -> TableResult:
        self._end_running()
        self.check_usable()
        n = len(tokens)
        dev, b = self.device, self.buffers
        dev.write(b["control"], self._write_rows(tokens, slots, positions, want, tables, drawn,
                                                 draws, steps, stops))
        self._state_on_device = None
        flags = b["host_flags"]
        flags[HostFlag.STOP] = 0
        try:
            if steps > 1 and should_stop is not None:
                self._run_until(should_stop)
            else:
                self.run_launches()
            control = dev.read(b["control"])
        except KernelError as e:
            self._broken = str(e).splitlines()[0]
            raise KernelError(f"{self.name}: a step of {n} rows (step {self._steps}) failed: "
                              f"{e}") from None
        self.check_error(control)
        ran = int(control[State.STEP]) - self._steps
        self._steps += ran
        V = self.config.vocab_size
        drawn = np.zeros(n, bool) if drawn is None else np.asarray(drawn, bool)
        m = int(np.count_nonzero(np.asarray(want, bool) & ~drawn))
        # only the host's rows cross back (the drawn rows' logits stay on the device)
        self._last_logits = (dev.read(b["logits"][:m * V]).reshape(m, V) if m else
                             np.zeros((0, V), np.float32))
        self.logits_rows_read += m
        # each drawn row's token, and the later steps' of its slot, from the slot's out_tokens
        # row (host-mapped: the step's end writes it at the fed position)
        out, M = b["out_tokens"], self.max_seq_len
        tokens, later = [], {}
        for s, p in zip(np.asarray(slots)[drawn], np.asarray(positions)[drawn]):
            tokens.append(int(out[s * M + p]))
            if ran > 1:
                row = out[s * M + p + 1:s * M + min(p + ran, M)]
                got = int(np.argmax(row == NO_TOKEN)) if np.any(row == NO_TOKEN) else len(row)
                later[int(s)] = [int(t) for t in row[:got]]
        return TableResult(self._last_logits, np.array(tokens, np.int64), later)

    def _run_until(self, should_stop: Callable[[], bool]) -> None:
        """The launches, in a run of their own (device.start), while this thread polls
        ``should_stop`` and raises the host's stop flag once it is true: the kernel ends after
        its current step (or the next, when the flag comes after its LM head read it)."""
        flags = self.buffers["host_flags"]
        run, pause = self.device.start(self.run_launches), 0.0
        try:
            while not run.done():
                if not flags[HostFlag.STOP] and should_stop():
                    flags[HostFlag.STOP] = 1
                pause = min(pause * 2 or 20e-6, 1e-3)
                time.sleep(pause)
        finally:
            run.finish()

    def _own_rows(self, tokens: list[int], start_pos: int, want: str) -> np.ndarray:
        """One-sequence calls on a kernel of many (tools, tests, a prompt's logprobs): the
        tokens at positions start_pos.. in steps of up to max_step_rows rows of the own slot
        (block table row ``slots``: the identity, pages [0, slot_pages)); the logits of the last
        row (``want`` "last") or of every row ("all")."""
        if start_pos < 0 or start_pos + len(tokens) > self.max_seq_len:
            raise KernelError(f"positions [{start_pos}, {start_pos + len(tokens)}) are outside "
                              f"the KV cache [0, {self.max_seq_len})")
        out, T = [], self.max_step_rows
        for i in range(0, len(tokens), T):
            part = np.asarray(tokens[i:i + T], np.int64)
            pos = start_pos + i + np.arange(len(part))
            w = np.ones(len(part), bool) if want == "all" else \
                (i + np.arange(len(part)) == len(tokens) - 1)
            self._check_tokens(part, f"{self.name}: tokens")
            out.append(self._table_step(part, np.full(len(part), self.slots), pos, w, {}).logits)
        return np.concatenate(out)

    def step(self, token: int, pos: int, sample: DeviceSample | None = None) -> StepResult:
        if self.table:  # the host samples (device_sampling is off)
            return StepResult(token=None, logits=self._own_rows([token], pos, "last")[0])
        control = self.launch_step(token, pos, sample)
        if sample is not None:
            nxt = int(control[State.TOKEN])
            if nxt < 0:
                raise NumericalError(f"{self.name}: NaN in the logits at position {pos}")
            return StepResult(token=nxt, logits=None)
        return StepResult(token=None, logits=self.logits())

    def prefill(self, tokens: list[int], start_pos: int = 0) -> np.ndarray:
        if self.table:
            return self._own_rows(tokens, start_pos, "last")[-1]
        for i, t in enumerate(tokens):
            self.launch_step(t, start_pos + i, None)
        return self.logits()

    def prefill_all(self, tokens: list[int], start_pos: int = 0) -> np.ndarray:
        if self.table:
            return self._own_rows(tokens, start_pos, "all")
        return super().prefill_all(tokens, start_pos)

    def logits(self) -> np.ndarray:
        """float32 [vocab] of the last step (a step of many rows: its last logits row)."""
        if self.table:
            return self._last_logits[-1].copy()
        return self.device.read(self.buffers["logits"])

    def read_buffer(self, name: str) -> np.ndarray:
        """A buffer's contents; a bf16 input (isa.BF16_INPUTS in a tensor-core build) as the
        float32 values it holds. The bf16 KV cache comes back as its raw uint16 bits."""
        out = self.device.read(self.buffers[name])
        if name in BF16_INPUTS and out.dtype == np.uint16:  # not the KV cache: its bits as stored
            return (out.astype(np.uint32) << 16).view(np.float32)
        return out

    def trace_records(self) -> np.ndarray:
        """uint64 [blocks, max_len, TRACE_WORDS] of the last step (MK_TRACE builds)."""
        return self.device.read(self.buffers["trace"])


# ================================================================================================
# Backends: the kernel family's options and the emulator factories
# ================================================================================================
@dataclass(frozen=True)
class KernelOptions(BackendOptions):
    """The options every kernel backend takes (``LLM(backend="emulator", blocks=8)``):
    KernelExecutor's keywords. Each device adds its own (EmulatorOptions, CudaOptions)."""

    blocks: int = field(default=4, metadata={"min": 1})
    multi: bool = False
    graph: bool = False
    pdl: bool = False
    prefetch: bool = True
    attn_splits: int | None = field(default=None, metadata={"min": 1})
    attn_min_chunk: int | None = field(default=None, metadata={"min": 1})
    watchdog_ms: int = field(default=20000, metadata={"min": 1})
    trace: bool = False
    program: Program | None = None
    name: str | None = None
    multi_step: bool = True
    steps_per_launch: int = field(default=0, metadata={"min": 0})
    sync: int | None = None
    merge_ticket_min: int | None = field(default=None, metadata={"min": 0})
    # a prompt runs in steps of up to this many tokens (megakernel.cu MK_T_MAX), each bitwise
    # the one-token steps' (docs/many-tokens.md, slice 2)
    step_tokens: int = field(default=1, metadata={"min": 1, "max": MAX_STEP_TOKENS})
    # > 1: steps of up to max(step_tokens, slots) rows of up to this many sequences, K/V in
    # pages of page_size positions; the Engine batches on it (docs/many-tokens.md, slice 3)
    slots: int = field(default=1, metadata={"min": 1, "max": MAX_STEP_TOKENS})
    page_size: int = field(default=DEFAULT_PAGE_SIZE, metadata={"min": 1})
    # the K/V pool's pages for the slots (None: a context for each); fewer: memory follows the
    # tokens in use, and requests wait for pages
    kv_pages: int | None = field(default=None, metadata={"min": 1})
    # the mat-muls of a kernel of slots on tensor cores (mma.sync, bf16 inputs; docs/
    # tensor-cores.md, slice 6a): judged by the reference's bf16_inputs mode; off until a GPU
    # has timed it
    tensor_cores: bool = False

    def __post_init__(self):
        if self.tensor_cores and (self.slots < 2 or self.multi):
            raise ParameterError("option tensor_cores=True is for the persistent kernel of slots: "
                                 f"it needs slots >= 2 and multi=False (got slots={self.slots}"
                                 f"{', multi=True' if self.multi else ''})")
        if self.merge_ticket_min == 1 and self.slots < 2:
            raise ParameterError("option merge_ticket_min=1 is for a kernel of slots (slots >= "
                                 "2); the one-sequence kernel merges by ticket from 2 splits "
                                 "(merge_ticket_min >= 2, or 0: never)")

    def batch_limits(self) -> tuple[int | None, int | None]:
        if self.slots > 1:
            return self.slots, max(self.step_tokens, self.slots)
        return None, None

    def executor_kwargs(self) -> dict:
        """KernelExecutor's keywords: every option but the device's own."""
        return {f: getattr(self, f) for f in KernelOptions.names()}


@dataclass(frozen=True)
class EmulatorOptions(KernelOptions):
    """``sanitize``: build the emulator under a sanitizer ("address")."""

    sanitize: str | None = None


def _emulator(model, max_seq_len, o: EmulatorOptions, **extra) -> KernelExecutor:
    return KernelExecutor(model, max_seq_len, device=EmulatorDevice(o.sanitize),
                          **o.executor_kwargs(), **extra)


# backend name -> Backend (options family, fixed options, factory), read by runtime.make_executor
BACKENDS = {
    "emulator": Backend("emulator", EmulatorOptions, _emulator),
    "emulator-multi": Backend("emulator-multi", EmulatorOptions, _emulator, {"multi": True}),
}
