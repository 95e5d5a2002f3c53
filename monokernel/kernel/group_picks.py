"""Token groups picked by the cost model: how many members each mat-mul op takes in the
program a tensor-core executor runs.

schedule(token_groups=True) takes token_groups.choose's closed form, which counts the L2
bytes a block moves (the input broadcast against the other members' weight rows) and nothing
else. The cost model also counts what those bytes cost: a walk's rounds at L2 and HBM
latency, the row split of a big share, the RMS ops' staged rows. On Llama-3.2-1B at 64 tokens
a step the closed form puts O_PROJ, GATE_UP and DOWN in groups of 2 where the model predicts
row tiles faster (benchmarks/NOTES.md "Token groups picked by the cost model").

``pick`` asks the model, one op at a time with the others at the closed form's picks, on a
one-layer copy of the model (every layer's ops are tiled alike): each c in
token_groups.candidates on a decode step of the program's tokens on MODEL_GPU (the
attention's cost does not depend on the groups), the closed form's c on ties; then all the
ops' picks together, kept only if that step is cheaper than the closed form's. The picks go
to schedule as a dict {Op: c}; a pick's min_tokens is the closed form's threshold for its c
(token_groups.members_of).

This module sits above schedule and the cost model (it schedules programs and predicts
them), so schedule does not ask it: the tensor-core executor, ``monokernel plan`` and the GPU
check's prepare do, through ``tensor_core_program`` and ``tensor_core_slices``.

A pick takes seconds (14 one-layer schedules and predictions at 132 blocks), and every process
that builds a tensor-core executor asks for it: the picks are remembered on disk,
$MONOKERNEL_CACHE/picks/<key>.json, keyed by the arguments and by the bytes of this package's
sources (the cost model's code and tables, the ops' tilings, the scheduler), so a change to any
of them picks again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from . import costmodel as cm
from .costmodel.tokens import StepShape
from .isa import Op
from .schedule import forget, schedule, tensor_core_splits
from .schedule import tensor_core_slices as slices_of_groups
from .token_groups import GROUPED_OPS, MIN_SHARE, candidates

MODEL_GPU = "h200"  # the GPU whose predicted step ``pick`` minimises (the project's target)
PICK_CONTEXT = 16  # the decode step's context (the groups' cost does not depend on it)


def pick(cfg, num_blocks: int, max_seq_len: int, splits: int, min_chunk: int, tokens: int,
         input_slices: bool | int = True) -> bool | dict:
    """schedule's token_groups for the tensor-core program (merge_ticket_min 1) of ``cfg``
    on ``num_blocks`` with steps of up to ``tokens``: a dict {Op: c} of the ops whose pick
    differs from the closed form's, or True where none does (or where the attention cannot
    be merged by ticket: schedule then runs row tiles, and the executor names why).
    Remembered per arguments."""
    picked = _pick(cfg, num_blocks, max_seq_len, splits, min_chunk, tokens,
                   "chosen" if input_slices is True else int(input_slices))
    return dict(picked) if picked else True


@lru_cache(maxsize=64)
def _pick(cfg, num_blocks: int, max_seq_len: int, splits: int, min_chunk: int, tokens: int,
          slicing: str | int) -> tuple:
    """((Op, c), ...) sorted by op, empty for the closed form everywhere (``pick``; True ==
    1 and they hash alike, so ``slicing`` says "chosen" for input_slices True): from the
    disk if an earlier process picked them with the same sources, else searched and kept."""
    from ..model.cache import cache_dir, remember

    args = (cfg, num_blocks, max_seq_len, splits, min_chunk, tokens, slicing)
    key = hashlib.sha256(repr((args, MODEL_GPU, PICK_CONTEXT, sources_digest())).encode())
    path = cache_dir() / "picks" / f"{key.hexdigest()}.json"
    try:
        return tuple((Op[name], int(c)) for name, c in json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not picked yet (or a damaged file: picked again and rewritten)
    picked = _search(*args)
    remember(path, json.dumps([(op.name, c) for op, c in picked]))
    return picked


@lru_cache(maxsize=1)
def sources_digest() -> str:
    """sha256 of every source file of monokernel/kernel (Python, CUDA, the SASS facts): what
    a pick is a function of besides its arguments."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for f in sorted(root.rglob("*")):
        if f.suffix in (".py", ".json", ".cu", ".cuh") and "__pycache__" not in f.parts:
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _search(cfg, num_blocks: int, max_seq_len: int, splits: int, min_chunk: int, tokens: int,
            slicing: str | int) -> tuple:
    """The cost model's picks (``pick``), searched."""
    if tokens < 2 * MIN_SHARE or num_blocks < 2 or cfg.num_layers < 1:
        return ()
    one = replace(cfg, num_layers=1)
    g = cm.gpu(MODEL_GPU)
    shape = StepShape.decode(tokens, PICK_CONTEXT)

    def program(token_groups):
        return schedule(one, num_blocks, max_seq_len, splits, min_chunk, merge_ticket_min=1,
                        tokens=tokens, token_groups=token_groups, tensor_cores=True,
                        input_slices=True if slicing == "chosen" else slicing)

    def step_us(prog) -> float:
        return cm.predict(prog, g, cm.design_for(prog, tensor_cores=True),
                          shape=shape).total_us

    try:
        closed = program(True)
        if closed.merge_ticket_min != 1:  # no groups: schedule runs row tiles
            return ()
        base = step_us(closed)
        chosen = {}
        for op in GROUPED_OPS:
            best, closed_c = base, members(closed, op)
            for c in candidates(tokens, num_blocks):
                if c == closed_c:  # the closed form's own program: base
                    continue
                us = step_us(program({op: c}))
                if us < best * (1.0 - 1e-9):
                    best, chosen[op] = us, c
        keep = bool(chosen) and step_us(program(chosen)) < base
    finally:
        forget(one)  # room for the whole models' programs in schedule's memo
    return tuple(sorted(chosen.items(), key=lambda kv: kv[0].value)) if keep else ()


def members(prog, op) -> int:
    """The members of ``op``'s token groups in ``prog`` at its full step (1: row tiles; block
    0's group is a whole one)."""
    return next((ins.group.members if ins.group else 1 for ins in prog.queues[0]
                 if ins.op == op), 1)


def tensor_core_program(cfg, num_blocks: int, max_seq_len: int, splits: int, min_chunk: int,
                        tokens: int, input_slices: bool | int = True):
    """The tensor-core program (every step's attention merged by ticket) of ``cfg`` with the
    splits fixed by absolute position (schedule.tensor_core_splits), steps of up to
    ``tokens``, the token groups the cost model picks and ``input_slices``."""
    return schedule(cfg, num_blocks, max_seq_len, splits, min_chunk, merge_ticket_min=1,
                    tokens=tokens, tensor_cores=True, input_slices=input_slices,
                    token_groups=pick(cfg, num_blocks, max_seq_len, splits, min_chunk, tokens,
                                      input_slices))


def tensor_core_slices(cfg, num_blocks: int, max_seq_len: int, tokens: int) -> tuple[int, int]:
    """(O_PROJ's, DOWN's) input slices of the program a tensor-core executor builds by default
    (``tensor_core_program`` with the default splits and input_slices True), without building
    it (schedule.tensor_core_slices with the picks): the GPU check's prepare compiles that
    kernel before any executor."""
    splits, min_chunk = tensor_core_splits(cfg, num_blocks, max_seq_len)
    return slices_of_groups(cfg, num_blocks, max_seq_len, tokens,
                            pick(cfg, num_blocks, max_seq_len, splits, min_chunk, tokens))
