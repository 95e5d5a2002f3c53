"""The megakernel in strict-memory mode under ThreadSanitizer (monokernel/emulator/strict.py).

Strict mode runs every CUDA thread as its own OS thread, with CUDA's relaxed atomics, so TSan sees
the cross-block races that x86 and the fiber emulator hide. The tiny model on 2 blocks must run
with no report and match the reference, with either hop (MK_SYNC=2: release add; MK_SYNC=1: fence
+ atomicAdd); the same kernel with the producer's release (or, MK_SYNC=1, its __threadfence) or the
consumer's acquire removed (textual mutations of the generated source) must be reported.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess

import numpy as np
import pytest

from monokernel.kernel.emulator.strict import DataRaceError, rewrite_shared, run_strict, tsan_available
from monokernel.kernel.executor import KernelExecutor, kernel_source
from monokernel.model.loader import load_model
from monokernel.model.reference import ReferenceModel

# ThreadSanitizer builds and runs (an OS thread per CUDA thread): `make test` runs them, the
# fast lane leaves them out
pytestmark = pytest.mark.sanitizer

MAX_SEQ = 8
BLOCKS = 2
# First token, the last vocabulary row, and a token read back from the first step's KV cache.
STEPS = [(5, 0), (999, 1), (17, 2)]


@functools.lru_cache(maxsize=1)
def _tsan_reason() -> str | None:
    return tsan_available()


needs_tsan = pytest.mark.skipif("_tsan_reason() is not None",
                                reason="g++ -fsanitize=thread cannot build and run programs here")


def reference_logits(model, steps) -> np.ndarray:
    ref = ReferenceModel(model.config, model.weights, MAX_SEQ)
    return np.stack([ref.forward([tok], pos)[0] for tok, pos in steps])


@pytest.fixture(scope="module")
def tiny(synth_dir):
    return load_model(synth_dir("tiny"), progress=False)


def executor(model) -> KernelExecutor:
    ex = KernelExecutor(model, MAX_SEQ, blocks=BLOCKS)
    ex.poison()
    return ex


def without_signal_release(source: str) -> str:
    """red_add_release as a relaxed add (MK_SYNC=2): the signal no longer releases."""
    old = "emu::red_add_release(p, v);"
    assert source.count(old) == 1, "red_add_release's emulator body not found in the kernel source"
    return source.replace(old, "__atomic_fetch_add(p, v, __ATOMIC_RELAXED);")


def without_signal_fence(source: str) -> str:
    """signal_counter with its __threadfence() removed (MK_SYNC=1): the atomicAdd no longer
    releases."""
    m = re.search(r"__device__ void signal_counter\(.*?\n}\n", source, re.DOTALL)
    assert m, "signal_counter not found in the kernel source"
    body, n = re.subn(r"__threadfence\(\);", "", m.group(0))
    assert n == 1, f"expected one __threadfence() in signal_counter, found {n}"
    return source[:m.start()] + body + source[m.end():]


def without_acquire(source: str) -> str:
    """load_acquire as a relaxed load: the consumer no longer synchronises with the producer."""
    old = "return emu::load_acquire(p);"
    assert source.count(old) == 1, "load_acquire's emulator body not found in the kernel source"
    return source.replace(old, "return __atomic_load_n(p, __ATOMIC_RELAXED);")


def assert_race_reported(model, mutate, **defines) -> None:
    """Two strict-mode steps of the kernel source changed by ``mutate``: TSan must report a
    data race in the kernel's code."""
    ex = executor(model)
    with pytest.raises(DataRaceError) as info:
        run_strict(ex, STEPS[:2], source=mutate(kernel_source(model.config, MAX_SEQ)),
                   defines=defines or None)
    report = info.value.report
    assert "WARNING: ThreadSanitizer: data race" in report
    assert re.search(r"\bop_\w+|rms_normalize|run_instructions", report), report[:4000]


def test_rewrite_shared_forms():
    src = ("__shared__ OpShared s;\n  __shared__ float s_red[NWARPS + 1];\n"
           "__shared__ unsigned int hist[4][ 8 ];\n__shared__ int s_ok;\n")
    assert rewrite_shared(src) == ("EMU_SHARED(OpShared, s, );\n  EMU_SHARED(float, s_red, [NWARPS+1]);\n"
                                   "EMU_SHARED(unsigned int, hist, [4][8]);\nEMU_SHARED(int, s_ok, );\n")


DYN_KERNEL = r"""
struct DynParams { int* flag; int* out; };

// Thread 0 fills dynamic shared memory, calls dynamic_shared again (as the megakernel calls
// dynamic_smem() between a fill and its reads), then raises a relaxed flag; thread 1 waits
// for the flag (an order in time, no happens-before), calls dynamic_shared and reads the fill.
// BARRIER 1 puts a __syncthreads between the fill and the read.
extern "C" __global__ void dyn_fill_then_read(const DynParams* p) {
  int* d = static_cast<int*>(emu::dynamic_shared(64));
  if (threadIdx.x == 0) {
    d[0] = 42;
    (void)emu::dynamic_shared(64);
    __atomic_store_n(p->flag, 1, __ATOMIC_RELAXED);
  } else {
    while (__atomic_load_n(p->flag, __ATOMIC_RELAXED) == 0) std::this_thread::yield();
  }
#if BARRIER
  __syncthreads();
#endif
  if (threadIdx.x == 1) p->out[0] = static_cast<int*>(emu::dynamic_shared(64))[0];
}

#include <cstdio>
int main() {
  int flag = 0, out = 0;
  DynParams p{&flag, &out};
  int rc = emu::launch(&emu::kernel_entry<&dyn_fill_then_read>, 1, 2, &p, 30.0);
  if (rc != 0) { std::printf("error %d %s\n", rc, emu::last_error()); return 1; }
  std::printf("%d\n", out);
  return 0;
}
"""


