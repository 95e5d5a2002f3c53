"""Steps of many tokens (issue 17), as the cost model predicts them before the kernel has them.

A step carries the tokens of one or more sequence *segments*: a decode token of each running
sequence (a segment of one token), or a chunk of a prompt (a segment of T tokens). Each segment
has the context its first token sees (positions already cached) and how many of its tokens need
logits. ``StepShape`` is that list; ``predict(..., shape=...)`` simulates the program of the
kernel as built with every op's phases widened to the step's tokens by the functions here:

- a mat-mul reads its weights once per step and multiplies them by the step's T tokens on
  tensor cores (``mma.sync`` m16n8k16: weights fill the 16-row side, tokens the 8-wide side,
  both padded), at ``GPU.mma_tflops``; the weight stream and the mma run side by side, so the
  slower of the two bounds the op;
- with row tiles every block reads its tile's input for all T tokens from L2 (the *activation
  broadcast*). 2D tiles (``tile_2d``, ``tile_split``) cut it two ways, chosen per op by cost:
  over the tokens (c groups: a block takes c x the rows for T / c tokens; the weights it shares
  with the other groups come from L2) and over the input (s slices: a block reads K / s, and
  the row group's last block to draw its ticket adds the s partial sums in a fixed order).
  Either way a token's numbers never depend on the step's other tokens (batch invariance);
- attention runs per token over its own sequence's cache: a decode token costs what the
  one-token step's attention costs at its context, spread over the blocks; a prefill chunk reads
  its sequence's K/V once for all its tokens and computes the scores on tensor cores;
- the LM head runs only for the tokens that need logits, and the step's end reduces each such
  token's partials.

Everything here is a prediction for a kernel not yet built (design ``v7``); T = 1 (no shape)
leaves every phase exactly as the one-token model computes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import takewhile

import numpy as np

from ...errors import CostModelError
from ..isa import MMA_KC, MMA_UNROLL
from . import levers
from .parts import OpBatch, Phases, hop_latency


@dataclass(frozen=True)
class Segment:
    """``tokens`` consecutive tokens of one sequence, the first at position ``context`` (that
    many positions already cached), ``logits`` of them needing logits (the last ones)."""

    context: int
    tokens: int = 1
    logits: int = 1

    def __post_init__(self):
        if self.context < 0 or self.tokens < 1 or not 0 <= self.logits <= self.tokens:
            raise CostModelError(f"bad segment {self}: need context >= 0, tokens >= 1, "
                                 "0 <= logits <= tokens")


@dataclass(frozen=True)
class StepShape:
    """The tokens of one step, by sequence segment."""

    segments: tuple[Segment, ...] = field(default_factory=tuple)

    @classmethod
    def decode(cls, batch: int, context: int) -> "StepShape":
        """``batch`` sequences each decoding one token at ``context`` cached positions."""
        if batch < 1:
            raise CostModelError(f"batch must be >= 1, got {batch}")
        return cls((Segment(context),) * batch)

    @classmethod
    def chunk(cls, start: int, tokens: int, last: bool) -> "StepShape":
        """A prompt chunk of ``tokens`` tokens at positions start..; the prompt's last chunk
        needs the logits of its last token."""
        return cls((Segment(start, tokens, 1 if last else 0),))

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.segments)

    @property
    def logits(self) -> int:
        return sum(s.logits for s in self.segments)

    @property
    def max_context(self) -> int:
        """The last position any token of the step writes, + 0 (the cache needs one more)."""
        return max(s.context + s.tokens - 1 for s in self.segments)

    @property
    def single(self) -> bool:
        """One token that needs its logits: the one-token step the kernel runs today."""
        return self.tokens == 1 and self.logits == 1


def logits_rows(shape: StepShape) -> StepShape:
    """The rows of ``shape`` that need logits, each segment's last ``logits`` tokens (a prompt
    chunk's last token, every decode row): what the last layer's ops after its K/V need to
    run (design knob ``last_layer_logits``); no segments where no row needs logits."""
    return StepShape(tuple(Segment(s.context + s.tokens - s.logits, s.logits, s.logits)
                           for s in shape.segments if s.logits))


def prefill_shapes(prompt: int, chunk: int) -> list[StepShape]:
    """The steps that prefill a ``prompt``-token prompt ``chunk`` tokens at a time."""
    if prompt < 1 or chunk < 1:
        raise CostModelError(f"prompt and chunk must be >= 1, got {prompt} and {chunk}")
    return [StepShape.chunk(s, min(chunk, prompt - s), s + chunk >= prompt)
            for s in range(0, prompt, chunk)]


def _pad(n, m: int):
    return -(-np.asarray(n) // m) * m


def mma_us(rows, k: int, tokens: int, g) -> np.ndarray:
    """Tensor-core time of a block's rows x k weights times ``tokens`` tokens (m16n8k16:
    rows and k padded to 16, tokens to 8) at the SM's share of ``mma_tflops``."""
    flops = 2.0 * _pad(rows, 16) * _pad(k, 16) * _pad(tokens, 8)
    return np.where(np.asarray(rows) > 0, flops / (g.mma_tflops * 1e6 / g.sms), 0.0)


