"""The instruction set: the single source of truth for opcodes, the instruction word layout,
the state/error words and the kernel's argument struct.

header.py renders all of it, with each op's named argument words (kernel/ops/), as the C header
of megakernel.cu (NVRTC and g++ both include it); nothing here is written a second time by hand
on the CUDA side.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

from ..model.config import ModelConfig


class Op(IntEnum):
    """One decode step, in order (ARCHITECTURE section 2)."""

    NOOP = 0
    EMBED = 1  # residual = embed[token]
    RMS_QKV_ROPE = 2  # q, k, v = rmsnorm(residual) @ Wqkv (+bias); q/k-norm; RoPE; K/V -> cache
    ATTENTION = 3  # flash-decoding partials per (KV head, position split)
    O_PROJ_RESIDUAL = 4  # merge partials; residual += attn @ Wo
    RMS_GATE_UP = 5  # h = silu(rmsnorm(residual) @ Wg) * (rmsnorm(residual) @ Wu)
    DOWN_RESIDUAL = 6  # residual += h @ Wd
    RMS_LM_HEAD = 7  # logits tile + per-tile best; the last block's ticket picks the token


class Word(IntEnum):
    """Meaning of each int32 word of an instruction."""

    OP = 0
    LAYER = 1
    TILE_BEGIN = 2  # first tile (row, row pair, or attention unit) of this instruction
    TILE_END = 3  # one past the last tile
    WAIT_COUNTER = 4  # counter to wait on, -1 for none
    WAIT_COUNT = 5  # signals per step to wait for: target = count * (step + 1)
    SIGNAL_COUNTER = 6  # counter to increment once when done, -1 for none
    # the op's own arguments: each op module (kernel/ops/) names them (``Args``), and the
    # kernel reads them by those names (A_<OP>_<NAME>, rendered below), never as ARGn
    ARG0 = 7
    ARG1 = 8
    ARG2 = 9
    ARG3 = 10
    ARG4 = 11
    # token groups of a mat-mul (kernels of slots on tensor cores; program.Instruction.group):
    # PACKED_WORDS["GROUP"]: its members, index and the op's fewest step tokens for them (0:
    # none), with an input slice of O_PROJ / DOWN (program.InputSlice, input_slices.py) log2
    # of the slices and the slice (0: none; its row group's counter is the op's signal + 1 +
    # block / (members x slices): Program.verify checks it); and the group's rows,
    # PACKED_WORDS["GROUP_TILE"] (megakernel.cu token_group, slice_mma). No word of its own: a
    # 15th word spilled Qwen3's tensor-core kernel (its VM loop holds the words in registers)
    GROUP = 12
    GROUP_TILE = 13


WIDTH = len(Word)
ARG_WORDS = Word.GROUP - Word.ARG0


class Field(NamedTuple):
    """A field of a packed int32 word: ``bits`` bits from bit ``shift``, a value >= 0."""

    name: str
    shift: int
    bits: int

    @property
    def most(self) -> int:
        """The largest value the field holds (its mask)."""
        return (1 << self.bits) - 1


# Words that pack several small values: Python packs them (pack), the kernel reads each field
# through the header's accessor MK_<WORD>_<FIELD>(w) (header.render_header), so the layout is
# written here alone. Bit 31 stays clear (the words are int32).
PACKED_WORDS: dict[str, tuple[Field, ...]] = {
    # Word.GROUP: a token group's members, this member's index, the op's fewest step tokens
    # for the groups (token_groups.MAX_MIN_TOKENS); an input slice's log2 of the slices and
    # its slice (0 and 0 without slices)
    "GROUP": (Field("MEMBERS", 0, 8), Field("INDEX", 8, 8), Field("MIN_TOKENS", 16, 8),
              Field("SLICES_LOG2", 24, 3), Field("SLICE", 27, 4)),
    # Word.GROUP_TILE: the group's rows [begin, end)
    "GROUP_TILE": (Field("BEGIN", 0, 16), Field("END", 16, 15)),
    # O_PROJ's argument `keys` (late q/k, ops/o_proj.py key_parts): the KV heads [kv_first,
    # kv_end) whose keys of the step's rows part `part` of `parts` the block caches
    "O_PROJ_KEYS": (Field("KV_FIRST", 0, 8), Field("KV_END", 8, 8), Field("PARTS", 16, 8),
                    Field("PART", 24, 7)),
}


def field(word: str, name: str) -> Field:
    """PACKED_WORDS[word]'s field ``name`` (upper case)."""
    return next(f for f in PACKED_WORDS[word] if f.name == name)


