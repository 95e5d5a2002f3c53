"""The attention split merge by ticket (megakernel.cu attention_ticket, design 2): a step that
uses at least the program's merge_ticket_min splits merges them once per KV group, in the
ATTENTION instruction whose block draws the group's last ticket, and O_PROJ reads the merged
vector ``attn``; below it every O_PROJ block merges the splits itself.

The default threshold (isa.merge_ticket_min_splits: a per-block merge of >= 64 KB) is never
reached by the tiny shapes, so these tests pass ``merge_ticket_min`` explicitly: 2 puts every
step from the second used split on through the ticket. qwen3-gqa-tiny has two KV groups (the
other tiny shapes one), so the group offsets of tickets, partials and merged outputs are
exercised; its q/k-norm also runs the late q/k path.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from monokernel.errors import ProgramError
from monokernel.kernel.executor import KernelExecutor
from monokernel.kernel.isa import Op, merge_ticket_min_splits
from monokernel.kernel.schedule import schedule
from monokernel.model.config import ModelConfig

from helpers.kernel import MAX_SEQ, assert_logits_match, reference_run, run_kernel, used_splits

PROMPT = [1, 999, 5, 0, 517, 998, 77]
N_STEPS = 20


@pytest.fixture(scope="module")
def reference(synth_model):
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            fed, logits, _ = reference_run(synth_model(arch), PROMPT, N_STEPS, MAX_SEQ)
            cache[arch] = (fed, logits)
        return cache[arch]

    return get


def ticket_counters(program) -> list[int]:
    """Indices of ATTENTION's ticket counters (scheduler: L<layer>.ATTENTION.ticket<group>)."""
    return [k for k, n in enumerate(program.counter_names) if ".ATTENTION.ticket" in n]


# (arch, blocks, splits): one unit per instruction with empty instructions (8 units on 10
# blocks), two units per instruction within a group (8 on 4), one KV group over 2 and over 1
# block(s), several units of one group per instruction
TICKET_CASES = [("qwen3-gqa-tiny", 10, 4), ("qwen3-gqa-tiny", 4, 4), ("tiny", 2, 5),
                ("tiny", 1, 3), ("llama3-tiny", 3, 6)]


@pytest.mark.parametrize("multi", [False, True], ids=["emulator", "emulator-multi"])
@pytest.mark.parametrize("arch,blocks,splits", TICKET_CASES,
                         ids=[f"{a}-b{b}-s{s}" for a, b, s in TICKET_CASES])
def test_logits_every_step_match_reference_with_the_merge_by_ticket(
        synth_model, reference, arch, blocks, splits, multi):
    fed, ref = reference(arch)
    ex = KernelExecutor(synth_model(arch), MAX_SEQ, blocks=blocks, attn_splits=splits,
                        multi=multi, attn_min_chunk=1, merge_ticket_min=2)
    assert ex.program.merge_ticket_min == 2
    # steps on both sides of the threshold: one used split (per-block merge), then 2..splits
    used = {used_splits(p + 1, splits, 1) for p in range(len(fed))}
    assert 1 in used and splits in used
    worst = assert_logits_match(run_kernel(ex, fed), ref, ex.name + " merge by ticket")
    print(f"{ex.name} {arch} blocks={blocks} splits={splits}: max error {worst:.2e}")


def _merge_partials(o: np.ndarray, ml: np.ndarray, used: int) -> np.ndarray:
    """The merged attention output from the partials [KV, S, G, D] and (max, sum) [KV, S, G, 2]
    of the first ``used`` splits, float64."""
    m, s = ml[:, :used, :, 0].astype(np.float64), ml[:, :used, :, 1].astype(np.float64)
    M = m.max(axis=1, keepdims=True)
    w = np.exp(m - M)
    return ((o[:, :used].astype(np.float64) * w[..., None]).sum(axis=1)
            / (s * w).sum(axis=1)[..., None]).reshape(-1)