def _tile_us(n: int, k: int, tokens: int, c: int, s: int, g, d, local_input: bool = False,
             in_bytes: int | None = None) -> tuple[float, float, float]:
    """(input, weight re-read, reduction) us of a tile that takes c times the row tile's ``n``
    rows for 1/c of the tokens and 1/s of the input: the input T/c x K/s from L2 (at
    levers.input_rate, LL words with data-as-flag hops; nothing with ``local_input``, the
    fused FFN's own h); the weights its c - 1 other token groups also read, from L2 (HBM
    streams each weight byte once, as in the row tile); ``in_bytes`` per input element
    (levers.input_bytes; default d.input_bytes); with s > 1, the row group's last block
    to draw its ticket (one L2 round) reads the s partial sums of the group's rows and writes
    their sum, in a fixed order."""
    l2_share = g.l2_bw / g.sms
    in_bytes = d.input_bytes if in_bytes is None else in_bytes
    t_in = 0.0 if local_input else \
        (tokens / c) * (k / s) * in_bytes * levers.flag_factor(d) / levers.input_rate(g, d)
    # the weights its c - 1 other token groups also read, from L2. With the spread split a
    # block multiplies its group's c x s x n rows over K / s for its T / c tokens: its own n x
    # K bytes from HBM, the other (c - 1) n K from L2 whatever s. tile_2d (v7) charges them
    # (c - 1) n K / s, as it was predicted: optimistic (benchmarks/NOTES.md, "The input split,
    # spread")
    t_w = (c - 1) * n * (k if d.input_slices_spread else k / s) * 2.0 / l2_share
    t_red = 0.0
    if s > 1 and d.input_slices_spread:
        # its s n T fp32 partials written, then after the group's counter (a hop) n T outputs'
        # s partials read and summed
        t_red = hop_latency(g, d) + 8.0 * s * n * tokens / l2_share
    elif s > 1:
        group_rows = n * c * s  # a row group: s blocks of c x n rows over K / s each
        t_red = g.ticket + g.l2_latency + (s + 1) * (tokens / c) * group_rows * 4.0 / l2_share
    return t_in, t_w, t_red


