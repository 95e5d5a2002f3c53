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

    def step(self, plan: dict[int, int]) -> None:
        rows, want = [], []
        for slot, n in plan.items():
            s = self.seqs[slot]
            for p in range(s["done"], s["done"] + n):
                rows.append((s["tokens"][p], slot, p, True, p < s["prompt"]))
            while len(s["pages"]) * PAGE < s["done"] + n:
                s["pages"].append(self.free.pop(0))
        table = StepTable.of(rows, {slot: self.seqs[slot]["pages"] for slot in plan})
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