def pack(word: str, **values: int) -> int:
    """PACKED_WORDS[word] of the fields ``values`` (by lower-case name; 0 for one not given).
    A value outside its bits, or a name the word does not have, is a ValueError."""
    fields = {f.name.lower(): f for f in PACKED_WORDS[word]}
    unknown = set(values) - set(fields)
    if unknown:
        raise ValueError(f"{word} has no field {sorted(unknown)} (its: {', '.join(fields)})")
    out = 0
    for name, v in values.items():
        f, v = fields[name], int(v)
        if not 0 <= v <= f.most:
            raise ValueError(f"{word}.{name} = {v} does not fit its {f.bits} bits")
        out |= v << f.shift
    return out


def unpack(word: str, w) -> dict:
    """The fields of PACKED_WORDS[word] ``w`` (an int or an integer array), by lower-case
    name, in layout order."""
    return {f.name.lower(): (w >> f.shift) & f.most for f in PACKED_WORDS[word]}


class Args:
    """The named argument words of one op (declared in its module under kernel/ops/): name k
    lives in word ARG0 + k. Rendered into the header as A_<OP>_<NAME>, so the kernel, the cost
    model and the tests read an argument by its name."""

    def __init__(self, *names: str):
        if len(names) > ARG_WORDS or len(set(names)) != len(names):
            raise ValueError(f"at most {ARG_WORDS} distinct argument names, got {names}")
        self.names = names

    def word(self, name: str) -> int:
        try:
            return Word.ARG0 + self.names.index(name)
        except ValueError:
            from ..errors import ProgramError

            raise ProgramError(f"no argument {name!r} (this op's: "
                               f"{', '.join(self.names) or 'none'})") from None

    def pack(self, values: dict[str, int]) -> tuple[int, ...]:
        """The argument words in order (0 for a name not given); an unknown name is refused."""
        for name in values:
            self.word(name)
        return tuple(int(values.get(n, 0)) for n in self.names)


class State(IntEnum):
    """int32 words of the state buffer: what a step reads from device memory, so that one
    launch (or one captured graph) serves every step."""

    TOKEN = 0  # the token this step embeds; the step's end overwrites it with the next token
    POS = 1  # its position; the step's end advances it
    STEP = 2  # steps run since the counters were zeroed; the step's end advances it
    TEMPERATURE = 3  # float32 bits; 0 = greedy
    SEED = 4  # Gumbel-max RNG seed
    WATCHDOG_MS = 5  # spin deadline in milliseconds
    PROGRAM_LEN = 6  # instructions per block queue (max_len)
    # many steps per launch (the megakernel; a thin kernel of the baseline runs one):
    FEED_END = 7  # positions < FEED_END embed feed[pos] (the prompt); the samples are unused
    STEPS = 8  # steps the launch runs at most (<= 1: one); the kernel counts it down
    STOP_POS = 9  # the launch ends after the step at STOP_POS - 1 (0: only at the cache end)
    STEP_COUNTER = 10  # index of the step counter (after the program's counters)
    RUN = 11  # written at each step's end: 1 if the launch goes on to the next step
    STOP_REASON = 12  # why the launch ended (StopReason), written with RUN
    # the step's tokens: positions POS..POS+NTOK-1 (> 1 only for a prompt chunk, in a program
    # built for steps of several tokens: Program.tokens); TOKEN is the first, feed[] the rest
    NTOK = 13
    # the host's stop flag as the LM head's first tile (slot 0) read it this step: one PCIe read
    # a step (132 blocks each reading it were served one after another, ~1 us each: NOTES);
    # the block that draws the step's last ticket reads it here
    HOST_STOP = 14
    # (a step of the token table) its logits rows below this store their logits for the host
    # (the executor numbers the host's rows first); a row drawn on the device keeps only its
    # draw's partials (megakernel.cu lm_head_mma): logits nobody reads are not written
    HOST_LOGITS = 15