def tile_split(rows, k: int, tokens: int, g, d, in_bytes: int | None = None
               ) -> tuple[int, int]:
    """How an op's tiles split for a step of ``tokens`` tokens: (c, s), c token groups and s
    input slices per row group (c x s blocks share what one row tile of c x s x the rows
    would do). (1, 1) without ``tile_2d`` (row tiles: every block reads every token's whole
    input); else the cheapest for the op's busiest tile of c, s powers of two with c x s at
    most the blocks and token groups of 8 or more (the mma's n side). A token's outputs come from
    one block's k-loop, or from a fixed-order sum over s: never from the step's other tokens."""
    if not d.tile_2d or tokens <= 1:
        return 1, 1
    n = int(np.max(rows)) if np.size(rows) else 0

    def grid():  # c x s at most the blocks, token groups of 8 or more
        for c in (2 ** i for i in range(8)):
            if c > 1 and tokens / c < 8:
                return
            yield from ((c, s) for s in takewhile(lambda s: c * s <= len(rows),
                                                  (2 ** i for i in range(8))))

    return _cheapest(n, k, tokens, g, d, in_bytes, grid())


def spread_slices(n: int, k: int, tokens: int, c: int, g, d, in_bytes: int) -> int:
    """input_slices_spread: the input slices s (a power of two up to 16 dividing ``k`` into
    16-column chunks) that cost the least with ``c`` token groups, by _tile_us."""
    slices = (1, *takewhile(lambda s: k % (16 * s) == 0, (2, 4, 8, 16)))
    return _cheapest(n, k, tokens, g, d, in_bytes, ((c, s) for s in slices))[1]


def _cheapest(n: int, k: int, tokens: int, g, d, in_bytes: int | None,
              tiles) -> tuple[int, int]:
    """Of ``tiles`` ((c, s) pairs), the one whose _tile_us costs least (the first of equals;
    (1, 1) of none)."""
    best, best_t = (1, 1), None
    for c, s in tiles:
        t = sum(_tile_us(n, k, tokens, c, s, g, d, in_bytes=in_bytes))
        if best_t is None or t < best_t:
            best, best_t = (c, s), t
    return best


def program_groups(b: OpBatch, tokens: int) -> int:
    """The token groups' members the program gives the op's instructions for a step of
    ``tokens`` tokens (kernel/token_groups.py; the op's busiest group); 1: row tiles."""
    return max([i.group.members for i in b.instructions
                if getattr(i, "group", None) is not None and tokens >= i.group.min_tokens],
               default=1)


def program_slices(b: OpBatch) -> int:
    """The input slices the program gives the op's instructions (kernel/input_slices.py; 1:
    none)."""
    return max([i.split.slices for i in b.instructions
                if getattr(i, "split", None) is not None], default=1)


