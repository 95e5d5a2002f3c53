"""The C header prepended to megakernel.cu: isa.py's enums, word layout, state words and argument
struct, each op's named argument words (A_<OP>_<NAME>, from kernel/ops/) and the model's
constants. Generated for every build; never written by hand. ``kernel_source`` is the whole
text a compiler gets: this header, then megakernel.cu with its own headers inlined."""

from __future__ import annotations

from pathlib import Path

from ..model.config import ModelConfig
from . import isa, ops
from .includes import inline_includes
from .isa import (ERROR_WORDS, HOST_FLAG_WORDS, KV_UNROLL, MATVEC_LOADS, MERGE_CHUNK,
                  MERGE_TICKET_WAYS, NUM_THREADS, PARAMS, PREFETCH_MAX_BYTES, ROW_WORDS,
                  SEG_KEYS, SEG_QUERIES, STATE_WORDS, T_TILE, TRACE_WORDS, WIDTH, Err,
                  ErrCode, HostFlag, Op, RowWord, State, StopReason, TraceWord, Word, attn_k_vec,
                  merge_block_ways)


SOURCE_PATH = Path(__file__).with_name("megakernel.cu")


def stop_mask_words(vocab_size: int) -> int:
    """32-bit words of one stop-token bitmap (stop_mask: one, or one per slot)."""
    return (vocab_size + 31) // 32


def _float_literal(x: float) -> str:
    return f"{float(x)!r}f".replace("inf", "INFINITY")


def model_constants(cfg: ModelConfig, max_seq_len: int) -> dict[str, int | str]:
    return {
        "MK_THREADS": NUM_THREADS,
        "MK_PREFETCH_MAX_BYTES": PREFETCH_MAX_BYTES,
        "MK_T_TILE": T_TILE,
        "MK_SEG_SUB": isa.seg_sub(cfg.head_dim),
        "MK_SEG_TILE": segment_tile(cfg),
        "MK_SEG_KEYS": SEG_KEYS,
        "MK_KEY_CACHE_KEYS": isa.KEY_CACHE_KEYS,
        "MK_BEST_LOADS": isa.BEST_LOADS,
        "MK_EMBED_STAGE_BYTES": isa.EMBED_STAGE_BYTES,
        "MK_SEG_QUERIES": SEG_QUERIES,
        "MK_MATVEC_LOADS": MATVEC_LOADS,
        "MK_KV_UNROLL": KV_UNROLL,
        **{f"MK_{name}": getattr(isa, name) for name in isa.MMA_CONSTANTS},
        "MK_K_VEC": attn_k_vec(cfg.head_dim),
        "MK_MERGE_CHUNK": MERGE_CHUNK,
        "MK_MERGE_WAYS": merge_block_ways(cfg),
        "MK_MERGE_TICKET_WAYS": MERGE_TICKET_WAYS,
        "MK_HIDDEN": cfg.hidden_size,
        "MK_FFN": cfg.intermediate_size,
        "MK_LAYERS": cfg.num_layers,
        "MK_HEADS": cfg.num_heads,
        "MK_KV_HEADS": cfg.num_kv_heads,
        "MK_HEAD_DIM": cfg.head_dim,
        "MK_GROUP": cfg.group_size,
        "MK_Q_DIM": cfg.q_dim,
        "MK_KV_DIM": cfg.kv_dim,
        "MK_QKV_DIM": cfg.qkv_dim,
        "MK_VOCAB": cfg.vocab_size,
        "MK_STOP_WORDS": stop_mask_words(cfg.vocab_size),  # a stop mask's 32-bit words
        "MK_MAX_SEQ": max_seq_len,
        "MK_HAS_BIAS": int(cfg.attention_bias),
        "MK_QK_NORM": int(cfg.qk_norm),
        "MK_RMS_EPS": _float_literal(cfg.rms_norm_eps),
    }


