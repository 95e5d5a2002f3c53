"""The cost model: predicted time of one decode step of a Program on a named GPU.

Three parts, each in one place:

- ``CONSTANTS``: the GPU's numbers (latencies, bandwidths, the parts of a hop), one table, each
  row with its range and its source (shared/PERFORMANCE.md section 1 for the H200).
- ``KernelDesign``: the kernel's design knobs (bytes in flight, dependent round trips per op,
  the hop's parts, attention's loop shape, SAMPLE as a serial op, L2 prefetch, steps per
  launch). ``V1`` is the kernel of commit 6b168f3; ``LADDER`` holds the steps of
  PERFORMANCE.md section 3 as knob settings. ``design_for(program)`` names the design the
  kernel in megakernel.cu implements now: change it in the commit that changes the kernel.
- ``OP_MODELS``: one entry per op, named exactly like the op's section in megakernel.cu
  (EMBED, RMS_QKV_ROPE, ATTENTION, O_PROJ_RESIDUAL, RMS_GATE_UP, DOWN_RESIDUAL, RMS_LM_HEAD,
  SAMPLE). Each turns the op's instructions (vectorised over all of them) into phases: fixed
  work after the wait (dependent round trips to L2 or HBM, reductions, barriers) and a weight
  stream (bytes, rounds of loads of the busiest warp, bytes prefetched into L2 before the wait).

``predict(program, gpu, design, context)`` runs the per-block queues as a discrete-event
simulation: an instruction starts when its block's previous one ends, fetches its words,
issues its L2 prefetch, and becomes ready when its counter has all its signals (the last
signal's time + the hop latency) or, if they are already there, after one acquire load. Its
weight stream runs at min(bytes in flight / latency, the SM's share of HBM bandwidth) (Little's
law), where the bytes the prefetch brought into L2 during the wait are read at L2 latency.

Every number this module prints is a prediction, not a measurement.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ..errors import CostModelError
from . import sass_facts
from .isa import (KV_UNROLL, MERGE_CHUNK, MERGE_TICKET_WAYS, NUM_THREADS, Op,
                  attn_round_positions, merge_block_ways, pair_rows, row_shape)

# ================================================================================================
# The GPU's constants: ONE table. name -> (unit, {gpu: (value, low, high)}, source)
# ================================================================================================
CONSTANTS: dict[str, tuple[str, dict[str, tuple[float, float, float]], str]] = {
    "sms": ("", {"h200": (132, 132, 132), "h100": (132, 132, 132)},
            "H200: measured on the H200 we test on (PERFORMANCE.md 1); H100 SXM5: datasheet"),
    "clock_ghz": ("GHz", {"h200": (1.98, 1.98, 1.98), "h100": (1.98, 1.98, 1.98)},
                  "H200: measured (PERFORMANCE.md 1); H100 SXM5: datasheet boost clock. For "
                  "reading cycle counts; the latencies below are in us already"),
    "hbm_bw": ("TB/s", {"h200": (4.3, 4.3, 4.3), "h100": (3.0, 2.8, 3.2)},
               "device-to-device copy, read+write counted. H200: measured (PERFORMANCE.md 1); "
               "H100: assumed ~90% of the 3.35 TB/s datasheet figure, not measured"),
    "hbm_latency": ("us", {"h200": (0.53, 0.35, 0.6), "h100": (0.53, 0.35, 0.6)},
                    "one warp's coalesced load from HBM: ~0.35-0.5 us unloaded (570-700 cycle "
                    "pointer chase on H100, public microbenchmarks); nominal 0.53 = 8 KB x 132 "
                    "SMs / 2.0 TB/s, the cap PERFORMANCE.md 2 gives v1's 8 KB in flight per SM; "
                    "high = loaded"),
    "l2_latency": ("us", {"h200": (0.2, 0.13, 0.3), "h100": (0.2, 0.13, 0.3)},
                   "L2 hit round trip: 260-291 cycles pointer chase (0.13-0.15 us), up to "
                   "~0.3 us to the far L2 partition (public H100 microbenchmarks, "
                   "PERFORMANCE.md 1)"),
    "l2_bw": ("TB/s", {"h200": (7.0, 5.5, 10.0), "h100": (5.5, 4.5, 7.0)},
              "L2 hit bandwidth of the whole chip; assumed from public H100 L2 microbenchmarks "
              "(5.5-7 TB/s), H200 taken a little higher; only bounds prefetched streams"),
    "fence": ("us", {"h200": (0.58, 0.3, 0.8), "h100": (0.58, 0.3, 0.8)},
              "MEMBAR.SC.GPU (waits for every outstanding store of the SM): the rest of "
              "PERFORMANCE.md's ~1.07 us per v1 hop once the parts below are counted; fitted by "
              "`monokernel calibrate` from a GPU trace"),
    "release": ("us", {"h200": (0.3, 0.2, 0.45), "h100": (0.3, 0.2, 0.45)},
                "red.release.gpu (R4): on sm_90 it compiles to MEMBAR.ALL.GPU + REDG (SASS of "
                "4b0e6fe), so it drains the block's stores, >= one L2 round trip (0.13-0.3 us) "
                "after the last store, before the add; was assumed 0.15 before the SASS was read "
                "(fence + relaxed atomic ~ release atomic: mscclpp PR 505)"),
    "ticket": ("us", {"h200": (0.5, 0.4, 0.6), "h100": (0.5, 0.4, 0.6)},
               "atom.acq_rel.gpu (ticket_add): MEMBAR.ALL.GPU; ATOMG.E.ADD (a returning atomic: "
               "one L2 round trip); CCTL.IVALL (SASS of 4b0e6fe): the store drain, the round "
               "trip and the L1 invalidate (PERFORMANCE.md 0)"),
    "cctl": ("us", {"h200": (0.02, 0.01, 0.05), "h100": (0.02, 0.01, 0.05)},
             "CCTL.IVALL (L1 invalidate after an acquire, NVIDIA/cutlass issue 3117); assumed "
             "~40 cycles"),
    "bar_sync": ("us", {"h200": (0.02, 0.01, 0.04), "h100": (0.02, 0.01, 0.04)},
                 "__syncthreads of 8 warps; assumed ~40 cycles"),
    "shfl": ("us", {"h200": (0.015, 0.01, 0.025), "h100": (0.015, 0.01, 0.025)},
             "one dependent SHFL + FADD step of a warp reduction; assumed ~30 cycles"),
    "timer": ("us", {"h200": (0.01, 0.005, 0.02), "h100": (0.01, 0.005, 0.02)},
              "read %globaltimer in the poll loop; assumed"),
    "nanosleep": ("us", {"h200": (0.05, 0.03, 0.1), "h100": (0.05, 0.03, 0.1)},
                  "__nanosleep(32) in the poll loop (sleeps 0-2x the request, coarse "
                  "granularity); assumed"),
    "schedulers": ("", {"h200": (4, 4, 4), "h100": (4, 4, 4)},
                   "warp schedulers per SM, each issuing one warp instruction per clock (Hopper "
                   "SM: four partitions; NVIDIA H100 whitepaper). Turns instruction counts of "
                   "the SASS into issue time"),
    "gemv_bw": ("TB/s", {"h200": (3.8, 3.6, 4.3), "h100": (2.7, 2.5, 3.0)},
                "the weight stream's achieved rate in a GEMV: below the copy rate (a read-only "
                "stream with FMAs behind it, one block per SM); 3.6-4.0 TB/s on an H200 in the "
                "independent SASS model (PERFORMANCE.md 0), up to the copy rate; H100 scaled"),
    "hbm_loaded_latency": ("us", {"h200": (0.7, 0.6, 1.5), "h100": (0.7, 0.6, 1.5)},
                           "a lone dependent load that misses L2 while the other SMs stream "
                           "weights (HBM queues full): 0.6-1.5 us (PERFORMANCE.md 0); program "
                           "words and late norm weights pay it"),
    "fetch_miss": ("", {"h200": (0.75, 0.5, 1.0), "h100": (0.75, 0.5, 1.0)},
                   "share of an instruction's word fetches that miss L2: the program is re-read "
                   "every step after 0.27-2.5 GB of weights passed the 50 MB L2 (~3 in 4, "
                   "PERFORMANCE.md 0)"),
    "pcie_read": ("us", {"h200": (1.3, 0.9, 2.0), "h100": (1.3, 0.9, 2.0)},
                  "LDG.E.STRONG.SYS of mapped host memory (finish_step's host stop flag): a "
                  "PCIe round trip, ~1-2 us (PERFORMANCE.md 0); assumed"),
    "sys_fence": ("us", {"h200": (0.8, 0.4, 1.5), "h100": (0.8, 0.4, 1.5)},
                  "MEMBAR.SC.SYS (__threadfence_system after the step's token store to host "
                  "memory): drains the store over PCIe; assumed (PERFORMANCE.md 0: the host "
                  "read and this fence 1-3 us per step together)"),
    "launch": ("us", {"h200": (8.0, 5.0, 12.0), "h100": (8.0, 5.0, 12.0)},
               "host submit + cooperative launch + drain per launch; assumed so that R6 (N steps "
               "per launch) saves 7-8 us per token, as PERFORMANCE.md 3 predicts"),
}


@dataclass(frozen=True)
class GPU:
    """One GPU's constants, in microseconds and bytes per microsecond (see CONSTANTS)."""

    name: str
    sms: int
    clock_ghz: float
    hbm_bw: float  # bytes/us
    hbm_latency: float
    l2_latency: float
    l2_bw: float  # bytes/us
    fence: float
    release: float
    ticket: float
    cctl: float
    bar_sync: float
    shfl: float
    timer: float
    nanosleep: float
    schedulers: int
    gemv_bw: float  # bytes/us
    hbm_loaded_latency: float
    fetch_miss: float
    pcie_read: float
    sys_fence: float
    launch: float

    def replace(self, **changes) -> "GPU":
        return dataclasses.replace(self, **changes)