def _pin_to_one_cpu() -> None:
    """preexec_fn: the child runs on the first CPU this process may use."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])


@needs_tsan
@pytest.mark.parametrize("barrier", [0, 1])
def test_dynamic_shared_memory_orders_no_accesses(tmp_path, barrier):
    """A call of emu::dynamic_shared is no synchronisation between a block's threads (it once
    took the block's lock on every call, which hid a missing barrier after a fill whenever the
    writers called it before the readers): a read of another thread's write with no barrier
    between them is reported even when the write came first in time, and the same program with
    the barrier is clean.

    Each way is run 8 times, 4 of them on one CPU, since the runtime once hid this race in
    timing-dependent ways: thread 0 ran to its end before thread 1 was created (every run on
    one CPU; the start gate of run_host_threads now prevents it), or thread 1 waited for the
    allocation lock while thread 0 exited under that same lock (about half the runs on two
    CPUs; the allocation now has its own lock)."""
    from monokernel.kernel.emulator.build import compile_unit
    from monokernel.kernel.emulator.strict import STRICT_FLAGS, TSAN_FLAGS

    exe = tmp_path / "dyn_strict"
    compile_unit(DYN_KERNEL, [*STRICT_FLAGS, *TSAN_FLAGS, f"-DBARRIER={barrier}"], exe,
                 "the dynamic shared memory test", executable=True)
    for run in range(8):
        pin = _pin_to_one_cpu if run % 2 else None
        out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, preexec_fn=pin)
        assert out.stdout.strip() == "42", out.stdout + out.stderr[-4000:]
        raced = "WARNING: ThreadSanitizer: data race" in out.stderr
        assert raced == (not barrier), f"run {run} (one CPU: {pin is not None})\n" + out.stderr[-4000:]
        if raced:
            assert "dyn_fill_then_read" in out.stderr, out.stderr[-4000:]


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_strict_tsan_tiny_no_race_matches_reference(tiny):
    ex = executor(tiny)
    controls, logits, report = run_strict(ex, STEPS)
    assert report == ""
    want = reference_logits(tiny, STEPS)
    for i, (tok, pos) in enumerate(STEPS):
        err = float(np.abs(logits[i] - want[i]).max())
        assert err <= 2e-3 * float(np.abs(want[i]).max()), (tok, pos, err)
        assert controls[i][0:3].tolist() == [int(np.argmax(logits[i])), pos + 1, i + 1]  # token, pos, step
    # The executor continues where the strict run left it: its KV cache holds the three steps.
    np.testing.assert_allclose(ex.step(23, 3).logits, reference_logits(tiny, [*STEPS, (23, 3)])[3],
                               atol=2e-3 * float(np.abs(want).max()))


@needs_tsan
def test_strict_tsan_chained_steps_in_one_launch(tiny):
    """Many steps per launch (R6): the step boundary (the step counter, released by the block
    that ends each step, acquired by every block before its next step) must order every read of
    one step before the next step's writes of the same buffers; TSan checks that here."""
    ex = executor(tiny)
    steps = STEPS + [(23, 3)]
    controls, logits, report = run_strict(ex, steps, chained=True)
    assert report == ""
    want = reference_logits(tiny, steps)
    err = float(np.abs(logits[0] - want[-1]).max())
    assert err <= 2e-3 * float(np.abs(want[-1]).max()), err
    assert controls[0][0:3].tolist() == [int(np.argmax(logits[0])), 4, 4]  # token, pos, step
    assert ex.steps_run == 4


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_negative_control_missing_step_boundary_is_reported(tiny):
    """The same chained launch with the wait between two steps removed: a block starts the next
    step's writes while others still read the last step's buffers; TSan must see it."""
    ex = executor(tiny)
    source = kernel_source(tiny.config, MAX_SEQ)
    old = "if (!wait_counter(P, st[S_STEP_COUNTER], st[S_STEP] + 1,"
    assert source.count(old) == 1, "the step-boundary wait is not where this test expects it"
    source = source.replace(old, "if (false && !wait_counter(P, st[S_STEP_COUNTER], st[S_STEP] + 1,")
    with pytest.raises(DataRaceError) as info:
        run_strict(ex, STEPS + [(23, 3)], chained=True, source=source)
    assert "load_state" in info.value.report, info.value.report[:4000]


@needs_tsan
def test_sync1_hop_no_race_matches_reference(tiny):
    """The v1 hop (MK_SYNC=1: fence + atomicAdd), kept as the A/B twin, is race-free too."""
    ex = executor(tiny)
    _controls, logits, report = run_strict(ex, STEPS[:2], defines={"MK_SYNC": "1"})
    assert report == ""
    want = reference_logits(tiny, STEPS[:2])
    assert float(np.abs(logits - want).max()) <= 2e-3 * float(np.abs(want).max())


@needs_tsan
def test_negative_control_missing_release_is_reported(tiny):
    assert_race_reported(tiny, without_signal_release)


@needs_tsan
def test_negative_control_missing_threadfence_is_reported(tiny):
    assert_race_reported(tiny, without_signal_fence, MK_SYNC="1")


@needs_tsan
def test_negative_control_missing_acquire_is_reported(tiny):
    assert_race_reported(tiny, without_acquire)


