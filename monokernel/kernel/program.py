"""A Program: per-block instruction queues, counters and buffers, and its proof.

Every instruction declares the buffer regions it reads and writes; ``Program.verify()`` proves
from those declarations that the waits and signals order every conflicting pair of accesses,
that no wait can hang, and that every step ends after all its work. schedule.py builds the
programs (each op tiles itself: kernel/ops/); the executors and the cost model read them.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

from ..model.config import ModelConfig
from ..errors import ProgramError
from .isa import WIDTH, Op, Word, pack

# Accesses the hazard check holds at once (verify(): ~40 bytes each)
PAIRS = 1 << 21
# Bumped when verify() gains a check: on-disk proofs of older versions no longer count.
VERIFY_VERSION = 4


# A region of a buffer, in elements: (buffer name, lo, hi) of every token's row, or (buffer
# name, lo, hi, Tokens) of some of them in some steps (a token group's: token_groups.py).
Region = tuple


# A token group's share of a step's tokens, in TOKEN_SHARES-ths (lcm(1..8): every share j / c
# of c <= 8 members is whole).
TOKEN_SHARES = 840
# Steps of more tokens than any program has.
ANY_TOKENS = 1 << 30


@dataclass(frozen=True)
class Tokens:
    """Which of a step's n tokens a region covers, and in which steps: the tokens [share_lo n
    / TOKEN_SHARES, share_hi n / TOKEN_SHARES) (integer division, as the kernel splits them)
    of the steps of n in [steps_lo, steps_hi) tokens. Two regions of one buffer conflict only
    where their rows, their shares and their steps all overlap: shares that do not overlap
    take disjoint tokens in every step (the split points are monotone in the share)."""

    share_lo: int = 0
    share_hi: int = TOKEN_SHARES
    steps_lo: int = 1
    steps_hi: int = ANY_TOKENS

    def overlaps(self, other: "Tokens") -> bool:
        return (self.share_lo < other.share_hi and other.share_lo < self.share_hi
                and self.steps_lo < other.steps_hi and other.steps_lo < self.steps_hi)


ALL_TOKENS = Tokens()


def region_tokens(r: Region) -> Tokens:
    """The tokens and steps a region covers (every token of every step unless it says)."""
    return r[3] if len(r) > 3 else ALL_TOKENS


@dataclass(frozen=True)
class TokenGroup:
    """An instruction's token group (token_groups.py): in a step of at least ``min_tokens``
    tokens (the same for every instruction of the op) it multiplies the group's rows ``tile``
    (its ``members`` instructions' tiles together) by its share of the step's tokens, [index
    n / members, (index + 1) n / members); in a smaller step, its own tile by every token."""

    members: int
    index: int
    min_tokens: int
    tile: tuple[int, int]

    def words(self) -> tuple[int, int]:
        """(Word.GROUP, Word.GROUP_TILE) (isa.PACKED_WORDS)."""
        return (pack("GROUP", members=self.members, index=self.index,
                     min_tokens=self.min_tokens),
                pack("GROUP_TILE", begin=self.tile[0], end=self.tile[1]))


@dataclass(frozen=True)
class InputSlice:
    """An instruction's input slice (kernel/input_slices.py): one of a row group's
    ``members`` instructions (c token shares x ``slices`` input slices), its slice ``index``
    of the op's input columns. It writes its fp32 partials, signals the group's ``counter``,
    waits for the group's ``members`` signals and sums its own rows' partials in slice order
    (Instruction.sum_reads / sum_writes)."""

    slices: int
    index: int
    counter: int
    members: int

    def bits(self) -> int:
        """Its fields of Word.GROUP (isa.PACKED_WORDS): log2 of the slices, the slice."""
        return pack("GROUP", slices_log2=self.slices.bit_length() - 1, slice=self.index)


@dataclass
class Instruction:
    op: Op
    layer: int = 0
    tile: tuple[int, int] = (0, 0)
    wait: tuple[int, int] | None = None  # (counter, signals per step)
    signal: int | None = None
    args: tuple[int, ...] = ()  # the op's named argument words in order (ops.args(op))
    reads: list[Region] = field(default_factory=list)
    writes: list[Region] = field(default_factory=list)
    weight_bytes: int = 0  # bytes of weights this instruction streams
    # its token group (a mat-mul of a tensor-core kernel's program built with token groups;
    # its regions then say which tokens each covers); None: its tile, every token, every step
    group: TokenGroup | None = None
    # An atomic-ticket reduction (RMS_LM_HEAD; ATTENTION's merge): after its own work the
    # instruction takes a ticket on counter ticket[0]; the block that draws the last of
    # ticket[1] tickets of the step runs the tail, which reads tail_reads and writes
    # tail_writes. verify() sees the tail as an instruction right after this one that waits for
    # every ticket; the tails of one ticket are mutually exclusive (one block runs its tail).
    # (ATTENTION in a kernel of slots draws a ticket per row: ops/attention.py says why this
    # view of it is sound.)
    ticket: tuple[int, int] | None = None
    tail_reads: list[Region] = field(default_factory=list)
    tail_writes: list[Region] = field(default_factory=list)
    # An input slice (O_PROJ / DOWN of a program with input_slices): reads / writes say its
    # partials' part, sum_reads / sum_writes what it does after the wait on its group's counter
    # (verify() sees two parts, as a ticket's main part and tail; every member runs its sum)
    split: InputSlice | None = None
    sum_reads: list[Region] = field(default_factory=list)
    sum_writes: list[Region] = field(default_factory=list)
    # for verify()'s expanded view: the queue index to report, the part, exclusive ticket
    at: int | None = None
    part: str = ""
    exclusive: int | None = None

    def serialize(self) -> np.ndarray:
        w = np.zeros(WIDTH, np.int32)
        w[Word.OP] = int(self.op)
        w[Word.LAYER] = self.layer
        w[Word.TILE_BEGIN], w[Word.TILE_END] = self.tile
        w[Word.WAIT_COUNTER], w[Word.WAIT_COUNT] = self.wait if self.wait else (-1, 0)
        w[Word.SIGNAL_COUNTER] = -1 if self.signal is None else self.signal
        for k, a in enumerate(self.args):
            w[Word.ARG0 + k] = a
        if self.group is not None:
            w[Word.GROUP], w[Word.GROUP_TILE] = self.group.words()
        if self.split is not None:
            w[Word.GROUP] |= self.split.bits()
        return w

    def arg(self, name: str) -> int:
        """The argument word ``name`` of this instruction's op (kernel/ops/<op>.py ARGS)."""
        from . import ops

        k = ops.args(self.op).word(name) - Word.ARG0
        return self.args[k] if k < len(self.args) else 0

    def label(self, block: int, index: int) -> str:
        index = index if self.at is None else self.at
        return (f"block {block} #{index} {self.op.name}(layer {self.layer}, tiles "
                f"{self.tile[0]}:{self.tile[1]}){self.part}")

    @property
    def empty(self) -> bool:
        return self.tile[0] >= self.tile[1]


NOOP = Instruction(Op.NOOP)


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) cut into ``parts`` contiguous ranges whose sizes differ by at most one."""
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


@dataclass
class Program:
    config: ModelConfig
    num_blocks: int
    max_seq_len: int
    queues: list[list[Instruction]]
    counter_names: list[str]
    attn_splits: int
    lm_partials: int
    attn_min_chunk: int = 1  # fewest positions per attention split
    # a step using at least this many splits merges them once per KV group, by ticket, in
    # ATTENTION (isa.merge_ticket_min_splits); 0: every O_PROJ block merges them itself
    merge_ticket_min: int = 0
    # the most tokens a step carries (positions POS..POS+NTOK-1 of one sequence: a prompt
    # chunk); every per-token activation buffer has this many rows. Instructions and their
    # regions are per token row: an op touches the same columns of each token's row (of the
    # tokens its region's Tokens say: a token group's share), and no op reads another
    # token's row but through a counter (K/V of the chunk's positions: RMS_QKV_ROPE ->
    # ATTENTION; the LM head reads the last row), so verify() of the queues proves every row.
    tokens: int = 1
    # for a tensor-core kernel (MK_MMA): its regions include the residual's bf16 copy
    # (residual_in), written beside the residual and read by the RMS ops
    tensor_cores: bool = False

    @property
    def max_len(self) -> int:
        return max(len(q) for q in self.queues)

    @property
    def num_counters(self) -> int:
        return len(self.counter_names)

    def words(self) -> np.ndarray:
        """int32 [blocks, max_len, WIDTH], padded with NOOP."""
        out = np.zeros((self.num_blocks, self.max_len, WIDTH), np.int32)
        for b, q in enumerate(self.queues):
            for i, ins in enumerate(q):
                out[b, i] = ins.serialize()
        return out

    def slots(self) -> list[tuple[Op, int, int, int]]:
        """Aligned slot ranges: (op, layer, begin, end) in queue order, for the baseline."""
        out: list[tuple[Op, int, int, int]] = []
        for i in range(self.max_len):
            ops = {(q[i].op, q[i].layer) for q in self.queues if i < len(q) and q[i].op != Op.NOOP}
            if len(ops) != 1:
                raise ProgramError(f"slot {i} is not aligned across blocks: {sorted(ops)}")
            op, layer = ops.pop()
            if out and out[-1][0] == op and out[-1][1] == layer and out[-1][3] == i:
                out[-1] = (op, layer, out[-1][2], i + 1)
            else:
                out.append((op, layer, i, i + 1))
        return out

    def buffer_sizes(self) -> dict[str, int]:
        """Elements of each activation buffer the program touches."""
        c, T = self.config, self.tokens
        return {
            "residual": T * c.hidden_size, "q": T * c.q_dim,
            "attn_o": T * c.num_kv_heads * self.attn_splits * c.group_size * c.head_dim,
            "attn_ml": T * c.num_kv_heads * self.attn_splits * c.group_size * 2,
            **({"attn": T * c.q_dim} if self.merge_ticket_min else {}),
            "ffn_h": T * c.intermediate_size, "logits": c.vocab_size,
            "lm_part": self.lm_partials * 2, "out_tokens": self.max_seq_len,
            **({"k_raw": T * c.kv_dim} if c.qk_norm else {}),
            **({"residual_in": T * c.hidden_size} if self.tensor_cores else {}),
            **({"partials": T * c.hidden_size * self.input_slices}
               if self.input_slices > 1 else {}),
        }

    def slices_of(self, op: Op) -> int:
        """The input slices of ``op``'s instructions (input_slices.py; 1: none): one number
        an op, which the kernel is compiled with (MK_O_PROJ_SLICES, MK_DOWN_SLICES)."""
        mine = [ins for q in self.queues for ins in q if ins.op == op]
        got = {ins.split.slices for ins in mine if ins.split is not None}
        if len(got) > 1:
            raise ProgramError(f"{op.name} has instructions of {sorted(got)} input slices: "
                               "the kernel is compiled with one number an op")
        if got and any(ins.split is None and not ins.empty for ins in mine):
            raise ProgramError(f"{op.name} has sliced instructions and unsliced ones with rows: "
                               "a sliced kernel runs every instruction of the op with rows "
                               "sliced (megakernel.cu slice_mma)")
        return got.pop() if got else 1

    @property
    def input_slices(self) -> int:
        """The most input slices of any instruction (input_slices.py; 1: none)."""
        return max((ins.split.slices for q in self.queues for ins in q
                    if ins.split is not None), default=1)

    # ---- verification ---------------------------------------------------------------------
    def fingerprint(self) -> str:
        """sha256 of everything verify() reads: every instruction's words and declared regions,
        the counters and the grid. Equal fingerprints, equal verdicts."""
        h = hashlib.sha256()
        h.update(f"verify v{VERIFY_VERSION}".encode())  # a new check invalidates old proofs
        h.update(repr((self.num_blocks, self.max_seq_len, self.counter_names,
                       self.tokens, self.tensor_cores)).encode())
        h.update(self.words().tobytes())
        for q in self.queues:
            for ins in q:
                h.update(repr((ins.wait, ins.signal, ins.reads, ins.writes, ins.ticket,
                               ins.tail_reads, ins.tail_writes, ins.split, ins.sum_reads,
                               ins.sum_writes)).encode())
        return h.hexdigest()

    def verify(self, *, use_cache: bool = True) -> None:
        """Reject the program, naming instructions, if a wait can never be met, the queues
        deadlock, or two conflicting accesses are not ordered by program order + counters.

        A pass is remembered on disk ($MONOKERNEL_CACHE/verified/<fingerprint>): verify() is a
        pure function of the program, and a 132-block program takes seconds to prove, in every
        process of the GPU check. A failure is never cached."""
        marker = None
        if use_cache:
            from ..model.cache import cache_dir

            marker = cache_dir() / "verified" / self.fingerprint()
            if marker.is_file():
                return
        self._verify()
        if marker is not None:
            from ..model.cache import remember

            remember(marker, "verified\n")

    def verification_queues(self) -> list[list[Instruction]]:
        """The queues as verify() sees them: a ticket instruction becomes its main part, which
        signals the ticket counter, and its tail, which waits for every ticket; an input
        slice its partials' part, which signals the group's counter, and its sum, which waits
        for the group's every signal and signals the instruction's own counter."""
        out = []
        for q in self.queues:
            vq = []
            for i, ins in enumerate(q):
                if ins.split is not None:
                    if ins.ticket is not None:
                        raise ProgramError(f"{ins.label(len(out), i)} has both a ticket and "
                                           "an input slice")
                    sl = ins.split
                    vq.append(replace(ins, signal=sl.counter, split=None, at=i,
                                      part=" [slice partials]"))
                    vq.append(replace(ins, wait=(sl.counter, sl.members), split=None, at=i,
                                      reads=list(ins.sum_reads), writes=list(ins.sum_writes),
                                      weight_bytes=0, part=" [slice sum]"))
                    continue
                if ins.ticket is None:
                    vq.append(ins)
                    continue
                # the instruction's own signal (ATTENTION's; the LM head has none) comes
                # after its tail: the group's merge is done before its last unit signals
                counter, count = ins.ticket
                vq.append(replace(ins, signal=counter, ticket=None, at=i))
                vq.append(replace(ins, wait=(counter, count), ticket=None, at=i,
                                  reads=list(ins.tail_reads), writes=list(ins.tail_writes),
                                  part=" [ticket tail]", exclusive=counter))
            out.append(vq)
        return out

    def _verify(self) -> None:
        self._check_slice_counters()
        queues = self.verification_queues()
        nodes = [(b, i) for b, q in enumerate(queues) for i in range(len(q))]
        index = {n: k for k, n in enumerate(nodes)}
        ins_of = lambda n: queues[n[0]][n[1]]  # noqa: E731
        label = lambda n: ins_of(n).label(*n)  # noqa: E731
        signalers: dict[int, list[int]] = defaultdict(list)
        for n in nodes:
            s = ins_of(n).signal
            if s is not None:
                if not 0 <= s < self.num_counters:
                    raise ProgramError(f"{label(n)} signals counter {s}, which does not exist")
                signalers[s].append(index[n])
        # edges: program order, and signal -> wait when the wait needs every signaler
        waits_on: dict[int, int] = {}
        for n in nodes:
            w = ins_of(n).wait
            if w is None:
                continue
            counter, count = w
            have = len(signalers.get(counter, []))
            if not 0 <= counter < self.num_counters or count > have or count <= 0:
                raise ProgramError(
                    f"{label(n)} waits for {count} signals of counter {counter} "
                    f"({self._counter_name(counter)}) but only {have} instruction(s) signal "
                    "it per step: the wait can never be met")
            if count == have:
                waits_on[index[n]] = counter
        order = self._topological(nodes, waits_on, signalers, label)
        block_of = np.array([b for b, _ in nodes], np.int64)
        slot_of = np.array([i for _, i in nodes], np.int64)
        clock = self._clocks(order, nodes, block_of, slot_of, waits_on, signalers)
        self._check_hazards(nodes, block_of, slot_of, clock, ins_of, label)
        self._check_step_end(nodes, block_of, slot_of, clock, ins_of, label)

    def _check_slice_counters(self) -> None:
        """megakernel.cu slice_mma derives a row group's counter from the instruction's words
        (no word of its own): the op's signal + 1 + block / members."""
        for b, q in enumerate(self.queues):
            for i, ins in enumerate(q):
                sl = ins.split
                if sl is not None and (ins.signal is None or
                                       sl.counter != ins.signal + 1 + b // sl.members):
                    raise ProgramError(
                        f"{ins.label(b, i)}: its row group's counter {sl.counter} is not the "
                        f"op's signal + 1 + block / members ({ins.signal} + 1 + {b} // "
                        f"{sl.members}), which megakernel.cu slice_mma waits on")

    @staticmethod
    def _check_step_end(nodes, block_of, slot_of, clock, ins_of, label) -> None:
        """Many steps per launch: every block starts step s + 1 once the step's end (the writer
        of the state: the LM head's ticket tail) has run and released the step
        counter. So that end must come after every instruction of the step, or a block could
        write a buffer of step s + 1 that an instruction of step s still reads (a WAR across
        steps that the per-step hazard check above cannot see). Programs with no state writer
        (hand-built fragments) end no step and are not checked."""
        ends = [k for k, n in enumerate(nodes)
                if any(r[0] == "state" for r in ins_of(n).writes)]
        for e in ends:
            excl = ins_of(nodes[e]).exclusive
            for k in np.flatnonzero(slot_of >= clock[e][block_of]):  # not before the end
                ins = ins_of(nodes[k])
                if k == e or ins.op == Op.NOOP or (excl is not None and ins.exclusive == excl):
                    continue  # itself, padding, or another block's tail (only one runs)
                raise ProgramError(
                    f"{label(nodes[k])} is not ordered before the step's end "
                    f"{label(nodes[e])}: the next step of a launch could start while it runs")

    def _counter_name(self, c: int) -> str:
        return self.counter_names[c] if 0 <= c < len(self.counter_names) else "?"

    @staticmethod
    def _topological(nodes, waits_on, signalers, label) -> list[int]:
        """Kahn's order of the nodes under program order and the full waits. A counter is a
        node of its own (after its every signaler, before its every full wait), so the edges
        grow with signalers + waiters, not their product."""
        n = len(nodes)
        counters = {c: n + j for j, c in enumerate(sorted(set(waits_on.values())))}
        succ: list[list[int]] = [[] for _ in range(n + len(counters))]
        indeg = [0] * (n + len(counters))
        for k in range(1, n):
            if nodes[k][1] > 0:  # nodes are block-major: k - 1 is its block's previous one
                succ[k - 1].append(k)
                indeg[k] += 1
        for k, c in waits_on.items():
            succ[counters[c]].append(k)
            indeg[k] += 1
        for c, v in counters.items():
            for s in signalers[c]:
                succ[s].append(v)
            indeg[v] = len(signalers[c])
        order = [k for k in range(n + len(counters)) if indeg[k] == 0]
        for k in order:
            for s in succ[k]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    order.append(s)
        if len(order) < len(indeg):
            stuck = [label(nodes[k]) for k in range(n) if indeg[k] > 0]
            raise ProgramError("the queues deadlock: a cycle of waits runs through "
                               + "; ".join(stuck[:8]) + (" ..." if len(stuck) > 8 else ""))
        return [k for k in order if k < n]

    @staticmethod
    def _clocks(order, nodes, block_of, slot_of, waits_on, signalers) -> np.ndarray:
        """Vector clocks: clock[k, b] = how many of block b's instructions are ordered before
        k. What is ordered before an instruction is a prefix of each block's queue (program
        order), so instruction (b, i) precedes k exactly when i < clock[k, b]; and k precedes
        (b, i) when clock[(b, i), block of k] > k's index (the clock only grows down a queue)."""
        num_blocks = int(block_of.max(initial=-1)) + 1
        clock = np.zeros((len(nodes), num_blocks), np.int32)
        group_done: dict[int, np.ndarray] = {}
        for k in order:
            b, i = nodes[k]
            row = clock[k]
            if i:  # after its block's previous instruction and all that was before it
                row[:] = clock[k - 1]
                row[b] = i
            c = waits_on.get(k)
            if c is not None:
                g = group_done.get(c)
                if g is None:  # all signalers precede k in topological order
                    members = np.array(signalers[c], np.int64)
                    g = clock[members].max(axis=0)
                    np.maximum.at(g, block_of[members], (slot_of[members] + 1).astype(np.int32))
                    group_done[c] = g
                np.maximum(row, g, out=row)
        return clock

    def _check_hazards(self, nodes, block_of, slot_of, clock, ins_of, label) -> None:
        """Every write against every access of the same buffer in another block whose rows,
        token shares and steps overlap it (Tokens.overlaps), unless both are tails of one
        ticket: one must be ordered before the other.

        Only the accesses of instructions that run concurrently with the write can fail: for
        a write of instruction k and a block b, those are b's instructions from clock[k, b] up
        to the first one k is ordered before. Those windows are searched for overlaps, all
        writes of a buffer at once; a buffer with a hazard is walked write by write to name
        the first one (_first_hazard)."""
        by_buffer: dict[str, list[tuple]] = defaultdict(list)
        for k, n in enumerate(nodes):
            ins = ins_of(n)
            for regions, w in ((ins.reads, False), (ins.writes, True)):
                for r in regions:
                    t = region_tokens(r)
                    by_buffer[r[0]].append((k, r[1], r[2], w, t.share_lo, t.share_hi,
                                            t.steps_lo, t.steps_hi))
        n = len(nodes)
        num_blocks = clock.shape[1]
        starts = np.searchsorted(block_of, np.arange(num_blocks + 1))  # block-major
        # after[k, b]: the first of block b's instructions that k is ordered before
        # (a block's clocks only grow down its queue: one search a block, the queues side by
        # side under offsets of `span`)
        after = np.empty((n, num_blocks), np.int64)
        span = int(clock.max(initial=0)) + int(slot_of.max(initial=0)) + 2
        offset = np.arange(num_blocks, dtype=np.int64) * span
        for b in range(num_blocks):
            mine = slice(starts[b], starts[b + 1])
            keys = block_of * span + clock[:, b]
            after[mine] = np.searchsorted(keys, offset + slot_of[mine, None], side="right") \
                - starts[:-1]
        excl_of = np.array([-1 if ins_of(nd).exclusive is None else ins_of(nd).exclusive
                            for nd in nodes], np.int64)
        for buf, acc in by_buffer.items():
            arr = np.array(acc, np.int64)
            arr = arr[np.argsort(arr[:, 0], kind="stable")]  # by instruction: block-major
            ids, lo, hi, _, s_lo, s_hi, n_lo, n_hi = (np.ascontiguousarray(c) for c in arr.T)
            wr = np.flatnonzero(arr[:, 3])
            if not len(wr):
                continue
            k = ids[wr]
            # each write's window in each block, as instruction numbers, then as accesses
            first = starts[:-1] + clock[k].astype(np.int64)
            last = np.maximum(first, starts[:-1] + after[k])
            last[np.arange(len(k)), block_of[k]] = first[np.arange(len(k)), block_of[k]]
            begin = np.searchsorted(ids, first).reshape(len(k), num_blocks)
            count = np.searchsorted(ids, last).reshape(len(k), num_blocks) - begin
            per_write = np.cumsum(count.sum(axis=1))
            # in pieces of about PAIRS accesses (bounded memory), narrowed one test at a time
            cut = 0
            while cut < len(k):
                end = max(cut + 1, int(np.searchsorted(per_write, per_write[cut] + PAIRS)))
                c = count[cut:end].ravel()
                at = np.repeat(begin[cut:end].ravel() - (np.cumsum(c) - c), c)
                o = np.arange(len(at)) + at
                w = wr[np.repeat(np.arange(cut, end), num_blocks)]
                w = np.repeat(w, c)
                cut = end
                for mine, theirs in ((lo, hi), (s_lo, s_hi), (n_lo, n_hi)):
                    keep = (mine[o] < theirs[w]) & (theirs[o] > mine[w])
                    o, w = o[keep], w[keep]
                ex = excl_of[ids[w]]
                if ((ex < 0) | (excl_of[ids[o]] != ex)).any():
                    self._first_hazard(buf, acc, clock, block_of, slot_of, excl_of, nodes, label)

    @staticmethod
    def _first_hazard(buf, acc, clock, block_of, slot_of, excl_of, nodes, label) -> None:
        """Raise for the first write of ``acc`` (in instruction order) with an unordered
        conflicting access, naming the first such access."""
        arr = np.array(acc, np.int64)
        ids, los, his, isw = arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3].astype(bool)
        s_lo, s_hi, n_lo, n_hi = arr[:, 4], arr[:, 5], arr[:, 6], arr[:, 7]
        for k, lo, hi, w, a_lo, a_hi, m_lo, m_hi in acc:
            if not w:
                continue
            sel = (los < hi) & (his > lo) & (block_of[ids] != block_of[k]) \
                & (s_lo < a_hi) & (s_hi > a_lo) & (n_lo < m_hi) & (n_hi > m_lo)
            if excl_of[k] >= 0:  # the tails of one ticket never run together
                sel &= excl_of[ids] != excl_of[k]
            others = ids[sel]
            ordered = (slot_of[others] < clock[k][block_of[others]]) \
                | (clock[others, block_of[k]] > slot_of[k])
            bad = np.flatnonzero(~ordered)
            if not len(bad):
                continue
            other = int(others[bad[0]])
            if bool(isw[sel][bad[0]]):
                kind = "WAW"
            elif slot_of[k] <= slot_of[other]:
                kind = "RAW"
            else:
                kind = "WAR"
            first, second = (k, other) if slot_of[k] <= slot_of[other] else (other, k)
            raise ProgramError(
                f"{kind} hazard on {buf}[{lo}:{hi}]: {label(nodes[second])} is not "
                f"ordered after {label(nodes[first])} (add a wait)")
        raise AssertionError(f"{buf}: a hazard was found and then not")  # pragma: no cover

    # ---- figures for `monokernel plan` ------------------------------------------------------
    def critical_path_hops(self) -> int:
        """Counter waits on the longest dependency chain of one token."""
        nodes = [(b, i) for b, q in enumerate(self.queues) for i in range(len(q))]
        index = {n: k for k, n in enumerate(nodes)}
        sig: dict[int, list[int]] = defaultdict(list)
        for n in nodes:
            if self.queues[n[0]][n[1]].signal is not None:
                sig[self.queues[n[0]][n[1]].signal].append(index[n])
        depth = [0] * len(nodes)
        for i in range(self.max_len):  # slots are aligned: slot order is a topological order
            for b, q in enumerate(self.queues):
                if i >= len(q):
                    continue
                k = index[(b, i)]
                d = depth[index[(b, i - 1)]] if i else 0
                w = q[i].wait
                if w is not None:
                    d = max([d] + [depth[s] + 1 for s in sig[w[0]]])
                depth[k] = d
        return max(depth)

    def op_table(self, context: int) -> list[dict]:
        """Per op: instructions, weight bytes, KV bytes at ``context`` positions."""
        c = self.config
        rows: dict[Op, dict] = {}
        for q in self.queues:
            for ins in q:
                if ins.op == Op.NOOP:
                    continue
                r = rows.setdefault(ins.op, {"op": ins.op.name, "instructions": 0, "bytes": 0})
                r["instructions"] += 1
                r["bytes"] += ins.weight_bytes
        if Op.ATTENTION in rows:  # K and V, bf16, every layer, every KV head
            rows[Op.ATTENTION]["bytes"] += 2 * 2 * c.num_layers * context * c.kv_dim
        return [rows[o] for o in Op if o in rows]