def _slice_mma_shape(b: OpBatch, T: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, tokens) each instruction of a sliced op multiplies over its K / s columns in a
    step of ``T`` tokens (megakernel.cu slice_mma): from the group's min_tokens, the row
    group's rows by its share of the tokens; below, rows part i of the group (its rows cut
    in c) by every token; a block past the last group nothing."""
    mm_rows = np.zeros(len(b.instructions))
    mm_tokens = np.full(len(b.instructions), T)
    for i, ins in enumerate(b.instructions):
        if getattr(ins, "split", None) is None:
            continue
        grp = ins.group
        lo, hi, c, j = grp.tile[0], grp.tile[1], grp.members, grp.index
        if c > 1 and T >= grp.min_tokens:
            mm_rows[i], mm_tokens[i] = hi - lo, -(-T // c)
        else:
            mm_rows[i] = (j + 1) * (hi - lo) // c - j * (hi - lo) // c
    return mm_rows, mm_tokens


def widen_matmul(b: OpBatch, g, d, ph: Phases, k: int, rows=None, tokens: int | None = None,
                 out_bytes: float = 8.0) -> Phases:
    """A mat-mul op's one-token phases for the step's tokens (b.shape): the same HBM weight
    stream; the tensor-core time as a floor under it; every token's input read from L2 and the
    2D tiles' extra costs (``tile_split``). ``rows``: the rows each instruction multiplies
    (default its tile); ``tokens``: how many tokens it multiplies (default all of the step's)."""
    shape = b.shape
    if shape is None or shape.single:
        return ph
    T = shape.tokens if tokens is None else tokens
    rows = b.n if rows is None else np.asarray(rows)
    if T == 0:  # nothing to multiply (the LM head of a chunk that needs no logits)
        z = np.zeros(len(rows))
        return Phases(z, z.copy(), z.copy(), z.copy(), z.copy(), z.copy())
    if d.token_loop and not d.tensor_cores:
        return _token_loop(ph, T, g)
    if not d.tensor_cores:
        raise CostModelError(f"design {d.name} has no tensor cores nor a token loop: a step "
                             f"of {T} tokens is not modelled on it")
    busy = (rows > 0).astype(np.float64)
    sliced = program_slices(b)
    if sliced > 1:  # the program's input slices, as built (slice_mma): the spread split's costs
        d = d.replace(input_slices_spread=True)
    fused = levers.fused_down(b, d)
    n = int(np.max(rows)) if len(rows) else 0
    if fused:  # the token groups of the block's GATE_UP, whose h rows it multiplies
        F, B = b.program.config.intermediate_size, len(rows)
        c, s = tile_split(np.full(B, 2 * -(-F // B)), b.program.config.hidden_size, T, g, d)
        s = 1
    elif d.tile_2d:
        c, s = tile_split(rows, k, T, g, d, levers.input_bytes(b, d))
    else:
        c, s = program_groups(b, T), sliced
        if sliced == 1 and d.input_slices_spread and not levers.rms_input(b):
            # (an RMS op norms whole rows)
            s = spread_slices(n, k, T, c, g, d, levers.input_bytes(b, d))
    t_in, t_w, t_red = _tile_us(n, k, T, c, s, g, d, local_input=fused,
                                in_bytes=levers.input_bytes(b, d))
    mm_rows, mm_tokens = rows, np.full(len(rows), T)
    if sliced > 1:
        mm_rows, mm_tokens = _slice_mma_shape(b, T)
    elif c > 1 and not (fused or d.tile_2d):  # a member multiplies its group's rows by its share
        mm_rows, mm_tokens = _group_mma_shape(b, rows, T)
    compute = mma_us(mm_rows, k // sliced, mm_tokens, g) \
        + (ph.compute if ph.compute is not None else 0.0)
    if d.input_slices_spread and sliced == 1:  # a block's rows: its group's s row tiles' over K / s
        mm_rows = mm_rows * s
    t_again, rounds = _passes(mm_rows, k / s, mm_tokens, g, d, levers.input_bytes(b, d),
                              local_input=fused, rms=levers.rms_input(b),
                              staged=levers.rms_staged(b, d, mm_tokens))
    rolling = ph.rolling
    if d.mma_rows_prefetch:
        # block_mma_rows' walk (_passes' rounds: the row split's) prefetches a row group's next
        # k range into L2 as it starts one: each row group's rounds but its first range's wait
        # on L2, where the walk is what bounds the instruction's rounds
        chunks = -(-int(k / s) // MMA_KC)
        first = -(-(chunks // d.warps) // d.mma_rows_split_unroll)
        walk = rows_walk(chunks, d.warps, d.mma_rows_split_unroll)
        walked = (rounds > 0) & (rounds >= ph.rounds)
        rolling = np.where(walked, 1.0 - first / max(walk, 1), 0.0 if rolling is None else rolling)
    if fused:  # its partial of every residual row for its T / c tokens, by atomics
        epilogue = busy * levers.atomic_us(b.program.config.hidden_size, T / c, g)
    else:  # the tile's outputs per token: written once (the residual's rows read and written)
        epilogue = busy * T * rows * out_bytes * levers.output_factor(b, d) / (g.l2_bw / g.sms)
    copy_rounds, copy_bytes = levers.residual_copy(b, d)
    if sliced > 1:  # the sum stores residual_in in its own loop: 2 bytes an output, no pass
        copy_rounds, copy_bytes = 0, 2.0
    epilogue = epilogue + busy * T * rows * copy_bytes / (g.l2_bw / g.sms)
    reads = busy * (t_in + t_w) + t_again  # its L2 reads: after the stream (loads a round)
    # ... or beside the mma, with the stream's bytes through the same L2 share (a ring):
    # every mat-mul's (mma_l2_overlap), the row split's (mma_rows_l2_overlap), the k split's
    # of an unsliced op (mma_k_ring: slice_mma's k split keeps its loads in registers)
    ring = d.mma_l2_overlap | (d.mma_rows_l2_overlap & rows_split(k / s, mm_tokens, d)) \
        | (d.mma_k_ring & (sliced == 1))
    if np.any(ring):
        floor = reads + np.asarray(ph.stream_bytes, np.float64) / (g.l2_bw / g.sms)
        compute = np.where(ring, np.maximum(compute, floor), compute)
        reads = np.where(ring, 0.0, reads)
    return Phases(ph.l2_trips + busy * copy_rounds, ph.hbm_trips,
                  ph.other_us + reads + busy * t_red + epilogue,
                  np.maximum(ph.rounds, rounds), ph.stream_bytes, ph.prefetch_bytes, ph.early, ph.issue,
                  compute, (c, s), rolling=rolling)


def _passes(rows, k: float, tokens, g, d, in_bytes: int, local_input: bool = False,
            rms: bool = False, staged=False) -> tuple[np.ndarray, np.ndarray]:
    """(L2 us, dependent rounds) of block_mma's passes (``mma_token_tiles``): a block's
    ``rows`` x k weights again for every pass over its ``tokens`` after the first (the first
    is the op's HBM stream), and with more than one row pass the token pass's inputs again on
    every row pass after the first when they are past ``l1_input_bytes``. A pass splits the
    k-loop over the warps (``mma_token_tiles`` token tiles x ``mma_pass_rows`` rows, each warp
    its k range: ~C / (warps x MMA_UNROLL) rounds) or, in a step of more than
    ``mma_rows_split_above`` tokens, the rows (a row group of 16 a warp,
    ``mma_rows_split_tiles`` token tiles, each warp every k range in turn: C /
    ``mma_rows_split_unroll`` rounds). (0, 0) where the design reads each
    once (``mma_token_tiles`` 0). An RMS op's (``rms``) mma_rms reads its rows first (the
    one read the caller charges): the share of its rows ``staged`` (levers.rms_staged) reads
    nothing more (the passes read shared memory); the others' first pass reads them again,
    from L2 where they are past ``l1_input_bytes``."""
    rows = np.asarray(rows, np.float64)
    tokens = np.asarray(tokens, np.float64)
    if not d.mma_token_tiles:
        return np.zeros_like(rows), np.zeros_like(rows)
    chunks = -(-int(k) // MMA_KC)
    by_rows = rows_split(k, tokens, d) & np.ones(len(rows), bool)
    per_pass = np.where(by_rows, 8 * d.mma_rows_split_tiles, 8 * d.mma_token_tiles)
    pass_rows = np.where(by_rows, 16 * d.warps, d.mma_pass_rows)
    walk = np.where(by_rows, rows_walk(chunks, d.warps, d.mma_rows_split_unroll),
                    np.ceil(chunks / d.warps / MMA_UNROLL))
    l2_share = g.l2_bw / g.sms
    token_passes = np.ceil(tokens / per_pass)
    weights = np.maximum(token_passes - 1, 0) * rows * k * 2.0 / l2_share
    row_passes = np.ceil(rows / pass_rows)
    pass_in = np.minimum(tokens, per_pass) * k * in_bytes
    # the rows passes read from L2 or L1 (an RMS op's staged share reads shared memory)
    unstaged = 1.0 - np.asarray(staged, np.float64) * rms
    again = (row_passes > 1) & (pass_in * unstaged > d.l1_input_bytes) & (not local_input)
    reads = np.where(again, row_passes - 1, 0.0)
    if rms:  # mma_rms read them first: the first pass again, unless L1 still holds them
        reads = reads + (tokens * unstaged * k * in_bytes > d.l1_input_bytes)
    inputs = reads * tokens * unstaged * k * in_bytes * levers.flag_factor(d) \
        / levers.input_rate(g, d)
    rounds = np.where(by_rows, row_passes * token_passes * walk, 0.0)
    busy = rows > 0
    return np.where(busy, weights + inputs, 0.0), np.where(busy, rounds, 0.0)


def rows_split(k: float, tokens, d) -> np.ndarray:
    """Whether block_mma's passes over ``k`` input columns and ``tokens`` tokens (an array:
    each instruction's) split the rows over the warps (block_mma_rows: a step of more than
    ``mma_rows_split_above`` tokens, k at most ``mma_rows_split_max_k``)."""
    split = d.mma_rows_split_above > 0 and k <= d.mma_rows_split_max_k
    return np.asarray(tokens) > d.mma_rows_split_above if split \
        else np.zeros(np.shape(tokens), bool)


def rows_walk(chunks: int, warps: int, unroll: int) -> int:
    """Dependent rounds of a warp's walk in block_mma_rows: block_mma's k ranges (warp r's:
    chunks [r C / warps, (r + 1) C / warps)) one after the other, ``unroll`` chunks a round
    in each."""
    return sum(-(-((r + 1) * chunks // warps - r * chunks // warps) // unroll)
               for r in range(warps))


def _group_mma_shape(b: OpBatch, rows: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, tokens) each instruction's mma multiplies in a step of ``T`` tokens: a token
    group's member (megakernel.cu token_group) its group's rows (its tile's ``rows`` scaled
    by the group's tile over its own) by its share of the tokens, at most ceil(T / members);
    an instruction of a smaller step than its group's min_tokens, or of none, its own rows by
    all T (mma pads rows to 16 and tokens to 8: the group's fewer, larger fragments)."""
    mm_rows = np.asarray(rows, np.float64).copy()
    mm_tokens = np.full(len(mm_rows), T)
    for i, ins in enumerate(b.instructions):
        grp = getattr(ins, "group", None)
        own = ins.tile[1] - ins.tile[0]
        if grp is None or grp.members <= 1 or T < grp.min_tokens or own <= 0:
            continue
        mm_rows[i] = mm_rows[i] * (grp.tile[1] - grp.tile[0]) / own
        mm_tokens[i] = -(-T // grp.members)
    return mm_rows, mm_tokens


def _token_loop(ph: Phases, T: int, g) -> Phases:
    """The token loop (``token_loop``): the op's one-token work again for each token after
    the first, its weights from L2 (their rounds at L2 latency, or the SM's L2 share), its
    own trips and fixed work (the norm's residual, the reductions) again."""
    l2_share = g.l2_bw / g.sms
    issue = ph.issue if ph.issue is not None else 0.0
    again = np.maximum(ph.rounds * g.l2_latency + issue, ph.stream_bytes / l2_share) \
        + ph.other_us + ph.l2_trips * g.l2_latency + ph.hbm_trips * g.hbm_latency
    return Phases(ph.l2_trips, ph.hbm_trips, ph.other_us + (T - 1) * again, ph.rounds,
                  ph.stream_bytes, ph.prefetch_bytes, ph.early, ph.issue, ph.compute)


def widen_attention(b: OpBatch, g, d, one_token) -> Phases:
    """ATTENTION for the step's tokens. ``one_token(batch)`` is the op's one-token cost at
    ``batch.context``, per instruction. A decode token (a segment of one) costs the one-token
    units at its context; a prefill chunk of T tokens reads its sequence's K/V once (the units
    at its last token's context) and computes T x G queries per KV head on tensor cores.

    The program deals its (KV head, split) units over the blocks once, the same for every row
    (ops/attention.py ``units``): an instruction runs its units for every row of the step, so
    its cost is the sum over the rows of its own units' costs, and the op ends with its
    busiest instruction. (Before 2026-12-02, fifth session, the model spread the step's units
    evenly over the blocks: at short contexts every row's work sits on the few blocks holding
    the used splits, so that was several times optimistic; benchmarks/NOTES.md.) Up to
    ``attn_units_in_flight`` units of an instruction run side by side: their dependent trips
    and fixed work overlap k ways; their bytes do not."""
    shape = b.shape
    if shape is None or (shape.single and not d.tensor_cores):
        return one_token(b, g, d)
    c = b.program.config
    n = len(b.lo)
    zero = np.zeros(n)
    tot = {k: zero.copy() for k in ("l2", "hbm", "other", "rounds", "bytes", "pref")}
    flops = 0.0
    cache: dict[int, Phases] = {}
    segments = shape.segments
    if not d.attn_tensor_cores:  # CUDA cores: every token is its own pass over its context
        segments = tuple(Segment(s.context + i) for s in segments for i in range(s.tokens))
    for seg in segments:
        ctx = seg.context + seg.tokens - 1  # the last token's context: the most K/V
        if ctx not in cache:
            cache[ctx] = one_token(OpBatch(b.program, ctx, b.layer, b.lo, b.hi, b.weight_bytes,
                                           b.instructions), g, d)
        one = cache[ctx]
        for key, arr in (("l2", one.l2_trips), ("hbm", one.hbm_trips), ("other", one.other_us),
                         ("rounds", one.rounds), ("bytes", one.stream_bytes),
                         ("pref", one.prefetch_bytes)):
            tot[key] += np.asarray(arr, dtype=np.float64)
        if seg.tokens > 1:
            # the chunk's queries (T x G per KV head) against its context: QK and PV on
            # tensor cores (the one-token units' compute stays for the softmax and the merge)
            flops += 4.0 * c.num_heads * c.head_dim * seg.tokens * (seg.context + seg.tokens / 2)
    busy = b.busy()
    # an instruction's units of the step: its (KV head, split) units once per segment
    mine = b.n.astype(np.float64) * len(segments)
    k = np.maximum(np.minimum(d.attn_units_in_flight, mine), 1.0)
    serial = np.ceil(mine / k) / np.maximum(mine, 1.0)  # of its units' dependent trips
    rounds = tot["rounds"]
    if d.kv_bytes_in_flight:
        rounds = np.ceil(tot["bytes"] / d.kv_bytes_in_flight)
    # the chunks' tensor-core work, shared by the instructions in proportion to their units
    share = b.n / max(float(b.n.sum()), 1.0) * len(np.unique(b.layer))
    compute = busy * flops * share / (g.mma_tflops * 1e6 / g.sms)
    return Phases(tot["l2"] * serial, tot["hbm"] * serial, tot["other"] / k, rounds * busy,
                  tot["bytes"], tot["pref"], compute=compute)


def step_end_extra_us(shape: StepShape | None, g, d) -> float:
    """The step's end for many logits rows (megakernel.cu lm_head_ticket, finish_rows), past
    the one row step_end_us charges: the reducer's warps draw the rows, a row a warp round
    (an L2 round of its partials, the warp's shuffles); then finish_rows hands every row's
    token on: one thread a row after another (finish_rows_parallel False: two dependent L2
    trips a row, its drawn token, then its slot's stop mask), or a thread a row at once and
    a block scan for the next table's order."""
    if shape is None or shape.single or shape.logits == 0:
        return 0.0
    rounds = -(-shape.logits // d.warps)
    t = (rounds - 1) * (g.l2_latency + 10 * g.shfl)
    if d.finish_rows_parallel:
        return t + 2 * g.bar_sync + 10 * g.shfl
    return t + (shape.logits - 1) * 2 * g.l2_latency
