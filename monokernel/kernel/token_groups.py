"""Token groups: in a big step, a mat-mul's blocks share their rows and split the tokens.

With row tiles every block multiplies its own rows by every token of the step, so every block
reads the op's whole input, T tokens x K columns, from L2: at 64 tokens that activation
broadcast is more L2 traffic than the weights (benchmarks/NOTES.md "Token groups"). In a
group, c consecutive instructions of an op take the union of their tiles (the group's rows)
for a share of the step's tokens each, member j the tokens [j n / c, (j + 1) n / c) of a step
of n: a block reads c times less input, and the group's rows, c times its own, of which the
c - 1 other members' come from L2 (each member still prefetches its own tile: HBM streams
every weight byte once). A token's numbers do not change: its rows' k-loops are the same
whichever block runs them, and mma's token columns are independent (megakernel.cu
token_group), so a sequence's logits stay bitwise what they are in row tiles.

How many members: ``choose``'s closed form (schedule(token_groups=True)); the tensor-core
executor, ``monokernel plan`` and prepare take the cost model's picks instead (group_picks.py:
each op's c on a one-layer copy of the model, the cheapest predicted step, passed to schedule
as a dict {Op: c}), whose ``min_tokens`` is the closed form's threshold for that c. The
closed form counts bytes only, where the model also counts the walks'
rounds at L2 and HBM latency. ``choose``: both costs are L2 bytes a block moves, so the choice
needs no GPU table: per input column r T b / c (the input, b bytes an element as the blocks
read it, r times: ``input_reads``, once a row pass of block_mma and once more in an RMS op's
mma_rms unless its share is staged in shared memory) + 2 (c - 1) n (the other members' weight
rows, n the op's busiest tile's), the cheapest power of two c <= MAX_MEMBERS with at least
MIN_SHARE tokens a member (the mma's 8-token side). A step runs in groups when it has at least
``min_tokens`` tokens, the fewest from which c beats row tiles at every step size up to the
program's (with r = 1: T b (1 - 1 / c) > 2 (c - 1) n, T > 2 n c / b) and MIN_SHARE c; a smaller
step, one token among them, runs in row tiles as before. The last group of an op whose
instructions do not divide by c has fewer members (a group of one: its own tile, every token).

Only a tensor-core kernel of slots runs them (schedule(token_groups=True or a dict): the
executor's tensor_cores programs); its mat-mul ops are RMS_QKV_ROPE, O_PROJ_RESIDUAL, RMS_GATE_UP and
DOWN_RESIDUAL (the LM head keeps row tiles: its per-tile partials are the step's end's). Each
op module says its input bytes (INPUT_BYTES), weight rows a tile row (WEIGHT_ROWS), the op's
tile rows (tile_rows) and a tile's accesses for one token (row_accesses); an instruction's
regions then say which tokens and steps each covers (program.Tokens), so verify() proves both
modes.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import ProgramError
from .isa import MMA_RG, MMA_ROWS_SPLIT_ABOVE, MMA_ROWS_SPLIT_MAX_K, NUM_THREADS, Op, field
from .program import ANY_TOKENS, TOKEN_SHARES, Instruction, Tokens, TokenGroup

GROUPED_OPS = (Op.RMS_QKV_ROPE, Op.O_PROJ_RESIDUAL, Op.RMS_GATE_UP, Op.DOWN_RESIDUAL)
MIN_SHARE = 8  # tokens a member takes at least (mma m16n8k16: 8 tokens a fragment)
MAX_MEMBERS = 8  # (TOKEN_SHARES divides by every group size up to it)
# the most min_tokens Word.GROUP holds (isa.PACKED_WORDS: the slices' bits above it)
MAX_MIN_TOKENS = field("GROUP", "MIN_TOKENS").most


def input_reads(share: int, rows: int, k: int, staged: int | None = None) -> int:
    """How many times a block reads its share of ``share`` tokens' input (megakernel.cu
    block_mma) multiplying ``rows`` weight rows of ``k`` columns: once a row pass (the k
    split's passes take 16 x MMA_RG rows; the row split's, in a share of more than
    MMA_ROWS_SPLIT_ABOVE rows at k <= MMA_ROWS_SPLIT_MAX_K, 16 a warp); an RMS op (``staged``
    not None) reads them first in mma_rms, and a share of at most ``staged`` rows there only
    (its passes read shared memory). A larger share is charged as unstaged, though mma_rms
    stages its first ``staged`` rows (the cost model's levers.rms_staged counts them; the
    served shapes' picks at 64 and 128 tokens leave every grouped RMS share within the stage,
    at 256 Llama-3.2-1B's QKV (64) and GATE_UP (128) shares pass its 33: benchmarks/NOTES.md,
    "Steps of 256 tokens"). What L1 keeps between passes is not counted."""
    if staged is not None and share <= staged:
        return 1
    by_rows = share > MMA_ROWS_SPLIT_ABOVE and k <= MMA_ROWS_SPLIT_MAX_K
    passes = -(-rows // (16 * (NUM_THREADS // 32 if by_rows else MMA_RG)))
    return passes + (staged is not None)


def choose(tokens: int, input_bytes: int, rows: int, blocks: int, k: int | None = None,
           staged: int | None = None) -> tuple[int, int]:
    """(members c, min_tokens) of an op whose busiest tile has ``rows`` weight rows, for a
    program of ``tokens`` tokens a step; (1, 0): row tiles always. With ``k`` (the op's input
    columns) a member's input is charged ``input_reads`` times (``staged``: an RMS op's
    staged rows), else once; min_tokens is the fewest tokens from which the groups cost less
    than row tiles at every step size up to the program's."""
    cost = _bytes(input_bytes, rows, k, staged)
    best, best_cost = 1, cost(1, tokens)
    c = 2
    while c <= min(MAX_MEMBERS, blocks) and tokens >= MIN_SHARE * c:
        if cost(c, tokens) < best_cost:
            best, best_cost = c, cost(c, tokens)
        c *= 2
    return (1, 0) if best == 1 else (best, _threshold(cost, best, tokens))


