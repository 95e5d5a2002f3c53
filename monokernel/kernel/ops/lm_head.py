"""RMS_LM_HEAD: logits = rmsnorm(residual) @ lm_head, a tile of vocabulary rows per block, each
block's best (Gumbel-max when sampling) into its partial slot; then every block draws the
step's ticket and the last drawer reduces the partials to the token and ends the step
(megakernel.cu "Op: RMS_LM_HEAD", finish_step). It signals no counter: the step counter is
the next step's wait."""

from __future__ import annotations

import numpy as np

from ..costmodel.tokens import widen_matmul
from ..costmodel.parts import OpBatch, Phases, block_sum_us, late_norm, matvec, prefetched, trips
from ..isa import STATE_WORDS, Args, Op
from ..program import Instruction, split_even

OP = Op.RMS_LM_HEAD
# its input is the residual, normed by the op (tensor cores: megakernel.cu mma_rms, which
# reads the rows first and stages a small share in shared memory; costmodel levers.py)
RMS_INPUT = True
ARGS = Args("slot",  # this block's partial (best score, token) in lm_part
            "ticket",  # the step's ticket counter
            "tickets")  # tickets per step (every block draws one)
SIGNALS = False


def tile(plan, layer: int) -> list[Instruction]:
    c, B = plan.config, plan.num_blocks
    H = c.hidden_size
    ticket = plan.counter("RMS_LM_HEAD.ticket")
    end_reads = [("lm_part", 0, 2 * B), ("state", 0, STATE_WORDS)]
    end_writes = [("state", 0, STATE_WORDS), ("out_tokens", 0, plan.max_seq_len)]
    out = []
    for b, (lo, hi) in enumerate(split_even(c.vocab_size, B)):
        ins = Instruction(OP, 0, (lo, hi), args=ARGS.pack({"slot": b, "ticket": ticket,
                                                           "tickets": B}),
                          reads=[(plan.rms_input(), 0, H)] if hi > lo else [],
                          writes=([("logits", lo, hi)] if hi > lo else [])
                          + [("lm_part", 2 * b, 2 * b + 2)],
                          weight_bytes=2 * (hi - lo) * H + (2 * H if hi > lo else 0))
        ins.ticket = (ticket, B)
        ins.tail_reads, ins.tail_writes = list(end_reads), list(end_writes)
        out.append(ins)
    return out


def cost(b: OpBatch, g, d) -> Phases:
    H = b.program.config.hidden_size
    busy = b.busy()
    l2, hbm = trips(d, "RMS_LM_HEAD", busy)
    # the block's best of its warps: thread 0 walks NWARPS shared-memory partials
    other = busy * block_sum_us(g) + g.bar_sync + d.warps * 0.01
    if d.ticket_as_compiled:
        other = other + g.ticket  # every block draws; the last one's reduction: step_end_us
    else:  # the last block (atomic ticket, a warp's loads, warp reductions)
        l2 = l2 + 3.0 / len(b.lo)  # reduces all partials: spread over the instructions
        other = other + 10 * g.shfl / len(b.lo)
    rounds, issue = matvec(b.n, H, g, d)
    pref = prefetched(d, b.n * H * 2)
    ph = Phases(l2, hbm, other, rounds, b.weight_bytes.astype(np.float64), pref,
                late_norm(busy, d), busy * issue)
    # only the tokens that need logits (none: a prompt chunk before the last); a row drawn on
    # the device stores no logits (State.HOST_LOGITS: the host's rows only), and a step of
    # many tokens is predicted with every row drawn there (the server's greedy and
    # temperature sampling), so the outputs cost nothing beyond the partials
    return widen_matmul(b, g, d, ph, H, tokens=None if b.shape is None else b.shape.logits,
                        out_bytes=0.0)