STATE_WORDS = 16


class RowWord(IntEnum):
    """int32 words of one row of a step's token table (a kernel built with ``slots``: steps of
    many sequences, docs/many-tokens.md). Rows of one sequence are consecutive and in position
    order (a prompt chunk is a segment of rows); State.NTOK counts the step's rows."""

    TOKEN = 0  # the token the row embeds
    SLOT = 1  # its sequence slot: the slot's block table maps positions to K/V pages
    POS = 2  # its position
    SEG = 3  # the first row of its segment (late q/k: the earlier keys of the same step)
    LOGITS = 4  # the row of `logits` it writes, -1: none (a prompt row before the last)
    # a row with logits also draws the token after it (row_tokens): argmax of logits /
    # TEMPERATURE + Gumbel noise keyed by (SEED, POS), the one-sequence kernel's draw
    TEMPERATURE = 5  # float32 bits; 0: greedy
    SEED = 6
    # a launch of many table steps (State.STEPS > 1): the step's end makes each row with
    # logits a decode row of the next step, fed its drawn token, unless the token is one of its
    # slot's stop tokens (stop_mask row SLOT), a NaN's -1, or the next position reaches STOP_POS
    STOP_POS = 7


ROW_WORDS = len(RowWord)


class StopReason(IntEnum):
    """Why a launch ended (State.STOP_REASON), decided by the block that ends each step."""

    NONE = 0  # it did not: the step was not the launch's last
    TOKEN = 1  # the sampled token is a stop token (stop_mask)
    POSITION = 2  # the next step would be at STOP_POS (max_new_tokens, context end)
    HOST = 3  # the host asked (host_flags[HostFlag.STOP]): a stop string, a cancel
    NAN = 4  # a logit was NaN: the token is -1
    BUDGET = 5  # the launch ran STEPS steps


class HostFlag(IntEnum):
    """int32 words of host_flags, memory the host writes while a launch runs (mapped)."""

    STOP = 0  # nonzero: end the launch (read before each LM head's wait: this step or the next)


HOST_FLAG_WORDS = 4


class Err(IntEnum):
    """int32 words of the error record; the first block to fail writes it."""

    CODE = 0
    BLOCK = 1
    INSTR = 2
    OP = 3
    COUNTER = 4
    EXPECTED = 5
    SEEN = 6


ERROR_WORDS = 8


class ErrCode(IntEnum):
    OK = 0
    WATCHDOG = 1  # a wait passed its deadline
    BAD_OPCODE = 2  # an unknown opcode reached the VM loop
    BAD_TOKEN = 3  # EMBED was given a token outside the vocabulary (a NaN step's -1): SEEN


class TraceWord(IntEnum):
    """uint64 words recorded per instruction when built with MK_TRACE."""

    START = 0  # ns (%globaltimer), before the wait
    READY = 1  # ns, the wait satisfied
    END = 2  # ns, after the signal
    SMID = 3  # the SM the block runs on (%smid; the block index in the emulator)
    # the same three moments in the SM's cycle counter (clock64; ns in the emulator): times
    # within a block at cycle resolution, where %globaltimer may tick every 32 ns to 1 us
    # (tools/trace.py timestamps: the block's %globaltimer span converts cycles to ns)
    START_CLK = 4
    READY_CLK = 5
    END_CLK = 6


TRACE_WORDS = 7