def _bytes(input_bytes: int, rows: int, k: int | None, staged: int | None):
    """choose's cost: L2 bytes a member moves per input column, c members, a step of t."""
    def cost(c: int, t: int) -> float:
        share = -(-t // c)
        reads = 1 if k is None else input_reads(share, c * rows, k, staged)
        return reads * t * input_bytes / c + 2.0 * (c - 1) * rows
    return cost


def _threshold(cost, c: int, tokens: int) -> int:
    """min_tokens of c members: the fewest tokens from which they cost less than row tiles
    at every step size up to ``tokens`` (at least MIN_SHARE a member; ``tokens`` itself where
    they never do by ``cost``: a pick of the model's runs in groups at the program's full
    step only), at most MAX_MIN_TOKENS."""
    t = tokens
    while t - 1 >= MIN_SHARE * c and cost(c, t - 1) < cost(1, t - 1):
        t -= 1
    return min(t, MAX_MIN_TOKENS)


def candidates(tokens: int, blocks: int) -> list[int]:
    """The members an op may take in a program of ``tokens`` tokens a step on ``blocks``."""
    out, c = [1], 2
    while c <= min(MAX_MEMBERS, blocks) and tokens >= MIN_SHARE * c:
        out.append(c)
        c *= 2
    return out


def members_of(plan, module, tiles: list[Instruction],
               members: int | tuple[int, int] | dict | None = None) -> tuple[int, int]:
    """(members c, min_tokens) of the op's token groups (``apply``): by ``choose`` for
    ``plan.tokens``; or as ``members`` asks: a dict {Op: c} (group_picks.pick's; an op not in it by
    ``choose``) c members from the closed form's threshold for c, 1 row tiles; or (the
    tests) an int or (members, min_tokens) for every op."""
    busiest = max((hi - lo for lo, hi in (i.tile for i in tiles)), default=0)
    rows = busiest * module.WEIGHT_ROWS
    if members is None or isinstance(members, dict):
        staged = None
        if getattr(module, "RMS_INPUT", False):  # mma_rms's staged rows
            from .header import rms_stage_rows

            staged = rms_stage_rows(plan.config, plan.tokens, True)
        k = module.input_columns(plan.config)
        picked = None if members is None else members.get(module.OP)
        if picked is None:
            return choose(plan.tokens, module.INPUT_BYTES, rows, len(tiles), k, staged)
        if picked not in candidates(plan.tokens, len(tiles)):
            raise ProgramError(f"{module.OP.name} in token groups of {picked}: a program of "
                               f"{plan.tokens} tokens on {len(tiles)} blocks takes "
                               f"{candidates(plan.tokens, len(tiles))}")
        if picked == 1:
            return 1, 0
        return picked, _threshold(_bytes(module.INPUT_BYTES, rows, k, staged), picked,
                                  plan.tokens)
    c, min_tokens = members if isinstance(members, tuple) else (members, MIN_SHARE * members)
    if not 1 <= c <= min(MAX_MEMBERS, len(tiles)) or not c <= min_tokens <= MAX_MIN_TOKENS:
        raise ProgramError(f"token groups of {c} members from {min_tokens} tokens: need "
                           f"1..{min(MAX_MEMBERS, len(tiles))} members (at most "
                           f"{MAX_MEMBERS}, at most the blocks) and at least a token each, "
                           f"from at most {MAX_MIN_TOKENS} tokens")
    return c, min_tokens


def _tagged(regions, tokens: Tokens) -> list:
    return [(r[0], r[1], r[2], tokens) for r in regions]


def apply(plan, module, layer: int, tiles: list[Instruction],
          members: int | tuple[int, int] | dict | None = None) -> list[Instruction]:
    """``tiles`` (one op's instructions, tile k on block k) with their token groups: c by
    ``choose`` for ``plan.tokens``, or the dict's (``members_of``); an int (the tests): that
    many, in steps of at least MIN_SHARE x that many tokens, or (members, min_tokens). Each instruction's regions in
    both modes."""
    c, min_tokens = members_of(plan, module, tiles, members)
    if c <= 1 or plan.tokens < min_tokens:
        return tiles
    rows_mode = Tokens(steps_hi=min_tokens)
    out = []
    for g0 in range(0, len(tiles), c):
        group = tiles[g0:g0 + c]
        if any(a.tile[1] != b.tile[0] for a, b in zip(group, group[1:])):
            raise ProgramError(f"{group[0].op.name} tiles {[i.tile for i in group]} are not "
                               "consecutive: no token groups")
        lo, hi = group[0].tile[0], group[-1].tile[1]
        end_bits = field("GROUP_TILE", "END").bits  # Word.GROUP_TILE (isa.PACKED_WORDS)
        if hi >= 1 << end_bits:
            raise ProgramError(f"{group[0].op.name} has {hi} tile rows: token groups take "
                               f"fewer than {1 << end_bits}")
        for j, ins in enumerate(group):
            own_r, own_w = module.row_accesses(plan, layer, *ins.tile)
            grp_r, grp_w = module.row_accesses(plan, layer, lo, hi)
            m = len(group)
            share = Tokens(j * TOKEN_SHARES // m, (j + 1) * TOKEN_SHARES // m, min_tokens,
                           ANY_TOKENS)
            rest_r = [r for r in ins.reads if r not in own_r]
            rest_w = [r for r in ins.writes if r not in own_w]
            out.append(replace(
                ins, group=TokenGroup(m, j, min_tokens, (lo, hi)),
                reads=rest_r + _tagged(own_r, rows_mode) + _tagged(grp_r, share),
                writes=rest_w + _tagged(own_w, rows_mode) + _tagged(grp_w, share)))
    return out