def slot_pages(max_seq_len: int, page_size: int) -> int:
    """Pages of one slot's block table: a whole context."""
    return -(-max_seq_len // page_size)


def dynamic_shared_bytes(cfg: ModelConfig, tokens: int, mma: bool = False) -> int:
    """Dynamic shared memory a block of the kernel takes (MK_DYN_SMEM; every launch passes
    it): in the tensor-core kernel (``mma``), a segment's staged K and V [S, head_dim + 8]
    tile buffers (S = segment_tile; two with attn_pipeline), bf16, then its split mode's
    SegSplit (attention_segment: scores fp32 [16, S + 4], probability fragments [S / 16, 32,
    4] and corrections [S / seg_sub, 32, 2] words, the final (max, sum) [32, 4]), then a query tile a warp, bf16 [16, head_dim + 8]
    (or, if more, a row-split mat-mul pass's sums, block_mma_rows, in steps of more than 32,
    then the RMS ops' staged inputs, rms_stage_rows); on CUDA cores, late q/k attention's
    chunk keys, bf16 [tokens, head_dim] (megakernel.cu chunk_keys), in a kernel of steps of
    many tokens; 0 otherwise. megakernel.cu asserts it is enough."""
    if mma:
        stage = rms_stage_rows(cfg, tokens, mma) * 2 * rms_stage_ld(cfg.hidden_size)
        return max(_segment_bytes(cfg), row_split_sums_bytes(tokens) + stage)
    if cfg.qk_norm:
        return tokens * cfg.head_dim * 2 if tokens > 1 else 0
    return 0


def _segment_bytes(cfg: ModelConfig, buffers: int | None = None,
                   tile: int | None = None) -> int:
    """attention_segment's dynamic shared memory (dynamic_shared_bytes): ``buffers`` K and V
    tile buffers (default attn_pipeline's) of ``tile`` positions (default segment_tile's), the
    split mode's, the query tiles."""
    D = cfg.head_dim
    if buffers is None:
        buffers = 2 if attn_pipeline(cfg) else 1
    if tile is None:
        tile = segment_tile(cfg)
    tiles = 2 * tile * (D + 8) * 2
    split = (16 * (tile + 4) + tile // 16 * 32 * 4 + tile // isa.seg_sub(D) * 32 * 2 +
             32 * 4)
    queries = NUM_THREADS // 32 * 16 * (D + 8) * 2
    return buffers * tiles + split * 4 + queries


def segment_tile(cfg: ModelConfig) -> int:
    """Positions of a K/V tile of the tensor-core kernel's attention (MK_SEG_TILE): T_TILE
    where two such buffers fit DYN_SMEM_CAP (head_dim 64), else half of it (head_dim 128,
    Qwen3-0.6B: two buffers in the shared memory one of T_TILE took, its L1 kept), at least
    one online-softmax step (isa.seg_sub: the numbers do not depend on the tile)."""
    tile = T_TILE
    while tile > isa.seg_sub(cfg.head_dim) and _segment_bytes(cfg, 2, tile) > DYN_SMEM_CAP:
        tile //= 2
    return tile


def attn_pipeline(cfg: ModelConfig) -> bool:
    """Whether the tensor-core kernel's attention pipelines its tiles (MK_ATTN_PIPE;
    megakernel.cu segment_pass: each tile's successor, the unit's next tile or the next unit's
    first, copied into a second buffer while it computes): where two buffers of segment_tile's
    positions keep dynamic shared memory within DYN_SMEM_CAP (every shape served: head_dim 64
    in tiles of T_TILE, 128 in tiles of half; benchmarks/NOTES.md "Attention's tiles in a
    pipeline")."""
    return _segment_bytes(cfg, 2, segment_tile(cfg)) <= DYN_SMEM_CAP


def residual_in_epilogue(cfg: ModelConfig) -> bool:
    """Whether the tensor-core kernel's unsliced O_PROJ and DOWN store the residual's bf16
    copy in their mat-mul's epilogue beside the sum (MK_RES_IN_EPI; megakernel.cu
    mma_add_rows) instead of in a pass after it (store_residual_in): at head_dim 64 (SmolLM2,
    Llama: 254 registers, no spills). At 128 (Qwen3-0.6B) the kernel of unsliced O_PROJ and
    DOWN sits at 255 registers (attention's m-tiles pass) and the epilogue's store spills it
    (20-28 bytes, in either op alone; benchmarks/NOTES.md "residual_in in the epilogue")."""
    return cfg.head_dim <= 64


def k_split_ring(cfg: ModelConfig, tokens: int) -> bool:
    """Whether the tensor-core kernel's block_mma copies the k split's weights into
    block_mma_rows' cp.async ring (MK_K_RING; megakernel.cu block_mma, not slice_mma's):
    where the kernel has that ring (steps of more than isa.MMA_ROWS_SPLIT_ABOVE tokens,
    row_split_sums_bytes) and the registers for it, head_dim 64 (SmolLM2, Llama: 254-255, no
    spills). At 128 (Qwen3-0.6B, 255 registers) it spills 20-32 bytes of the run loop's state,
    with the ring in QKV's, GATE_UP's or the LM head's k split alone, however the copies are
    laid out; the model predicts nothing from it there (benchmarks/NOTES.md "block_mma's
    weights through the ring")."""
    return tokens > isa.MMA_ROWS_SPLIT_ABOVE and cfg.head_dim <= 64


def row_split_sums_bytes(tokens: int) -> int:
    """block_mma_rows' shared memory at the start of dynamic shared memory (a kernel of steps
    of more than isa.MMA_ROWS_SPLIT_ABOVE tokens): its sums [token tiles][warps][16][8] fp32,
    then its ring [isa.MMA_RING][MMA_ROWS_UNROLL][2][threads] of 16 bytes; 0 otherwise."""
    if tokens <= isa.MMA_ROWS_SPLIT_ABOVE:
        return 0
    sums = min(isa.MMA_RT, -(-tokens // 8)) * NUM_THREADS // 32 * 16 * 8 * 4
    return sums + isa.MMA_RING * isa.MMA_ROWS_UNROLL * 2 * NUM_THREADS * 16


def rms_stage_ld(hidden: int) -> int:
    """bf16 elements a row of the RMS ops' staged inputs takes (megakernel.cu mma_rms): its 2H
    bytes rounded up to 128, plus 64, so the two rows a quarter warp's 16-byte fragment loads
    read (lanes (g, t) for g of two rows) lie 64 bytes apart modulo 128: 32 distinct banks."""
    return (-(-2 * hidden // 128) * 128 + 64) // 2


# Dynamic shared memory grows for the RMS ops' staged rows (rms_stage_rows, at most
# isa.RMS_STAGE_MAX_ROWS) to at most this: with the kernel's ~27 KB of static shared memory,
# an SM keeps ~60 KB of L1 (its 256 KB less the 196 KB carveout)
DYN_SMEM_CAP = 168 * 1024


def rms_stage_rows(cfg: ModelConfig, tokens: int, mma: bool = False) -> int:
    """How many rows (a block's share of a step's tokens) of an RMS op's normed bf16 inputs
    the tensor-core kernel stages in dynamic shared memory, after block_mma_rows' sums
    (MK_RMS_STAGE_FIT; megakernel.cu mma_rms stages the first that many rows of a share, and
    block_mma's passes read their inputs there): up to isa.RMS_STAGE_MAX_ROWS and the step's
    tokens, as many as DYN_SMEM_CAP (or attention's larger need) holds; 0 without tensor
    cores."""
    if not mma:
        return 0
    room = max(_segment_bytes(cfg), DYN_SMEM_CAP) - row_split_sums_bytes(tokens)
    fit = room // (2 * rms_stage_ld(cfg.hidden_size))
    return max(0, min(tokens, isa.RMS_STAGE_MAX_ROWS, fit))


def render_header(cfg: ModelConfig, max_seq_len: int, tokens: int = 1, slots: int = 0,
                  page_size: int = 0, pool_pages: int = 0, mma: bool = False,
                  slices: tuple[int, int] = (1, 1)) -> str:
    """The C header prepended to megakernel.cu; ``tokens``: the most tokens a step carries
    (Program.tokens, MK_T_MAX); ``slots`` (> 0): steps of many sequences read from the token
    table, their K/V in pages of ``page_size`` positions (MK_SLOTS; the pool holds a context for
    the one-sequence calls, which use block table row ``slots``, then ``pool_pages`` pages for
    the slots: 0, a context for each); ``mma``: the mat-muls on tensor cores (MK_MMA, a kernel
    of slots only: backend option tensor_cores); ``slices``: O_PROJ's and DOWN's input slices
    (Program.slices_of; MK_O_PROJ_SLICES, MK_DOWN_SLICES, 1: none)."""
    out = ["// Generated by monokernel/kernel/header.py from isa.py, kernel/ops and the model's",
           "// config.",
           "// Do not edit: change isa.py, the op's module or config.py instead.", ""]

    def enum(name: str, members, prefix: str) -> None:
        out.append(f"enum {name} {{")
        out.extend(f"  {prefix}{m.name} = {int(m)}," for m in members)
        out.append("};")

    enum("Op", Op, "OP_")
    enum("Word", Word, "W_")
    enum("StateWord", State, "S_")
    enum("RowWordIndex", RowWord, "R_")
    enum("ErrWord", Err, "E_")
    enum("ErrCode", ErrCode, "ERR_")
    enum("StopReason", StopReason, "STOP_")
    enum("HostFlag", HostFlag, "H_")
    enum("TraceWord", TraceWord, "T_")
    out.append("// The packed words' fields (isa.PACKED_WORDS): MK_<WORD>_<FIELD>(w).")
    for word, fields in isa.PACKED_WORDS.items():
        for f in fields:
            mask = hex(f.most)
            value = f"((w) & {mask})" if f.shift == 0 else f"(((w) >> {f.shift}) & {mask})"
            out.append(f"#define MK_{word}_{f.name}(w) {value}")
    out.append("// Each op's named argument words (kernel/ops/<op>.py ARGS).")
    out.append("enum OpArg {")
    for op in Op:
        if op == Op.NOOP:
            continue
        out.extend(f"  A_{op.name}_{n.upper()} = W_ARG{k},"
                   for k, n in enumerate(ops.args(op).names))
    out.append("};")
    out.append(f"#define MK_NUM_OPS {len(Op)}")
    out.append(f"#define MK_WIDTH {WIDTH}")
    out.append(f"#define MK_STATE_WORDS {STATE_WORDS}")
    out.append(f"#define MK_ERROR_WORDS {ERROR_WORDS}")
    out.append(f"#define MK_HOST_FLAG_WORDS {HOST_FLAG_WORDS}")
    out.append(f"#define MK_TRACE_WORDS {TRACE_WORDS}")
    out.append(f"#define MK_T_MAX {tokens}")
    out.append(f"#define MK_DYN_SMEM {dynamic_shared_bytes(cfg, tokens, mma)}")
    out.append(f"#define MK_RMS_STAGE_FIT {rms_stage_rows(cfg, tokens, mma)}")
    out.append(f"#define MK_RMS_STAGE_LD {rms_stage_ld(cfg.hidden_size)}")
    out.append(f"#define MK_RMS_STAGE_AT {row_split_sums_bytes(tokens) if mma else 0}")
    out.append(f"#define MK_ROW_WORDS {ROW_WORDS}")
    out.append(f"#define MK_SLOTS {slots}")
    out.append(f"#define MK_MMA {int(bool(mma))}")
    out.append(f"#define MK_ATTN_PIPE {int(bool(mma) and attn_pipeline(cfg))}")
    out.append(f"#define MK_RES_IN_EPI {int(bool(mma) and residual_in_epilogue(cfg))}")
    out.append(f"#define MK_K_RING {int(bool(mma) and k_split_ring(cfg, tokens))}")
    out.append(f"#define MK_O_PROJ_SLICES {slices[0]}")
    out.append(f"#define MK_DOWN_SLICES {slices[1]}")
    out.append(f"#define MK_PARTIALS_LD {cfg.hidden_size * max(slices)}")
    if slots:
        pages = slot_pages(max_seq_len, page_size)
        out.append(f"#define MK_PAGE {page_size}")
        out.append(f"#define MK_SLOT_PAGES {pages}")
        pool = pool_pages or slots * pages
        out.append(f"#define MK_KV_ROWS {(pages + pool) * page_size}")
    else:
        out.append(f"#define MK_KV_ROWS {max_seq_len}")
    out.append("")
    out.append(f"// model: {cfg.name} ({cfg.arch})")
    for k, v in model_constants(cfg, max_seq_len).items():
        out.append(f"#define {k} {v}")
    out.append("")
    out.append("// Op names, for error messages and traces.")
    names = ", ".join(f'"{m.name}"' for m in Op)
    out.append(f"#define MK_OP_NAMES {{ {names} }}")
    out.append("")
    out.append("// isa.BF16_INPUTS: O_PROJ's and DOWN's inputs as their producers store them")
    out.append(f"typedef {'unsigned short' if mma else 'float'} mk_in_t;")
    out.append("struct Params {")
    width = max(len(f"{t} {n};") for n, t, _ in PARAMS)
    for n, t, shape in PARAMS:
        out.append(f"  {(t + ' ' + n + ';').ljust(width)}  // {shape}")
    out.append("};")
    return "\n".join(out) + "\n"


def kernel_source(cfg: ModelConfig, max_seq_len: int, tokens: int = 1, slots: int = 0,
                  page_size: int = 0, pool_pages: int = 0, mma: bool = False,
                  slices: tuple[int, int] = (1, 1)) -> str:
    """Generated header + megakernel.cu (its own quoted includes inlined), with #line so compiler
    errors point at real lines. ``tokens``: the program's most tokens per step; ``slots`` (> 0):
    steps of many sequences from the token table, K/V in pages of ``page_size`` positions,
    ``pool_pages`` of them for the slots (0: a context per slot); ``mma``: the mat-muls on
    tensor cores (a kernel of slots); ``slices``: O_PROJ's and DOWN's input slices."""
    return (render_header(cfg, max_seq_len, tokens, slots, page_size, pool_pages, mma, slices)
            + '#line 1 "megakernel.cu"\n'
            + inline_includes(SOURCE_PATH.read_text(), SOURCE_PATH.parent, "megakernel.cu"))