def ticket_executor(model) -> KernelExecutor:
    """Two attention splits on the two blocks, merged by ticket from two used splits: position
    0 uses one split (every O_PROJ block merges), positions 1.. both (the ticket's last drawer
    merges, O_PROJ reads `attn`)."""
    ex = KernelExecutor(model, MAX_SEQ, blocks=BLOCKS, attn_splits=2, attn_min_chunk=1,
                        merge_ticket_min=2)
    assert ex.program.merge_ticket_min == 2
    ex.poison()
    return ex


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_strict_tsan_merge_by_ticket_no_race_matches_reference(tiny):
    """The ticket (acq_rel), the last drawer's merge of the other block's partials, the reset
    for the next step and O_PROJ's read of the merged vector: race-free, one step a launch and
    four chained steps in one launch."""
    steps = STEPS + [(23, 3)]
    want = reference_logits(tiny, steps)
    _controls, logits, report = run_strict(ticket_executor(tiny), steps)
    assert report == ""
    assert float(np.abs(logits - want).max()) <= 2e-3 * float(np.abs(want).max())
    _controls, logits, report = run_strict(ticket_executor(tiny), steps, chained=True)
    assert report == ""
    assert float(np.abs(logits[0] - want[-1]).max()) <= 2e-3 * float(np.abs(want[-1]).max())


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_negative_control_relaxed_ticket_is_reported(tiny):
    """ticket_add as a relaxed add: the last drawer's merge reads the other block's partials
    with nothing ordering them; TSan must see it in the merge."""
    ex = ticket_executor(tiny)
    source = kernel_source(tiny.config, MAX_SEQ)
    old = "return emu::atom_add_acq_rel(p, v);"
    assert source.count(old) == 1, "ticket_add's emulator body not found in the kernel source"
    source = source.replace(old, "return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);")
    with pytest.raises(DataRaceError) as info:
        run_strict(ex, STEPS[:2], source=source)
    assert "merge_chunk" in info.value.report, info.value.report[:4000]


def chunk_executor(model) -> KernelExecutor:
    """Steps of up to 3 tokens: a chained run of 4 fed positions is a chunk of 3, then 1."""
    ex = KernelExecutor(model, MAX_SEQ, blocks=BLOCKS, step_tokens=3)
    ex.poison()
    return ex


@needs_tsan
def test_strict_tsan_prompt_chunks_no_race_match_reference(tiny):
    """Prompt chunks (issue 17 slice 2): each op loops over the chunk's tokens, reusing its
    shared memory from one token to the next; the chunk's K/V reach ATTENTION through the
    layer's counters. Race-free, and the last position's logits are the reference's."""
    steps = STEPS + [(23, 3)]
    want = reference_logits(tiny, steps)
    ex = chunk_executor(tiny)
    controls, logits, report = run_strict(ex, steps, chained=True)
    assert report == ""
    assert float(np.abs(logits[0] - want[-1]).max()) <= 2e-3 * float(np.abs(want[-1]).max())
    assert controls[0][0:3].tolist() == [int(np.argmax(logits[0])), 4, 2]  # token, pos, step
    assert ex.steps_run == 2


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_negative_control_missing_barrier_between_a_chunks_tokens_is_reported(tiny):
    """DOWN_RESIDUAL without the barrier between two tokens of a chunk: the next token's copy
    of h overwrites the shared input vector while other warps still read it; TSan must see
    it. (RMS_GATE_UP needs no such barrier: RMSNorm's block sum orders it.)"""
    source = kernel_source(tiny.config, MAX_SEQ, 3)
    m = re.search(r"__device__ void op_down_residual\(.*?\n}\n", source, re.DOTALL)
    assert m, "op_down_residual not found in the kernel source"
    old = "if (tok + 1 < ntok) __syncthreads();"
    assert m.group(0).count(old) == 1, "the barrier between tokens is not where this test expects"
    source = source[:m.start()] + m.group(0).replace(old, "") + source[m.end():]
    with pytest.raises(DataRaceError) as info:
        run_strict(chunk_executor(tiny), STEPS + [(23, 3)], chained=True, source=source)
    assert re.search(r"copy_to_shared|block_dot_rows|op_down_residual", info.value.report), \
        info.value.report[:4000]


def table_executor(model, tensor_cores: bool = False, **kw) -> KernelExecutor:
    """A kernel of 2 sequence slots, steps of up to 3 rows, K/V pages of 2 positions; with
    ``tensor_cores``, its mat-muls on mma (MK_MMA)."""
    ex = KernelExecutor(model, MAX_SEQ, blocks=BLOCKS, slots=2, step_tokens=3, page_size=2,
                        tensor_cores=tensor_cores, **kw)
    ex.poison()
    return ex


def table_steps(ex: KernelExecutor):
    """Two steps of two sequences: slot 0's prompt chunk of 2 (crossing into its second page
    in the next step) beside slot 1's first token, then the other way round; slot 1's tokens
    drawn on the device at a high temperature (the LM head's per-row partials and draws)."""
    from monokernel.kernel.base import DeviceSample, StepTable

    pages = list(ex.add_pages(6))
    tables = {0: [pages[5], pages[0]], 1: [pages[2], pages[3]]}  # slot 0 on the pool's end
    draws = {1: DeviceSample(25.0, 9)}
    return [StepTable.of([(5, 0, 0, True, True), (999, 0, 1, True, True),
                          (17, 1, 0, True, True)], tables, draws),
            StepTable.of([(23, 0, 2, True, True), (7, 1, 1, True, True),
                          (999, 1, 2, True, True)], tables, draws)]


@needs_tsan
@pytest.mark.parametrize("tensor_cores,splits,groups",
                         [(False, None, False), (True, None, False), (True, 4, False),
                          (True, None, True), (True, None, "slices")],
                         ids=["cuda-cores", "tensor-cores", "tensor-cores-4-splits",
                              "tensor-cores-token-groups", "tensor-cores-input-slices"])
