"""The kernel wing's shared test pieces: the tolerance of kernel vs reference logits, the one
emulator build length, the reference run a kernel test compares with, a kernel run on poisoned
buffers, and the attention split geometry (test_kernel_emulator, test_merge_ticket,
test_attention_context, and the face's tests that share the emulator build)."""

from __future__ import annotations

import numpy as np

from monokernel.kernel.executor import KernelExecutor
from monokernel.kernel.isa import split_chunk, splits_used
from monokernel.kernel.schedule import schedule
from monokernel.model.config import ModelConfig
from monokernel.model.reference import ReferenceModel

# Kernel and reference both compute in float32 from the same bf16 weights and round K/V to bf16;
# they differ only in summation order (warp-shuffle trees and split-merged softmax vs NumPy's BLAS
# and pairwise sums): measured ~2e-7 of max|ref|. Where a K or V element's float32 value lies
# within an ulp of a bf16 rounding midpoint, the two round it to neighbouring bf16 values (seen
# once in 31 tiny steps: layer 0, position 5); that one flip moves the logits by up to ~4e-4 of
# max|ref|. Mutants of the kernel measured on tiny: dropping one key position, flipping RoPE's
# sin sign or merging one attention split too few cost 3e-2 to 6e-1 of max|ref|.
RTOL_OF_MAX = 2e-3

# One MAX_SEQ for every test that needs no other: MK_MAX_SEQ is compiled into the kernel, so each
# distinct (shape, MAX_SEQ) is a separate emulator build (~3 s).
MAX_SEQ = 160

_PROGRAMS: dict[tuple, object] = {}


def program(name: str, blocks: int = 132, max_seq: int = 1025, **changes):
    """The program of a named shape (its config ``replace``d by ``changes``), scheduled once
    per session: scheduling takes seconds. One program at 1025 positions serves contexts 16
    and 1024 (max_seq_len only sizes out_tokens). The cost-model tests share it."""
    key = (name, blocks, max_seq, tuple(sorted(changes.items())))
    if key not in _PROGRAMS:
        cfg = ModelConfig.from_name(name)
        if changes:
            cfg = cfg.replace(**changes)
        _PROGRAMS[key] = schedule(cfg, blocks, max_seq)
    return _PROGRAMS[key]


def relative_error(kernel: np.ndarray, ref: np.ndarray) -> float:
    """max|kernel - ref| / max|ref| (NaN anywhere -> NaN, which fails every comparison)."""
    return float(np.max(np.abs(kernel.astype(np.float64) - ref)) / np.max(np.abs(ref)))


def split_ranges(n_pos: int, splits: int, min_chunk: int = 1) -> list[tuple[int, int]]:
    """The kernel's attention split s covers positions [s * chunk, min(n_pos, (s + 1) * chunk))
    (isa.split_chunk, as megakernel.cu computes it)."""
    chunk = split_chunk(n_pos, splits, min_chunk)
    return [(s * chunk, min(n_pos, (s + 1) * chunk)) for s in range(splits)]


def used_splits(n_pos: int, splits: int, min_chunk: int = 1) -> int:
    """Splits with at least one position (isa.splits_used; test_ops.py checks it counts
    the non-empty ranges above)."""
    return splits_used(n_pos, splits, min_chunk)



def reference_run(model, tokens: list[int], n_steps: int, max_seq_len: int):
    """Feed ``tokens`` one per step, then the reference's own greedy token, for ``n_steps`` steps.
    Returns (the token fed at each step, the reference's logits [n_steps, vocab], the model)."""
    ref = ReferenceModel(model.config, model.weights, max_seq_len)
    fed, logits = [], []
    tok = tokens[0]
    for pos in range(n_steps):
        if pos < len(tokens):
            tok = tokens[pos]
        fed.append(tok)
        logits.append(ref.forward([tok], pos)[0])
        tok = int(np.argmax(logits[-1]))
    return fed, np.stack(logits), ref


def run_kernel(ex: KernelExecutor, fed: list[int]) -> np.ndarray:
    """Logits of every step, each step on NaN-poisoned activation buffers."""
    ex.reset()
    out = []
    for pos, tok in enumerate(fed):
        ex.poison()
        res = ex.step(tok, pos)
        assert res.token is None and res.logits is not None
        out.append(res.logits)
    return np.stack(out)



def assert_logits_match(kernel: np.ndarray, ref: np.ndarray, what: str) -> float:
    worst = 0.0
    for pos in range(len(ref)):
        assert np.isfinite(kernel[pos]).all(), (
            f"{what}: position {pos}: {int((~np.isfinite(kernel[pos])).sum())} non-finite logits "
            f"(first at id {int(np.flatnonzero(~np.isfinite(kernel[pos]))[0])})")
        err = relative_error(kernel[pos], ref[pos])
        assert err <= RTOL_OF_MAX, f"{what}: position {pos}: max|kernel - ref| = {err:.3g} * max|ref|"
        worst = max(worst, err)
    return worst


def mutate_kernel_source(monkeypatch, edit: tuple[str, str], what: str) -> None:
    """Make every kernel the executor builds from now on (until ``monkeypatch.undo()``) take
    ``edit`` (old, new) on its source: a negative control's mutation. ``old`` must occur
    exactly once (``what``: the code the test expects there, named in the failure)."""
    from monokernel.kernel import executor

    real = executor.kernel_source

    def mutated(*a, **k):
        src = real(*a, **k)
        assert src.count(edit[0]) == 1, f"{what} is not where this test expects"
        return src.replace(*edit)

    monkeypatch.setattr(executor, "kernel_source", mutated)