_TB_S = 1e6  # 1 TB/s = 1e12 B/s = 1e6 B/us


def gpu(name: str) -> GPU:
    """The named GPU's nominal constants (CONSTANTS' values; ``constant_range`` has the ends)."""
    key = name.lower()
    if key not in CONSTANTS["sms"][1]:
        raise CostModelError(f"unknown GPU {name!r} (known: {', '.join(CONSTANTS['sms'][1])})")
    vals = {c: row[1][key][0] for c, row in CONSTANTS.items()}
    vals["hbm_bw"] *= _TB_S
    vals["l2_bw"] *= _TB_S
    vals["gemv_bw"] *= _TB_S
    vals["sms"] = int(vals["sms"])
    vals["schedulers"] = int(vals["schedulers"])
    return GPU(name=key, **vals)


def constant_range(gpu_name: str, constant: str) -> tuple[float, float]:
    _unit, per_gpu, _src = CONSTANTS[constant]
    v = per_gpu[gpu_name.lower()]
    return v[1], v[2]


# ================================================================================================
# The kernel's design knobs
# ================================================================================================
@dataclass(frozen=True)
class KernelDesign:
    """What the kernel does, as the cost model sees it. Every prediction takes one.

    Add a design (e.g. ``V2``) when a kernel change lands, in the same commit, and point
    ``design_for`` at it. Knobs not listed keep V1's value.
    """

    name: str
    threads: int = NUM_THREADS
    # mat-vecs: 16-byte weight loads outstanding per lane, and rows a warp streams together
    # (v1: `#pragma unroll 2` in warp_dot, one row per warp: 2 x 16 B x 256 threads = 8 KB/SM)
    loads_in_flight_per_lane: int = 2
    rows_per_warp: int = 1
    # dependent global round trips per op after its wait, NOT counting the weight stream's own
    # rounds (those follow from the tiles): (to L2, to HBM). v1 (SmolLM2, with the stream):
    # QKV 5, O_PROJ 11 (8 of them the split merge), GATE_UP 10, DOWN 6, LM head 96.
    trips: dict[str, tuple[int, int]] = field(default_factory=lambda: {
        "EMBED": (0, 1),  # the embedding row
        "RMS_QKV_ROPE": (2, 1),  # residual, rope tables (L2); norm weights (HBM)
        "ATTENTION": (1, 0),  # the group's queries, per unit
        "O_PROJ_RESIDUAL": (1, 0),  # residual read-modify-write (+ the merge, below)
        "RMS_GATE_UP": (1, 1),  # residual; norm weights
        "DOWN_RESIDUAL": (3, 0),  # ffn_h into shared memory, residual read-modify-write
        "RMS_LM_HEAD": (1, 1),  # residual; final norm weights
        "SAMPLE": (0, 0),
    })
    o_proj_merge_trips_per_split: float = 1.0  # v1: every O_PROJ block merges every split
    # design 2: the merge's loads issued a chunk of splits at a time: rounds = ceil(S / chunk)
    o_proj_merge_chunk: int = 0  # 0: v1's per-split trips above
    # design 5: when a step uses at least the program's merge_ticket_min splits, the last unit
    # of each KV group to draw the group's ticket (an acq_rel atomic) merges the group once
    # (into `attn`), and O_PROJ reads the merged vector (one L2 round). False: every O_PROJ
    # block merges every used split itself
    o_proj_merge_ticket: bool = False
    # the per-block merge shares an output chunk's splits among isa.merge_block_ways(config)
    # lanes (threads that would idle otherwise): ceil(used / (chunk x ways)) rounds. False: one
    # lane per chunk
    o_proj_merge_ways: bool = False
    qk_norm_whole_heads: bool = True  # v1: Qwen3's q/k-norm needs a whole head per tile
    # hop: signal = bar + (MEMBAR.SC + CCTL | release atomic); poll = loads + timer + sleep
    signal_sc_fence: bool = True
    poll_loads: int = 2  # v1: error word and counter, both acquire loads
    poll_sleep: bool = True
    # attention: positions per warp per K round, V positions in flight per thread (v1: the V
    # loop's loads are independent; 16 in flight gives PERFORMANCE.md's ~26 serial rounds per
    # 129-position unit; SASS check pending), K/V load width, positions per pass (T_TILE)
    attn_positions_per_warp: int = 1
    attn_v_in_flight: int = 16
    attn_load_bytes: int = 2
    attn_tile: int = 128
    # design 2's loop (megakernel.cu attention_scores / attention_values), geometry from isa.py:
    # a K/V row is KV_LANES = head_dim / 8 lanes of 16-byte loads, KV_SLOTS positions per block
    # per load, KV_UNROLL loads per lane: attn_round_positions(head_dim) positions per pass.
    # True replaces the three knobs above (v1's loop and the ladder's sketches of R1).
    attn_isa_loop: bool = False
    # ... of those KV_UNROLL K loads, how many the compiled loop keeps in flight per lane, by
    # head_dim ((head_dim, loads), ...; absent: all KV_UNROLL). tests/test_sass.py checks it
    attn_k_in_flight: tuple[tuple[int, int], ...] = ()
    # the K loop's (load, head) chains: False, one after another through shared memory (each
    # ends by a store before the next one's q load; commit 43be27c); True, all dot products of
    # an iteration first, their shuffle reductions side by side, then the stores (the chains'
    # latency paid once per iteration, the rest issue-bound)
    attn_k_interleaved: bool = False
    # late q/k (QK_NORM models): ATTENTION norms and ropes its queries and the new key, O_PROJ
    # caches the key; False: RMS_QKV_ROPE does it (whole-head or row-pair tiles)
    late_qk: bool = False
    # ... and warp_qk_norm_rope issues its vector, norm-weight and RoPE loads together, the
    # weights and the RoPE row prefetched into L2 before the wait (False: three dependent
    # trips, the weights from HBM)
    late_qk_one_trip: bool = False
    # ATTENTION prefetches its units' K/V rows of the positions cached before this step into L2
    # before its wait (the cache never depends on this step's counters but for the new row)
    attn_kv_prefetch: bool = False
    # SAMPLE as a separate serial op: thread 0 walks the partials, dependent L2 loads each.
    # False: the LM head's last block reduces them (a v1 program's SAMPLE slot is then skipped)
    sample_op: bool = True
    sample_trips_per_partial: int = 2
    # L2 prefetch of an instruction's weights before its wait, at most this much per range
    l2_prefetch: bool = True
    prefetch_max_bytes: int = 64 * 1024
    # decode steps per launch (launch overhead amortised; chained steps add one hop each)
    steps_per_launch: int = 1
    # ---- the kernel as compiled (issue 15, V5 on): what the sm_90 SASS shows and the earlier
    # designs did not charge. The defaults keep those designs' figures.
    # The instruction's words: dependent loads before its prefetch and wait (v5: the opcode, a
    # branch on NOOP, then the other 11 words: 2; 0: fetched ahead, off the path), at L2
    # latency, or with fetch_misses the share `fetch_miss` of them at HBM's loaded latency.
    instruction_fetch_trips: int = 1
    fetch_misses: bool = False
    # mat-vec passes from isa.row_shape (loads per lane per pass, rows per pass, chunks) instead
    # of the loads_in_flight_per_lane / rows_per_warp knobs above
    row_geometry: bool = False
    # issue slots per 16-byte weight load once it arrives (bf16 unpack, FFMA, x's LDS) on the
    # SM's schedulers, and the pass's warp sums (5 dependent SHFL + FADD); 0: not charged
    matvec_issue_per_load: float = 0.0
    # copies into shared memory of a vector other blocks wrote (DOWN's ffn_h, O_PROJ's merged
    # attention): 0, one round (all loads first); u > 0, as nvcc compiles a strided loop
    # unrolled u times: (n mod u) single loads, then n // u rounds of u (n: the busiest
    # thread's elements)
    copy_unroll: int = 0
    # the step's end (finish_step, by the LM head's last ticket drawer): the host's stop flag
    # read over PCIe before the release; MEMBAR.SC.SYS after the token's store
    step_end_host_read: bool = False
    step_end_sys_fence: bool = False
    # tickets (attention's merge, the LM head's) cost the constant `ticket` (acq_rel as
    # compiled: drain, round trip, L1 invalidate), every drawer; the last LM-head drawer's
    # reduction and finish_step's loads end the step (False: spread over the instructions)
    ticket_as_compiled: bool = False
    # the weight stream at the achieved GEMV rate (gemv_bw) instead of the copy rate, and its
    # first bytes one latency after it starts (a ramp per op)
    gemv_rate: bool = False
    stream_ramp: bool = False
    # RMS ops load their norm weights just before the wait, so on a block whose wait returns at
    # once (the last one, on the critical path) their loaded HBM latency is not hidden behind
    # the residual's L2 trip. False: they are in L2 or registers before they are needed
    norm_weights_late: bool = False

    @property
    def bytes_in_flight_per_sm(self) -> int:
        return self.loads_in_flight_per_lane * 16 * self.threads

    @property
    def warps(self) -> int:
        return self.threads // 32

    def replace(self, **changes) -> "KernelDesign":
        return dataclasses.replace(self, **changes)