def test_strict_tsan_steps_of_two_sequences_no_race_match_reference(tiny, tensor_cores, splits,
                                                                    groups):
    """Steps of many sequences (issue 17 slice 3): the token table copied into shared memory
    with the state, rows of two slots in one step, K/V through block tables. Race-free, and
    every row's logits the reference's for its own sequence. On tensor cores (slice 6a): the
    warps' partials through shared memory, each pass's epilogue, the rows' rms, the LM head's
    per-row bests, every row's attention merged by ticket; judged by the bf16-inputs
    reference (tolerance: tests/kernel/test_tensor_cores.py). With 4 splits of 2 positions
    (fixed by absolute position) the second step's rows at position 2 merge by ticket beside
    a row its unit finishes. With token groups (kernel/token_groups.py) of both blocks from 2
    tokens a step: each step's mat-muls split its 3 rows 1 + 2 over the blocks, each block
    multiplying every row of the op (the other block's residual rows read and written).
    With input slices (kernel/input_slices.py) of O_PROJ and DOWN over both blocks: each
    block's partials of every residual row, the row group's counter, then its own rows' sum
    of the other block's partials."""
    from monokernel.kernel.schedule import schedule, tensor_core_splits
    from monokernel.sampling import Sampler, SamplingParams

    kw = {"attn_splits": splits}
    if groups == "slices":
        s, c = tensor_core_splits(tiny.config, BLOCKS, MAX_SEQ)
        kw = {"program": schedule(tiny.config, BLOCKS, MAX_SEQ, s, c, merge_ticket_min=1,
                                  tokens=3, tensor_cores=True, input_slices=2)}
    elif groups:
        s, c = tensor_core_splits(tiny.config, BLOCKS, MAX_SEQ)
        kw = {"program": schedule(tiny.config, BLOCKS, MAX_SEQ, s, c, merge_ticket_min=1,
                                  tokens=3, token_groups=(2, 2), tensor_cores=True)}
    ex = table_executor(tiny, tensor_cores, **kw)
    ex.drawn_logits = True  # the drawn rows' logits stored too (the kernel's draw checked below)
    if splits:
        assert ex.program.attn_min_chunk == 2  # MAX_SEQ / splits
    tol = 4e-3 if tensor_cores else 2e-3
    seqs = {0: [], 1: []}
    for t in table_steps(ex):
        _, logits, report = run_strict(ex, [], table=t)
        assert report == ""
        rows = logits[0].reshape(ex.program.tokens, -1)
        # logits rows: the host's rows (slot 0's) first, then the drawn ones (slot 1's)
        order = np.concatenate([np.flatnonzero(t.slots == 0), np.flatnonzero(t.slots == 1)])
        drawn = ex.buffers["row_tokens"][:len(t)]
        for k, i in enumerate(order):
            slot, pos = int(t.slots[i]), int(t.positions[i])
            seqs[slot].append(int(t.tokens[i]))
            want = ReferenceModel(tiny.config, tiny.weights, MAX_SEQ,
                                  bf16_inputs=tensor_cores,
                                  attn_chunk=ex.program.attn_min_chunk).forward(seqs[slot], 0)[-1]
            assert float(np.abs(rows[k] - want).max()) <= tol * float(np.abs(want).max()), \
                (slot, pos)
            if slot == 1:  # the device's draw from the row's own logits
                host = Sampler(SamplingParams(temperature=25.0, seed=9), 9)
                assert drawn[i] == host(rows[k], [0] * (pos + 1)), (slot, pos)
    assert ex.steps_run == 2


@needs_tsan
def test_strict_tsan_a_step_without_logits_idles_its_last_layer_no_race(tiny):
    """A step none of whose rows needs logits (two slots' prompt rows) on tensor cores with
    O_PROJ and DOWN in input slices: its last layer idles after QKV (megakernel.cu
    last_layer_idle: each instruction's threads read their rows of the table, one
    __syncthreads_or; a slice signals its row group's counter and returns). Race-free, and the
    next step's rows (which attend over the idle step's K/V) the bf16-inputs reference's."""
    from monokernel.kernel.base import StepTable
    from monokernel.kernel.schedule import schedule, tensor_core_splits

    s, c = tensor_core_splits(tiny.config, BLOCKS, MAX_SEQ)
    ex = table_executor(tiny, True, program=schedule(tiny.config, BLOCKS, MAX_SEQ, s, c,
                                                     merge_ticket_min=1, tokens=3,
                                                     tensor_cores=True, input_slices=2))
    pages = list(ex.add_pages(6))
    tables = {0: [pages[5], pages[0]], 1: [pages[2], pages[3]]}
    steps = [StepTable.of([(5, 0, 0, False, True), (999, 0, 1, False, True),
                           (17, 1, 0, False, True)], tables),
             StepTable.of([(23, 0, 2, True, True), (7, 1, 1, True, True)], tables)]
    for t in steps:
        _, logits, report = run_strict(ex, [], table=t)
        assert report == ""
    rows = logits[0].reshape(ex.program.tokens, -1)
    for k, seq in enumerate(([5, 999, 23], [17, 7])):
        want = ReferenceModel(tiny.config, tiny.weights, MAX_SEQ, bf16_inputs=True,
                              attn_chunk=ex.program.attn_min_chunk).forward(seq, 0)[-1]
        assert float(np.abs(rows[k] - want).max()) <= 4e-3 * float(np.abs(want).max()), k
    assert ex.steps_run == 2


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_negative_control_a_segments_keys_without_their_barrier_is_reported(synth_dir):
    """Late q/k (Qwen3), slot 1's segment of three rows: its later rows score the earlier
    rows' keys from shared memory (chunk_keys, dynamic shared memory filled per unit from the
    segment's k_raw rows, a warp a key). Without the barrier after the fill, warps read keys
    other warps still write: TSan must see it (and the kernel as built is race-free on the
    same step).

    On one block: TSan's runtime tracks 255 threads at once (strict.py's docstring);
    past that, threads take turns on its slots, and a slot handed from a writer to a reader
    orders them, so 2 blocks of 256 threads once hid this race in CI on a loaded machine.
    (The strict runtime's dynamic_shared() also took the block's lock on every call then,
    ordering the fill before the reads whenever the writers called it first; it no longer
    does: test_dynamic_shared_memory_orders_no_accesses.)"""
    from monokernel.kernel.base import StepTable

    model = load_model(synth_dir("qwen3-tiny"), progress=False)

    def one_block() -> KernelExecutor:
        ex = KernelExecutor(model, MAX_SEQ, blocks=1, slots=2, step_tokens=3, page_size=2)
        ex.poison()
        return ex

    ex = one_block()
    pages = list(ex.add_pages(4))
    table = StepTable.of([(17, 1, 0, True, True), (999, 1, 1, True, True),
                          (5, 1, 2, True, True)], {1: [pages[3], pages[1]]})
    source = ex.source
    old = (" kc[(p - pos0) * D + d] = f32_to_bf16(tmp[d]);\n        }\n"
           "        __syncthreads();\n")
    assert source.count(old) == 1, "the segment keys' barrier is not where this test expects"
    _, _, report = run_strict(ex, [], table=table)
    assert report == ""
    mutated = source.replace(old, old.replace("        __syncthreads();\n", ""))
    ex = one_block()
    ex.add_pages(4)
    with pytest.raises(DataRaceError) as info:
        run_strict(ex, [], table=table, source=mutated)
    assert re.search(r"op_attention|attention_scores|load_kv_rows", info.value.report), \
        info.value.report[:4000]