def test_the_ticket_step_writes_the_merged_vector_and_resets_its_tickets(synth_model):
    """Poisoned buffers: a step below the threshold leaves ``attn`` unwritten (O_PROJ merged
    itself), a step at or above it writes all of it - the merge of the partials the step left
    - and every ticket counter is back at 0 after every step."""
    arch, splits = "qwen3-gqa-tiny", 4
    ex = KernelExecutor(synth_model(arch), MAX_SEQ, blocks=8, attn_splits=splits,
                        attn_min_chunk=1, merge_ticket_min=3)
    c, prog = ex.config, ex.program
    tickets = ticket_counters(prog)
    assert len(tickets) == c.num_layers * c.num_kv_heads
    ex.reset()
    seen = set()
    for pos, tok in enumerate(PROMPT):
        ex.poison()
        ex.step(tok, pos)
        used = used_splits(pos + 1, splits, 1)
        attn = ex.read_buffer("attn")
        if used < 3:
            assert np.isnan(attn).all(), f"position {pos}: {used} splits merged by ticket"
        else:
            # the last layer's partials are still in attn_o / attn_ml: its merge is attn
            o = ex.read_buffer("attn_o").reshape(c.num_kv_heads, splits, c.group_size,
                                                 c.head_dim)
            ml = ex.read_buffer("attn_ml").reshape(c.num_kv_heads, splits, c.group_size, 2)
            np.testing.assert_allclose(attn, _merge_partials(o, ml, used), rtol=2e-6,
                                       atol=1e-7)
        counters = ex.read_buffer("counters")
        assert (counters[tickets] == 0).all(), f"position {pos}: tickets not reset"
        seen.add(used >= 3)
    assert seen == {False, True}


def test_the_threshold_and_the_tiling_decide_whether_a_program_merges_by_ticket():
    q = ModelConfig.from_name("qwen3-0.6b")
    assert merge_ticket_min_splits(q) == 8  # 8 KV x 2 x 130 floats: 8 splits = 66.6 KB
    assert schedule(q, 132, 2048).merge_ticket_min == 8
    s = ModelConfig.from_name("smollm2-135m")
    assert merge_ticket_min_splits(s) > 16  # a 38 KB merge at most: never
    assert schedule(s, 132, 2048).merge_ticket_min == 0
    g = ModelConfig.from_name("qwen3-gqa-tiny")
    # 8 units on 3 blocks: block 1 holds units 2..4, of both groups: no ticket
    assert schedule(g, 3, MAX_SEQ, attn_splits=4, merge_ticket_min=2).merge_ticket_min == 0
    assert schedule(g, 4, MAX_SEQ, attn_splits=4, merge_ticket_min=2).merge_ticket_min == 2
    assert schedule(g, 4, MAX_SEQ, attn_splits=4, merge_ticket_min=0).merge_ticket_min == 0
    assert schedule(g, 4, MAX_SEQ, attn_splits=4, merge_ticket_min=5).merge_ticket_min == 0
    with pytest.raises(ProgramError, match="merge_ticket_min"):
        schedule(g, 4, MAX_SEQ, attn_splits=4, merge_ticket_min=-1)


def test_verify_rejects_a_ticket_that_does_not_wait_for_every_unit_of_its_group():
    """Negative control of the verifier's view of the ticket: one ticket fewer than the group's
    instructions lets the tail merge partials that nothing orders before it."""
    g = ModelConfig.from_name("qwen3-gqa-tiny")
    prog = copy.deepcopy(schedule(g, 8, MAX_SEQ, attn_splits=4, merge_ticket_min=2))
    prog.verify(use_cache=False)  # as built: proven
    ins = next(i for q in prog.queues for i in q if i.op == Op.ATTENTION and i.ticket)
    counter, count = ins.ticket
    for q in prog.queues:
        for i in q:
            if i.ticket and i.ticket[0] == counter:
                i.ticket = (counter, count - 1)
    with pytest.raises(ProgramError, match=r"attn_o|attn_ml"):
        prog.verify(use_cache=False)