V1 = KernelDesign("v1")

# The ladder of PERFORMANCE.md section 3, cumulative, as knob settings: R1 (latency fixes) and
# R2 (32 KB in flight). Steps that change the schedule rather than the kernel need the matching
# Program too: R1's balanced Qwen3 QKV is ``with_row_pair_tiles(program)``. R3 (a loader warp
# and a shared-memory ring) is not expressible in these knobs yet, so neither are R4-R6 of the
# ladder; "issue8" is what issue 8 section 2 builds: R1 + R2 + many steps per launch (R6).
_R1 = V1.replace(
    name="r1",
    trips={"EMBED": (0, 1), "RMS_QKV_ROPE": (2, 0), "ATTENTION": (1, 0),
           "O_PROJ_RESIDUAL": (2, 0), "RMS_GATE_UP": (2, 0), "DOWN_RESIDUAL": (2, 0),
           "RMS_LM_HEAD": (2, 0), "SAMPLE": (0, 0)},
    o_proj_merge_trips_per_split=0.0, qk_norm_whole_heads=False,
    attn_positions_per_warp=8, attn_v_in_flight=16, attn_load_bytes=16, sample_op=False)
_R2 = _R1.replace(name="r2", loads_in_flight_per_lane=8, rows_per_warp=2)
_ISSUE8 = _R2.replace(name="issue8", steps_per_launch=16)
LADDER: dict[str, KernelDesign] = {"v1": V1, "r1": _R1, "r2": _R2, "issue8": _ISSUE8}

# What megakernel.cu does with MK_DESIGN=2 (scheduler design 2) and MK_SYNC=1, kernel v2 part 1:
# - mat-vecs: RowShape<N> gives every lane >= 8 16-byte loads in flight (9-12 measured in the
#   sm_90 SASS by tests/test_sass.py: 36-48 KB per SM), several rows per warp pass;
# - after the wait, only the residual (RMS ops) or ffn_h (DOWN) is a round trip before the
#   weights; norm weights are loaded before the wait, bias / RoPE entries / q-k-norm weights and
#   the block's own residual rows in the weights' round trip (O_PROJ and DOWN read-modify-write);
# - SAMPLE folded into the LM head (atomic ticket, one warp's reduction);
# - attention: K and V rows read 16 bytes per lane (KV_LANES lanes per row), KV_UNROLL = 4
#   loads in flight per lane: 64 positions per block per round at head_dim 128, 128 at 64
#   (attn_isa_loop: the loop as compiled, see _attention_tile_isa; in the sm_90 SASS all 4 K
#   and 4 V loads are in flight at every head_dim - before the unpredicated clamped loads, the
#   K loop at head_dim 64 kept ONE - and the K loop's (load, head) dot products run side by
#   side, attn_k_interleaved);
# - the O_PROJ split merge (still in every block) loads 4 splits at a time: ceil(used / 4)
#   rounds;
# - q/k-norm (Qwen3): row-pair QKV tiles; attention norms and ropes q and the new k, O_PROJ
#   caches k ("late q/k", charged: 2 more dependent trips per unit, 3 on the key owners), so
#   QKV is balanced (max/mean 1.0x instead of 4.1x);
# - unchanged from v1: the hop (MEMBAR.SC + atomic; two acquire loads per poll), one step per
#   launch.
V2 = V1.replace(
    name="v2",
    loads_in_flight_per_lane=8, rows_per_warp=2,
    trips={"EMBED": (0, 1), "RMS_QKV_ROPE": (1, 0), "ATTENTION": (1, 0),
           "O_PROJ_RESIDUAL": (0, 0), "RMS_GATE_UP": (1, 0), "DOWN_RESIDUAL": (1, 0),
           "RMS_LM_HEAD": (1, 0), "SAMPLE": (0, 0)},
    attn_load_bytes=16, attn_isa_loop=True, attn_k_interleaved=True,
    o_proj_merge_chunk=MERGE_CHUNK, qk_norm_whole_heads=False, late_qk=True, sample_op=False)
# V3 = V2 + the cheaper hop of PERFORMANCE.md R4 (megakernel.cu MK_SYNC=2): the signal is the
# block barrier, then one `red.release.gpu.global.add` by thread 0 (no MEMBAR.SC, no CCTL); the
# wait polls ONE `ld.acquire.gpu` per trip, the error word and the timer only every few trips,
# and no nanosleep for the first microseconds of a wait.
V3 = V2.replace(name="v3", signal_sc_fence=False, poll_loads=1, poll_sleep=False)
# V4 = V3 + many steps per launch (R6, megakernel.cu run_instructions): one launch runs the
# prompt and the decode steps; every step after the first begins with one hop (the step
# counter), and the launch's overhead is shared by its steps: 64, the issue's generation of 64
# greedy tokens (a longer prompt in the same launch only shares it further).
GENERATION_STEPS = 64
V4 = V3.replace(name="v4", steps_per_launch=GENERATION_STEPS)
# V5 = V4 + three latency cuts of ATTENTION and O_PROJ (benchmarks/NOTES.md, "Kernel v2 part 1,
# third session"): the K/V rows cached before the step prefetched into L2 before ATTENTION's
# wait; late q/k's loads in one trip (weights and RoPE row prefetched); and, from the
# program's merge_ticket_min used splits on (isa.merge_ticket_min_splits), the O_PROJ merge
# done once per KV group by the last unit to draw the group's ticket; below it, the per-block
# merge shares each output chunk's splits among idle lanes (isa.merge_block_ways).
# They do not depend on the hop: design_for applies them to every design-2 kernel.
_V5_KNOBS = {"attn_kv_prefetch": True, "late_qk_one_trip": True, "o_proj_merge_ticket": True,
             "o_proj_merge_ways": True}
