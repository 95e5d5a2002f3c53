"""Continuous batching: many generations at once on a batched executor (``max_num_seqs`` > 1).

The Batcher owns the step loop. Each step, at its boundary: sequences that ended or were
cancelled give back their slot and pages; waiting ones are admitted while a slot is free and
the pages they may need can be promised; then one StepTable is built under the token budget
(``max_num_batched_tokens``), running decode tokens first, then prompt chunks of the sequences
still prefilling, in arrival order (a prompt longer than the budget runs over several steps),
and the executor runs it. Every sequence samples from its own logits with its own Sampler
(seeded noise keyed by position, so a draw does not depend on the batch) and its own StopRule.

No preemption: a sequence is admitted only when the pool can give it every page it may need
(its prompt and ``max_tokens``, cut at the context's end), counting pages promised to the running
ones; pages are handed out only as positions are reached, so memory follows the tokens. A
request that could never fit is refused up front (PromptError).

A Generation pulls its tokens from its own queue; pulling from an empty queue runs steps (under
one lock) until it has one, so one thread driving several Generations, or the server's engine
thread, advances all of them. Prompt pages are kept in the prefix cache (kv_pages.py) when a
sequence ends and shared by later prompts with the same head.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Iterator

import numpy as np

from .errors import MonokernelError, NumericalError, ParameterError, PromptError
from .kernel.base import DeviceSample, StepTable, TableResult
from .kv_pages import PagePool

# The runtime's Engine, Generation and Sampled appear in annotations only: runtime.py imports
# this module, not the other way round.
Engine = Generation = Sampled = Any

DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512
MAX_NUM_SEQS_LIMIT = 1024


def batch_options(max_num_seqs: int | None, max_num_batched_tokens: int | None,
                  most_seqs: int | None = None, most_rows: int | None = None
                  ) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) with defaults filled in, validated. An executor
    that takes at most ``most_seqs`` sequences and ``most_rows`` rows a step (a kernel of
    ``slots``) caps them: the sequences silently (32 asked, 8 slots: 8 run), the rows by
    default, and an explicit max_num_batched_tokens above them is refused."""
    seqs = DEFAULT_MAX_NUM_SEQS if max_num_seqs is None else max_num_seqs
    check_batch_options(seqs, None)
    if most_seqs is not None:
        seqs = min(seqs, most_seqs)
    tokens = max_num_batched_tokens
    if tokens is not None:
        check_batch_options(seqs, tokens)
    if most_rows is not None and tokens is not None and tokens > most_rows:
        raise ParameterError(f"max_num_batched_tokens {tokens} exceeds the {most_rows} rows one "
                             "step of this backend takes (its step_tokens option)")
    if tokens is None:
        tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, seqs)
        tokens = tokens if most_rows is None else min(tokens, most_rows)
    check_batch_options(seqs, tokens)
    return int(seqs), int(tokens)


def check_batch_options(max_num_seqs: int, max_num_batched_tokens: int | None) -> None:
    """ParameterError naming the option and its valid range (None: max_num_seqs alone)."""
    def is_int(v) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

    if not is_int(max_num_seqs) or not 1 <= max_num_seqs <= MAX_NUM_SEQS_LIMIT:
        raise ParameterError(f"max_num_seqs must be an integer in [1, {MAX_NUM_SEQS_LIMIT}], "
                             f"got {max_num_seqs!r}")
    if max_num_batched_tokens is None:
        return
    if not is_int(max_num_batched_tokens) or max_num_batched_tokens < max_num_seqs:
        raise ParameterError(f"max_num_batched_tokens must be an integer >= max_num_seqs "
                             f"({max_num_seqs}: every running sequence decodes a token per "
                             f"step), got {max_num_batched_tokens!r}")