def test_many_steps_in_one_launch_with_the_merge_by_ticket(synth_model):
    """The prompt and 16 greedy tokens in one launch, every step from the second on merging by
    ticket (the tickets reset between the chained steps): the reference's greedy tokens."""
    from monokernel.kernel.base import DeviceSample
    from monokernel.model.reference import ReferenceModel

    arch = "qwen3-gqa-tiny"
    m = synth_model(arch)
    ex = KernelExecutor(m, MAX_SEQ, blocks=4, attn_splits=4, attn_min_chunk=1,
                        merge_ticket_min=2)
    ref = ReferenceModel(m.config, m.weights, MAX_SEQ)
    logits = ref.forward(PROMPT, 0)[-1]
    want = []
    stop = len(PROMPT) + 16  # the last step runs at stop - 1: tokens for positions 7 .. 23
    last = logits
    for pos in range(len(PROMPT), stop + 1):
        want.append(int(np.argmax(logits)))
        last = logits
        logits = ref.forward([want[-1]], pos)[0]
    ex.reset()
    got = list(ex.run_steps(PROMPT, 0, DeviceSample(0.0, 0), stop_pos=stop))
    assert got == want and ex.launches == 1
    # the last step's logits (a step merged by ticket after 16 chained ones): the reference's
    assert_logits_match(ex.read_buffer("logits")[None], last[None], "last chained step")
    tickets = ticket_counters(ex.program)
    assert tickets and (ex.read_buffer("counters")[tickets] == 0).all()


@pytest.mark.parametrize("arch,blocks", [("qwen3-gqa-tiny", 8), ("llama3-tiny", 3)])
def test_a_row_of_one_split_is_finished_by_its_unit(synth_model, arch, blocks):
    """merge_ticket_min 1 (the tensor-core kernel's; here a CUDA-core kernel of 2 slots,
    poisoned before every one-row step): a step whose row uses one split has its split-0 unit
    normalise its outputs into ``attn`` and leaves the partials unwritten (no ticket, no
    merge); from the second used split on the ticket merges. Both kinds of step: the
    reference's logits. The one-sequence kernel refuses the setting (it does not build it)."""
    from monokernel.errors import KernelError

    splits = 4 if arch == "qwen3-gqa-tiny" else 3
    m = synth_model(arch)
    with pytest.raises(KernelError, match="merge_ticket_min=1 is for a kernel of slots"):
        KernelExecutor(m, MAX_SEQ, blocks=blocks, attn_splits=splits, merge_ticket_min=1)
    from monokernel.errors import ParameterError
    from monokernel.runtime import backend_options

    with pytest.raises(ParameterError, match="merge_ticket_min=1 is for a kernel of slots"):
        backend_options("emulator", {"merge_ticket_min": 1})
    assert backend_options("emulator", {"merge_ticket_min": 1, "slots": 2}).merge_ticket_min == 1
    ex = KernelExecutor(m, MAX_SEQ, blocks=blocks, attn_splits=splits, attn_min_chunk=3,
                        merge_ticket_min=1, slots=2, page_size=4)
    assert ex.program.merge_ticket_min == 1
    fed, ref = reference_run(m, PROMPT, 8, MAX_SEQ)[:2]
    ex.reset()
    tickets = ticket_counters(ex.program)
    kinds = set()
    for pos, tok in enumerate(fed):
        ex.poison()
        got = ex.step(tok, pos).logits
        assert_logits_match(got[None], ref[pos][None], f"{arch} position {pos}")
        one = used_splits(pos + 1, splits, 3) == 1
        attn = ex.read_buffer("attn")[:m.config.q_dim]  # the step's one row
        assert np.isfinite(attn).all(), f"position {pos}: attn not written"
        assert np.isnan(ex.read_buffer("attn_o")).all() == one, f"position {pos}"
        assert (ex.read_buffer("counters")[tickets] == 0).all()
        kinds.add(one)
    assert kinds == {True, False}