# V5 as compiled (issue 15 section 3): what the sm_90 SASS of commit 4b0e6fe does and the
# model did not charge before (benchmarks/NOTES.md, "The cost model tells the truth"). These
# are v5's own numbers, kept so that `plan --design v5` predicts v5; the kernel as built now
# (V6) takes the knobs the kernel fixes from its compiled SASS (sass_facts).
_V5_AS_COMPILED = {
    "instruction_fetch_trips": 2,  # LDG the opcode, ISETP + BRA on NOOP, then 11 LDG
    "fetch_misses": True,
    "row_geometry": True,
    "matvec_issue_per_load": 17.0,  # unpack + FFMA + LDS of x per LDG.E.128 (~17 slots)
    "copy_unroll": 4,  # DOWN's ffn_h: a peel, then 4 x LDG -> 4 x STS per iteration
    "step_end_host_read": True,  # LDG.E.STRONG.SYS of the host flag before the release
    "step_end_sys_fence": True,  # MEMBAR.SC.SYS after the token's store
    "ticket_as_compiled": True,  # MEMBAR.ALL.GPU; ATOMG.E.ADD; CCTL.IVALL
    "gemv_rate": True,
    "stream_ramp": True,
    "norm_weights_late": True,
}
V5 = V4.replace(name="v5", **_V5_KNOBS, **_V5_AS_COMPILED)
# V6 = V5 with a leaner step (issue 15 section 4): every instruction's words fetched during
# the previous one (off the path), DOWN's and O_PROJ's copies in one round (all loads first),
# the host's stop flag read before the LM head's wait and no system fence at the step's end,
# the next instruction's norm weights prefetched into L2 during the current one. The knobs the
# compiled kernel fixes (the fetch's trips, the copies' rounds, the system fence, the mat-vec
# issue slots per load) are read off its SASS: sass_facts.compiled_knobs, from the checked-in
# sass_facts.json that tests/test_sass.py holds to the kernel.
_V6_KNOBS = {"step_end_host_read": False, "norm_weights_late": False,
             **sass_facts.compiled_knobs()}
V6 = V5.replace(name="v6", **_V6_KNOBS)
# Every design a prediction can name (`monokernel plan --design`).
DESIGNS: dict[str, KernelDesign] = dict(LADDER, v2=V2, v3=V3, v4=V4, v5=V5, v6=V6)


def design_for(program, sync: int = 2, multi_step: bool = True) -> KernelDesign:
    """The design megakernel.cu implements for this program: its scheduler design (MK_DESIGN)
    1 is V1; 2 is V6 with the default hop (MK_SYNC=2) and many steps per launch, V3's hop with
    V6's knobs with one launch per step (backend cuda-1step), V2's hop with them (MK_SYNC=1,
    backend cuda-sync1). A kernel change updates these (or adds a design) in the same commit."""
    if getattr(program, "design", 1) < 2:
        return V1
    if sync >= 2 and multi_step:
        return V6
    d = (V3 if sync >= 2 else V2).replace(**{**_V5_KNOBS, **_V5_AS_COMPILED, **_V6_KNOBS})
    d = d.replace(name="v6" + ("" if sync >= 2 else "-sync1") + ("" if multi_step else "-1step"))
    return d.replace(steps_per_launch=GENERATION_STEPS) if multi_step else d


def program_design(d: KernelDesign) -> int:
    """The scheduler design whose program matches ``d``: 1 (a SAMPLE op) or 2 (ticket)."""
    return 1 if d.sample_op else 2


def design(name: str) -> KernelDesign:
    if name.lower() not in DESIGNS:
        raise CostModelError(f"unknown kernel design {name!r} (known: {', '.join(DESIGNS)})")
    return DESIGNS[name.lower()]


# ================================================================================================
# Derived costs shared by the ops
# ================================================================================================
def hop_parts(g: GPU, d: KernelDesign) -> dict[str, float]:
    """The parts of one counter hop, in us. signal: on the producer, inside its instruction;
    propagate: the atomic reaching L2; detect: the poll loop noticing (half a poll period on
    average, then the load's way back) and the block barrier after it."""
    signal = g.bar_sync + (g.fence + g.cctl if d.signal_sc_fence else g.release)
    period = d.poll_loads * g.l2_latency + g.timer + (g.nanosleep if d.poll_sleep else 0.0)
    return {"signal": signal, "propagate": g.l2_latency / 2,
            "detect": period / 2 + g.l2_latency / 2 + g.bar_sync}


def hop_latency(g: GPU, d: KernelDesign) -> float:
    """Producer's last stores issued -> consumer block past its wait."""
    return sum(hop_parts(g, d).values())


def block_sum_us(g: GPU) -> float:
    """block_sum: warp_sum, shared store, barrier, warp_sum of the partials, two barriers."""
    return 10 * g.shfl + 3 * g.bar_sync


