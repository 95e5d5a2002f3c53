"""ModelConfig + grid size -> Program: the decode step as per-block instruction queues.

The step is EMBED, then per layer RMS_QKV_ROPE, ATTENTION, O_PROJ_RESIDUAL, RMS_GATE_UP,
DOWN_RESIDUAL, then RMS_LM_HEAD (``STEP``). Each op tiles itself (kernel/ops/<op>.py ``tile``)
so that every block works in every op, balanced by bytes; this module loops over the layers,
gives each op its counters, chains each op's wait to the previous op's signal, and verifies the
result. Queues are aligned: instruction slot i holds the same (op, layer) in every block, so
the multi-kernel baseline can launch one slot range per op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ProgramError
from ..model.config import ModelConfig
from . import input_slices as slices, ops, token_groups as groups
from .isa import STATE_WORDS, Op, attn_round_positions, merge_ticket_min_splits
from .program import Instruction, Program

# The ops of one step: (op, once per layer). The first runs once before the layers, the
# per-layer ones in this order in every layer, the last once after them.
STEP: tuple[tuple[Op, bool], ...] = (
    (Op.EMBED, False),
    (Op.RMS_QKV_ROPE, True), (Op.ATTENTION, True), (Op.O_PROJ_RESIDUAL, True),
    (Op.RMS_GATE_UP, True), (Op.DOWN_RESIDUAL, True),
    (Op.RMS_LM_HEAD, False),
)

# Enough splits that a unit is at most one round of K and one of V at LONG_CONTEXT
# positions (or the program's context, if shorter), but never fewer positions per split than a
# round (min_chunk): a short context then uses few splits and the merge reads only those. The
# cost model picked it (benchmarks/NOTES.md): SmolLM2 16, Qwen3 16, Llama 16 at 132 blocks.
LONG_CONTEXT = 2048
MAX_DEFAULT_SPLITS = 16
# The most tokens a step may carry: the kernel's bound (megakernel.cu: MK_T_MAX <= MK_THREADS,
# a row's ticket draw a thread); every build fits its shared memory at 256 (benchmarks/NOTES.md
# "Steps of 256 tokens": Llama's CUDA-core kernel of slots 47.2 KB static, the nearest to 48);
# late q/k keeps the chunk's keys in dynamic shared memory (megakernel.cu chunk_keys, bf16
# [T_MAX, HEAD_DIM]: 64 KB on Qwen3).
MAX_STEP_TOKENS = 256


def default_attn_splits(cfg: ModelConfig, num_blocks: int, max_seq_len: int | None = None) -> int:
    """Enough (KV head, split) units to give most blocks one, capped (see above)."""
    units = max(1, num_blocks // cfg.num_kv_heads)
    context = min(max_seq_len or LONG_CONTEXT, LONG_CONTEXT)
    need = -(-context // attn_round_positions(cfg.head_dim))
    return max(1, min(units, need, MAX_DEFAULT_SPLITS))


def default_min_chunk(cfg: ModelConfig) -> int:
    return attn_round_positions(cfg.head_dim)


@dataclass
class Plan:
    """What an op's ``tile`` sees: the model, the grid and the program-wide choices; and
    ``counter(name)``, which gives the op a counter of its own (a ticket)."""

    config: ModelConfig
    num_blocks: int
    max_seq_len: int
    attn_splits: int
    min_chunk: int  # fewest positions per attention split
    merge_min: int = 0  # fewest used splits a step merges by ticket (0: never)
    tokens: int = 1  # the most tokens a step carries (Program.tokens)
    # the mat-muls' token groups (token_groups.py): False none, True chosen per op by the
    # closed form, a dict {Op: members} as picked (group_picks.py; an op not in it by the
    # closed form); the tests: an int, that many members in every mat-mul op, or (members,
    # min_tokens)
    token_groups: bool | int | tuple[int, int] | dict = False
    # a tensor-core kernel's program (MK_MMA): the residual's writers also store its bf16 copy
    # residual_in, which the RMS ops read instead of the residual (Program.tensor_cores)
    tensor_cores: bool = False
    # O_PROJ's and DOWN's input columns cut in this many slices (input_slices.py; 1: none;
    # True: chosen per op, input_slices.choose)
    input_slices: bool | int = 1
    counters: list[str] = field(default_factory=list)

    def residual_writes(self, lo: int, hi: int) -> list:
        """The regions of a write of residual columns [lo, hi): with tensor_cores, its bf16
        copy's too (megakernel.cu op_embed, store_residual_in)."""
        if hi <= lo:
            return []
        return [("residual", lo, hi)] + ([("residual_in", lo, hi)] if self.tensor_cores else [])

    def rms_input(self) -> str:
        """The buffer an RMS op norms: the residual, or with tensor_cores its bf16 copy."""
        return "residual_in" if self.tensor_cores else "residual"

    def counter(self, name: str) -> int:
        self.counters.append(name)
        return len(self.counters) - 1