# The buffers the mat-muls take their input from: a tensor-core build (MK_MMA) stores them as
# bf16 (C type mk_in_t), the precision block_mma rounds its input to, so those mat-muls read
# half the bytes: O_PROJ's and DOWN's (attn, ffn_h) the same numbers, the RMS ops' copy of the
# residual (residual_in) the residual rounded before its norm (the reference's bf16_inputs mode
# mirrors it); fp32 in every other build, where residual_in is not used.
BF16_INPUTS = ("attn", "ffn_h", "residual_in")

# The kernel's argument struct, in order: (name, C type, shape comment). The Python side packs
# the same list (kernel/executor.py); every buffer carries its shape.
PARAMS: list[tuple[str, str, str]] = [
    ("program", "const int*", "[blocks, max_len, WIDTH] instruction words"),
    ("counters", "int*", "[num_counters] monotonic, zeroed once per generation"),
    ("state", "int*", "[STATE_WORDS]"),
    ("error", "int*", "[ERROR_WORDS]"),
    ("trace", "unsigned long long*", "[blocks, max_len, TRACE_WORDS] (MK_TRACE builds)"),
    ("residual", "float*", "[H] the residual stream"),
    ("residual_in", "mk_in_t*", "[H] the residual as bf16, stored beside it by every write of it "
     "(EMBED, O_PROJ, DOWN): the RMS ops' input in a tensor-core build (BF16_INPUTS)"),
    ("q", "float*", "[Q_DIM] roped (and normed) queries; raw with QK_NORM (late q/k)"),
    ("k_raw", "float*", "[KV_DIM] the step's keys before q/k-norm and RoPE (QK_NORM)"),
    ("attn_o", "float*", "[KV_HEADS, max_splits, GROUP, HEAD_DIM] unnormalised partial outputs"),
    ("attn_ml", "float*", "[KV_HEADS, max_splits, GROUP, 2] partial (max, sum of exp)"),
    ("attn", "mk_in_t*", "[Q_DIM] the merged attention output (a step that merges by ticket); "
     "bf16 in a tensor-core build (BF16_INPUTS)"),
    ("ffn_h", "mk_in_t*", "[FFN] silu(gate) * up; bf16 in a tensor-core build (BF16_INPUTS)"),
    ("partials", "float*", "[T_MAX, PARTIALS_LD] O_PROJ's / DOWN's input slices' fp32 sums: "
     "slice j of residual row r at j H + r (kernel/input_slices.py)"),
    ("logits", "float*", "[VOCAB]"),
    ("lm_part", "float*", "[max_partials, 2] (best score, its token id as float bits)"),
    ("out_tokens", "int*", "[MAX_SEQ] token each step at pos chose for pos + 1 (host-mapped); "
     "SLOTS: [SLOTS + 1, MAX_SEQ], a row per slot"),
    ("feed", "int*", "[MAX_SEQ] tokens fed at positions < FEED_END (written before a launch)"),
    ("stop_mask", "unsigned*", "[(VOCAB + 31) / 32] bitmap of the stop tokens; SLOTS: one per "
     "slot"),
    ("host_flags", "int*", "[HOST_FLAG_WORDS] host-mapped: the host writes them mid-launch"),
    ("k_cache", "unsigned short*", "[LAYERS, KV_ROWS, KV_HEADS, HEAD_DIM] bf16 (KV_ROWS: MAX_SEQ,"
     " or the pages' positions)"),
    ("v_cache", "unsigned short*", "[LAYERS, KV_ROWS, KV_HEADS, HEAD_DIM] bf16"),
    ("rows", "int*", "[T_MAX, ROW_WORDS] the step's token table (SLOTS builds)"),
    ("row_tokens", "int*", "[T_MAX] the token drawn after each row with logits (SLOTS)"),
    ("block_table", "int*", "[SLOTS + 1, SLOT_PAGES] K/V page of each slot's positions (SLOTS)"),
    ("rope_cos", "const float*", "[MAX_SEQ, HEAD_DIM/2]"),
    ("rope_sin", "const float*", "[MAX_SEQ, HEAD_DIM/2]"),
    ("embed", "const unsigned short*", "[VOCAB, H] bf16"),
    ("lm_head", "const unsigned short*", "[VOCAB, H] bf16 (== embed when tied)"),
    ("final_norm", "const unsigned short*", "[H] bf16"),
    ("in_norm", "const unsigned short*", "[LAYERS, H] bf16"),
    ("post_norm", "const unsigned short*", "[LAYERS, H] bf16"),
    ("wqkv", "const unsigned short*", "[LAYERS, QKV_DIM, H] bf16, rows q | k | v"),
    ("bqkv", "const unsigned short*", "[LAYERS, QKV_DIM] bf16 (HAS_BIAS)"),
    ("q_norm", "const unsigned short*", "[LAYERS, HEAD_DIM] bf16 (QK_NORM)"),
    ("k_norm", "const unsigned short*", "[LAYERS, HEAD_DIM] bf16 (QK_NORM)"),
    ("wo", "const unsigned short*", "[LAYERS, H, Q_DIM] bf16"),
    ("wg", "const unsigned short*", "[LAYERS, FFN, H] bf16"),
    ("wu", "const unsigned short*", "[LAYERS, FFN, H] bf16"),
    ("wd", "const unsigned short*", "[LAYERS, H, FFN] bf16"),
    ("begin", "int", "first instruction slot this launch runs"),
    ("end", "int", "one past the last slot"),
]