def _loads_per_row(n: int) -> int:
    """16-byte loads of the busiest lane for one bf16 row of n elements."""
    return -(-n // (8 * 32))


def _stream_rounds(rows_per_warp: np.ndarray, n: int, d: KernelDesign, dots: int = 1) -> np.ndarray:
    """Rounds of dependent weight loads of the busiest warp: groups of rows_per_warp rows, each
    group's loads issued loads_in_flight_per_lane at a time; ``dots`` dot products per row one
    after the other (RMS_GATE_UP: gate, then up, each ended by a warp_sum)."""
    groups = -(-rows_per_warp // d.rows_per_warp)
    per_group = -(-(_loads_per_row(n) * d.rows_per_warp) // d.loads_in_flight_per_lane)
    last = rows_per_warp - (groups - 1) * d.rows_per_warp  # the last group may be short
    last_rounds = -(-(_loads_per_row(n) * last) // d.loads_in_flight_per_lane)
    return dots * np.where(groups > 0, (groups - 1) * per_group + last_rounds, 0)


def _matvec(rows: np.ndarray, n: int, g: GPU, d: KernelDesign,
            pairs: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(rounds, issue us) of the busiest warp of block_dot_rows (or block_dot_row_pairs: gate
    and up) over ``rows`` rows of n bf16 each, vectorised over instructions. With row_geometry
    the passes follow isa.row_shape (megakernel.cu RowShape<n>): warp w takes passes of R rows
    (R' row pairs), each ceil(L / K) chunks of R x K loads per lane, every chunk one round;
    after its data, a pass costs its loads' issue slots (matvec_issue_per_load each, the SM's
    schedulers shared by its warps) and the rows' warp sums (5 SHFL + FADD, side by side)."""
    rows = np.asarray(rows)
    if not d.row_geometry:
        rr = _stream_rounds(-(-rows // d.warps), n, d, dots=2 if pairs else 1)
        return rr.astype(np.float64), np.zeros(rows.shape)
    L, K, R = row_shape(n)
    per_pass = pair_rows(R) if pairs else R
    passes = -(-rows // (d.warps * per_pass))
    rounds = passes * -(-L // K)
    issue = 0.0
    if d.matvec_issue_per_load:
        loads = per_pass * (2 if pairs else 1) * L  # per lane per pass
        issue = _issue_us(g, d, loads * d.matvec_issue_per_load) + 5 * g.shfl
    return rounds.astype(np.float64), passes * issue


def _copy_rounds(n: int, d: KernelDesign) -> int:
    """Dependent rounds of a copy loop whose busiest thread moves n elements (copy_unroll)."""
    if not d.copy_unroll:
        return 1
    return n % d.copy_unroll + n // d.copy_unroll


def _fetch_us(g: GPU, d: KernelDesign) -> float:
    """An instruction's word fetch before its prefetch and wait (instruction_fetch_trips): the
    first trip, with fetch_misses, misses L2 in the share fetch_miss of the steps (HBM's
    loaded latency); the later ones read the line the first brought in (L2)."""
    if d.instruction_fetch_trips <= 0:
        return 0.0
    first = g.l2_latency
    if d.fetch_misses:
        first = g.fetch_miss * g.hbm_loaded_latency + (1 - g.fetch_miss) * g.l2_latency
    return first + (d.instruction_fetch_trips - 1) * g.l2_latency


def step_end_us(g: GPU, d: KernelDesign) -> float:
    """After the last LM-head instruction ends: with ticket_as_compiled its last drawer's
    reduction (one L2 round of the partials, a warp's shuffles) and finish_step (the fed token
    or the stop mask: one L2 round; the host flag over PCIe; the system fence). The step
    counter's release is the next step's hop (its signal)."""
    t = 0.0
    if d.ticket_as_compiled:
        t += 2 * g.l2_latency + 10 * g.shfl
    if d.step_end_host_read:
        t += g.pcie_read
    if d.step_end_sys_fence:
        t += g.sys_fence
    return t


# ================================================================================================
# One entry per op, named like its section in megakernel.cu
# ================================================================================================
@dataclass
class Phases:
    """Per instruction of one op (arrays over its instructions)."""

    l2_trips: np.ndarray  # dependent round trips to L2 after the wait (not the stream)
    hbm_trips: np.ndarray  # ... to HBM
    other_us: np.ndarray  # reductions, barriers, serial compute
    rounds: np.ndarray  # weight stream: rounds of dependent loads of the busiest warp
    stream_bytes: np.ndarray  # weight (or KV) bytes streamed by the block
    prefetch_bytes: np.ndarray  # of those, issued as L2 prefetches before the wait
    # loads from HBM issued at the instruction's start that the op needs with its first L2
    # trip (norm_weights_late): their latency past the wait and that trip is on the path
    early: np.ndarray | None = None
    # issue time of the stream's compute once each round's data is there (mat-vecs with
    # matvec_issue_per_load): on the path of a latency-bound stream, hidden under a
    # bandwidth-bound one (the other warps' loads keep the memory pipe busy meanwhile)
    issue: np.ndarray | None = None


@dataclass
class OpBatch:
    """The instructions of one op in a program, as arrays."""

    program: object
    context: int
    layer: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    weight_bytes: np.ndarray
    args: list

    @property
    def n(self) -> np.ndarray:
        return np.maximum(self.hi - self.lo, 0)

    def zeros(self) -> np.ndarray:
        return np.zeros(len(self.lo), np.float64)


OP_MODELS: dict[Op, object] = {}


def op_model(fn):
    """Register ``fn`` as the phases of the op it is named after (isa.Op, megakernel.cu)."""
    if fn.__name__ not in Op.__members__:
        raise CostModelError(f"cost model entry {fn.__name__} names no op of isa.Op: rename or "
                             "remove it in the commit that changes the op")
    OP_MODELS[Op[fn.__name__]] = fn
    return fn


def _prefetch(d: KernelDesign, *ranges: np.ndarray) -> np.ndarray:
    if not d.l2_prefetch:
        return np.zeros_like(ranges[0], dtype=np.float64)
    return sum(np.minimum(r, d.prefetch_max_bytes) for r in ranges).astype(np.float64)


def _trips(d: KernelDesign, op: str, busy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    l2, hbm = d.trips[op]
    return busy * float(l2), busy * float(hbm)


def _late_norm(busy: np.ndarray, d: KernelDesign) -> np.ndarray | None:
    """RMS ops: their norm weights, one load per thread issued just before the wait."""
    return busy.copy() if d.norm_weights_late else None


@op_model
def EMBED(b: OpBatch, g: GPU, d: KernelDesign) -> Phases:
    busy = (b.n > 0).astype(np.float64)
    l2, hbm = _trips(d, "EMBED", busy)
    z = b.zeros()
    return Phases(l2, hbm, z, z.copy(), b.weight_bytes.astype(np.float64), z.copy())


@op_model
def RMS_QKV_ROPE(b: OpBatch, g: GPU, d: KernelDesign) -> Phases:
    c = b.program.config
    half, H = c.head_dim // 2, c.hidden_size
    busy = (b.n > 0).astype(np.float64)
    l2, hbm = _trips(d, "RMS_QKV_ROPE", busy)
    # the kernel walks the tile head by head: each head segment's 2n rows over the warps, then
    # RoPE (and q/k-norm) with barriers in between
    seg_ins, seg_n, seg_normed = [], [], []
    for k, (lo, hi) in enumerate(zip(b.lo.tolist(), b.hi.tolist())):
        p = lo
        while p < hi:
            head, j0 = divmod(p, half)
            n = min(half, j0 + hi - p) - j0
            seg_ins.append(k)
            seg_n.append(n)
            seg_normed.append(c.qk_norm and head < c.num_heads + c.num_kv_heads)
            p += n
    idx, n = np.array(seg_ins, np.int64), np.array(seg_n, np.int64)
    normed = np.array(seg_normed, bool) & d.qk_norm_whole_heads
    m = len(b.lo)
    seg_rounds, seg_issue = _matvec(2 * n, H, g, d)
    rounds = np.bincount(idx, seg_rounds, m)
    seg_other = 2 * g.bar_sync + normed * (block_sum_us(g) + g.bar_sync)
    other = busy * block_sum_us(g) + np.bincount(idx, seg_other, m)
    hbm = hbm + np.bincount(idx, normed + float(c.attention_bias), m)  # q/k-norm weights, bias
    pref = np.bincount(idx, 2.0 * np.minimum(n * H * 2, d.prefetch_max_bytes), m) \
        if d.l2_prefetch else b.zeros()
    return Phases(l2, hbm, other, rounds, b.weight_bytes.astype(np.float64), pref,
                  _late_norm(busy, d), np.bincount(idx, seg_issue, m))


def _split_chunk(program, n_pos: int) -> int:
    """megakernel.cu split_chunk: n_pos over the splits, at least the program's min chunk."""
    return max(getattr(program, "attn_min_chunk", 1), -(-n_pos // program.attn_splits))


def _splits_used(program, n_pos: int) -> int:
    return min(program.attn_splits, -(-n_pos // _split_chunk(program, n_pos)))


def _merge_by_ticket(b: OpBatch, d: KernelDesign, used: int) -> bool:
    """megakernel.cu merge_by_ticket: the step merges the splits by ticket in ATTENTION."""
    least = getattr(b.program, "merge_ticket_min", 0)
    return d.o_proj_merge_ticket and least > 0 and used >= least


def _unit_positions(b: OpBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(instruction index, first position, positions) of every attention unit: units cover
    [split * chunk, (split + 1) * chunk) of the context + 1 positions."""
    splits = b.program.attn_splits
    n_pos = b.context + 1
    chunk = _split_chunk(b.program, n_pos)
    idx = np.repeat(np.arange(len(b.lo)), b.n)
    units = np.concatenate([np.arange(lo, hi) for lo, hi in zip(b.lo.tolist(), b.hi.tolist())]
                           or [np.zeros(0, np.int64)]).astype(np.int64)
    split = units % splits
    t0 = split * chunk
    cnt = np.clip(np.minimum(n_pos, t0 + chunk) - t0, 0, None)
    return idx, t0, cnt


def _issue_us(g: GPU, d: KernelDesign, instructions_per_warp):
    """Issue time of every warp of the block running this many instructions: each of the SM's
    schedulers issues one warp instruction per clock for its share of the warps."""
    return instructions_per_warp * -(-d.warps // g.schedulers) / (g.clock_ghz * 1e3)


def _attention_tile_isa(n: np.ndarray, g: GPU, d: KernelDesign, G: int, D: int):
    """(K rounds, V rounds, compute us) of one pass over n <= T_TILE positions of design 2's
    loop, vectorised over n. Geometry from isa.py; instruction shapes read off the sm_90 SASS
    of megakernel.cu (commit 43be27c):

    - attention_scores: one iteration per attn_round_positions(D) positions; its KV_UNROLL
      loads per lane, of which the compiled loop keeps ``attn_k_in_flight`` in flight (a group
      of loads is one HBM round; a load whose rows all lie past n is predicated off). Every
      (load u, head h) is a dependent chain: LDS of q_h, dot8, log2(KV_LANES) SHFL+FADD steps,
      FMUL, STS of the score; the STS of one chain precedes the LDS of the next (the compiler
      cannot reorder them: both address shared memory through different registers), so a
      warp runs its KV_UNROLL x G chains one after another (~ (2 + log2 KV_LANES) shuffle
      steps each), the block's warps in parallel. The next load group is issued after the
      first chain of the previous one, so the rest of that group's chains run under its HBM
      latency.
    - attention_values: the iteration's KV_UNROLL loads all issued before the first FMA (one
      HBM round; every shape's SASS); per load 8 unpacks and G x (LDS p + 8 FFMA), issue-bound;
      then the cross-slot sum (G x 8 values x log2(KV_PPW) SHFL+FADD), the shared-memory store
      and barrier, and the cross-warp sum (an LDS round, NWARPS dependent adds: ~2 steps).
    - the online softmax between them (one warp per head: max and sum reductions, expf) and
      the tile's four barriers."""
    lanes = D // 8  # KV_LANES
    ppw = 32 // lanes  # KV_PPW
    slots = d.warps * ppw  # KV_SLOTS
    per_round = attn_round_positions(D)
    if per_round != slots * KV_UNROLL:
        raise CostModelError(f"isa.attn_round_positions({D}) = {per_round} is not KV_SLOTS "
                             f"{slots} x KV_UNROLL {KV_UNROLL}: the model's geometry is stale")
    kf = min(dict(d.attn_k_in_flight).get(D, KV_UNROLL), KV_UNROLL)
    steps = int(np.log2(lanes))
    it = -(-n // per_round)  # loop iterations
    rem = n - np.maximum(it - 1, 0) * per_round  # positions of the last iteration
    u_last = -(-rem // slots)  # its loads with a row in range
    k_rounds = np.maximum(it - 1, 0) * -(-KV_UNROLL // kf) + np.where(it > 0, -(-u_last // kf), 0)
    v_rounds = it
    chain = (2 + steps) * g.shfl  # one (load, head) of the scores
    hidden = np.maximum(k_rounds - it, 0) * min(g.hbm_latency, (kf * G - 1) * chain)
    k_issue = _issue_us(g, d, it * KV_UNROLL * (8 + G * (14 + 2 * steps)))
    if d.attn_k_interleaved:
        k_compute = np.maximum(it * chain, k_issue)
    else:
        k_compute = np.maximum(it * KV_UNROLL * G * chain - hidden, k_issue)
    v_issue = _issue_us(g, d, it * KV_UNROLL * (8 + 9 * G))
    v_reduce = max(_issue_us(g, d, G * 8 * 2 * np.log2(ppw)), np.log2(ppw) * g.shfl) \
        + 2 * g.shfl
    softmax = 10 * g.shfl + 0.02
    busy = n > 0
    compute = busy * (k_compute + v_issue + v_reduce + softmax + 4 * g.bar_sync)
    return k_rounds, v_rounds, compute


@op_model
def ATTENTION(b: OpBatch, g: GPU, d: KernelDesign) -> Phases:
    c = b.program.config
    T_TILE, G, D = d.attn_tile, c.group_size, c.head_dim
    idx, t0, cnt = _unit_positions(b)
    ntile = -(-cnt // T_TILE)
    full, last = np.maximum(ntile - 1, 0), cnt - np.maximum(ntile - 1, 0) * T_TILE
    unit_hbm = np.zeros(len(idx))
    unit_l2 = np.full(len(idx), float(d.trips["ATTENTION"][0]))  # the group's queries
    if d.attn_isa_loop:
        kf, vf, of = _attention_tile_isa(np.full(1, T_TILE), g, d, G, D)
        kl, vl, ol = _attention_tile_isa(last, g, d, G, D)
        k_rounds, v_rounds = full * kf[0] + kl, full * vf[0] + vl
        unit_other = full * of[0] + ol + 2 * g.bar_sync  # the unit's set-up and end barriers
        if d.late_qk and c.qk_norm:
            # warp_qk_norm_rope per query head and the key, after the queries' L2 trip: the
            # warp_sum, then the q/k-norm weights (HBM: evicted since the last token), then the
            # RoPE row (L2: every layer reads the same position's row), a barrier; the unit
            # holding the new position scores it from shared memory (barrier, warp_sum)
            if not d.late_qk_one_trip:
                unit_hbm += 1.0
                unit_l2 += 1.0
            unit_other += 5 * g.shfl + g.bar_sync
            holds = (t0 <= b.context) & (b.context < t0 + cnt)  # the new position's unit
            unit_other += holds * (g.bar_sync + 6 * g.shfl)
    else:
        per_k = d.warps * d.attn_positions_per_warp
        k_rounds = full * -(-T_TILE // per_k) + -(-last // per_k)
        elems = max(1, d.attn_load_bytes // 2)  # bf16 elements per K/V load
        passes = -(-(G * D) // (d.threads * elems))  # V: each thread owns `elems` output dims
        v_rounds = passes * (full * -(-T_TILE // d.attn_v_in_flight)
                             + -(-last // d.attn_v_in_flight))
        # per position of a warp: its K loads issued, G dot products each ended by a warp_sum;
        # per tile: the online softmax (one warp per head: max and sum reductions) and four
        # barriers
        k_loads = -(-D // (32 * elems))
        k_compute = (full * -(-T_TILE // d.warps) + -(-last // d.warps)) \
            * (G * 5 * g.shfl + k_loads * 0.002)
        softmax = ntile * (10 * g.shfl + 4 * g.bar_sync + 0.02)
        unit_other = k_compute + softmax + 3 * g.bar_sync
    n = len(b.lo)
    used = _splits_used(b.program, b.context + 1)
    other = np.bincount(idx, unit_other, n)
    l2 = np.bincount(idx, unit_l2, n)
    if _merge_by_ticket(b, d, used):
        # every instruction with units (one KV group's): a barrier, the ticket (an acq_rel
        # returning atomic, MK_SYNC=1: fence + atomicAdd; one L2 round trip); the last of its
        # group (charged to all: the group's last one ends the op) loads the used splits'
        # partials (MERGE_CHUNK x MERGE_TICKET_WAYS a round), merges them and stores the
        # merged vector
        busy = (b.n > 0).astype(np.float64)
        mb = used * G * (D + 2) * 4.0
        l2_share = g.l2_bw / g.sms
        ticket = g.ticket if d.ticket_as_compiled else (g.fence if d.signal_sc_fence
                                                         else g.release)
        l2 = l2 + busy * (1 + -(-used // (MERGE_CHUNK * MERGE_TICKET_WAYS)))
        other = other + busy * (2 * g.bar_sync + ticket + mb / l2_share + G * D * 4 / l2_share)
    # K/V rounds go to HBM; with attn_kv_prefetch the rows cached before this step were
    # brought into L2 during the wait (the prefetch share of the rounds then hits L2)
    rounds = np.bincount(idx, (k_rounds + v_rounds).astype(np.float64), n)
    hbm = np.bincount(idx, unit_hbm, n)
    sbytes = np.bincount(idx, cnt * 2 * D * 2.0, n)
    pref = b.zeros()
    if d.attn_kv_prefetch:  # K and V: a range each, positions before the new one
        old = np.clip(np.minimum(cnt, b.context - t0), 0, None)
        pref = np.bincount(idx, 2 * np.minimum(old * D * 2.0, d.prefetch_max_bytes), n)
    return Phases(l2, hbm, other, rounds, sbytes, pref)


@op_model
def O_PROJ_RESIDUAL(b: OpBatch, g: GPU, d: KernelDesign) -> Phases:
    c = b.program.config
    S = b.program.attn_splits
    busy = (b.n > 0).astype(np.float64)
    l2, hbm = _trips(d, "O_PROJ_RESIDUAL", busy)
    used = _splits_used(b.program, b.context + 1)
    # the merge reads every split's partial outputs from L2 (v1: all S splits, each a trip)
    partial_bytes = c.num_kv_heads * c.group_size * (c.head_dim + 2) * 4  # per split
    if _merge_by_ticket(b, d, used):
        # ATTENTION merged the groups: read the merged vector (Q_DIM / 4 float4s over the
        # threads: one round, or as the copy loop compiles)
        l2 = l2 + busy * _copy_rounds(-(-c.q_dim // (4 * d.threads)), d)
        merge_bytes = busy * c.q_dim * 4
    elif d.o_proj_merge_chunk:  # design 2 merges only the splits the context uses
        ways = merge_block_ways(c) if d.o_proj_merge_ways else 1
        l2 = l2 + busy * -(-used // (d.o_proj_merge_chunk * ways))
        merge_bytes = busy * partial_bytes * used
    else:
        l2 = l2 + busy * d.o_proj_merge_trips_per_split * S
        merge_bytes = busy * partial_bytes * S * d.o_proj_merge_trips_per_split
    other = busy * (g.bar_sync + merge_bytes / (g.l2_bw / g.sms))
    if d.late_qk and c.qk_norm:
        # before the merge, the blocks that own KV heads (ARG2..ARG3) cache their keys: one
        # warp per head, warp_qk_norm_rope of k_raw (L2), then the k-norm weights and the RoPE
        # row (both in L2: ATTENTION read them this layer), a barrier
        owner = np.array([float(len(a) > 3 and a[3] > a[2]) for a in b.args])
        l2 = l2 + (1 if d.late_qk_one_trip else 3) * owner
        other = other + owner * (5 * g.shfl + g.bar_sync)
    rounds, issue = _matvec(b.n, c.q_dim, g, d)
    pref = _prefetch(d, b.n * c.q_dim * 2)
    return Phases(l2, hbm, other, rounds, b.weight_bytes.astype(np.float64), pref,
                  issue=busy * issue)


@op_model
def RMS_GATE_UP(b: OpBatch, g: GPU, d: KernelDesign) -> Phases:
    c = b.program.config
    busy = (b.n > 0).astype(np.float64)
    l2, hbm = _trips(d, "RMS_GATE_UP", busy)
    rounds, issue = _matvec(b.n, c.hidden_size, g, d, pairs=True)
    other = busy * block_sum_us(g)
    pref = _prefetch(d, b.n * c.hidden_size * 2, b.n * c.hidden_size * 2)
    return Phases(l2, hbm, other, rounds, b.weight_bytes.astype(np.float64), pref,
                  _late_norm(busy, d), busy * issue)


@op_model
def DOWN_RESIDUAL(b: OpBatch, g: GPU, d: KernelDesign) -> Phases:
    c = b.program.config
    busy = (b.n > 0).astype(np.float64)
    l2, hbm = _trips(d, "DOWN_RESIDUAL", busy)
    # the first of its trips is the copy of ffn_h into shared memory, one element per thread a
    # round or as the copy loop compiles
    l2 = l2 + busy * (_copy_rounds(-(-c.intermediate_size // d.threads), d) - 1)
    rounds, issue = _matvec(b.n, c.intermediate_size, g, d)
    other = busy * g.bar_sync
    pref = _prefetch(d, b.n * c.intermediate_size * 2)
    return Phases(l2, hbm, other, rounds, b.weight_bytes.astype(np.float64), pref,
                  issue=busy * issue)


@op_model
def RMS_LM_HEAD(b: OpBatch, g: GPU, d: KernelDesign) -> Phases:
    c = b.program.config
    busy = (b.n > 0).astype(np.float64)
    l2, hbm = _trips(d, "RMS_LM_HEAD", busy)
    # the block's best of its warps: thread 0 walks NWARPS shared-memory partials
    other = busy * block_sum_us(g) + g.bar_sync + d.warps * 0.01
    if not d.sample_op and d.ticket_as_compiled:
        other = other + g.ticket  # every block draws; the last one's reduction: step_end_us
    elif not d.sample_op:  # the last block (atomic ticket, a warp's loads, warp reductions)
        l2 = l2 + 3.0 / len(b.lo)  # reduces all partials: spread over the instructions
        other = other + 10 * g.shfl / len(b.lo)
    rounds, issue = _matvec(b.n, c.hidden_size, g, d)
    pref = _prefetch(d, b.n * c.hidden_size * 2)
    return Phases(l2, hbm, other, rounds, b.weight_bytes.astype(np.float64), pref,
                  _late_norm(busy, d), busy * issue)


@op_model
def SAMPLE(b: OpBatch, g: GPU, d: KernelDesign) -> Phases:
    partials = np.array([a[0] if a else 0 for a in b.args], np.float64)
    l2 = partials * d.sample_trips_per_partial
    z = b.zeros()
    return Phases(l2, z.copy(), z + 0.05, z.copy(), z.copy(), z.copy())


# ================================================================================================
# The discrete-event simulation
# ================================================================================================
@dataclass
class Prediction:
    """Predicted times of one decode step (us). start/ready/end: per block, per slot (NaN for
    NOOP); trips: dependent round trips after the wait incl. the stream's rounds."""

    program: object
    gpu: GPU
    design: KernelDesign
    context: int
    start: np.ndarray
    ready: np.ndarray
    end: np.ndarray
    trips: np.ndarray
    step_us: float  # the launch's start (t = 0) to the last end of the simulated step
    launch_us: float  # launch overhead per token
    critical: list[tuple[int, int]]  # (block, slot) from the first instruction to the last
    critical_hops: int

    @property
    def total_us(self) -> float:
        return self.step_us + self.launch_us

    @property
    def floor_us(self) -> float:
        return self.program.config.weight_bytes_per_token() / self.gpu.hbm_bw

    @property
    def x_floor(self) -> float:
        return self.total_us / self.floor_us

    def op_rows(self) -> list[dict]:
        """Per op: instructions, mean and max busy time (ready -> end), mean wait, median
        round trips after the wait of the busy instructions, time on the critical path."""
        prog = self.program
        crit: dict[Op, float] = {}
        prev_end = 0.0
        for blk, slot in self.critical:
            op = prog.queues[blk][slot].op
            crit[op] = crit.get(op, 0.0) + self.end[blk, slot] - prev_end
            prev_end = self.end[blk, slot]
        rows = []
        for op in Op:
            sel = [(bb, i) for bb, q in enumerate(prog.queues) for i, ins in enumerate(q)
                   if ins.op == op and op != Op.NOOP and not np.isnan(self.end[bb, i])]
            if not sel:  # not in the program, or not run by this design (SAMPLE)
                continue
            bi = tuple(np.array(sel).T)
            busy = self.end[bi] - self.ready[bi]
            wait = self.ready[bi] - self.start[bi]
            nonempty = np.array([not prog.queues[bb][i].empty for bb, i in sel])
            trips = self.trips[bi][nonempty] if nonempty.any() else np.zeros(1)
            rows.append({"op": op.name, "instructions": len(sel), "busy_mean_us": busy.mean(),
                         "busy_max_us": busy.max(), "wait_mean_us": wait.mean(),
                         "trips": float(np.median(trips)), "critical_us": crit.get(op, 0.0)})
        return rows


def _batches(program, context: int) -> dict[Op, tuple[list[tuple[int, int]], OpBatch]]:
    by_op: dict[Op, list] = {}
    for blk, q in enumerate(program.queues):
        for i, ins in enumerate(q):
            if ins.op != Op.NOOP:
                by_op.setdefault(ins.op, []).append((blk, i, ins))
    out = {}
    for op, items in by_op.items():
        ins = [t[2] for t in items]
        batch = OpBatch(program, context,
                        np.array([x.layer for x in ins], np.int64),
                        np.array([x.tile[0] for x in ins], np.int64),
                        np.array([x.tile[1] for x in ins], np.int64),
                        np.array([x.weight_bytes for x in ins], np.int64),
                        [x.args for x in ins])
        out[op] = ([(t[0], t[1]) for t in items], batch)
    return out


class Static:
    """Per-instruction phases of a program at one context and design, [blocks, slots]. They
    do not depend on the constants the calibration fits (latencies, bandwidth, fence)."""

    def __init__(self, program, context: int, g: GPU, d: KernelDesign):
        if context < 0 or context + 1 > program.max_seq_len:
            raise CostModelError(
                f"context {context} does not fit the program's KV cache of "
                f"{program.max_seq_len} positions (need context + 1 <= max_seq_len)")
        B, L = program.num_blocks, program.max_len
        self.shape = (B, L)
        self.fields = {k: np.zeros((B, L)) for k in
                       ("l2", "hbm", "other", "rounds", "bytes", "pref", "early", "issue")}
        for op, (where, batch) in _batches(program, context).items():
            if op not in OP_MODELS:
                raise CostModelError(f"the cost model has no entry for op {op.name}: add one "
                                     "named like its section in megakernel.cu")
            ph = OP_MODELS[op](batch, g, d)
            bi = tuple(np.array(where).T)
            f = self.fields
            f["l2"][bi], f["hbm"][bi], f["other"][bi] = ph.l2_trips, ph.hbm_trips, ph.other_us
            f["rounds"][bi], f["bytes"][bi] = ph.rounds, ph.stream_bytes
            f["pref"][bi] = np.minimum(ph.prefetch_bytes, ph.stream_bytes)
            for name in ("early", "issue"):
                if getattr(ph, name) is not None:
                    f[name][bi] = getattr(ph, name)


def predict(program, g: GPU | str = "h200", d: KernelDesign | None = None, context: int = 16,
            static: "Static | None" = None) -> Prediction:
    """Predicted time of one decode step on GPU ``g`` (a name or a ``GPU``) with kernel design
    ``d`` (default ``design_for(program)``) at ``context`` positions already in the cache (the
    step attends over context + 1). Pass ``static`` (a ``Static`` of the same program, context
    and design) to reuse the phases when only the GPU's constants change."""
    g = gpu(g) if isinstance(g, str) else g
    d = design_for(program) if d is None else d
    st = static or Static(program, context, g, d)
    return _simulate(program, g, d, context, st)


def busy_constants(g: GPU, d: KernelDesign, num_blocks: int) -> tuple[float, ...]:
    """What ``busy_us`` needs of the GPU and design: (HBM share per SM (at the GEMV rate with
    gemv_rate), L2 share per SM, L2 latency, HBM latency, signal cost, barrier, loaded HBM
    latency, 1.0 with stream_ramp else 0.0)."""
    bw = g.gemv_bw if d.gemv_rate else g.hbm_bw
    return (bw / min(num_blocks, g.sms), g.l2_bw / min(num_blocks, g.sms), g.l2_latency,
            g.hbm_latency, hop_parts(g, d)["signal"], g.bar_sync, g.hbm_loaded_latency,
            float(d.stream_ramp))


def busy_us(k: tuple[float, ...], l2, hbm, other, rounds, nbytes, pref, lead, signals,
            mn=min, mx=max, early=0.0, issue=0.0):
    """Ready -> end of one instruction (or of arrays of them: pass ``mn=np.minimum,
    mx=np.maximum``): its dependent round trips and fixed work, then its weight stream at
    min(bytes in flight / latency, the SM's HBM share), then its signal. ``k`` is
    ``busy_constants``; ``lead``: how long its L2 prefetch has run when the wait returns;
    ``early``: HBM loads issued at the start that its first L2 trip needs (their loaded
    latency past the lead and that trip is on the path); ``issue``: the stream's compute after
    its data (on the path of a latency-bound stream only). The one formula the simulation and
    the calibration share."""
    share, l2_share, L2, HBM, sig, bar, HBM_loaded, ramp = k
    fixed = l2 * L2 + hbm * HBM + other + early * mx(HBM_loaded - lead - L2, 0.0)
    hits = mn(pref, share * (lead + fixed))  # the prefetch ran from the start until the stream
    h = hits / mx(nbytes, 1.0)
    lat = h * L2 + (1 - h) * HBM  # the prefetched share of the rounds hits L2
    first = ramp * lat * (nbytes > 0)  # stream_ramp: the first bytes a latency after the start
    stream = mx(rounds * lat + issue, first + (nbytes - hits) / share + hits / l2_share)
    return fixed + stream + signals * sig + (1 - signals) * bar


def _prefetch_issue_us(pref, d: KernelDesign):
    """Issuing the prefetches: one 128-byte line per thread per pass, a few cycles each."""
    return np.ceil(np.asarray(pref) / 128 / d.threads) * 0.004


def _simulate(program, g: GPU, d: KernelDesign, context: int, st: "Static") -> Prediction:
    B, L = st.shape
    f = {k: v.tolist() for k, v in st.fields.items()}
    issue = _prefetch_issue_us(st.fields["pref"], d).tolist()
    parts = hop_parts(g, d)
    propagate, detect = parts["propagate"], parts["detect"]
    fetch = _fetch_us(g, d)
    check = g.l2_latency + g.bar_sync  # the first acquire load finds the count already there
    k = busy_constants(g, d, program.num_blocks)

    queues = program.queues
    n_sig = [0] * program.num_counters
    for q in queues:
        for ins in q:
            if ins.signal is not None:
                n_sig[ins.signal] += 1
    sig_ends: list[list[tuple[float, int, int]]] = [[] for _ in range(program.num_counters)]
    visible: list[float | None] = [None] * program.num_counters
    last_sig: list[tuple[int, int] | None] = [None] * program.num_counters
    nan = float("nan")
    start = [[nan] * L for _ in range(B)]  # after the instruction's words are fetched (T_START)
    ready = [[nan] * L for _ in range(B)]
    end = [[nan] * L for _ in range(B)]
    # what made each instruction ready: (its block's previous node or the counter's last
    # signaler, whether that was a hop)
    bound: list[list] = [[None] * L for _ in range(B)]
    t_block = [0.0] * B
    prev_node: list[tuple[int, int] | None] = [None] * B
    ptr = [0] * B
    if d.steps_per_launch > 1:  # EMBED waits for the previous step's token: one more hop
        t_block = [sum(parts.values())] * B

    def resolve(c: int, need: int, stuck: bool) -> bool:
        ends = sig_ends[c]
        if visible[c] is not None:
            return True
        if len(ends) < need or (len(ends) < n_sig[c] and not stuck):
            return False
        t, blk, slot = sorted(ends)[need - 1]
        visible[c] = t + propagate
        last_sig[c] = (blk, slot)
        return True

    # a design without a SAMPLE op reduces the partials in the LM head (RMS_LM_HEAD's entry)
    skip = {Op.NOOP} if d.sample_op else {Op.NOOP, Op.SAMPLE}
    remaining = sum(1 for q in queues for ins in q if ins.op not in skip)
    stuck = False
    while remaining:
        progress = False
        for b in range(B):
            q = queues[b]
            while ptr[b] < len(q):
                i = ptr[b]
                ins = q[i]
                if ins.op in skip:
                    ptr[b] += 1
                    continue
                s = t_block[b] + fetch
                t_check = s + issue[b][i]
                if ins.wait is not None:
                    c, need = ins.wait
                    if not resolve(c, need, stuck):
                        break
                    via_counter = visible[c] + detect
                    if via_counter > t_check + check:
                        r, bnd = via_counter, (last_sig[c], True)
                    else:
                        r, bnd = t_check + check, (prev_node[b], False)
                else:
                    r, bnd = t_check, (prev_node[b], False)
                sig = ins.signal is not None
                e = r + busy_us(k, f["l2"][b][i], f["hbm"][b][i], f["other"][b][i],
                                f["rounds"][b][i], f["bytes"][b][i], f["pref"][b][i],
                                r - s, 1.0 if sig else 0.0, early=f["early"][b][i],
                                issue=f["issue"][b][i])
                start[b][i], ready[b][i], end[b][i], bound[b][i] = s, r, e, bnd
                if sig:
                    sig_ends[ins.signal].append((e, b, i))
                t_block[b] = e
                prev_node[b] = (b, i)
                ptr[b] += 1
                remaining -= 1
                progress = True
        if not progress:
            if stuck:
                raise CostModelError("the simulated queues deadlock (a wait can never be met); "
                                     "run Program.verify() for the instructions")
            stuck = True
        else:
            stuck = False

    end_a = np.array(end, np.float64)
    last = np.unravel_index(np.nanargmax(end_a), end_a.shape)
    node: tuple[int, int] | None = (int(last[0]), int(last[1]))
    chain, hops = [], 0
    while node is not None:
        chain.append(node)
        node, hop = bound[node[0]][node[1]]
        hops += hop
    chain.reverse()
    st_a = np.array(start, np.float64)
    trips = st.fields["l2"] + st.fields["hbm"] + st.fields["rounds"]
    return Prediction(program, g, d, context, st_a, np.array(ready, np.float64), end_a, trips,
                      float(np.nanmax(end_a)) + step_end_us(g, d), g.launch / d.steps_per_launch,
                      chain, hops)


def with_row_pair_tiles(program):
    """A copy of ``program`` whose RMS_QKV_ROPE instructions take even row-pair tiles over all
    blocks (as the scheduler tiles models without q/k-norm): what a balanced Qwen3 QKV (step R1)
    would cost, before the scheduler makes one. For predictions only: the copy's declared reads
    and writes are the old ones, so it must never run."""
    from .scheduler import split_even

    c = program.config
    half, H = c.head_dim // 2, c.hidden_size
    tiles = split_even((c.num_heads + 2 * c.num_kv_heads) * half, program.num_blocks)
    queues = []
    for b, q in enumerate(program.queues):
        lo, hi = tiles[b]
        wbytes = 2 * 2 * (hi - lo) * H + (2 * H if hi > lo else 0)
        queues.append([dataclasses.replace(ins, tile=(lo, hi), weight_bytes=wbytes)
                       if ins.op == Op.RMS_QKV_ROPE else ins for ins in q])
    return dataclasses.replace(program, queues=queues)


# Constants whose HIGH end makes a step faster (rates, counts); for every other one the low end does.
_FASTER_WHEN_HIGH = frozenset({"sms", "clock_ghz", "hbm_bw", "l2_bw", "gemv_bw", "schedulers"})


def corner(gpu_name: str, fast: bool) -> GPU:
    """The GPU with every constant at the end of its range that makes a step faster (``fast``)
    or slower: the ends of `plan --predict`'s low / high range."""
    base = gpu(gpu_name)
    vals = {}
    for c in CONSTANTS:
        lo, hi = constant_range(base.name, c)
        v = hi if (c in _FASTER_WHEN_HIGH) == fast else lo
        vals[c] = v * _TB_S if c in ("hbm_bw", "l2_bw", "gemv_bw") else v
    vals["sms"], vals["schedulers"] = int(vals["sms"]), int(vals["schedulers"])
    return base.replace(**vals)


def predict_range(program, gpu_name: str, d: KernelDesign, context: int) -> tuple[float, float]:
    """(low, high) us/token: every constant at its fast end, then at its slow end. A band, not
    a confidence interval: the ends assume every constant errs the same way at once."""
    return tuple(predict(program, corner(gpu_name, fast), d, context).total_us
                 for fast in (True, False))


def sensitivity(program, g: GPU | str, d: KernelDesign, context: int,
                static: Static | None = None) -> dict[str, float]:
    """Total us/token with L2 or HBM latency at the low and high end of its range."""
    base = gpu(g) if isinstance(g, str) else g
    st = static or Static(program, context, base, d)
    out = {}
    for const in ("l2_latency", "hbm_latency"):
        lo, hi = constant_range(base.name, const)
        for tag, v in (("low", lo), ("high", hi)):
            gg = base.replace(**{const: v})
            out[f"{const}_{tag}"] = predict(program, gg, d, context, st).total_us
    return out