def decode_launch(ex: KernelExecutor):
    """Two slots' decode rows (positions 0), drawn, in a launch of 3 steps: the step's end
    writes the next table (P.rows, the state) and every block copies it after the step
    counter moves."""
    from monokernel.kernel.base import DeviceSample, StepTable

    pages = list(ex.add_pages(4))
    return StepTable.of([(5, 0, 0, True, False), (999, 1, 0, True, False)],
                        {0: pages[:2], 1: pages[2:]},
                        {0: DeviceSample(0.0, 0), 1: DeviceSample(25.0, 4)}, steps=3)


@needs_tsan
def test_strict_tsan_a_launch_of_table_steps_no_race(tiny):
    """Many table steps in one launch (issue 17 slice 4): race-free, 3 steps run, each slot's
    three tokens in its out_tokens row."""
    ex = table_executor(tiny)
    controls, _, report = run_strict(ex, [], table=decode_launch(ex))
    assert report == ""
    assert ex.steps_run == 3 and controls[0][2] == 3  # State.STEP
    out = ex.buffers["out_tokens"].reshape(3, MAX_SEQ)
    assert all(0 <= t < tiny.config.vocab_size for t in out[:2, :3].ravel())


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_negative_control_next_table_written_after_the_release_is_reported(tiny):
    """finish_rows (the end of a table step) releasing the step counter before its threads
    write the next table: the other blocks copy rows still being written; TSan must see it."""
    ex = table_executor(tiny)
    source = ex.source
    final = ("#if MK_SYNC >= 2\n  red_add_release(&P.counters[st[S_STEP_COUNTER]], 1);  "
             "// after the barrier: every row's\n")
    early = "  const bool more = st[S_STEPS] > 1 && host_stop == 0;\n"
    assert source.count(final) == 1 and source.count(early) == 1
    source = source.replace(final, "#if MK_SYNC >= 2\n").replace(
        early, early + "  if (threadIdx.x == 0) "
                       "red_add_release(&P.counters[st[S_STEP_COUNTER]], 1);\n")
    with pytest.raises(DataRaceError) as info:
        run_strict(ex, [], table=decode_launch(ex), source=source)
    assert re.search(r"load_state|finish_rows|run_instructions", info.value.report), \
        info.value.report[:4000]


# A segment's prompt chunk of two m-tiles: tiny's GROUP 3 (21 queries), qwen3-gqa-tiny's 2
# (late q/k: 18 queries; its queries normed into the query tiles, its keys into the K tile).
SEGMENT_ROWS = {"tiny": 7, "qwen3-gqa-tiny": 9}