# Threads per block of the persistent kernel (8 warps).
NUM_THREADS = 256
# L2 prefetch of an instruction's weights (megakernel.cu prefetch_l2): at most this many bytes
# per range (the LM head's rows would not fit in L2 anyway).
PREFETCH_MAX_BYTES = 64 * 1024
# Positions of one attention unit processed per pass (its scores live in shared memory).
T_TILE = 128


def seg_sub(head_dim: int) -> int:
    """Positions of one online-softmax step of a segment's unit on tensor cores (megakernel.cu
    attention_segment, MK_SEG_SUB: a warp's scores of 16 queries x seg_sub positions and their
    probability fragments live in registers beside its head_dim / 2 outputs a thread): 64, or
    32 above head_dim 64 (Qwen3's pipelined kernel spilled with 64: benchmarks/NOTES.md
    "Attention's tiles in a pipeline"). The numbers follow it (the running max steps by it)."""
    return 64 if head_dim <= 64 else 32


# Late q/k keys of a segment's own rows a warp norms and ropes at once when it stages a K tile
# (megakernel.cu segment_keys: every key's loads issued before the first one's arithmetic).
SEG_KEYS = 4
# Late q/k keys of a step a warp of O_PROJ's owner block norms, ropes and caches at once
# (megakernel.cu op_o_proj_residual: the step's (token, head) pairs over the block's warps).
KEY_CACHE_KEYS = 8
# The LM head's partials a reducer lane loads before its first compare (megakernel.cu
# warp_best_of): one L2 round a row up to 32 x this many blocks.
BEST_LOADS = 8
# EMBED in a step of many rows (megakernel.cu op_embed): the rows' 16-byte chunks of the
# block's tile copied by cp.async into this many bytes of shared memory a pass (s.embed, in a
# union with s.vec), every copy of a pass issued before the wait: a pass one HBM round.
EMBED_STAGE_BYTES = 8192
# Late q/k queries of an m-tile a warp norms and ropes at once when it builds its query tile
# (megakernel.cu segment_q_tile): a 16-query m-tile in two rounds.
SEG_QUERIES = 8
# Mat-vecs (megakernel.cu RowShape<N>): 16-byte weight loads per lane a warp pass
# keeps in flight where the row allows; see row_shape.
MATVEC_LOADS = 8
# Tensor-core mat-muls (megakernel.cu block_mma and block_mma_rows, MK_MMA; the header renders
# each as MK_<name>, the cost model's design and tokens.py read them here):
MMA_KC = 32  # input columns a chunk (a lane: 8 of them)
MMA_RG = 2  # row groups of 16 a k-split pass: one input fragment feeds both
MMA_UNROLL = 2  # chunks whose loads a lane issues before their mma (a dependent round)
# token tiles (8 tokens each) a k-split pass multiplies by each chunk's weight fragments,
# loaded once (8 spilled the megakernel: benchmarks/NOTES.md)
MMA_NT = 4
# a step (a block's share) of more than this many rows, at K <= MMA_ROWS_SPLIT_MAX_K, splits a
# pass's rows over the warps (block_mma_rows): MMA_RT token tiles a pass, each warp walking
# every k range, MMA_ROWS_UNROLL chunks' weights a lane loads together
MMA_ROWS_SPLIT_ABOVE = 32
MMA_ROWS_SPLIT_MAX_K = 2048
MMA_RT = 8
MMA_ROWS_UNROLL = 2
# rounds of a warp's weight chunks block_mma_rows keeps in a ring of shared memory a lane its
# own (cp.async, a group a round): this many - 1 in flight while it multiplies one
MMA_RING = 3
# the RMS ops stage a block's share of a step of up to this many rows in shared memory (a
# prompt chunk of 128 in token groups of two, the LM head of 64 sequences; header.rms_stage_rows)
RMS_STAGE_MAX_ROWS = 64
# The most m-tiles of 16 (row, head) queries a part of a segment's rows holds (segment_parts;
# megakernel.cu op_attention_segments; -DMK_ROW_PARTS overrides it, 0: no parts): a pass on
# half the warps, the SM's 4 tensor cores busy (benchmarks/NOTES.md: 8 and 16 predicted slower).
ROW_PART_MTILES = 4
MMA_CONSTANTS = ("MMA_KC", "MMA_RG", "MMA_UNROLL", "MMA_NT", "MMA_ROWS_SPLIT_ABOVE",
                 "MMA_ROWS_SPLIT_MAX_K", "MMA_RT", "MMA_ROWS_UNROLL", "MMA_RING", "ROW_PART_MTILES")


