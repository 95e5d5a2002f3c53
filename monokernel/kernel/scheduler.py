"""ModelConfig + grid size -> Program: per-block instruction queues, counters and buffers.

Every op of the decode step is split into tiles so that every block works in every op, balanced
by bytes (rows of one matrix all cost the same, so an even split of rows is an even split of
bytes). Queues are aligned: instruction slot i holds the same (op, layer) in every block, padded
with NOOP where a block has nothing (only SAMPLE), so the multi-kernel baseline can launch one
slot range per op. Each instruction declares the buffer regions it reads and writes;
``Program.verify()`` proves from those declarations that the waits and signals order every
conflicting pair of accesses, and that no wait can hang.
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

from ..model.config import ModelConfig
from ..errors import ProgramError
from .isa import STATE_WORDS, WIDTH, Op, Word, attn_round_positions, merge_ticket_min_splits

# Bumped when verify() gains a check: on-disk proofs of older versions no longer count.
VERIFY_VERSION = 3
# Kernel designs (MK_DESIGN in megakernel.cu): 1 is v1 (SAMPLE as its own op in block 0, one
# row per warp pass); 2 (default) folds SAMPLE into the LM head by an atomic ticket.
DESIGNS = (1, 2)
DEFAULT_DESIGN = 2


# A region of a buffer, in elements: (buffer name, lo, hi).
Region = tuple[str, int, int]


@dataclass
class Instruction:
    op: Op
    layer: int = 0
    tile: tuple[int, int] = (0, 0)
    wait: tuple[int, int] | None = None  # (counter, signals per step)
    signal: int | None = None
    args: tuple[int, ...] = ()
    reads: list[Region] = field(default_factory=list)
    writes: list[Region] = field(default_factory=list)
    weight_bytes: int = 0  # bytes of weights this instruction streams
    # An atomic-ticket reduction (RMS_LM_HEAD in design 2): after its own work the instruction
    # takes a ticket on counter ticket[0]; the block that draws the last of ticket[1] tickets
    # of the step runs the tail, which reads tail_reads and writes tail_writes. verify() sees
    # the tail as an instruction right after this one that waits for every ticket; the tails
    # of one ticket are mutually exclusive (exactly one block runs its tail).
    ticket: tuple[int, int] | None = None
    tail_reads: list[Region] = field(default_factory=list)
    tail_writes: list[Region] = field(default_factory=list)
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
        return w

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
    design: int = DEFAULT_DESIGN  # the kernel design it was built for (MK_DESIGN)
    attn_min_chunk: int = 1  # fewest positions per attention split
    # a step using at least this many splits merges them once per KV group, by ticket, in
    # ATTENTION (isa.merge_ticket_min_splits); 0: every O_PROJ block merges them itself
    merge_ticket_min: int = 0

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
        c = self.config
        return {
            "residual": c.hidden_size, "q": c.q_dim,
            "attn_o": c.num_kv_heads * self.attn_splits * c.group_size * c.head_dim,
            "attn_ml": c.num_kv_heads * self.attn_splits * c.group_size * 2,
            **({"attn": c.q_dim} if self.merge_ticket_min else {}),
            "ffn_h": c.intermediate_size, "logits": c.vocab_size,
            "lm_part": self.lm_partials * 2, "out_tokens": self.max_seq_len,
            **({"k_raw": c.kv_dim} if c.qk_norm and self.design >= 2 else {}),
        }

    # ---- verification ---------------------------------------------------------------------
    def fingerprint(self) -> str:
        """sha256 of everything verify() reads: every instruction's words and declared regions,
        the counters and the grid. Equal fingerprints, equal verdicts."""
        h = hashlib.sha256()
        h.update(f"verify v{VERIFY_VERSION}".encode())  # a new check invalidates old proofs
        h.update(repr((self.num_blocks, self.max_seq_len, self.counter_names)).encode())
        h.update(self.words().tobytes())
        for q in self.queues:
            for ins in q:
                h.update(repr((ins.wait, ins.signal, ins.reads, ins.writes, ins.ticket,
                               ins.tail_reads, ins.tail_writes)).encode())
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
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                tmp = marker.with_name(f".{marker.name}.{os.getpid()}")
                tmp.write_text("verified\n")
                tmp.replace(marker)
            except OSError:
                pass  # an unwritable cache only costs the next process the proof again

    def verification_queues(self) -> list[list[Instruction]]:
        """The queues as verify() sees them: a ticket instruction becomes its main part, which
        signals the ticket counter, and its tail, which waits for every ticket."""
        out = []
        for q in self.queues:
            vq = []
            for i, ins in enumerate(q):
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
        preds: list[list[int]] = [[] for _ in nodes]
        waits_on: dict[int, int] = {}
        for n in nodes:
            k = index[n]
            if n[1] > 0:
                preds[k].append(index[(n[0], n[1] - 1)])
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
                waits_on[k] = counter
        order = self._topological(nodes, preds, waits_on, signalers, label)
        anc = self._ancestors(order, len(nodes), preds, waits_on, signalers)
        self._check_hazards(nodes, index, anc, ins_of, label)
        self._check_step_end(nodes, anc, ins_of, label)

    @staticmethod
    def _check_step_end(nodes, anc, ins_of, label) -> None:
        """Many steps per launch: every block starts step s + 1 once the step's end (the writer
        of the state: the LM head's ticket tail, or SAMPLE) has run and released the step
        counter. So that end must come after every instruction of the step, or a block could
        write a buffer of step s + 1 that an instruction of step s still reads (a WAR across
        steps that the per-step hazard check above cannot see). Programs with no state writer
        (hand-built fragments) end no step and are not checked."""
        ends = [k for k, n in enumerate(nodes)
                if any(buf == "state" for buf, _, _ in ins_of(n).writes)]
        for e in ends:
            before = np.unpackbits(anc[e], bitorder="little")[:len(nodes)]
            excl = ins_of(nodes[e]).exclusive
            for k in np.flatnonzero(before == 0):
                ins = ins_of(nodes[k])
                if k == e or ins.op == Op.NOOP or (excl is not None and ins.exclusive == excl):
                    continue  # itself, padding, or another block's tail (only one runs)
                raise ProgramError(
                    f"{label(nodes[k])} is not ordered before the step's end "
                    f"{label(nodes[e])}: the next step of a launch could start while it runs")

    def _counter_name(self, c: int) -> str:
        return self.counter_names[c] if 0 <= c < len(self.counter_names) else "?"

    @staticmethod
    def _topological(nodes, preds, waits_on, signalers, label) -> list[int]:
        n = len(nodes)
        succ: list[list[int]] = [[] for _ in range(n)]
        indeg = [0] * n
        for k in range(n):
            ps = list(preds[k]) + (signalers[waits_on[k]] if k in waits_on else [])
            for p in ps:
                succ[p].append(k)
            indeg[k] = len(ps)
        order = [k for k in range(n) if indeg[k] == 0]
        for k in order:
            for s in succ[k]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    order.append(s)
        if len(order) < n:
            stuck = [label(nodes[k]) for k in range(n) if indeg[k] > 0]
            raise ProgramError("the queues deadlock: a cycle of waits runs through "
                               + "; ".join(stuck[:8]) + (" ..." if len(stuck) > 8 else ""))
        return order

    @staticmethod
    def _ancestors(order, n, preds, waits_on, signalers) -> np.ndarray:
        """Bit matrix anc[k] = every instruction ordered before k (packed uint8)."""
        nbytes = (n + 7) // 8
        anc = np.zeros((n, nbytes), np.uint8)
        group_done: dict[int, np.ndarray] = {}
        pos_in_order = np.empty(n, np.int64)
        pos_in_order[order] = np.arange(n)
        for k in order:
            row = anc[k]
            for p in preds[k]:
                row |= anc[p]
                row[p >> 3] |= np.uint8(1 << (p & 7))
            if k in waits_on:
                c = waits_on[k]
                g = group_done.get(c)
                if g is None:  # all signalers precede k in topological order
                    members = signalers[c]
                    g = np.bitwise_or.reduce(anc[members], axis=0)
                    for m in members:
                        g[m >> 3] |= np.uint8(1 << (m & 7))
                    group_done[c] = g
                row |= g
        return anc

    def _check_hazards(self, nodes, index, anc, ins_of, label) -> None:
        by_buffer: dict[str, list[tuple[int, int, int, bool]]] = defaultdict(list)
        for n in nodes:
            ins = ins_of(n)
            for buf, lo, hi in ins.reads:
                by_buffer[buf].append((index[n], lo, hi, False))
            for buf, lo, hi in ins.writes:
                by_buffer[buf].append((index[n], lo, hi, True))
        block_of = np.array([n[0] for n in nodes], np.int64)
        slot_of = np.array([n[1] for n in nodes], np.int64)
        excl = ins_of
        excl_of = np.array([-1 if excl(n).exclusive is None else excl(n).exclusive
                            for n in nodes], np.int64)

        for buf, acc in by_buffer.items():
            arr = np.array(acc, np.int64)
            ids, los, his, isw = arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3].astype(bool)
            for k, lo, hi, w in acc:
                if not w:
                    continue
                sel = (los < hi) & (his > lo) & (block_of[ids] != block_of[k])
                if excl_of[k] >= 0:  # the tails of one ticket never run together
                    sel &= excl_of[ids] != excl_of[k]
                others = ids[sel]
                if not len(others):
                    continue
                # ordered(a, b): bit a set in anc[b]
                k_before = (anc[others, k >> 3] >> (k & 7)) & 1
                k_after = (anc[k, others >> 3] >> (others & 7)) & 1
                bad = np.flatnonzero((k_before | k_after) == 0)
                if not len(bad):
                    continue
                other = int(others[bad[0]])
                other_w = bool(isw[sel][bad[0]])
                if other_w:
                    kind = "WAW"
                elif slot_of[k] <= slot_of[other]:
                    kind = "RAW"
                else:
                    kind = "WAR"
                first, second = (k, other) if slot_of[k] <= slot_of[other] else (other, k)
                raise ProgramError(
                    f"{kind} hazard on {buf}[{lo}:{hi}]: {label(nodes[second])} is not "
                    f"ordered after {label(nodes[first])} (add a wait)")

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


# Position splits per KV head at most, by default (design 1). Every O_PROJ block merges all
# splits itself, so each split costs every block KV_HEADS * GROUP * HEAD_DIM floats of L2 reads
# per layer (SmolLM2 at 132 blocks: 44 splits = 100 KB per block per layer); and MegaQwen
# measured attention 33% slower when one head was split over 5 blocks. benchmarks/NOTES.md.
MAX_DEFAULT_SPLITS = 8
# Design 2: enough splits that a unit is at most one round of K and one of V at LONG_CONTEXT
# positions (or the program's context, if shorter), but never fewer positions per split than a
# round (min_chunk): a short context then uses few splits and the merge reads only those. The
# cost model picked it (benchmarks/NOTES.md): SmolLM2 16, Qwen3 16, Llama 16 at 132 blocks.
LONG_CONTEXT = 2048
MAX_DEFAULT_SPLITS_V2 = 16


def default_attn_splits(cfg: ModelConfig, num_blocks: int, max_seq_len: int | None = None,
                        design: int = 1) -> int:
    """Enough (KV head, split) units to give most blocks one, capped (see above)."""
    units = max(1, num_blocks // cfg.num_kv_heads)
    if design < 2:
        return min(units, MAX_DEFAULT_SPLITS)
    context = min(max_seq_len or LONG_CONTEXT, LONG_CONTEXT)
    need = -(-context // attn_round_positions(cfg.head_dim))
    return max(1, min(units, need, MAX_DEFAULT_SPLITS_V2))


def default_min_chunk(cfg: ModelConfig, design: int) -> int:
    return attn_round_positions(cfg.head_dim) if design >= 2 else 1


# Verified programs by (config, blocks, max_seq_len, splits). verify() of a 132-block program
# takes seconds, and the GPU check builds a dozen executors of each shape; they share one Program.
_VERIFIED: dict[tuple, Program] = {}
_VERIFIED_MAX = 16


def schedule(cfg: ModelConfig, num_blocks: int, max_seq_len: int,
             attn_splits: int | None = None, design: int = DEFAULT_DESIGN,
             attn_min_chunk: int | None = None, merge_ticket_min: int | None = None) -> Program:
    """Build and verify the decode-step program for ``num_blocks`` persistent blocks.

    ``attn_splits``: position splits per KV head (default: the design's policy);
    ``attn_min_chunk``: fewest positions per split (default: one round of K/V loads with the
    default splits, 1 - exact splits - when ``attn_splits`` is given);
    ``merge_ticket_min``: fewest used splits a step merges by ticket (design 2; default
    isa.merge_ticket_min_splits, 0: never, the per-block merge of every O_PROJ block). It
    applies only where no attention instruction holds units of two KV groups.

    Memoised: the same arguments return the same (shared) Program. Never edit a returned
    Program in place; ``copy.deepcopy`` it first (the tests that break programs do)."""
    if num_blocks < 1:
        raise ProgramError(f"num_blocks must be >= 1, got {num_blocks}")
    if design not in DESIGNS:
        raise ProgramError(f"unknown kernel design {design!r} (known: {DESIGNS})")
    if attn_min_chunk is None:
        attn_min_chunk = 1 if attn_splits else default_min_chunk(cfg, design)
    splits = attn_splits or default_attn_splits(cfg, num_blocks, max_seq_len, design)
    if merge_ticket_min is None:
        merge_ticket_min = merge_ticket_min_splits(cfg)
    if merge_ticket_min < 0:
        raise ProgramError(f"merge_ticket_min must be >= 0, got {merge_ticket_min}")
    key = (cfg, num_blocks, max_seq_len, splits, design, attn_min_chunk, merge_ticket_min)
    prog = _VERIFIED.get(key)
    if prog is None:
        prog = _build(cfg, num_blocks, max_seq_len, splits, design, attn_min_chunk,
                      merge_ticket_min)
        prog.verify()
        if len(_VERIFIED) >= _VERIFIED_MAX:
            _VERIFIED.pop(next(iter(_VERIFIED)))
        _VERIFIED[key] = prog
    return prog


def _build(cfg: ModelConfig, num_blocks: int, max_seq_len: int, attn_splits: int,
           design: int, min_chunk: int, least: int) -> Program:
    c = cfg
    B = num_blocks
    H, F, D, half = c.hidden_size, c.intermediate_size, c.head_dim, c.head_dim // 2
    S = attn_splits
    # design 2 with q/k-norm: QKV tiles are row pairs like every other model (v1's whole-head
    # tiles put Qwen3-0.6B's 32 heads on 32 of 132 blocks); ATTENTION norms and ropes q and the
    # new k itself, and O_PROJ caches that k (megakernel.cu: "late q/k")
    late_qk = c.qk_norm and design >= 2
    queues: list[list[Instruction]] = [[] for _ in range(B)]
    counters: list[str] = []

    def counter(name: str) -> int:
        counters.append(name)
        return len(counters) - 1

    def emit(make, wait: int | None, sig: int, only_block: int | None = None) -> None:
        for b in range(B):
            if only_block is not None and b != only_block:
                queues[b].append(NOOP)
                continue
            ins = make(b)
            # every op but SAMPLE runs in all B blocks, so a wait needs B signals
            ins.wait = (wait, B) if wait is not None else None
            ins.signal = sig
            queues[b].append(ins)

    # EMBED: residual[b:e] = embed[token]
    cnt = counter("EMBED")
    tiles = split_even(H, B)

    def embed(b):
        lo, hi = tiles[b]
        return Instruction(Op.EMBED, 0, (lo, hi), reads=[("state", 0, STATE_WORDS)],
                           writes=[("residual", lo, hi)] if hi > lo else [],
                           weight_bytes=2 * (hi - lo))
    emit(embed, None, cnt)
    prev = cnt
    n_heads_total = c.num_heads + 2 * c.num_kv_heads
    # attention units over the blocks (the same tiles every layer), and whether the splits can
    # be merged by ticket: design 2, a merge large enough to be worth it (isa), and no
    # instruction holding units of two KV groups (one ticket per instruction)
    units = split_even(c.num_kv_heads * S, B)
    gd = c.group_size * D
    merge_min = least if (design >= 2 and 0 < least <= S and
                          all(hi <= lo or lo // S == (hi - 1) // S for lo, hi in units)) else 0
    group_tickets = [sum(1 for lo, hi in units if hi > lo and lo // S == g)
                     for g in range(c.num_kv_heads)]
    # O_PROJ reads the merged vector in the steps that merge by ticket, the partials otherwise
    merged = [("attn", 0, c.q_dim)] if merge_min else []
    for layer in range(c.num_layers):
        # RMS_QKV_ROPE: tiles are row pairs; whole heads when q/k-norm needs the head's norm
        cnt = counter(f"L{layer}.RMS_QKV_ROPE")
        if c.qk_norm and not late_qk:
            qkv_tiles = [(a * half, b_ * half) for a, b_ in split_even(n_heads_total, B)]
        else:
            qkv_tiles = split_even(n_heads_total * half, B)

        def qkv(b, layer=layer, qkv_tiles=qkv_tiles):
            lo, hi = qkv_tiles[b]
            writes: list[Region] = []
            for head in range(lo // half, (hi - 1) // half + 1 if hi > lo else 0):
                j0, j1 = max(lo, head * half) - head * half, min(hi, (head + 1) * half) - head * half
                if head < c.num_heads:
                    buf, base = "q", head * D
                elif head < c.num_heads + c.num_kv_heads and late_qk:
                    buf, base = "k_raw", (head - c.num_heads) * D
                elif head < c.num_heads + c.num_kv_heads:
                    buf, base = "k_cache", layer * c.kv_dim + (head - c.num_heads) * D
                else:
                    buf, base = "v_cache", layer * c.kv_dim + (head - c.num_heads - c.num_kv_heads) * D
                writes += [(buf, base + j0, base + j1), (buf, base + half + j0, base + half + j1)]
            rows = 2 * (hi - lo)
            return Instruction(Op.RMS_QKV_ROPE, layer, (lo, hi),
                               reads=[("residual", 0, H)] if hi > lo else [], writes=writes,
                               weight_bytes=2 * rows * H + (2 * H if hi > lo else 0))
        emit(qkv, prev, cnt)
        prev = cnt

        # ATTENTION: units (KV head, split); with merge by ticket, one ticket counter per KV
        # group, drawn once per step by every instruction holding units of the group
        cnt = counter(f"L{layer}.ATTENTION")
        tickets = ([counter(f"L{layer}.ATTENTION.ticket{g}") for g in range(c.num_kv_heads)]
                   if merge_min else [])

        def attn(b, layer=layer, tickets=tickets):
            lo, hi = units[b]
            reads: list[Region] = []
            writes: list[Region] = []
            for u in range(lo, hi):
                g = u // S
                reads += [("q", g * gd, (g + 1) * gd),
                          ("k_cache", layer * c.kv_dim + g * D, layer * c.kv_dim + (g + 1) * D),
                          ("v_cache", layer * c.kv_dim + g * D, layer * c.kv_dim + (g + 1) * D)]
                if late_qk:  # the new key, normed and roped in the unit (kernel: late q/k)
                    reads.append(("k_raw", g * D, (g + 1) * D))
                writes += [("attn_o", u * gd, (u + 1) * gd),
                           ("attn_ml", u * c.group_size * 2, (u + 1) * c.group_size * 2)]
            ins = Instruction(Op.ATTENTION, layer, (lo, hi), args=(S, min_chunk, -1, 0, 0),
                              reads=reads, writes=writes)
            if merge_min and hi > lo:  # the units lie in one KV group (merge_min's condition)
                g = lo // S
                ins.args = (S, min_chunk, tickets[g], group_tickets[g], merge_min)
                ins.ticket = (tickets[g], group_tickets[g])
                ins.tail_reads = [("attn_o", g * S * gd, (g + 1) * S * gd),
                                  ("attn_ml", g * S * c.group_size * 2,
                                   (g + 1) * S * c.group_size * 2)]
                ins.tail_writes = [("attn", g * gd, (g + 1) * gd)]
            return ins
        emit(attn, prev, cnt)
        prev = cnt

        # O_PROJ_RESIDUAL: every block merges all splits, then its rows of Wo
        cnt = counter(f"L{layer}.O_PROJ_RESIDUAL")
        rows = split_even(H, B)

        kv_owner = split_even(c.num_kv_heads, B)

        def oproj(b, layer=layer, rows=rows):
            lo, hi = rows[b]
            k0, k1 = kv_owner[b] if late_qk else (0, 0)
            # late q/k: this block also caches the step's keys of KV heads [k0, k1), after
            # every attention unit of the layer has read them raw
            cache = ([("k_raw", k0 * D, k1 * D),
                      ("k_cache", layer * c.kv_dim + k0 * D, layer * c.kv_dim + k1 * D)]
                     if k1 > k0 else [])
            args = (S, min_chunk, k0, k1, merge_min)
            if hi <= lo:
                return Instruction(Op.O_PROJ_RESIDUAL, layer, (lo, hi), args=args,
                                   reads=cache[:1], writes=cache[1:])
            return Instruction(
                Op.O_PROJ_RESIDUAL, layer, (lo, hi), args=args,
                reads=[("attn_o", 0, c.num_kv_heads * S * gd),
                       ("attn_ml", 0, c.num_kv_heads * S * c.group_size * 2),
                       ("residual", lo, hi)] + cache[:1] + merged,
                writes=[("residual", lo, hi)] + cache[1:], weight_bytes=2 * (hi - lo) * c.q_dim)
        emit(oproj, prev, cnt)
        prev = cnt

        # RMS_GATE_UP: rows of Wg and Wu
        cnt = counter(f"L{layer}.RMS_GATE_UP")
        frows = split_even(F, B)

        def gate_up(b, layer=layer, frows=frows):
            lo, hi = frows[b]
            if hi <= lo:
                return Instruction(Op.RMS_GATE_UP, layer, (lo, hi))
            return Instruction(Op.RMS_GATE_UP, layer, (lo, hi), reads=[("residual", 0, H)],
                               writes=[("ffn_h", lo, hi)],
                               weight_bytes=2 * 2 * (hi - lo) * H + 2 * H)
        emit(gate_up, prev, cnt)
        prev = cnt

        # DOWN_RESIDUAL: rows of Wd
        cnt = counter(f"L{layer}.DOWN_RESIDUAL")

        def down(b, layer=layer, rows=rows):
            lo, hi = rows[b]
            if hi <= lo:
                return Instruction(Op.DOWN_RESIDUAL, layer, (lo, hi))
            return Instruction(Op.DOWN_RESIDUAL, layer, (lo, hi),
                               reads=[("ffn_h", 0, F), ("residual", lo, hi)],
                               writes=[("residual", lo, hi)], weight_bytes=2 * (hi - lo) * F)
        emit(down, prev, cnt)
        prev = cnt

    # RMS_LM_HEAD: rows of the vocabulary; partial slot = block
    vrows = split_even(c.vocab_size, B)
    sample_reads = [("lm_part", 0, 2 * B), ("state", 0, STATE_WORDS)]
    sample_writes = [("state", 0, STATE_WORDS), ("out_tokens", 0, max_seq_len)]
    if design >= 2:  # the last block to finish its tile reduces the partials (atomic ticket)
        cnt = None
        ticket = counter("RMS_LM_HEAD.ticket")
    else:
        cnt = counter("RMS_LM_HEAD")

    def lm_head(b):
        lo, hi = vrows[b]
        ins = Instruction(Op.RMS_LM_HEAD, 0, (lo, hi), args=(b,),
                          reads=[("residual", 0, H)] if hi > lo else [],
                          writes=([("logits", lo, hi)] if hi > lo else []) + [("lm_part", 2 * b, 2 * b + 2)],
                          weight_bytes=2 * (hi - lo) * H + (2 * H if hi > lo else 0))
        if design >= 2:
            ins.args = (b, ticket, B)
            ins.ticket = (ticket, B)
            ins.tail_reads, ins.tail_writes = list(sample_reads), list(sample_writes)
        return ins
    emit(lm_head, prev, cnt)
    prev = cnt

    if design < 2:  # v1: one instruction in block 0 reduces the partials, serially
        cnt = counter("SAMPLE")
        emit(lambda b: Instruction(Op.SAMPLE, 0, (0, 1), args=(B,), reads=list(sample_reads),
                                   writes=list(sample_writes)),
             prev, cnt, only_block=0)

    # Each block reads the state words at launch start, before its first instruction.
    for q in queues:
        first = next(ins for ins in q if ins.op != Op.NOOP)
        if ("state", 0, STATE_WORDS) not in first.reads:
            first.reads = first.reads + [("state", 0, STATE_WORDS)]
    prog = Program(config=cfg, num_blocks=B, max_seq_len=max_seq_len, queues=queues,
                   counter_names=counters, attn_splits=S, lm_partials=B, design=design,
                   attn_min_chunk=min_chunk, merge_ticket_min=merge_min)
    return prog
