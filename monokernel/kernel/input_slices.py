"""Input slices: O_PROJ's and DOWN's input columns split over a row group's blocks, the fp32
partials summed in a fixed order (benchmarks/NOTES.md "The input split, built in slices").

With row tiles and token groups, one block's k-loop makes each output, reading the op's whole
input (K columns) for its tokens; at DOWN's K (the FFN's width) that read, not the weights, is
what a block's step of many tokens waits on (costmodel/floor.py). Cut the columns in s slices:
a row group of c x s instructions (c the op's token-group members, token_groups.choose) shares
the group's rows, an even cut of the op's rows over the B // (c s) groups (the blocks left over
get an empty tile; they only signal). Member m = i s + j:

- in a step of at least the group's min_tokens tokens, multiplies the group's rows by token
  share i (token_groups' shares) over input slice j;
- in a smaller step, rows part i of the group (the group's rows cut in c) by every token, over
  input slice j.

Either way the partial of (token, row, slice j) is the same k-loop over slice j's columns; the
member writes it as fp32 to partials[token][j R + row] (R the op's rows), signals the group's
counter, waits for the group's c s signals and sums its own rows (the group's rows cut in c s)
over the s slices in slice order into the residual (and residual_in). A token's sum does not
depend on the step's other tokens: s is the program's, fixed per op (batch invariance).
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import ProgramError
from .isa import Op
from .program import ANY_TOKENS, TOKEN_SHARES, InputSlice, Instruction, TokenGroup, Tokens, \
    split_even

SLICED_OPS = (Op.O_PROJ_RESIDUAL, Op.DOWN_RESIDUAL)
MAX_SLICES = 16
# a slice's columns are whole 16-column chunks of the mma (m16n8k16)
SLICE_COLUMNS = 16


def check(op: Op, k: int, slices: int, blocks: int, members: int = 1) -> None:
    """Refuse a split the kernel cannot run, naming why."""
    if slices < 1 or slices > MAX_SLICES or slices & (slices - 1):
        raise ProgramError(f"{op.name}: input slices must be a power of two in [1, "
                           f"{MAX_SLICES}], got {slices}")
    if k % (SLICE_COLUMNS * slices):
        raise ProgramError(f"{op.name}: {slices} input slices do not cut its {k} input columns "
                           f"into whole {SLICE_COLUMNS}-column chunks")
    if members * slices > blocks:
        raise ProgramError(f"{op.name}: a row group of {members} x {slices} instructions needs "
                           f"that many blocks; the program has {blocks}")


# input_slices=True picks each op's slices by the cost model's spread split
# (costmodel/tokens.py _tile_us, design v6-mma-split) in closed form, as token_groups.choose
# does (this module must not import the cost model: it imports the scheduler). Every term is
# L2 bytes a block moves: the input (T / c) (K / s) b, and with s > 1 the partials written and
# read, 8 s n T, and the group counter's hop, HOP_BYTES: the h200 table's hop (0.645 us) at an
# SM's share of its L2 (7.0 TB/s / 132). tests/kernel/test_input_slices.py checks both against
# the cost model.
HOP_BYTES = 34205
CHOICE_GPU, CHOICE_DESIGN = "h200", "v6-mma-split"  # the model it stands for (the tests)


def choose(plan, module, tiles: list[Instruction], members: int) -> int:
    """The input slices of ``module``'s op with ``members`` token groups: the s (a power of two
    cutting K into whole 16-column chunks, a row group of members x s within the blocks) that
    moves the fewest bytes in a step of the program's tokens, the first of equals; 1 in a
    program of one token a step (no input worth splitting)."""
    T, c = plan.tokens, members
    if T <= 1:
        return 1
    n = max((hi - lo for lo, hi in (i.tile for i in tiles)), default=0)
    k = module.input_columns(plan.config)

    def cost(s: int) -> float:
        return (T / c) * (k / s) * module.INPUT_BYTES + (HOP_BYTES + 8.0 * s * n * T
                                                          if s > 1 else 0.0)

    best = 1
    s = 2
    while s <= MAX_SLICES and k % (SLICE_COLUMNS * s) == 0 and c * s <= len(tiles):
        if cost(s) < cost(best):
            best = s
        s *= 2
    return best


def apply(plan, module, layer: int, tiles: list[Instruction], slices: int, members: int,
          min_tokens: int, counter) -> list[Instruction]:
    """``tiles`` (one op's instructions, tile k on block k, row tiles) cut into row groups of
    ``members`` x ``slices``, token groups from ``min_tokens`` tokens a step (members 1: none);
    ``counter(name)`` gives each row group its counter, called right after the op's own (the
    kernel takes group g's as the op's signal + 1 + g). Each instruction's partials' regions
    (reads, writes) and its sum's (sum_reads, sum_writes) in both modes."""
    c, s, B = members, slices, len(tiles)
    cfg = plan.config
    K, R = module.input_columns(cfg), module.tile_rows(plan)
    check(module.OP, K, s, B, c)
    m = c * s
    groups = B // m
    row_mode = Tokens(steps_hi=min_tokens if c > 1 else ANY_TOKENS)
    counters = [counter(f"L{layer}.{module.OP.name}.rows{g}") for g in range(groups)]
    out = []
    for b, ins in enumerate(tiles):
        g, member = divmod(b, m)
        own_r, own_w = module.row_accesses(plan, layer, *ins.tile)
        rest_r = [r for r in ins.reads if r not in own_r]
        rest_w = [r for r in ins.writes if r not in own_w]
        if g >= groups:  # a block past the last whole group: nothing of this op's rows
            out.append(replace(ins, tile=(0, 0), reads=rest_r, writes=rest_w, weight_bytes=0))
            continue
        lo, hi = split_even(R, groups)[g]
        i, j = divmod(member, s)
        k0, k1 = j * K // s, (j + 1) * K // s
        a, e = (lo + x for x in split_even(hi - lo, c)[i])  # row mode: rows part i
        x0, x1 = (lo + x for x in split_even(hi - lo, m)[member])  # its sum's rows
        parts = lambda r0, r1, t: [("partials", j * R + r0, j * R + r1, t)]  # noqa: E731
        reads = [(module.INPUT, k0, k1, row_mode)]
        writes = parts(a, e, row_mode)
        if c > 1:
            share = Tokens(i * TOKEN_SHARES // c, (i + 1) * TOKEN_SHARES // c, min_tokens,
                           ANY_TOKENS)
            reads.append((module.INPUT, k0, k1, share))
            writes += parts(lo, hi, share)
        out.append(replace(
            ins, tile=(x0, x1),
            group=TokenGroup(c, i, min_tokens if c > 1 else 0, (lo, hi)),
            split=InputSlice(s, j, counters[g], m),
            reads=rest_r + reads, writes=rest_w + writes,
            sum_reads=[("partials", jj * R + x0, jj * R + x1) for jj in range(s)]
            + [("residual", x0, x1)] if x1 > x0 else [],
            sum_writes=plan.residual_writes(x0, x1),
            weight_bytes=2 * (e - a) * (k1 - k0)))  # its share of the stream: part i, slice j
    return out