def segment_step(ex: KernelExecutor):
    """One step of a prompt chunk (slot 0: two m-tiles, a warp each) beside slot 1's first row
    (one m-tile, split over the warps): both modes of attention_segment."""
    from monokernel.kernel.base import StepTable

    n = ex.program.tokens - 1
    pages = list(ex.add_pages(-(-n // 2) + 1))
    tables = {0: pages[:-1], 1: pages[-1:]}
    rows = [(5 + 3 * i, 0, i, True, True) for i in range(n)] + [(17, 1, 0, True, True)]
    return StepTable.of(rows, tables)


def segment_executor(model, arch: str = "tiny", blocks: int = BLOCKS) -> KernelExecutor:
    n = SEGMENT_ROWS[arch]
    ex = KernelExecutor(model, 2 * MAX_SEQ, blocks=blocks, slots=2, step_tokens=n + 1,
                        page_size=2, tensor_cores=True)
    ex.poison()
    return ex


def assert_segment_step_matches_the_mirror(model, ex: KernelExecutor, logits) -> None:
    """segment_step's rows (slot 0's chunk, slot 1's first row) against the bf16-inputs
    reference (its mirror of the attention's rounding), test_tensor_cores.py's tolerance."""
    n = ex.program.tokens - 1
    rows = logits[0].reshape(ex.program.tokens, -1)
    ref = ReferenceModel(model.config, model.weights, 2 * MAX_SEQ, bf16_inputs=True,
                         attn_chunk=ex.program.attn_min_chunk)
    chunk = ref.forward([5 + 3 * i for i in range(n)], 0)
    ref.reset()
    want = np.concatenate([chunk, ref.forward([17], 0)])
    err = np.abs(rows[:n + 1] - want).max(axis=1) / np.abs(want).max(axis=1)
    assert err.max() <= 4e-3, err


@pytest.fixture
def segment_model(request, tiny, synth_dir):
    """(arch, model) for the segment tests: the session's tiny, or a synthetic late q/k one."""
    arch = request.param
    return arch, tiny if arch == "tiny" else load_model(synth_dir(arch), progress=False)


# the pipeline's buffer for the next unit's first tile (megakernel.cu segment_pass)
_NEXT_BUFFER = "smem + (buf ^ 1) * SEG_TILES_BYTES"


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
@pytest.mark.parametrize("per_group", [False, True], ids=["splits", "a-block-a-group"])
@pytest.mark.parametrize("segment_model", sorted(SEGMENT_ROWS), indirect=True)
def test_strict_tsan_segments_on_tensor_cores_no_race_match_the_mirror(segment_model,
                                                                       per_group):
    """Attention a segment at a time on tensor cores (megakernel.cu attention_segment): the
    staged K (cp.async) and V^T tiles, the query tiles, the m-tiles a warp each, and the one
    m-tile split over the warps (its query tile built by all warps; its scores, probability
    fragments and corrections through shared memory) race-free; with late q/k (qwen3-gqa-tiny)
    the segment's keys normed into the K tile too. On a block a KV group (one unit slot each)
    the attention pipeline (MK_ATTN_PIPE: the tiny shapes have it) runs between units: the
    chunk's unit copies slot 1's row's first tile into the other buffer while it computes,
    and that unit takes it (late q/k: its own key normed in after the copies). Every row's
    logits the bf16-inputs reference's (its mirror of the attention's rounding),
    test_tensor_cores.py's tolerance."""
    arch, model = segment_model
    ex = segment_executor(model, arch, blocks=model.config.num_kv_heads if per_group else BLOCKS)
    if per_group:
        assert ex.program.attn_splits == 1
        assert "#define MK_ATTN_PIPE 1\n" in ex.source and ex.source.count(_NEXT_BUFFER) == 1
    _, logits, report = run_strict(ex, [], table=segment_step(ex))
    assert report == ""
    assert_segment_step_matches_the_mirror(model, ex, logits)


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_strict_tsan_a_segments_rows_in_parts_no_race_match_the_mirror(tiny):
    """A segment's rows in parts (megakernel.cu segment_parts) built with MK_ROW_PARTS = 1:
    the chunk of 7 rows in 2 parts of one m-tile, one a block (a KV group's 2 unit slots), the
    second part's rows at rotation 1 merged by their tickets across the blocks: race-free, and
    every row's logits the bf16-inputs reference's."""
    from monokernel.kernel.isa import segment_parts

    ex = segment_executor(tiny)
    n = SEGMENT_ROWS["tiny"]
    assert ex.program.attn_splits == BLOCKS
    assert segment_parts(1, n, BLOCKS, tiny.config.group_size, 1) == 2
    _, logits, report = run_strict(ex, [], table=segment_step(ex), defines={"MK_ROW_PARTS": "1"})
    assert report == ""
    assert_segment_step_matches_the_mirror(tiny, ex, logits)


# A unit of two tiles or more (megakernel.cu segment_pass, MK_ATTN_PIPE): slot 0's
# 128-position prompt run first (not under TSan), then a step of slot 1's 3-row prompt (one
# m-tile: the split mode, which copies slot 0's first tile) and slot 0's 8 rows at positions
# 128..135 (two m-tiles over 136 positions: tiles of 128 and 8, or of 64, 64 and 8, each
# copied under the work of the one before).
TWO_TILES = ({0: 64}, {0: 64}, {1: 3, 0: 8})


def _two_tile_steps(model, strict: bool, edit=None):
    """TWO_TILES on a kernel of a block a KV group (one split: a unit is a row's whole
    context): the last step's rows' logits, run under strict TSan if ``strict`` (the source
    edited by ``edit``: (old, new))."""
    from helpers.batch import PAGE, Batch, prompt_of

    ex = KernelExecutor(model, 256, blocks=model.config.num_kv_heads, slots=2, page_size=PAGE,
                        tensor_cores=True, step_tokens=64)
    assert ex.program.attn_splits == 1 and "#define MK_ATTN_PIPE 1\n" in ex.source
    b = Batch(ex)
    b.join(0, prompt_of(model, 136, 0))
    b.join(1, prompt_of(model, 3, 1))
    for plan in TWO_TILES[:-1]:
        b.step(plan)
    if not strict:
        b.step(TWO_TILES[-1])
        return np.stack([b.seqs[1]["logits"][p] for p in range(3)] +
                        [b.seqs[0]["logits"][p] for p in range(128, 136)])
    table, rows = b.table(TWO_TILES[-1])
    source = ex.source
    if edit is not None:
        assert source.count(edit[0]) == 1
        source = source.replace(*edit)
    _, logits, report = run_strict(ex, [], table=table, source=source)
    assert report == ""
    return logits[0].reshape(ex.program.tokens, -1)[:len(rows)]


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
@pytest.mark.parametrize("segment_model", ["tiny", "qwen3-tiny"], indirect=True)
def test_strict_tsan_a_units_second_tile_pipelined_no_race(segment_model):
    """TWO_TILES' last step under strict TSan (qwen3-tiny: head_dim 128, late q/k, tiles of
    64: three of them): race-free, every row's logits the emulator's own run's (built without
    TSan), test_tensor_cores.py's tolerance."""
    _, model = segment_model
    got, want = _two_tile_steps(model, True), _two_tile_steps(model, False)
    assert np.isfinite(want).all()
    err = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert err.max() <= 4e-3, err


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_negative_control_a_units_next_tile_into_the_buffer_being_read_is_reported(tiny):
    """The same step with a unit's own next tile copied into the buffer its first tile is read
    from (the next unit's copies left as built): TSan must see it."""
    with pytest.raises(DataRaceError) as info:
        _two_tile_steps(tiny, True, edit=(_NEXT_BUFFER, _NEXT_BUFFER.replace("(buf ^ 1)",
                                                                             "(buf ^ !own)")))
    assert re.search(r"segment_pass|segment_stage|segment_score|ldmatrix|cp_async",
                     info.value.report), info.value.report[:4000]


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_negative_control_the_next_tile_into_the_buffer_being_read_is_reported(tiny):
    """The same step with the next unit's tile copied into the buffer the chunk's warps are
    reading: TSan must see it."""
    ex = segment_executor(tiny, blocks=tiny.config.num_kv_heads)
    assert ex.program.attn_splits == 1
    source = ex.source.replace(_NEXT_BUFFER, "smem + buf * SEG_TILES_BYTES")
    with pytest.raises(DataRaceError) as info:
        run_strict(ex, [], table=segment_step(ex), source=source)
    assert re.search(r"segment_pass|segment_stage|segment_score|ldmatrix|cp_async",
                     info.value.report), info.value.report[:4000]


_KEYS = "      segment_keys_in(P, layer, gk, seg, pos0, base, cnt, Ks);\n"
_STAGED = ("      cp_async_wait();\n"
           "      __syncthreads();  // the tiles (and the query tiles) are in\n")
SEGMENT_BARRIERS = {
    # the staged tile (and the query tiles) read before every thread has stored its share
    "staging": ("tiny", [(_STAGED, "      cp_async_wait();\n")]),
    # the split mode's softmax reading scores other warps are still storing
    "split-scores": ("tiny", [("      __syncthreads();\n      if (warp == 0) {  // the softmax",
                               "      if (warp == 0) {  // the softmax")]),
    # late q/k: the segment's keys normed into the K tile after the barrier, as other warps
    # read it
    "late-keys": ("qwen3-gqa-tiny", [(_KEYS, ""), (_STAGED, _STAGED + _KEYS)]),
}


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
@pytest.mark.parametrize("barrier", sorted(SEGMENT_BARRIERS))
def test_negative_control_a_segments_attention_without_its_barrier_is_reported(tiny, synth_dir,
                                                                              barrier):
    """attention_segment without the barrier after staging its tile, or (the split mode)
    between the warps' scores and warp 0's softmax over them, or (late q/k) with the keys
    normed into the K tile after it: TSan must see it."""
    arch, edits = SEGMENT_BARRIERS[barrier]
    model = tiny if arch == "tiny" else load_model(synth_dir(arch), progress=False)
    ex = segment_executor(model, arch)
    source = ex.source
    for old, new in edits:
        assert source.count(old) == 1, f"the {barrier} barrier is not where this test expects"
        source = source.replace(old, new)
    with pytest.raises(DataRaceError) as info:
        run_strict(ex, [], table=segment_step(ex), source=source)
    assert re.search(r"attention_segment|segment_pass|segment_stage|segment_keys|"
                     r"segment_score|ldmatrix", info.value.report), info.value.report[:4000]


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_negative_control_tensor_core_partials_without_their_barrier_is_reported(tiny):
    """block_mma without the barrier after a pass's epilogue: the next pass's warps write their
    partials while other threads still add the last pass's (DOWN and O_PROJ have 3 row groups
    a block here: two passes). TSan must see it."""
    ex = table_executor(tiny, tensor_cores=True)
    old = "        __syncthreads();  // sm.part: the next token tile's\n"
    assert ex.source.count(old) == 1, "block_mma's barrier is not where this test expects"
    with pytest.raises(DataRaceError) as info:
        run_strict(ex, [], table=table_steps(ex)[0], source=ex.source.replace(old, ""))
    assert re.search(r"block_mma|mma_add_rows|op_down_residual|op_o_proj", info.value.report), \
        info.value.report[:4000]


ROW_SPLIT_ROWS = 17  # a prompt chunk a slot: 34 rows, past block_mma's k split (32)


def row_split_executor(model) -> KernelExecutor:
    """2 blocks in row tiles (no token groups: each block multiplies all of a step's rows),
    steps of up to 34 rows: block_mma_rows."""
    from monokernel.kernel.schedule import schedule, tensor_core_splits

    seq = 2 * ROW_SPLIT_ROWS
    splits, min_chunk = tensor_core_splits(model.config, BLOCKS, seq)
    prog = schedule(model.config, BLOCKS, seq, splits, min_chunk, merge_ticket_min=1,
                    tokens=2 * ROW_SPLIT_ROWS, token_groups=False, tensor_cores=True)
    ex = KernelExecutor(model, seq, blocks=BLOCKS, slots=2, step_tokens=2 * ROW_SPLIT_ROWS,
                        page_size=2, tensor_cores=True, program=prog)
    ex.poison()
    return ex


def row_split_step(ex: KernelExecutor, n: int = ROW_SPLIT_ROWS):
    """A step of ``n`` rows a slot: 2 x 17 in the row split, 2 x 16 (32) in the k split, whose
    weights go through the same ring (MK_K_RING)."""
    from monokernel.kernel.base import StepTable

    pages = list(ex.add_pages(2 * -(-n // 2)))
    tables = {0: pages[:len(pages) // 2], 1: pages[len(pages) // 2:]}
    rows = [(5 + 3 * i, 0, i, True, True) for i in range(n)] + \
        [(7 + 2 * i, 1, i, True, True) for i in range(n)]
    return StepTable.of(rows, tables)


_ROW_SPLIT_SUMS = "      __syncthreads();\n      for (int j = 0; j < nt; ++j)\n"


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
@pytest.mark.parametrize("n", [ROW_SPLIT_ROWS, 16])
def test_strict_tsan_row_split_mat_muls_no_race_match_the_reference(tiny, n):
    """block_mma_rows (a step of 34 rows on 2 blocks in row tiles: every mat-mul splits its
    rows over the warps): the sums in dynamic shared memory, each lane's own until the
    epilogue's barrier, and the cp.async ring of its weights, each lane's own slots, race-free;
    every row's logits the bf16-inputs reference's (test_tensor_cores.py's tolerance). A step
    of 32 rows on the same kernel: block_mma's k split through the same ring (MK_K_RING, its
    barrier after the op before), the same."""
    ex = row_split_executor(tiny)
    assert ex.source.count(_ROW_SPLIT_SUMS) == 1 and "#define MK_K_RING 1" in ex.source
    _, logits, report = run_strict(ex, [], table=row_split_step(ex, n))
    assert report == ""
    rows = logits[0].reshape(ex.program.tokens, -1)
    ref = ReferenceModel(tiny.config, tiny.weights, 2 * n, bf16_inputs=True,
                         attn_chunk=ex.program.attn_min_chunk)
    want = [ref.forward([5 + 3 * i for i in range(n)], 0)]
    ref.reset()
    want.append(ref.forward([7 + 2 * i for i in range(n)], 0))
    want = np.concatenate(want)
    err = np.abs(rows[:2 * n] - want).max(axis=1) / np.abs(want).max(axis=1)
    assert err.max() <= 4e-3, err


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_negative_control_row_split_sums_without_their_barrier_are_reported(tiny):
    """block_mma_rows without the barrier between the warps' sums and the epilogue that reads
    every warp's: TSan must see it."""
    ex = row_split_executor(tiny)
    with pytest.raises(DataRaceError) as info:
        run_strict(ex, [], table=row_split_step(ex), source=ex.source.replace(
            _ROW_SPLIT_SUMS, "      for (int j = 0; j < nt; ++j)\n"))
    assert re.search(r"block_mma_rows|mma_add_rows|qkv_store|op_rms|op_down|op_o_proj",
                     info.value.report), info.value.report[:4000]


_RING_LANE = "+ MMA_SUMS_BYTES) + threadIdx.x;"


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
@pytest.mark.parametrize("n", [ROW_SPLIT_ROWS, 16])
def test_negative_control_a_ring_slot_shared_by_a_warps_lanes_is_reported(tiny, n):
    """The cp.async ring (mma_ring) with each warp's 32 lanes copying into one slot (the
    ring's lane offset dropped): every lane's 16 bytes land where its warp's other lanes land
    and read theirs, with nothing ordering them, in block_mma_rows (34 rows) or block_mma's
    k split (32). TSan must see it (the ring as built, each lane its own slot, is race-free:
    test_strict_tsan_row_split_mat_muls_no_race_...)."""
    ex = row_split_executor(tiny)
    assert ex.source.count(_RING_LANE) == 1
    with pytest.raises(DataRaceError) as info:
        run_strict(ex, [], table=row_split_step(ex, n), source=ex.source.replace(
            _RING_LANE, "+ MMA_SUMS_BYTES) + (threadIdx.x & ~31);"))
    assert re.search(r"block_mma_rows|cp_async", info.value.report), info.value.report[:4000]


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_negative_control_token_group_members_on_the_same_share_are_reported(tiny):
    """token_group (kernel/token_groups.py) with every member taking share 0 of the step's
    rows: the two blocks of a group write the same rows of the same tokens (QKV's q, the
    residual's read-modify-write) with nothing ordering them. TSan must see it (the kernel as
    built is race-free on the same step: test above, tensor-cores-token-groups)."""
    from monokernel.kernel.schedule import schedule, tensor_core_splits

    s, c = tensor_core_splits(tiny.config, BLOCKS, MAX_SEQ)
    prog = schedule(tiny.config, BLOCKS, MAX_SEQ, s, c, merge_ticket_min=1, tokens=3,
                    token_groups=(2, 2), tensor_cores=True)
    ex = table_executor(tiny, tensor_cores=True, program=prog)
    old = "j * ntok / c, (j + 1) * ntok / c};"
    assert ex.source.count(old) == 1, "token_group's shares are not where this test expects"
    source = ex.source.replace(old, "0 * ntok / c, (0 + 1) * ntok / c};")
    with pytest.raises(DataRaceError) as info:
        run_strict(ex, [], table=table_steps(ex)[0], source=source)
    assert re.search(r"op_rms_qkv_rope|qkv_store|mma_add_rows|op_rms_gate_up|op_down_residual|"
                     r"op_o_proj_residual", info.value.report), info.value.report[:4000]


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_negative_control_a_relaxed_row_ticket_is_reported(tiny):
    """A kernel of slots draws a ticket per row (attention_row_tickets); with that draw relaxed
    (the LM head's ticket left as it is), the first step (every row of one split, merged by
    its one holder) stays race-free, and in the second the row of slot 1 at position 2, its 2
    splits rotated past slot 0's one-split row to unit slots 1 and 2 (one on each block: a
    segment's rotation is the earlier segments' used splits), is merged by whichever block
    draws last, reading the other block's partials with nothing ordering them: TSan must see
    it in the merge."""
    from monokernel.kernel.base import StepTable

    ex = table_executor(tiny, tensor_cores=True, attn_splits=4)
    assert ex.program.attn_min_chunk == 2 and BLOCKS == 2  # unit slots 0-1 and 2-3 a block
    old = "last = ticket_add(c, n) + n == used;"
    assert ex.source.count(old) == 1, "the row ticket's draw is not where this test expects"
    source = ex.source.replace(old, "last = __atomic_fetch_add(c, n, __ATOMIC_RELAXED) + n "
                                    "== used;")
    pages = list(ex.add_pages(6))
    tables = {0: [pages[5], pages[0]], 1: [pages[2], pages[3]]}
    first = StepTable.of([(17, 1, 0, True, True), (7, 1, 1, True, True),
                          (5, 0, 0, True, True)], tables)
    second = StepTable.of([(999, 0, 1, True, True), (23, 1, 2, True, True)], tables)
    _, _, report = run_strict(ex, [], table=first, source=source)
    assert report == ""
    with pytest.raises(DataRaceError) as info:
        run_strict(ex, [], table=second, source=source)
    assert "merge_chunk" in info.value.report, info.value.report[:4000]


_SLICE_WAIT = "  if (!wait_counter(P, counter, members * (st[S_STEP] + 1), instr, ins[W_OP],"


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@needs_tsan
def test_negative_control_a_slice_sum_without_its_groups_wait_is_reported(tiny):
    """slice_mma (kernel/input_slices.py) with its wait on the row group's counter gone: a
    block sums its rows' partials while the other block may still write them. TSan must see
    it (the kernel as built is race-free on the same steps: tensor-cores-input-slices)."""
    from monokernel.kernel.schedule import schedule, tensor_core_splits

    s, c = tensor_core_splits(tiny.config, BLOCKS, MAX_SEQ)
    prog = schedule(tiny.config, BLOCKS, MAX_SEQ, s, c, merge_ticket_min=1, tokens=3,
                    tensor_cores=True, input_slices=2)
    ex = table_executor(tiny, tensor_cores=True, program=prog)
    assert ex.source.count(_SLICE_WAIT) == 1, "slice_mma's wait is not where this test expects"
    source = ex.source.replace(_SLICE_WAIT, "  if (false && !wait_counter(P, counter, members * "
                                            "(st[S_STEP] + 1), instr, ins[W_OP],")
    with pytest.raises(DataRaceError) as info:
        run_strict(ex, [], table=table_steps(ex)[0], source=source)
    assert re.search(r"slice_mma", info.value.report), info.value.report[:4000]