class Seq:
    """One generation's place in the batch."""

    def __init__(self, gen: "Generation", rule, host, need_pages: int,
                 draw: DeviceSample | None = None):
        self.gen = gen
        self.draw = draw  # the device samples its tokens (greedy or Gumbel-max), or None
        self.prompt = gen.ids
        self.tokens = list(gen.ids)  # the prompt, then every sampled token
        self.rule = rule
        self.host = host  # runtime._HostChoice: the sampler, its history, logprobs
        self.need_pages = need_pages  # positions [0, stop_pos) fed at most
        self.want_prompt = gen.params.prompt_logprobs is not None
        self.prompt_rows: list[np.ndarray] = []
        self.slot = -1
        self.pages: list[int] = []
        self.computed = 0  # positions whose K/V are written
        self.chunk = 0  # rows it has in the step being run
        self.registered = 0  # leading pages in the prefix cache
        self.key = None  # the prefix cache key of the last registered page
        self.out: deque["Sampled"] = deque()
        self.finished = False
        self.error: BaseException | None = None
        self.t_start = time.perf_counter()
        self.t_first: float | None = None

    @property
    def prefilled(self) -> bool:
        return self.computed >= len(self.prompt)


class Batcher:
    def __init__(self, engine: "Engine", max_num_seqs: int, max_num_batched_tokens: int,
                 num_pages: int | None = None):
        check_batch_options(max_num_seqs, max_num_batched_tokens)
        ex = self.executor = engine.executor
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        ps = ex.page_size
        if num_pages is None:  # every slot can hold a whole context, or the executor's pool
            num_pages = max_num_seqs * -(-ex.max_seq_len // ps)
            if ex.max_pages is not None:
                num_pages = min(num_pages, ex.max_pages)
        self.pool = PagePool(ex.add_pages(num_pages), ps)
        ex.pages_owner = self  # a later Engine on this executor takes the pool over
        self.lock = threading.RLock()
        # appended to without the lock (a deque's append is atomic), so that a launch of many
        # steps in flight, which holds the lock, sees a newcomer and ends early for it
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.steps = 0

    # ---- requests -------------------------------------------------------------------------
    def add(self, gen: "Generation", rule, host) -> Seq:
        """Queue ``gen`` with its StopRule and host sampler (runtime._HostChoice)."""
        need = -(-rule.stop_pos // self.pool.page_size)
        if need > self.pool.total:
            raise PromptError(f"this request may need {need} K/V pages of "
                              f"{self.pool.page_size} positions (its prompt of {len(gen.ids)} "
                              f"tokens and up to {rule.stop_pos - len(gen.ids) + 1} generated); "
                              f"the pool holds {self.pool.total}: ask for fewer max_tokens")
        params = gen.params
        draw = None  # the kernel draws what the host sampler would, bit for bit
        if (self.executor.table_draws and params.kernel_samplable and params.logprobs is None
                and params.prompt_logprobs is None):
            draw = DeviceSample(params.temperature, host.sampler.seed)
        seq = Seq(gen, rule, host, need, draw)
        self.waiting.append(seq)  # (no lock: see __init__) admitted at the next step boundary
        return seq

    def pull(self, seq: Seq) -> Iterator["Sampled"]:
        """``seq``'s tokens as they are made; runs steps while its queue is empty."""
        try:
            while True:
                with self.lock:
                    while not seq.out and not seq.finished:
                        self.step()
                    item = seq.out.popleft() if seq.out else None
                if item is None:
                    if seq.error is not None:
                        raise seq.error
                    return
                yield item
        finally:
            self.cancel(seq)

    def cancel(self, seq: Seq) -> None:
        """Free ``seq``'s slot and pages now, or at the next step boundary when a step is
        running in another thread (it sees ``gen.cancelled``)."""
        if self.lock.acquire(blocking=False):
            try:
                if not seq.finished:
                    self._finish(seq)
            finally:
                self.lock.release()

    def stats(self) -> dict[str, int]:
        return {"running": len(self.running), "waiting": len(self.waiting),
                "pages_in_use": self.pool.in_use, "pages": self.pool.total}

    # ---- the step loop --------------------------------------------------------------------
    def step(self) -> None:
        """One step: sweep, admit, run a table of decode tokens and prompt chunks, sample."""
        with self.lock:
            for s in [s for s in self.running + list(self.waiting) if s.gen.cancelled]:
                self._finish(s)
            self._admit()
            if not self.running:
                return
            rows, chunks = self._plan()
            steps = self._launch_steps(chunks)
            table = StepTable.of(rows, {s.slot: s.pages for s in chunks},
                                 {s.slot: s.draw for s in chunks if s.draw is not None},
                                 steps, {s.slot: (s.rule.stop_ids, s.rule.stop_pos)
                                         for s in chunks} if steps > 1 else None)
            try:
                if self.executor.pages_owner is not self:
                    raise MonokernelError(f"another Engine was made on this {self.executor.name}"
                                          f" executor and took its K/V pages: use that one")
                if steps > 1:  # ends early for a newcomer while a slot is free to take it
                    # (a full batch keeps its launch), or for a cancel among its rows
                    out = self.executor.run_table(table, should_stop=lambda: (
                        bool(self.waiting) and len(self.running) < self.max_num_seqs) or any(
                        s.gen.cancelled for s in chunks))
                else:
                    out = self.executor.run_table(table)
            except Exception as e:  # the executor failed: every sequence in the step ends
                for s in chunks:
                    self._finish(s, e)
                return
            self.steps += 1
            self._take(chunks, out)

    def _admit(self) -> None:
        pool = self.pool
        while self.waiting and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            reuse = self.engine.prefix_caching and not s.want_prompt
            # the last prompt token is always run: its logits give the first token
            hits, key = pool.lookup(s.prompt[:-1]) if reuse else ([], None)
            promised = sum(max(r.need_pages - len(r.pages), 0) for r in self.running)
            if pool.available - promised < s.need_pages - len(hits):
                pool.release(hits)
                return  # it waits for pages (preemption-free)
            self.waiting.popleft()
            s.pages, s.key, s.registered = list(hits), key, len(hits)
            s.computed = len(hits) * pool.page_size
            s.slot = self.free_slots.pop()
            s.t_start = time.perf_counter()
            st = s.gen.stats
            st.reused_tokens, st.prefill_tokens = s.computed, len(s.prompt) - s.computed
            self.engine.stats = st
            self.running.append(s)

    def _plan(self) -> tuple[list[tuple[int, int, int, bool, bool]], list[Seq]]:
        """The step's rows (token, slot, position, wants logits, is a prompt token): every
        decoding sequence's last token, then prompt chunks under what is left of the budget."""
        budget = self.max_num_batched_tokens
        rows, chunks = [], []
        for s in self.running:
            if s.prefilled:
                pos = len(s.tokens) - 1
                rows.append((s.tokens[-1], s.slot, pos, True, False))
                s.chunk = 1
                chunks.append(s)
                budget -= 1
        for s in self.running:
            if s.prefilled or budget <= 0:
                continue
            n = min(len(s.prompt) - s.computed, budget)
            last = len(s.prompt) - 1
            rows += [(s.prompt[p], s.slot, p, p == last or s.want_prompt, True)
                     for p in range(s.computed, s.computed + n)]
            s.chunk = n
            chunks.append(s)
            budget -= n
        ps = self.pool.page_size
        for s in chunks:  # pages as positions are reached (promised at admission)
            while len(s.pages) * ps < s.computed + s.chunk:
                s.pages.append(self.pool.allocate())
        return rows, chunks

    def _launch_steps(self, chunks: list[Seq]) -> int:
        """Steps the launch may run (an executor of ``max_table_steps`` > 1, the kernel): more
        than one only when nobody waits to join and every sequence of the step draws its tokens
        on the device and decodes after it (its prompt done), each up to its stop position;
        their pages for those positions are handed out now (promised at admission). The kernel
        stops a sequence at its stop tokens or position itself; the host's StopRule drops what a
        stop string ends early. A request arriving meanwhile ends the launch after its current
        step when a slot is free for it (``waiting``), else joins when a slot frees."""
        most = self.executor.max_table_steps
        if most <= 1 or self.waiting or not chunks:
            return 1
        last = {}
        for s in chunks:
            if s.draw is None or s.computed + s.chunk < len(s.prompt):
                return 1
            last[s] = s.computed + s.chunk - 1  # the position of its row that draws
        steps = min([most] + [s.rule.stop_pos - p for s, p in last.items()])
        ps = self.pool.page_size
        for s, p in last.items():
            while len(s.pages) * ps < p + steps:
                s.pages.append(self.pool.allocate())
        return max(steps, 1)

    def _take(self, chunks: list[Seq], out: TableResult) -> None:
        """Hand each sequence its logits rows or its drawn token (in row order: decode rows,
        then chunks)."""
        row = drawn = 0
        for s in chunks:
            decoding = s.prefilled
            n = 1 if decoding or not s.want_prompt else s.chunk
            ends_prompt = not decoding and s.computed + s.chunk == len(s.prompt)
            if s.draw is not None:  # the device drew its token: no logits rows
                s.computed += s.chunk
                if not decoding:
                    self._register(s)
                if decoding or ends_prompt:
                    self._accept(s, int(out.tokens[drawn]))
                    drawn += 1
                    for tok in out.later.get(s.slot, []):  # a launch of many steps
                        if s.finished:
                            break  # a stop string ended it: the rest is dropped
                        s.computed += 1  # the step that drew it fed the token before
                        self._accept(s, tok)
                continue
            logits = out.logits
            mine = logits[row:row + n] if (decoding or ends_prompt or s.want_prompt) else None
            row += 0 if mine is None else n
            s.computed += s.chunk
            if not decoding:
                self._register(s)
                if s.want_prompt:
                    s.prompt_rows.append(mine)
                if not ends_prompt:
                    continue
                if s.want_prompt:
                    self._prompt_logprobs(s, np.concatenate(s.prompt_rows))
            self._sample(s, mine[-1])

    def _sample(self, s: Seq, logits: np.ndarray) -> None:
        try:
            tok = s.host(logits)
        except NumericalError as e:  # NaN logits (the sampler names the token id): this
            self._finish(s, e)  # sequence ends, the others go on
            return
        self._accept(s, tok)

    def _accept(self, s: Seq, tok: int) -> None:
        """``tok`` (the host's or the device's draw) is ``s``'s next token."""
        if tok < 0:  # the device's draw from NaN logits
            self._finish(s, NumericalError(f"{self.executor.name}: NaN in the logits at "
                                           f"position {len(s.tokens) - 1}"))
            return
        s.host.history.append(tok)
        s.tokens.append(tok)
        i = len(s.tokens) - len(s.prompt) - 1
        ends = s.rule.reason(tok, i)  # known as the token is made: before it is handed on
        now = time.perf_counter()
        st = s.gen.stats
        if s.t_first is None:
            s.t_first, st.prefill_s = now, now - s.t_start
        st.generated_tokens += 1
        st.decode_s = now - s.t_first
        sampled = s.host.sampled(tok, s.rule)
        sampled.end = ends
        s.out.append(sampled)
        if ends is not None:
            self._finish(s)

    def _prompt_logprobs(self, s: Seq, every: np.ndarray) -> None:
        s.gen.prompt_logprobs = s.host.prompt_logprobs(s.prompt, every,
                                                       s.gen.params.prompt_logprobs)

    def _register(self, s: Seq) -> None:
        """Put the prompt's newly completed pages in the prefix cache (unless the engine's
        prefix caching is off). Only prompt pages: their rows always ran in padded matrix
        products, the same numbers in any batch and any chunking (NumpyExecutor.run_table);
        a lone decode step's do not."""
        if not self.engine.prefix_caching:
            return
        ps = self.pool.page_size
        full = min(s.computed, len(s.prompt)) // ps
        while s.registered < full:
            j = s.registered
            s.key = self.pool.key(s.key, s.prompt[j * ps:(j + 1) * ps])
            self.pool.register(s.pages[j], s.key)
            s.registered += 1

    def _finish(self, s: Seq, error: BaseException | None = None) -> None:
        """``s`` ends now: its slot and pages go back (cached prompt pages stay findable)."""
        s.finished = True
        s.error = error if s.error is None else s.error
        if s in self.running:
            self.running.remove(s)
            self.free_slots.append(s.slot)
            self.pool.release(s.pages)
            s.pages = []
        elif s in self.waiting:
            self.waiting.remove(s)
