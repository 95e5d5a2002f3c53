"""The kernel's design knobs, as the cost model sees them, and the named designs.

A knob is kept while a design still in use, or an A/B twin a GPU has yet to measure, sets it
differently (the hop of ``cuda-sync1``, the one launch per step of ``cuda-1step``, the L2
prefetch of ``cuda-noprefetch``), or while a test shows what it is worth. V6 is the kernel as
built: the knobs the compiled kernel fixes come from its SASS (sass_facts.json, held to the
kernel by tests/kernel/test_sass.py). V5 is the previous kernel as compiled, kept so that `plan
--design v5` predicts it. The retired designs (v1 to v4 and the ladder of PERFORMANCE.md
section 3) are in git history and benchmarks/NOTES.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ...errors import CostModelError
from .. import sass_facts
from ..isa import (EMBED_STAGE_BYTES, KEY_CACHE_KEYS, MMA_NT, MMA_RG, MMA_ROWS_SPLIT_ABOVE,
                   MMA_ROWS_SPLIT_MAX_K, MMA_ROWS_UNROLL, MMA_RT, NUM_THREADS,
                   RMS_STAGE_MAX_ROWS, ROW_PART_MTILES)

# Steps a multi-step launch shares its overhead with: the 64 greedy tokens of issue 8's
# generation (a longer prompt in the same launch only shares it further).
GENERATION_STEPS = 64


@dataclass(frozen=True)
class KernelDesign:
    """What the kernel does, as the cost model sees it. Every prediction takes one; the
    defaults are the kernel as built but for the knobs read off its SASS (``V6``)."""

    name: str
    threads: int = NUM_THREADS
    # dependent global round trips per op after its wait, NOT counting the weight stream's own
    # rounds (those follow from the tiles): (to L2, to HBM). Only the residual (RMS ops) or
    # ffn_h (DOWN) is a round trip before the weights; norm weights are loaded before the
    # wait, bias / RoPE / q-k-norm weights and the block's own residual rows in the weights'
    # round trip.
    trips: dict[str, tuple[int, int]] = field(default_factory=lambda: {
        "EMBED": (0, 1),  # the embedding row
        "RMS_QKV_ROPE": (1, 0),
        "ATTENTION": (1, 0),  # the group's queries, per unit
        "O_PROJ_RESIDUAL": (0, 0),  # (+ the merge: ops/o_proj.py)
        "RMS_GATE_UP": (1, 0),
        "DOWN_RESIDUAL": (1, 0),
        "RMS_LM_HEAD": (1, 0),
    })
    # when a step uses at least the program's merge_ticket_min splits, the last unit of each
    # KV group to draw the group's ticket merges the group once (into `attn`), and O_PROJ reads
    # the merged vector. False: every O_PROJ block merges every used split itself
    o_proj_merge_ticket: bool = True
    # the per-block merge shares an output chunk's splits among isa.merge_block_ways(config)
    # lanes: ceil(used / (MERGE_CHUNK x ways)) rounds. False: one lane per chunk
    o_proj_merge_ways: bool = True
    # hop: signal = bar + (MEMBAR.SC + CCTL | release atomic); poll = loads + timer + sleep.
    # MK_SYNC=2 (default): release add, one acquire load per poll, no early sleep; MK_SYNC=1
    # (cuda-sync1): fence + atomicAdd, two loads and a nanosleep per poll
    signal_sc_fence: bool = False
    poll_loads: int = 1
    poll_sleep: bool = False
    # ATTENTION: of its KV_UNROLL K loads, how many the compiled loop keeps in flight per lane,
    # by head_dim ((head_dim, loads), ...; absent: all KV_UNROLL). tests/kernel/test_sass.py
    # checks it
    attn_k_in_flight: tuple[tuple[int, int], ...] = ()
    # late q/k (QK_NORM): warp_qk_norm_rope issues its vector, norm-weight and RoPE loads
    # together, the weights and the RoPE row prefetched into L2 (False: three dependent trips,
    # the weights from HBM)
    late_qk_one_trip: bool = True
    # late q/k: O_PROJ's owner blocks cache the step's keys of their KV heads. 0 (before the
    # thirty-fourth session): a warp per head, one token after another (a step of T tokens: T
    # dependent rounds); N > 0: the step's (token, head) pairs over the block's warps, N keys a
    # warp round (warp_qk_norm_rope_n<N>: every load of the N issued together), so
    # ceil(T x heads / (warps x N)) rounds
    k_cache_keys_per_warp: int = 0
    # EMBED in a step of T rows. 0 (before the thirty-fifth session): a row after another,
    # each the tile's columns a thread, its load and stores before the next row's load (T
    # dependent HBM trips); N > 0: the rows' 16-byte chunks of the tile copied by cp.async into
    # N bytes of shared memory a pass, every copy of a pass issued before the wait, then stored
    # from there (ops/embed.py row_rounds: a pass one round)
    embed_stage_bytes: int = 0
    # a step's end with many logits rows: finish_rows hands each row's drawn token on (its
    # out_tokens word, its stop check, the next table's row) on one thread, a row after
    # another (False, before the thirty-fourth session), or a thread a row at once with a
    # block scan for the next table's order (tokens.step_end_extra_us)
    finish_rows_parallel: bool = False
    # ATTENTION prefetches its units' K/V rows of the positions cached before this step into L2
    # before its wait
    attn_kv_prefetch: bool = True
    # L2 prefetch of an instruction's weights before its wait (MK_PREFETCH; cuda-noprefetch: 0)
    l2_prefetch: bool = True
    # decode steps per launch (launch overhead amortised; chained steps add one hop each)
    steps_per_launch: int = GENERATION_STEPS
    # ---- the kernel as compiled (what the sm_90 SASS shows; issue 15 section 3)
    # The instruction's words: dependent loads before its prefetch and wait (0: fetched during
    # the previous instruction, off the path), at L2 latency, or with fetch_misses the share
    # `fetch_miss` of them at HBM's loaded latency.
    instruction_fetch_trips: int = 0
    fetch_misses: bool = True
    # issue slots per 16-byte weight load once it arrives (bf16 unpack, FFMA, x's LDS) on the
    # SM's schedulers, and the pass's warp sums (5 dependent SHFL + FADD); 0: not charged
    matvec_issue_per_load: float = 0.0
    # copies into shared memory of a vector other blocks wrote (DOWN's ffn_h, O_PROJ's merged
    # attention): 0, one round (all loads first); u > 0, as nvcc compiles a strided loop
    # unrolled u times: (n mod u) single loads, then n // u rounds of u
    copy_unroll: int = 0
    # the step's end (finish_step): the host's stop flag read over PCIe before the release;
    # MEMBAR.SC.SYS after the token's store
    step_end_host_read: bool = False
    step_end_sys_fence: bool = False
    # blocks that read the host's stop flag (mapped host memory) before the LM head's wait:
    # the reads of one host word are served one after another (`pcie_serial` each), and a
    # block's wait ends only when its read is back; 1 (the kernel since 2026-12-04: the first
    # tile's block alone) hides it under that wait. The kernel the first GPU run measured
    # (a5ee726) had every block read it (costmodel/measured.py)
    host_flag_readers: int = 1
    # tickets cost the constant `ticket` (acq_rel as compiled: drain, round trip, L1
    # invalidate), every drawer; the last LM-head drawer's reduction and finish_step's loads end
    # the step (False: spread over the instructions)
    ticket_as_compiled: bool = True
    # the weight stream at the achieved GEMV rate (gemv_bw) instead of the copy rate, and its
    # first bytes one latency after it starts (a ramp per op)
    gemv_rate: bool = True
    stream_ramp: bool = True
    # RMS ops load their norm weights just before the wait, so on a block whose wait returns at
    # once their loaded HBM latency is not hidden behind the residual's L2 trip. False: they are
    # in L2 or registers before they are needed (prefetch_norm of the previous instruction)
    norm_weights_late: bool = False
    # ---- steps of many tokens (issue 17; costmodel/tokens.py)
    # steps of up to prefill_chunk tokens of one sequence (a prompt chunk; megakernel.cu
    # MK_T_MAX), every op looping over them on CUDA cores: each token's arithmetic is the
    # one-token step's, its weights re-read from L2 after the first token's pass
    token_loop: bool = False
    # ---- predicted, not built yet
    # mat-muls of the step's tokens on tensor cores (mma.sync m16n8k16); False: one token per
    # step only (the kernel as built)
    tensor_cores: bool = False
    # 2D tiles: a mat-mul's input split over S blocks (tokens.input_splits), the partial sums
    # added in a fixed order
    tile_2d: bool = False
    # the input split with the token groups as built (PREDICTED, not built): O_PROJ's and
    # DOWN's input over s blocks where it pays (an RMS op's norm needs its rows whole) (s a power of two up to 16, chosen per op by
    # tokens._tile_us for its busiest tile, the program's token groups kept); the reduction
    # spread over the row group's c x s blocks: each writes its fp32 partials, waits on the
    # group's counter (a hop), and sums the s partials of its own share of the group's
    # outputs in a fixed order (costmodel/floor.py's split). tile_2d's reduction is one last
    # drawer's
    input_slices_spread: bool = False
    # bytes per element of a mat-mul's input as the blocks read it: 4, the fp32 residual (or
    # attention output, FFN h) as today; 2, a bf16 copy its producer writes beside it (the
    # tensor cores take bf16; RMSNorm's weight folded into the weights at load, its 1/rms per
    # token applied to the outputs from per-token sum-of-squares partials)
    input_bytes: int = 4
    # O_PROJ and DOWN read their input (the merged attention output, FFN h) as the bf16 its
    # producer stored (what the tensor cores round it to: a token's numbers unchanged), 2 bytes
    # an element whatever input_bytes says; the RMS ops still read the residual at input_bytes
    stored_bf16_inputs: bool = False
    # O_PROJ and DOWN store the residual's bf16 copy (residual_in) in a pass after their
    # mat-mul (megakernel.cu store_residual_in): one more dependent round, each output of the
    # epilogue read back (4 bytes) and its copy written (2)
    residual_copy_pass: bool = False
    # (with residual_copy_pass) the copy stored in the mat-mul's epilogue beside the residual's
    # sum instead (megakernel.cu mma_add_rows): no pass, 2 bytes an output
    residual_copy_epilogue: bool = False
    # n-tiles (8 tokens each) a tensor-core mat-mul pass multiplies per load of its weights
    # (megakernel.cu block_mma: a pass holds a 32-row group pair's fragments of a k chunk in
    # registers and runs them against this many token tiles): a block's tile re-reads its
    # weights ceil(T / (8 x this)) - 1 more times in a step of T tokens, from L2 (its tile
    # is past L1). 0: once a step whatever its tokens (v7 / v8: staged in shared memory)
    mma_token_tiles: int = 0
    # a mat-mul's inputs of one token pass that L1 keeps across the tile's row passes (each
    # pass of 32 weight rows reads them again); a larger token pass reads them again from L2
    # on each row pass after the first. A guess, for a GPU to check: the 90-150 KB of L1 the
    # kernel's shared memory leaves an SM, with the weights (__ldg) streaming through it too
    l1_input_bytes: int = 64 * 1024
    # the weight rows a block_mma pass multiplies (with mma_token_tiles): isa.MMA_RG row
    # groups of 16 with the k-loop split over the warps
    mma_pass_rows: int = 16 * MMA_RG
    # block_mma's passes in a step (a token group member's share) of more than this many
    # tokens split the rows over the warps instead of the k-loop: a row group of 16 a warp,
    # 8 token tiles, each warp every k range in turn (its partials added in warp order: the
    # same numbers); 0: never
    mma_rows_split_above: int = 0
    # ... in an op of at most this many input columns (a warp's walk over every k range is
    # C / MMA_UNROLL dependent rounds: DOWN's long k stays split over the warps)
    mma_rows_split_max_k: int = 1 << 30
    # ... its token tiles a pass, and the chunks whose loads a lane issues together
    mma_rows_split_tiles: int = MMA_RT
    mma_rows_split_unroll: int = MMA_ROWS_UNROLL
    # (block_mma_rows) as a warp starts a k range of its row group it prefetches the group's
    # next one into L2, so each walk's dependent rounds after its first range wait on L2, not
    # HBM (the stream's HBM share is unchanged; Phases.rolling)
    mma_rows_prefetch: bool = False
    # (PREDICTED, not built) a mat-mul's reads run beside its mma: block_mma's and
    # block_mma_rows' next round's weights (and inputs where they are a copy) in flight, by
    # cp.async into a ring per warp, while the warp multiplies this round's, so the bytes a
    # block reads from L2 (its token group's other tiles' weights, a token pass's re-reads, its
    # inputs) cost what they take at the SM's L2 share beside the mma, with the HBM stream's
    # bytes through the same share: the slower of the two bounds the mat-mul. False (as
    # built): they are loads into registers of a round its mma then waits on, charged after
    # the stream (tokens.widen_matmul)
    mma_l2_overlap: bool = False
    # ... block_mma_rows' alone (megakernel.cu: its weights through a per-lane cp.async ring of
    # isa.MMA_RING rounds, MMA_RING - 1 in flight during a round's mma; block_mma's k split
    # loads a round into registers): the slower of its mma and its bytes at the L2 share
    mma_rows_l2_overlap: bool = False
    # ... and block_mma's k split of an unsliced op (O_PROJ's and DOWN's without input slices,
    # QKV, GATE_UP, the LM head) through the same ring, a round of one chunk (MMA_RG row
    # groups x 2 halves), in a kernel with the ring's shared memory and the registers for it
    # (header.k_split_ring); slice_mma's k split (a warp's chunks of K / SLICES,
    # mostly one) keeps its register loads (benchmarks/NOTES.md "block_mma's weights through
    # the ring")
    mma_k_ring: bool = False
    # (PREDICTED, not built) the last layer's ATTENTION, O_PROJ, GATE_UP and DOWN run only the
    # step's rows that need logits (a prompt chunk's last token; every decode row): once QKV has
    # written every row's K/V, nothing reads the other rows' residual again (simulate.py
    # _step_batches); False (as built): every row through every layer
    last_layer_logits: bool = False
    # a step where no row needs logits (a prompt chunk before the prompt's last) runs nothing of
    # the last layer after QKV but what later steps read (late q/k: O_PROJ caching the keys;
    # the input slices' group counters): simulate.py _step_batches, megakernel.cu
    # last_layer_idle; a step with any row needing logits runs every row. Built in every
    # tensor-core kernel of slots (design_for)
    last_layer_skip: bool = False
    # the RMS ops (QKV, GATE_UP, the LM head) whose block's share of a step is at most this
    # many rows stage their normed bf16 inputs in shared memory (megakernel.cu mma_rms: each
    # row read from L2 once, for its sum of squares, then again from L1 by the same warp to
    # norm it), and block_mma's passes read them there; a larger share reads the fp32 residual
    # again in every pass (the first from L2 too where its rows are past l1_input_bytes).
    # header.rms_stage_rows: what fits beside block_mma_rows' sums
    rms_stage_rows: int = 0
    # ... and a larger share stages its first rms_stage_rows rows, the rest read as unstaged
    rms_stage_partial: bool = False
    # steps of many rows (kernels of slots): row r's split s runs in its KV group's unit slot
    # (s + off_r) mod splits, off_r the used splits of the step's earlier rows (the step's
    # non-empty units dealt round-robin over the slots), and a unit with no positions is
    # skipped; False: every row's split s in slot s (all rows on the blocks holding the used
    # splits: the one-sequence kernel of prompt chunks)
    attn_rotate_rows: bool = False
    # (with attn_rotate_rows) a ticket per row and KV group: the instructions holding a row's
    # units each add their count of them, all the rows' draws of a block at once, and the
    # last to draw merges that row; False: one ticket per KV group, its last drawer merging
    # every row of the step alone
    attn_row_tickets: bool = False
    # (kernels of slots) while an ATTENTION instruction runs a unit it prefetches the next
    # unit's K/V into L2 (prefetch.global.L2, a line a thread), so the K/V stream runs on
    # during each unit's fixed work; False: only the step's first row's units are prefetched,
    # before the wait (prefetch_weights)
    attn_rolling_prefetch: bool = False
    # (with attn_rolling_prefetch) before the wait, prefetch_weights prefetches the positions
    # cached before the step of the instruction's first unit, whichever row's it is; False:
    # the units of the step's first row
    attn_first_unit_prefetch: bool = False
    # (with attn_rotate_rows, a kernel of slots on tensor cores) a step's segment (one
    # sequence's rows: a prompt chunk, or a decode row) shares one rotation, the used splits
    # of its last row; a block runs a unit for all the segment's rows that reach it at once:
    # the unit's K and V staged in shared memory once, the rows' queries x K and
    # probabilities x V on tensor cores (mma.sync), the (row, head) pairs in m-tiles of 16 a
    # warp (megakernel.cu attention_segment); False: every row its own pass on CUDA cores
    attn_segments: bool = False
    # (with attn_segments) a unit's K and V tiles staged by cp.async as rows (V's B fragments
    # by ldmatrix .trans); False: V transposed through registers into V^T by 2-byte stores,
    # a row's HEAD_DIM / 8 chunks on one bank (T_TILE + 8 bf16 a V^T row: 544 words, a
    # multiple of 32 banks), so each warp store is HEAD_DIM / 8 shared-memory wavefronts
    attn_stage_async: bool = False
    # (with attn_segments) a pass issues its first tile's K and V copies (cp.async) before it
    # builds its query tile, so the queries' L2 trip runs under the tile's round; with late q/k
    # (whose 128-slot Qwen3 kernel spills so) after it, the segment's keys normed under the
    # copies from the last warp down, so where a decode row's one m-tile leaves those warps
    # free of queries, a key's trip and work run beside the queries' (megakernel.cu
    # segment_pass, segment_keys); False: query tile, then the tile's copies, then keys
    attn_stage_first: bool = False
    # ATTENTION units a block runs side by side (a warp each) when a step has more units than
    # blocks: their dependent trips and fixed work overlap
    attn_units_in_flight: int = 1
    # (with attn_segments, attn_units_in_flight > 1) the most positions of a decode row's unit
    # that one warp runs (v6-mma-warp-units): longer units stay the block's
    attn_warp_unit_positions: int = 0
    # (with attn_segments and attn_rotate_rows) an instruction's units in a pipeline: the next
    # unit's first K/V tile is copied (cp.async) into a second tile buffer while the block
    # computes the current one's last tile, so that much of the work runs beside the K/V
    # stream instead of before it (a unit's later tiles staged in turn: all of a one-tile
    # unit's work; benchmarks/NOTES.md "Attention's units in a pipeline")
    attn_unit_pipeline: bool = False
    # (with attn_unit_pipeline) the pipeline by tiles: each tile's successor (the unit's next
    # tile, else the next unit's first) copied into the other buffer while the tile computes,
    # so a unit of many tiles (a split of more than T_TILE positions) runs the work of every
    # tile beside the stream, the instruction's first tile's alone in turn (megakernel.cu
    # segment_pass; benchmarks/NOTES.md "Attention's tiles in a pipeline")
    attn_tile_pipeline: bool = False
    # (with attn_segments) a segment's rows split into parts that run its splits in the unit
    # slots its used splits leave empty (isa.segment_parts, megakernel.cu segment_parts): a
    # prompt chunk's attention on up to splits // used blocks a KV group instead of used, the
    # fewest parts of at most this many m-tiles each; 0: every row of a segment in its split's
    # one unit
    attn_row_parts: int = 0
    # (PREDICTED, not built; with attn_row_parts) a segment's slots dealt to its splits by their
    # work (isa.split_parts): split s's reaching rows in its own number of parts, so a chunk's
    # lighter splits (the diagonal ones, few rows) take fewer slots and the full ones more,
    # and every slot of the KV group runs a unit (benchmarks/NOTES.md "A chunk's attention
    # slots by the splits' work"); False: every split of a segment in the same parts
    attn_split_parts: bool = False
    # ATTENTION's scores and values on tensor cores (every step, one token too: a sequence's
    # numbers must not depend on the step's other tokens); False: CUDA-core FMA as built
    attn_tensor_cores: bool = False
    # K/V bytes a block keeps in flight in a step of many tokens (cp.async into a shared-memory
    # ring); 0: as the one-token loop compiles (KV_UNROLL loads per lane, attn_k_in_flight)
    kv_bytes_in_flight: int = 0
    # a prompt is prefilled this many tokens per step (the step's token budget)
    prefill_chunk: int = 128
    # ---- the throughput levers of the many-token design (issue 17; predicted, not built;
    # costmodel/levers.py charges them). Off: v7 as predicted in slice 1.
    # Lever 1, fewer grid-wide waits: gate_up and down fused in one instruction. A block
    # multiplies its own h rows (in shared memory) by Wd's columns for them (Wd stored
    # transposed) and adds its partial of every residual row with red.global.add.v4.f32: no
    # wait between gate_up and down, no h copy, no h input read; its H x T fp32 partial goes
    # to L2 as atomics (charged at the SM's L2 share). Float adds in arrival order: NOT batch
    # invariant (nor run-to-run identical); an ordered sum of the partials needs a grid-wide
    # wait of its own, the hop it saves (PERFORMANCE.md 3), so there is no deterministic twin.
    fused_ffn: bool = False
    # Lever 2, K/V at the copy rate: ATTENTION's K/V move by cp.async.bulk (TMA) into a ring
    # of kv_bytes_in_flight in shared memory and the mma reads the stages there, so no register
    # load and no FMA stands between the loads: the stream runs at the copy rate (hbm_bw), not
    # at a GEMV's achieved rate (gemv_bw). Its rounds still obey Little's law (rounds of
    # kv_bytes_in_flight at HBM latency)
    kv_copy_rate: bool = False
    # ... and the weights of a step of many tokens the same way: there the mma reads its
    # weight fragments from shared memory (ldmatrix), so they go there by cp.async.bulk as the
    # K/V do, at the copy rate (a step of one token keeps the mat-vec's loads and rate)
    weights_copy_rate: bool = False
    # Lever 3, input multicast: thread-block clusters of this many blocks that read the same
    # mat-mul input (same token group and input slice, different rows) load it once from L2
    # by TMA `.multicast::cluster` into every member's shared memory: the input reaches a
    # block at min(m x its L2 share, l2_fill). 1: no clusters. Needs a cooperative launch
    # with clusters that keeps one block per SM on all SMs: a GPU question
    input_multicast: int = 1
    # Lever 4, data-as-flag hops: a producer stores its outputs as 8-byte words of 4 data
    # bytes and the step's 4-byte flag (st.relaxed.gpu.u64, NCCL's LL protocol: single-copy
    # atomic), with no barrier nor release before a counter add; the consumer's read of its
    # input is the poll (it re-reads the words whose flag is stale), so the signal costs
    # nothing, and the input's own L2 trip after the wait merges into the poll. Relaxed flags
    # order only the flagged words themselves, so everything read after a hop in the same step
    # is written as LL words (residual, inputs, q, ffn_h, the merged attention, and the new
    # position's k/v in a side buffer beside its plain cache row); the plain K/V cache rows
    # reach the next step through the step's acq_rel ticket and the step counter, which stays
    # a counter. The price:
    # every waited-on input and every output store moves twice its bytes, so the kernel keeps
    # both protocols and takes the flags for steps of up to this many tokens (the step's
    # token count is in its token table, the same for every block); 0: counters always
    data_flag_hops: int = 0

    @property
    def warps(self) -> int:
        return self.threads // 32

    def replace(self, **changes) -> "KernelDesign":
        return dataclasses.replace(self, **changes)


# V5 as compiled (sm_90 SASS of commit 4b0e6fe; benchmarks/NOTES.md "The cost model tells the
# truth"): its words fetched in two dependent trips, copies unrolled by 4, the host flag read
# and a system fence at the step's end, norm weights loaded just before the wait.
V5 = KernelDesign("v5", instruction_fetch_trips=2, matvec_issue_per_load=17.0, copy_unroll=4,
                  step_end_host_read=True, step_end_sys_fence=True, norm_weights_late=True)
# V6: the kernel as built (issue 15 section 4), the knobs its SASS fixes read off it.
V6 = KernelDesign("v6", **sass_facts.compiled_knobs())
# V7: steps of many tokens (issue 17), PREDICTED before it is built: V6's program and hops,
# mat-muls on tensor cores with 2D tiles; v7-rows keeps row tiles (every block reads its op's
# whole input: the activation broadcast). A step of one token is V6's.
# Prompts in 512-token chunks: each step pays the one-token step's hops and trips (~270-770
# us) whatever its tokens, so larger chunks amortise them (predicted TTFT of 1024 tokens,
# SmolLM2: 4.5 ms in chunks of 128, 2.7 in 512, 2.3 in one step); 512 is vLLM's scale of
# token budget and keeps a step mixed with decode tokens under ~2.5 ms on Llama-3.2-1B.
V7 = V6.replace(name="v7", tensor_cores=True, tile_2d=True, input_bytes=2,
                attn_units_in_flight=8, attn_tensor_cores=True, kv_bytes_in_flight=32 * 1024,
                prefill_chunk=512)
V7_ROWS = V7.replace(name="v7-rows", tile_2d=False)
# V8: v7 with the levers a kernel can build keeping a sequence's numbers independent of its
# neighbours and needing no GPU answer first (issue 17, PREDICTED): K/V, and the weights of a
# step of many tokens, by cp.async at the copy rate; data-as-flag hops in steps of up to 16
# tokens (beyond that the flags' doubled input bytes cost more than the hops they save: at
# batch 64 -7% on Qwen3, -11% on Llama; at batch 16 they break even on Llama). v8-cluster
# adds input multicast in clusters of 2, if a cooperative launch with clusters keeps 132
# co-resident blocks (a GPU question). The fused FFN (fused_ffn) is in neither: float
# atomics, so not batch invariant, and slower at batch 64 on Qwen3 and Llama.
V8 = V7.replace(name="v8", kv_copy_rate=True, weights_copy_rate=True, data_flag_hops=16)
V8_CLUSTER = V8.replace(name="v8-cluster", input_multicast=2)
# V6-MMA: slice 6a of issue 17 (PREDICTED before it is built): the kernel of slots with its
# mat-muls on tensor cores (mma.sync m16n8k16, every step of the build, one token too: a
# sequence's numbers must not depend on the step's other rows) and nothing else of v7: row
# tiles (every block reads every row's input), the RMS ops' inputs read as fp32 and rounded to
# bf16 as the fragments are built (input_bytes 4; O_PROJ's and DOWN's stored as bf16 by their
# producers: stored_bf16_inputs, built), attention per row on CUDA cores as slice 3 built it,
# prompts in chunks of the program's tokens per step; a step's rows rotated over each KV
# group's unit slots (built: attn_rotate_rows), each row merged by its last holder's ticket
# (built: attn_row_tickets), each unit's successor prefetched into L2 while it runs and the
# first before the wait (built: attn_rolling_prefetch, attn_first_unit_prefetch). Its
# attention K loop keeps all KV_UNROLL loads in flight: at head_dim 64 a lane reads one row's
# four adjacent chunks (isa.attn_k_vec; with a chunk a lane ptxas issued a kernel of slots' K
# loads one at a time: benchmarks/NOTES.md), tests/kernel/test_sass.py.
V6_MMA = V6.replace(name="v6-mma", token_loop=True, tensor_cores=True, attn_rotate_rows=True,
                    stored_bf16_inputs=True, mma_token_tiles=1, attn_row_tickets=True,
                    attn_rolling_prefetch=True, attn_first_unit_prefetch=True)
# The tensor-core kernel (megakernel.cu SEG_ATTN): a step's segments run each attention unit
# for all their rows on mma.sync (attn_segments), a decode row's one m-tile split over the
# warps; with late q/k (Qwen3) the queries normed and roped into their query tiles and the
# segment's keys into the K tile; K and V staged by cp.async (attn_stage_async). V6_MMA (rows
# on CUDA cores) is no longer built.
# A pass of block_mma multiplies each chunk's weights by up to isa.MMA_NT token tiles
# (mma_token_tiles); in a step (a block's share) of more than isa.MMA_ROWS_SPLIT_ABOVE rows, at
# K <= isa.MMA_ROWS_SPLIT_MAX_K, its passes split the rows over the warps (block_mma_rows).
# The RMS ops stage a share of up to isa.RMS_STAGE_MAX_ROWS rows in shared memory (mma_rms;
# design_for: fewer where the shape's rows do not fit, Llama-3.2-1B's 33). A segment's rows
# run its attention in parts of at most isa.ROW_PART_MTILES m-tiles (attn_row_parts). The RMS
# ops read the residual's bf16 copy its writers store beside it (residual_in: input_bytes 2).
# The row split's walk prefetches each next k range into L2 (mma_rows_prefetch; NOTES.md "The
# row split's walk prefetches its next k range"). A share past the staged rows stages its first
# ones (rms_stage_partial).
# A segment pass issues its first K/V copies before its query tile, a decode row's key on the
# last warps beside its queries (attn_stage_first). Where the shape's two K/V tile buffers fit
# (header.attn_pipeline: every shape, Qwen3's in tiles of 64) the kernel is V6_MMA_TILES's
# (design_for).
V6_MMA_SEG = V6_MMA.replace(name="v6-mma-seg", attn_segments=True, attn_stage_async=True,
                            mma_token_tiles=MMA_NT, mma_rows_split_above=MMA_ROWS_SPLIT_ABOVE,
                            mma_rows_split_max_k=MMA_ROWS_SPLIT_MAX_K,
                            rms_stage_rows=RMS_STAGE_MAX_ROWS, attn_row_parts=ROW_PART_MTILES,
                            input_bytes=2, residual_copy_pass=True, attn_stage_first=True,
                            mma_rows_prefetch=True, rms_stage_partial=True)
# V6-MMA-SPLIT (PREDICTED, not built): the built design with O_PROJ's and DOWN's input split
# over the blocks where it pays, the partials reduced spread over each row group's blocks
# (input_slices_spread; benchmarks/NOTES.md "The floor of a step of many tokens").
V6_MMA_SPLIT = V6_MMA_SEG.replace(name="v6-mma-split", input_slices_spread=True)
# V6-MMA-PIPE: attention's units pipelined, the next unit's first K/V tile copied while one
# computes (attn_unit_pipeline; benchmarks/NOTES.md "Attention's units in a pipeline"; built
# 2026-12-05, then grown into V6_MMA_TILES): predicted for any shape here.
V6_MMA_PIPE = V6_MMA_SEG.replace(name="v6-mma-pipe", attn_unit_pipeline=True)
# V6-MMA-TILES: the pipeline by tiles, each tile's successor copied while it computes
# (attn_tile_pipeline; benchmarks/NOTES.md "Attention's tiles in a pipeline"): built where two
# tile buffers fit (design_for), predicted for any shape here.
# O_PROJ's and DOWN's unsliced mat-mul stores residual_in in its epilogue where the kernel
# has the registers for it (header.residual_in_epilogue: head_dim 64; design_for turns it off
# at 128; benchmarks/NOTES.md "residual_in in the epilogue").
V6_MMA_TILES = V6_MMA_PIPE.replace(name="v6-mma-tiles", attn_tile_pipeline=True,
                                   residual_copy_epilogue=True)
# V6-MMA-WARP-UNITS (PREDICTED, not built): the built design with a decode row's one-tile
# units run a warp each, up to NWARPS of an instruction's side by side (attn_units_in_flight;
# ops/attention.py _warp_unit; benchmarks/NOTES.md "Decode units a warp each").
V6_MMA_WARP = V6_MMA_TILES.replace(name="v6-mma-warp-units", attn_units_in_flight=8,
                                   attn_warp_unit_positions=32)
# V6-MMA-RING (built before v6-mma-keys): v6-mma-tiles with block_mma_rows' weights through a
# cp.async ring, its L2 reads beside its mma (mma_rows_l2_overlap; benchmarks/NOTES.md "The ring
# in block_mma_rows").
V6_MMA_RING = V6_MMA_TILES.replace(name="v6-mma-ring", mma_rows_l2_overlap=True)
# V6-MMA-KEYS (built before v6-mma-embed): v6-mma-ring with late q/k's key caching in O_PROJ spread
# over the owner block's warps, isa.KEY_CACHE_KEYS a warp round (k_cache_keys_per_warp; NOTES.md
# "Late q/k's key caching, a token at a time").
V6_MMA_KEYS = V6_MMA_RING.replace(name="v6-mma-keys", k_cache_keys_per_warp=KEY_CACHE_KEYS)
# V6-MMA-FINISH (built before v6-mma-embed): v6-mma-keys with the step's end a thread a row
# (finish_rows_parallel; benchmarks/NOTES.md "The step's end, a row at a time").
V6_MMA_FINISH = V6_MMA_KEYS.replace(name="v6-mma-finish", finish_rows_parallel=True)
# V6-MMA-EMBED (as built: design_for): v6-mma-finish with EMBED's rows staged by cp.async,
# isa.EMBED_STAGE_BYTES a pass (embed_stage_bytes; benchmarks/NOTES.md "EMBED, a row at a time"
# and "EMBED's rows by cp.async").
V6_MMA_EMBED = V6_MMA_FINISH.replace(name="v6-mma-embed", embed_stage_bytes=EMBED_STAGE_BYTES)
# V6-MMA-K-RING (as built: design_for where header.k_split_ring, a kernel of steps of more than
# isa.MMA_ROWS_SPLIT_ABOVE tokens at head_dim 64): v6-mma-embed with block_mma's k split of the
# unsliced ops through block_mma_rows' ring (mma_k_ring; benchmarks/NOTES.md "block_mma's
# weights through the ring"). Other kernels: v6-mma-embed.
V6_MMA_K_RING = V6_MMA_EMBED.replace(name="v6-mma-k-ring", mma_k_ring=True)
# V6-MMA-LAST-SKIP (as built: design_for's where the kernel has no MK_K_RING, Qwen3's):
# v6-mma-embed with a step that needs no logits idling its last layer after QKV
# (last_layer_skip; benchmarks/NOTES.md "The last layer skipped where no row needs logits");
# V6-MMA-K-RING-SKIP (as built, SmolLM2's and Llama's) the same on v6-mma-k-ring.
V6_MMA_SKIP = V6_MMA_EMBED.replace(name="v6-mma-last-skip", last_layer_skip=True)
V6_MMA_K_RING_SKIP = V6_MMA_K_RING.replace(name="v6-mma-k-ring-skip", last_layer_skip=True)
# V6-MMA-OVERLAP (PREDICTED, not built): ... and block_mma's too, every mat-mul's L2 reads
# beside its mma (mma_l2_overlap; benchmarks/NOTES.md "A mat-mul's L2 reads beside its mma").
V6_MMA_OVERLAP = V6_MMA_RING.replace(name="v6-mma-overlap", mma_l2_overlap=True)
# V6-MMA-LAST-LAYER (PREDICTED, not built): the built design with the last layer's ops after
# QKV on the rows needing logits alone (last_layer_logits; benchmarks/NOTES.md "The last
# layer on the logits rows").
V6_MMA_LAST = V6_MMA_EMBED.replace(name="v6-mma-last-layer", last_layer_logits=True)
# The tensor-core designs megakernel.cu builds (each with last_layer_skip: v6-mma-seg's kernels
# too, design_for).
BUILT_MMA = ("v6-mma-seg", "v6-mma-last-skip", "v6-mma-k-ring-skip")
# Every design a prediction can name (`monokernel plan --design`).
DESIGNS: dict[str, KernelDesign] = {"v5": V5, "v6": V6, "v6-mma": V6_MMA,
                                    "v6-mma-seg": V6_MMA_SEG, "v6-mma-split": V6_MMA_SPLIT,
                                    "v6-mma-pipe": V6_MMA_PIPE, "v6-mma-tiles": V6_MMA_TILES,
                                    "v6-mma-warp-units": V6_MMA_WARP, "v6-mma-ring": V6_MMA_RING,
                                    "v6-mma-overlap": V6_MMA_OVERLAP,
                                    "v6-mma-keys": V6_MMA_KEYS, "v6-mma-embed": V6_MMA_EMBED,
                                    "v6-mma-finish": V6_MMA_FINISH,
                                    "v6-mma-k-ring": V6_MMA_K_RING,
                                    "v6-mma-last-skip": V6_MMA_SKIP,
                                    "v6-mma-k-ring-skip": V6_MMA_K_RING_SKIP,
                                    "v6-mma-last-layer": V6_MMA_LAST,
                                    "v7": V7, "v7-rows": V7_ROWS,
                                    "v8": V8, "v8-cluster": V8_CLUSTER}


def design_for(program=None, sync: int = 2, multi_step: bool = True,
               tensor_cores: bool = False) -> KernelDesign:
    """The design megakernel.cu implements: V6 with the default hop (MK_SYNC=2) and many steps
    per launch; its A/B twins with one launch per step (backend cuda-1step) or the fenced hop
    (MK_SYNC=1, backend cuda-sync1); with a program of steps of up to T tokens (``tokens``),
    the token loop and prompts in chunks of T; ``tensor_cores`` (a kernel of slots built with
    them, MK_MMA): V6_MMA_EMBED where two K/V tile buffers fit (else V6_MMA_SEG with the ring,
    the keys and the step's end over the threads, EMBED's rows staged), V6_MMA_K_RING where
    the kernel runs block_mma's k split through block_mma_rows' ring (header.k_split_ring:
    steps of more than isa.MMA_ROWS_SPLIT_ABOVE tokens, head_dim 64), residual_in's copy in a
    pass where the epilogue's store would spill (head_dim 128); each with the last layer idle
    in a step that needs no logits (last_layer_skip: V6_MMA_SKIP, V6_MMA_K_RING_SKIP). A
    kernel change updates these in the same commit."""
    if tensor_cores:
        from ..header import attn_pipeline, k_split_ring, residual_in_epilogue, rms_stage_rows

        tokens = getattr(program, "tokens", 1)
        cfg = getattr(program, "config", None)
        # MK_ATTN_PIPE where two K/V tile buffers (header.segment_tile) fit the shape's
        # shared memory: every shape served
        # (block_mma_rows' ring is in every tensor-core kernel of steps of many tokens)
        # (and O_PROJ's late q/k key caching over the warps, cache_keys; the step's end a
        # thread a row, finish_rows; EMBED's rows staged by cp.async)
        d = V6_MMA_EMBED if cfg is not None and attn_pipeline(cfg) \
            else V6_MMA_SEG.replace(mma_rows_l2_overlap=True,
                                    k_cache_keys_per_warp=KEY_CACHE_KEYS,
                                    finish_rows_parallel=True,
                                    embed_stage_bytes=EMBED_STAGE_BYTES)
        if d is V6_MMA_EMBED and cfg is not None and not residual_in_epilogue(cfg):
            # MK_RES_IN_EPI 0 (head_dim 128): the copy in a pass after the mat-mul
            d = d.replace(residual_copy_epilogue=False)
        if cfg is not None and k_split_ring(cfg, tokens):  # MK_K_RING: the k split's weights
            # through block_mma_rows' ring
            d = d.replace(mma_k_ring=True, name=V6_MMA_K_RING.name if d.name == V6_MMA_EMBED.name
                          else d.name)
        # a step that needs no logits idles its last layer after QKV (megakernel.cu
        # last_layer_idle): every tensor-core kernel of slots
        d = d.replace(last_layer_skip=True, name={V6_MMA_EMBED.name: V6_MMA_SKIP.name,
                                                   V6_MMA_K_RING.name: V6_MMA_K_RING_SKIP.name
                                                   }.get(d.name, d.name))
        if tokens > 1:
            d = d.replace(prefill_chunk=tokens)
        rows = d.rms_stage_rows if cfg is None else rms_stage_rows(cfg, tokens, True)
        # fewer rows than a step's share can have where the shape's rows are too long
        return d if rows >= min(tokens, d.rms_stage_rows) else d.replace(rms_stage_rows=rows)
    d = V6
    if sync < 2:
        d = d.replace(signal_sc_fence=True, poll_loads=2, poll_sleep=True)
    if not multi_step:
        d = d.replace(steps_per_launch=1)
    tokens = getattr(program, "tokens", 1)
    if tokens > 1:  # prompt chunks of up to `tokens` (MK_T_MAX), late q/k's keys over the warps
        # (finish_rows_parallel: a kernel of slots' end, finish_rows; one sequence's chunk
        # ends in finish_step, one row, charged the scan it does not run: ~0.3 us)
        d = d.replace(token_loop=True, prefill_chunk=tokens, k_cache_keys_per_warp=KEY_CACHE_KEYS,
                      finish_rows_parallel=True)
    if d is V6:
        return d
    return d.replace(name="v6" + ("" if sync >= 2 else "-sync1") + ("" if multi_step else "-1step")
                     + (f"-t{tokens}" if tokens > 1 else ""))


def design(name: str) -> KernelDesign:
    if name.lower() not in DESIGNS:
        raise CostModelError(f"unknown kernel design {name!r} (known: {', '.join(DESIGNS)})")
    return DESIGNS[name.lower()]
