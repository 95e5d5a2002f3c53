"""Costs the ops share (the hop, block reductions, mat-vec passes, copies, the instruction's
fetch, the step's end) and what an op's cost entry takes and returns (``OpBatch``,
``Phases``). Each op's own entry is ``cost`` in kernel/ops/<op>.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..isa import PREFETCH_MAX_BYTES, pair_rows, row_shape
from .design import KernelDesign
from .gpu import GPU


def hop_parts(g: GPU, d: KernelDesign) -> dict[str, float]:
    """The parts of one counter hop, in us. signal: on the producer, inside its instruction;
    propagate: the atomic reaching L2; detect: the poll loop noticing (half a poll period on
    average, then the load's way back) and the block barrier after it."""
    signal = g.bar_sync + (g.fence + g.cctl if d.signal_sc_fence else g.release)
    if d.data_flag_hops:  # the outputs' own flagged stores are the signal (levers.py): only
        signal = g.bar_sync  # the block's end barrier stays (its shared memory's next user)
    period = d.poll_loads * g.l2_latency + g.timer + (g.nanosleep if d.poll_sleep else 0.0)
    return {"signal": signal, "propagate": g.l2_latency / 2,
            "detect": period / 2 + g.l2_latency / 2 + g.bar_sync}


def hop_latency(g: GPU, d: KernelDesign) -> float:
    """Producer's last stores issued -> consumer block past its wait."""
    return sum(hop_parts(g, d).values())


def block_sum_us(g: GPU) -> float:
    """block_sum: warp_sum, shared store, barrier, warp_sum of the partials, two barriers."""
    return 10 * g.shfl + 3 * g.bar_sync


def issue_us(g: GPU, d: KernelDesign, instructions_per_warp):
    """Issue time of every warp of the block running this many instructions: each of the SM's
    schedulers issues one warp instruction per clock for its share of the warps."""
    return instructions_per_warp * -(-d.warps // g.schedulers) / (g.clock_ghz * 1e3)


def matvec(rows: np.ndarray, n: int, g: GPU, d: KernelDesign,
           pairs: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(rounds, issue us) of the busiest warp of block_dot_rows (or block_dot_row_pairs: gate
    and up) over ``rows`` rows of n bf16 each, vectorised over instructions. The passes follow
    isa.row_shape (megakernel.cu RowShape<n>): warp w takes passes of R rows (R' row pairs),
    each ceil(L / K) chunks of R x K loads per lane, every chunk one round; after its data, a
    pass costs its loads' issue slots (matvec_issue_per_load each, the SM's schedulers shared by
    its warps) and the rows' warp sums (5 SHFL + FADD, side by side)."""
    rows = np.asarray(rows)
    L, K, R = row_shape(n)
    per_pass = pair_rows(R) if pairs else R
    passes = -(-rows // (d.warps * per_pass))
    rounds = passes * -(-L // K)
    issue = 0.0
    if d.matvec_issue_per_load:
        loads = per_pass * (2 if pairs else 1) * L  # per lane per pass
        issue = issue_us(g, d, loads * d.matvec_issue_per_load) + 5 * g.shfl
    return rounds.astype(np.float64), passes * issue


def copy_rounds(n: int, d: KernelDesign) -> int:
    """Dependent rounds of a copy loop whose busiest thread moves n elements (copy_unroll)."""
    if not d.copy_unroll:
        return 1
    return n % d.copy_unroll + n // d.copy_unroll


def fetch_us(g: GPU, d: KernelDesign) -> float:
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
    counter's release is the next step's hop (its signal). More than one block reading the
    host's flag before the LM head's wait: the last read back ``host_flag_readers`` x
    ``pcie_serial`` after they start, the first one's trip hidden under the wait."""
    t = max(0.0, d.host_flag_readers * g.pcie_serial - g.pcie_read)
    if d.ticket_as_compiled:
        t += 2 * g.l2_latency + 10 * g.shfl
    if d.step_end_host_read:
        t += g.pcie_read
    if d.step_end_sys_fence:
        t += g.sys_fence
    return t


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
    # tensor-core time of the whole stream's products (steps of many tokens, costmodel/
    # tokens.py): the stream runs beside it, so the slower of the two bounds the op
    compute: np.ndarray | None = None
    tiles: tuple[int, int] = (1, 1)  # 2D tiles' (token groups, input slices): tokens.tile_split
    # 1.0 where the stream runs at the copy rate (hbm_bw) rather than the GEMV's (gemv_bw):
    # K/V by cp.async (levers.py, kv_copy_rate)
    copy: np.ndarray | None = None
    # the share of the stream's dependent rounds whose loads hit L2 because the walk itself
    # prefetched them a round ahead (block_mma_rows' next k range: mma_rows_prefetch)
    rolling: np.ndarray | None = None


@dataclass
class OpBatch:
    """The instructions of one op in a program, as arrays; ``arg(name)`` reads a named
    argument word of every instruction (kernel/ops/<op>.py ARGS)."""

    program: object
    context: int
    layer: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    weight_bytes: np.ndarray
    instructions: list
    shape: object = None  # the step's tokens (tokens.StepShape); None: one token at context

    @property
    def n(self) -> np.ndarray:
        return np.maximum(self.hi - self.lo, 0)

    def zeros(self) -> np.ndarray:
        return np.zeros(len(self.lo), np.float64)

    def busy(self) -> np.ndarray:
        """1.0 for an instruction with work, 0.0 for an empty tile."""
        return (self.n > 0).astype(np.float64)

    def arg(self, name: str) -> np.ndarray:
        return np.array([ins.arg(name) for ins in self.instructions], np.int64)


def prefetched(d: KernelDesign, *ranges: np.ndarray) -> np.ndarray:
    """Bytes an instruction's L2 prefetch brings in: each range capped at PREFETCH_MAX_BYTES."""
    if not d.l2_prefetch:
        return np.zeros_like(ranges[0], dtype=np.float64)
    return sum(np.minimum(r, PREFETCH_MAX_BYTES) for r in ranges).astype(np.float64)


def trips(d: KernelDesign, op: str, busy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    l2, hbm = d.trips[op]
    return busy * float(l2), busy * float(hbm)


def late_norm(busy: np.ndarray, d: KernelDesign) -> np.ndarray | None:
    """RMS ops: their norm weights, one load per thread issued just before the wait."""
    return busy.copy() if d.norm_weights_late else None