# Verified programs by their arguments. verify() of a 132-block program takes seconds, and the
# GPU check builds a dozen executors of each shape; they share one Program.
_VERIFIED: dict[tuple, Program] = {}
_VERIFIED_MAX = 16


def tensor_core_splits(cfg: ModelConfig, num_blocks: int, max_seq_len: int,
                       attn_splits: int | None = None,
                       attn_min_chunk: int | None = None) -> tuple[int, int]:
    """(splits, fewest positions per split) of a tensor-core kernel's program: the splits fixed
    by absolute position (docs/many-tokens.md, slice 6b), C = at least ceil(max_seq_len /
    splits) positions each, so a row's split s covers [s C, (s + 1) C) with one C for every
    row of the program (isa.split_chunk never widens it), whatever its context; at least the
    fewest positions asked for (by default one round of K/V loads).

    With the default splits, the program has one KV group's unit slot per block (num_blocks //
    KV heads, if more): a kernel of slots deals a step's rows over each group's slots
    (megakernel.cu split_slot) and no row uses more than max_seq_len / C splits, so the slots
    past those spread the rows' units over every block (SmolLM2's 3 KV heads: 44 slots a group
    on 132 blocks, not 16) without moving a split's positions."""
    splits = attn_splits or default_attn_splits(cfg, num_blocks, max_seq_len)
    if attn_min_chunk is None:
        attn_min_chunk = 1 if attn_splits else default_min_chunk(cfg)
    chunk = max(attn_min_chunk, -(-max_seq_len // splits))
    if attn_splits is None:
        splits = max(splits, num_blocks // cfg.num_kv_heads)
    return splits, chunk


def schedule(cfg: ModelConfig, num_blocks: int, max_seq_len: int,
             attn_splits: int | None = None, attn_min_chunk: int | None = None,
             merge_ticket_min: int | None = None, tokens: int = 1,
             token_groups: bool | int | tuple[int, int] | dict = False,
             tensor_cores: bool = False, input_slices: bool | int = 1) -> Program:
    """Build and verify the decode-step program for ``num_blocks`` persistent blocks.

    ``attn_splits``: position splits per KV head (default: ``default_attn_splits``);
    ``attn_min_chunk``: fewest positions per split (default: one round of K/V loads with the
    default splits, 1 - exact splits - when ``attn_splits`` is given);
    ``merge_ticket_min``: fewest used splits a step merges by ticket (default
    isa.merge_ticket_min_splits, 0: never, the per-block merge of every O_PROJ block). It
    applies only where no attention instruction holds units of two KV groups.
    ``tokens``: the most tokens a step carries (a prompt chunk; at most MAX_STEP_TOKENS).
    ``token_groups``: the mat-muls' token groups of a tensor-core kernel (token_groups.py;
    needs every step's attention merged by ticket, merge_ticket_min 1): True, chosen per op
    for ``tokens`` by the closed form, token_groups.choose (none where the attention cannot
    be merged by ticket); a dict {Op: members}, the cost model's picks (group_picks.pick; an
    op not in it by the closed form); the tests: an int, that many members in every mat-mul
    op in steps of at least 8 a member, or (members, min_tokens); False, row tiles.
    ``tensor_cores``: the program of a tensor-core kernel (MK_MMA), which keeps the residual's
    bf16 copy residual_in for its RMS ops: its regions say so (Plan.residual_writes,
    Plan.rms_input) and verify() orders them.
    ``input_slices``: O_PROJ's and DOWN's input columns cut in that many slices over each row
    group (input_slices.py; a tensor-core program merged by ticket, with its token groups);
    True: as many as input_slices.choose picks for each op.

    Memoised: the same arguments return the same (shared) Program. Never edit a returned
    Program in place; ``copy.deepcopy`` it first (the tests that break programs do)."""
    if num_blocks < 1:
        raise ProgramError(f"num_blocks must be >= 1, got {num_blocks}")
    if attn_min_chunk is None:
        attn_min_chunk = 1 if attn_splits else default_min_chunk(cfg)
    splits = attn_splits or default_attn_splits(cfg, num_blocks, max_seq_len)
    if merge_ticket_min is None:
        merge_ticket_min = merge_ticket_min_splits(cfg)
    if merge_ticket_min < 0:
        raise ProgramError(f"merge_ticket_min must be >= 0, got {merge_ticket_min}")
    if not 1 <= tokens <= MAX_STEP_TOKENS:
        raise ProgramError(f"tokens per step must be in [1, {MAX_STEP_TOKENS}], got {tokens}")
    # (True == 1 and hash alike: the choices' keys say which they are)
    asked = tuple(sorted((op.value, c) for op, c in token_groups.items())) \
        if isinstance(token_groups, dict) else token_groups
    key = (cfg, num_blocks, max_seq_len, splits, attn_min_chunk, merge_ticket_min, tokens,
           ("chosen", None) if token_groups is True else ("asked", asked),
           bool(tensor_cores),
           ("chosen", None) if input_slices is True else ("asked", int(input_slices)))
    prog = _VERIFIED.get(key)
    if prog is None:
        plan = Plan(cfg, num_blocks, max_seq_len, splits, attn_min_chunk, tokens=tokens,
                    token_groups=token_groups, tensor_cores=bool(tensor_cores),
                    input_slices=input_slices)
        plan.merge_min = ops.attention.merge_min(plan, merge_ticket_min)
        if token_groups is not False and plan.merge_min != 1:
            if token_groups is not True:
                raise ProgramError("token groups are for a tensor-core kernel's program, whose "
                                   "attention is merged by ticket every step (merge_ticket_min "
                                   "1)")
            plan.token_groups = False  # (the executor names why it cannot merge by ticket)
        if (input_slices is True or input_slices > 1) and \
                not (plan.tensor_cores and plan.merge_min == 1):
            if input_slices is not True:
                raise ProgramError("input slices are for a tensor-core kernel's program, whose "
                                   "attention is merged by ticket every step "
                                   "(merge_ticket_min 1)")
            plan.input_slices = 1  # (the executor names why it cannot merge by ticket)
        prog = build(plan)
        prog.verify()
        if len(_VERIFIED) >= _VERIFIED_MAX:
            _VERIFIED.pop(next(iter(_VERIFIED)))
        _VERIFIED[key] = prog
    return prog


def _slicing(plan: Plan, op: Op, module, tiles: list[Instruction]) -> tuple[int, int, int]:
    """(input slices, token-group members, their min_tokens) of ``op`` in ``plan``: (1, 0, 0)
    for an op without input slices (its token groups are token_groups.apply's)."""
    want = plan.input_slices
    if op not in slices.SLICED_OPS or not (want is True or want > 1):
        return 1, 0, 0
    c, min_tokens = (1, 0) if plan.token_groups is False else groups.members_of(
        plan, module, tiles, None if plan.token_groups is True else plan.token_groups)
    if plan.tokens < min_tokens:
        c, min_tokens = 1, 0
    return (slices.choose(plan, module, tiles, c) if want is True else want), c, min_tokens


def forget(cfg: ModelConfig) -> None:
    """Drop the remembered programs of ``cfg`` (group_picks' one-layer copies of a model, so
    that they do not push whole models' programs out of the memo)."""
    for key in [key for key in _VERIFIED if key[0] == cfg]:
        del _VERIFIED[key]


def tensor_core_slices(cfg: ModelConfig, num_blocks: int, max_seq_len: int, tokens: int,
                       token_groups: bool | dict = True) -> tuple[int, int]:
    """(O_PROJ's, DOWN's) input slices of the program schedule(..., token_groups=token_groups,
    tensor_cores=True, input_slices=True) builds (the tensor-core executor's default, with
    the cost model's picks: group_picks.tensor_core_slices), without building it: the kernel
    is compiled with them (MK_O_PROJ_SLICES, MK_DOWN_SLICES), and the GPU check's prepare
    compiles that kernel before any executor."""
    splits, min_chunk = tensor_core_splits(cfg, num_blocks, max_seq_len)
    plan = Plan(cfg, num_blocks, max_seq_len, splits, min_chunk, tokens=tokens,
                token_groups=token_groups, tensor_cores=True, input_slices=True)
    plan.merge_min = ops.attention.merge_min(plan, 1)
    if plan.merge_min != 1:
        return 1, 1
    return tuple(_slicing(plan, op, ops.module(op), ops.module(op).tile(plan, 0))[0]
                 for op in (Op.O_PROJ_RESIDUAL, Op.DOWN_RESIDUAL))


def build(plan: Plan) -> Program:
    """The program of ``plan``, unverified: every op of STEP tiled over the blocks, its wait
    on the previous op's counter (all B blocks signal it), its own counter signalled (an op
    whose module says SIGNALS = False ends the step by a ticket instead)."""
    B = plan.num_blocks
    layers = plan.config.num_layers
    order = [(op, 0) for op, per_layer in STEP[:1]] \
        + [(op, layer) for layer in range(layers) for op, per_layer in STEP if per_layer] \
        + [(op, 0) for op, per_layer in STEP[1:] if not per_layer]
    queues: list[list[Instruction]] = [[] for _ in range(B)]
    prev: int | None = None
    for op, layer in order:
        module = ops.module(op)
        name = f"L{layer}.{op.name}" if (op, True) in STEP else op.name
        sig = plan.counter(name) if module.SIGNALS else None
        tiles = module.tile(plan, layer)
        if len(tiles) != B:
            raise ProgramError(f"{op.name} tiled {len(tiles)} instructions for {B} blocks")
        s, c, min_tokens = _slicing(plan, op, module, tiles)
        if s > 1:
            tiles = slices.apply(plan, module, layer, tiles, s, c, min_tokens, plan.counter)
        elif plan.token_groups is not False and op in groups.GROUPED_OPS:
            tiles = groups.apply(plan, module, layer, tiles,
                                 None if plan.token_groups is True else plan.token_groups)
        for q, ins in zip(queues, tiles):
            ins.wait = (prev, B) if prev is not None else None
            ins.signal = sig
            q.append(ins)
        prev = sig
    # Each block reads the state words at launch start, before its first instruction.
    for q in queues:
        first = next(ins for ins in q if ins.op != Op.NOOP)
        if ("state", 0, STATE_WORDS) not in first.reads:
            first.reads = first.reads + [("state", 0, STATE_WORDS)]
    return Program(config=plan.config, num_blocks=B, max_seq_len=plan.max_seq_len,
                   queues=queues, counter_names=plan.counters, attn_splits=plan.attn_splits,
                   lm_partials=B, attn_min_chunk=plan.min_chunk, merge_ticket_min=plan.merge_min,
                   tokens=plan.tokens, tensor_cores=plan.tensor_cores)
