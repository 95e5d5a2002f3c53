"""Driving a kernel of slots by hand (issue 17): sequences joining and leaving, each step's
rows taken from a plan, pages handed out as positions are reached. Shared by the tests of
steps of many sequences (test_batched_steps.py) and of tensor cores (test_tensor_cores.py)."""

from __future__ import annotations

import numpy as np

from monokernel.kernel.base import StepTable
from monokernel.kernel.executor import KernelExecutor

PAGE = 8  # the K/V page of these tests' kernels (page_size)


def prompt_of(model, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(1, model.config.vocab_size, n)]


class Batch:
    """Sequences on a kernel of many slots, driven by hand: each step takes ``plan[i]`` rows of
    sequence i (its prompt in chunks, then one decode row), pages handed out as positions are
    reached. Records each sequence's logits by position."""

    def __init__(self, ex: KernelExecutor):
        self.ex = ex
        self.free = list(ex.add_pages(ex.slots * ex.slot_pages))
        self.seqs: dict[int, dict] = {}

    def join(self, slot: int, prompt: list[int]) -> None:
        self.seqs[slot] = {"tokens": list(prompt), "prompt": len(prompt), "done": 0,
                           "pages": [], "logits": {}}

    def leave(self, slot: int) -> dict:
        s = self.seqs.pop(slot)
        self.free = s["pages"] + self.free  # the next pages handed out
        return s

    def table(self, plan: dict[int, int], logits: bool = True) -> tuple[StepTable, list[tuple]]:
        """The step's table and rows (pages handed out for them), not run; ``logits`` False:
        no row needs logits (prompt chunks before their prompt's last)."""
        rows = []
        for slot, n in plan.items():
            s = self.seqs[slot]
            for p in range(s["done"], s["done"] + n):
                rows.append((s["tokens"][p], slot, p, logits, p < s["prompt"]))
            while len(s["pages"]) * PAGE < s["done"] + n:
                s["pages"].append(self.free.pop(0))
        return StepTable.of(rows, {slot: self.seqs[slot]["pages"] for slot in plan}), rows

    def step(self, plan: dict[int, int], logits: bool = True) -> None:
        """Run the plan's rows, every row's logits recorded (``logits`` False: none needed,
        prompt rows only)."""
        table, rows = self.table(plan, logits)
        if not logits:
            assert all(pos < self.seqs[slot]["prompt"] for _, slot, pos, _, _ in rows)
            assert self.ex.run_table(table).logits.shape[0] == 0
            for slot, n in plan.items():
                self.seqs[slot]["done"] += n
            return
        logits = self.ex.run_table(table).logits
        assert logits.shape == (len(rows), self.ex.config.vocab_size)
        for (tok, slot, pos, _, _), lg in zip(rows, logits):
            s = self.seqs[slot]
            s["logits"][pos] = lg.copy()
            if pos + 1 == len(s["tokens"]):
                s["tokens"].append(int(np.argmax(lg)))
        for slot, n in plan.items():
            self.seqs[slot]["done"] += n

    def kv(self, slot: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The slot's K and V of positions [0, n), gathered from its pages."""
        s = self.seqs[slot]
        rows = [s["pages"][p // PAGE] * PAGE + p % PAGE for p in range(n)]
        return (self.ex.read_buffer("k_cache")[:, rows], self.ex.read_buffer("v_cache")[:, rows])


def chunkings_agree(ex: KernelExecutor, me: list[int], other: list[int], chunkings,
                    decode: int) -> dict:
    """Sequence 0 (``me``) on ``ex`` in each of ``chunkings`` (lists of step plans; one that
    names slot 1 runs ``other`` beside it), then ``decode`` decode steps: its logits at every
    position, its K/V and tokens bitwise the same in every run. The first run's record."""
    n = len(me) + decode
    runs = []
    for plans in chunkings:
        b = Batch(ex)
        b.join(0, me)
        if any(1 in p for p in plans):
            b.join(1, other)
        for plan in plans:
            b.step(plan)
        for _ in range(decode):
            b.step({slot: 1 for slot in b.seqs})
        runs.append((b.seqs[0], b.kv(0, n)))
    (first, (k0, v0)), rest = runs[0], runs[1:]
    assert sorted(first["logits"]) == list(range(n))
    for k, (run, (k1, v1)) in enumerate(rest):
        bad = [pos for pos in first["logits"] if not np.array_equal(
            run["logits"][pos].view(np.uint32), first["logits"][pos].view(np.uint32))]
        assert not bad, (k, bad[:5])
        assert np.array_equal(k0, k1) and np.array_equal(v0, v1), k
        assert run["tokens"] == first["tokens"]
    return first


def round_robin(its, each=None) -> list[list[int]]:
    """Pull the generations ``its`` in turn, a token each, until all end (the steps carry
    whoever is running): each one's tokens. ``each()`` runs after every pull."""
    its = list(its)
    got: list[list[int]] = [[] for _ in its]
    live = set(range(len(its)))
    while live:
        for i in sorted(live):
            try:
                got[i].append(next(its[i]).token)
            except StopIteration:
                live.discard(i)
            if each is not None:
                each()
    return got


# Steps of 4 to 32 rows on a kernel of 32 tokens a step and 6 slots (the token groups' and
# input slices' tests): 32 rows (token groups of 2 from 16), 17 (>= 16: shares of 8 and 9),
# 13 (row tiles; the slices' row mode), 32 with sequences 4 and 5 straddling a share, 4 rows
MIXED_STEPS = ({0: 5, 1: 11, 2: 16}, {0: 1, 1: 1, 3: 12, 4: 3}, {0: 1, 2: 1, 3: 11},
               {0: 1, 1: 1, 2: 1, 3: 1, 4: 20, 5: 8}, {s: 1 for s in range(4)})


def run_steps(model, prog, blocks: int, max_seq: int, tokens: int, steps=MIXED_STEPS,
              buffer: str | None = None, prompts=tuple(5 + 6 * k for k in range(6))):
    """Six sequences (by default prompts of 5, 11, .. 35 tokens; ``prompts``: their lengths)
    on a tensor-core kernel of ``prog`` (NaN-poisoned first), driven through ``steps``: every
    row's logits by (slot, position), and with ``buffer`` that buffer's contents after the last
    step (None if the kernel has none)."""
    ex = KernelExecutor(model, max_seq, blocks=blocks, slots=6, page_size=PAGE,
                        tensor_cores=True, program=prog, step_tokens=tokens)
    ex.poison()
    b = Batch(ex)
    for k, n in enumerate(prompts):
        b.join(k, prompt_of(model, n, k))
    for step in steps:
        b.step(step)
    logits = {(s, p): lg for s, q in b.seqs.items() for p, lg in q["logits"].items()}
    if buffer is None:
        return logits
    return logits, (np.array(ex.buffers[buffer]) if buffer in ex.buffers else None)