def row_shape(n: int) -> tuple[int, int, int]:
    """megakernel.cu RowShape<n> of a bf16 row of n elements: (L, K, R), L the
    16-byte loads of the busiest lane for the whole row, K of them per row per chunk, R rows per
    warp pass; a chunk issues R x K loads per lane before its first FMA (>= MATVEC_LOADS)."""
    v = n // 8
    L = -(-v // 32)
    K = min(L, MATVEC_LOADS)
    R = 1 if L >= MATVEC_LOADS else -(-MATVEC_LOADS // L)
    return L, K, R


def pair_rows(R: int) -> int:
    """megakernel.cu block_dot_row_pairs: row pairs (gate, up) per warp pass for RowShape R."""
    return R // 2 + R % 2 if R > 1 else 1

# ATTENTION: K/V loads in flight per lane; a block reads
# attn_round_positions(head_dim) positions of a unit per HBM round.
KV_UNROLL = 4


def attn_k_vec(head_dim: int) -> int:
    """Adjacent 16-byte chunks of a K row one lane reads (megakernel.cu K_VEC): 4 at head_dim
    64 (two lanes a row, one row a lane a round: ptxas keeps the four loads of one row's base
    together; with one chunk a lane it issued a kernel of slots' K loads one at a time), else 1
    (the V loop's layout). A round reads KV_UNROLL loads a lane and the same positions either
    way. (Tiny test heads: a row's chunks at most, head_dim / 8.)"""
    return min(4, head_dim // 8) if head_dim <= 64 else 1


def attn_round_positions(head_dim: int) -> int:
    """Positions one block reads per round (megakernel.cu: KV_SLOTS * KV_UNROLL): a K/V row is
    head_dim / 8 lanes of 16-byte loads, so a warp covers 256 / head_dim positions per load."""
    return (NUM_THREADS // 32) * (32 // (head_dim // 8)) * KV_UNROLL


# ATTENTION -> O_PROJ: when a per-block merge would read at least this many bytes of
# partial outputs (every O_PROJ block reads all used splits), the splits are merged once per KV
# group instead, by the last unit of the group to draw its ticket; O_PROJ then reads the merged
# vector. Below it the per-block merge is cheaper than the ticket's chain on attention's path
# (cost model, benchmarks/NOTES.md "Kernel v2 part 1, third session").
MERGE_TICKET_BYTES = 64 * 1024


def merge_ticket_min_splits(cfg: ModelConfig) -> int:
    """Fewest used splits whose per-block merge reads MERGE_TICKET_BYTES of partials: (max,
    sum) and head_dim outputs per (KV head, split, query head), float32."""
    per_split = cfg.num_kv_heads * cfg.group_size * (cfg.head_dim + 2) * 4
    return max(2, -(-MERGE_TICKET_BYTES // per_split))


def split_chunk(n_pos: int, splits: int, min_chunk: int) -> int:
    """megakernel.cu split_chunk: positions per attention split of a step over n_pos
    positions, at least min_chunk; split s covers [s * chunk, (s + 1) * chunk)."""
    return max(min_chunk, -(-n_pos // splits))


def splits_used(n_pos: int, splits: int, min_chunk: int) -> int:
    """megakernel.cu splits_used: the splits holding at least one of n_pos positions."""
    return min(splits, -(-n_pos // split_chunk(n_pos, splits, min_chunk)))


def merge_by_ticket(used: int, least: int) -> bool:
    """megakernel.cu merge_by_ticket: a step with ``used`` splits merges them by ticket in
    ATTENTION when the program allows it (least > 0) and they are at least ``least``."""
    return least > 0 and used >= least


def row_rotations(used: list[int], splits: int) -> list[int]:
    """megakernel.cu split_slot / next_rotation: in a step of a kernel of slots (many rows),
    row r's split s runs in its KV group's unit slot
    (s + off_r) mod splits, off_r the used splits of the step's earlier rows, mod splits:
    the step's non-empty units dealt round-robin over each group's slots."""
    out, run = [], 0
    for u in used:
        out.append(run % splits)
        run += u
    return out


def segment_parts(used: int, rows: int, splits: int, group: int, most_mtiles: int) -> int:
    """(design attn_row_parts; megakernel.cu segment_parts) The parts a segment's rows split
    into for its attention: part p of ``parts`` takes the rows segment_part_rows(p, parts,
    rows) and runs split s of them in the unit slot of split s + p x used (rotated as
    row_rotations), so a prompt chunk's units fill the KV group's slots its used splits leave
    empty; a row's partials are its own whichever part holds it. The fewest parts whose
    largest holds at most ``most_mtiles`` m-tiles of 16 (row, head) queries, at most the slots
    hold (splits // used); 1 with most_mtiles 0 (off), for a decode row, or where the slots
    hold one."""
    if most_mtiles <= 0 or used <= 0:
        return 1
    most = max(1, min(splits // used, rows))
    for parts in range(1, most + 1):
        if -(-(-(-rows // parts)) * group // 16) <= most_mtiles:
            return parts
    return most


def segment_part_rows(part: int, parts: int, rows: int) -> tuple[int, int]:
    """(first, end) of part ``part``'s rows among a segment's ``rows`` (segment_parts)."""
    return part * rows // parts, (part + 1) * rows // parts


def split_parts(used: int, rows: int, first_pos: int, chunk: int, splits: int, group: int,
                most_mtiles: int) -> list[int]:
    """(design attn_split_parts; PREDICTED, not built) A segment's parts per split: split s
    (positions [s chunk, (s + 1) chunk)) takes the segment's rows that reach it (positions
    >= s chunk, a suffix of the rows: split_part_rows) in parts[s] parts, its units in the
    slots after the earlier splits' (rotated as row_rotations), so the KV group's slots go to
    the splits by their work: every split one part, then one more part at a time to the split
    whose parts hold the most work (its rows reaching it x its positions up to the segment's
    last, over its parts; the first of equals), while the slots last (sum <= splits), a part
    keeps a row and at most the parts whose largest holds ``most_mtiles`` m-tiles of 16 (row,
    head) queries (as segment_parts). A decode row (rows 1): one part a split, the splits'
    slots as today. A row's partials are its own whichever unit holds them."""
    reach = [rows - min(rows, max(0, s * chunk - first_pos)) for s in range(used)]
    seen = [max(0, min(chunk, first_pos + rows - s * chunk)) for s in range(used)]
    work = [r * n for r, n in zip(reach, seen)]

    def most(r: int) -> int:  # the fewest parts of at most most_mtiles m-tiles, of a row each
        return next((p for p in range(1, r + 1) if -(-(-(-r // p)) * group // 16) <= most_mtiles),
                    max(r, 1))

    parts = [1] * used
    while sum(parts) < splits:
        grow = [(work[s] / parts[s], -s) for s in range(used) if parts[s] < most(reach[s])]
        if not grow:
            break
        parts[-max(grow)[1]] += 1
    return parts


def split_part_rows(split: int, part: int, parts: int, rows: int, first_pos: int,
                    chunk: int) -> tuple[int, int]:
    """(first, end) among a segment's ``rows`` of part ``part`` of ``parts`` of split
    ``split``'s rows (split_parts): the rows reaching the split, in equal shares."""
    first = min(rows, max(0, split * chunk - first_pos))
    n = rows - first
    return first + part * n // parts, first + (part + 1) * n // parts


def unit_finishes(used: int, least: int) -> bool:
    """megakernel.cu unit_finishes: a row of one used split whose step merges by ticket
    (merge_ticket_min 1: the tensor-core kernel; a kernel of slots, the only one the executor
    runs with merge_ticket_min 1) is normalised and stored into ``attn`` by its one unit
    (split 0), the value the merge of one split gives: no ticket, no merge."""
    return merge_by_ticket(used, least) and used == 1


def row_finishes(used: int, least: int, rot: int) -> bool:
    """megakernel.cu row_finishes: in a step of a kernel of slots, a row of one split is
    finished by its unit only in unit slot 0 (rotation 0), the KV group's declared `attn`
    writer; otherwise the ticket merges it."""
    return unit_finishes(used, least) and rot == 0


# The split merge (megakernel.cu merge_splits): a lane loads MERGE_CHUNK splits' partials at
# once, and `ways` lanes share an output chunk of 8 elements, so S used splits take
# ceil(S / (MERGE_CHUNK * ways)) dependent rounds; the merge by ticket uses MERGE_TICKET_WAYS.
MERGE_CHUNK = 4
MERGE_TICKET_WAYS = 8


def merge_ways(used: int) -> int:
    """megakernel.cu merge_ways: the lanes sharing an output chunk in the ticket's merge of a
    row of ``used`` splits: the fewest (a power of 2, at most MERGE_TICKET_WAYS) that load them
    in one round of MERGE_CHUNK each."""
    w = 1
    while w < MERGE_TICKET_WAYS and w * MERGE_CHUNK < used:
        w *= 2
    return w


def merge_row_lanes(cfg: ModelConfig, used: int) -> int:
    """megakernel.cu attention_ticket: lanes of one row's merge in a KV group (its G x head_dim
    outputs in chunks of 8, merge_ways lanes each), whole groups of MERGE_TICKET_WAYS."""
    lanes = cfg.group_size * cfg.head_dim // 8 * merge_ways(used)
    return -(-lanes // MERGE_TICKET_WAYS) * MERGE_TICKET_WAYS


def merge_block_ways(cfg: ModelConfig) -> int:
    """Lanes per output chunk of O_PROJ's per-block split merge: the largest power of 2 <=
    MERGE_TICKET_WAYS with Q_DIM / 8 chunks x ways <= NUM_THREADS (threads that would idle
    share a chunk's splits)."""
    ways = 1
    while ways < MERGE_TICKET_WAYS and (cfg.q_dim // 8) * ways * 2 <= NUM_THREADS:
        ways *= 2
    return ways


def params_dtype():
    """numpy mirror of struct Params (C layout: align=True), to pack a launch's argument."""
    import numpy as np

    return np.dtype([(n, np.uint64 if t.endswith("*") else np.int32) for n, t, _ in PARAMS],
                    align=True)
