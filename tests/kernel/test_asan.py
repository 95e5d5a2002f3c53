"""The megakernel under AddressSanitizer: the emulator build with sanitize="address" runs the tiny
models (persistent and multi-kernel, several grids, every position up to the last KV-cache slot)
in a subprocess started with asan_preload_env(), and must match the reference with no ASan report;
one grid merges the attention splits by ticket.

Every buffer the kernel touches is a separately malloc'd NumPy array in that process (PYTHONMALLOC
=malloc), so ASan's redzones sit right after each one: an index one past a buffer's end (the last
cache slot, the last vocabulary row, the last attention split) is reported. The shim's own tests
(test_emulator_shim.py) show that a deliberately out-of-bounds kernel is caught.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from monokernel.kernel.emulator import asan_preload_env

# AddressSanitizer builds and runs: `make test` runs them, the fast lane leaves them out
pytestmark = pytest.mark.sanitizer

SCRIPT = r"""
import sys
import numpy as np
from monokernel.kernel.base import DeviceSample
from monokernel.kernel.devices.emulator import EmulatorDevice
from monokernel.kernel.executor import KernelExecutor
from monokernel.model.loader import load_model
from monokernel.model.reference import ReferenceModel

MAX_SEQ = 11
path = sys.argv[1]
m = load_model(path, progress=False)
worst = 0.0
# (blocks, splits, multi, merge_ticket_min): the last, the split merge by ticket from 2 used
# splits on (attention_ticket, its 8-lane merge into attn, O_PROJ reading attn)
for blocks, splits, multi, ticket in [(3, 5, False, None), (8, None, True, None),
                                      (1, 3, False, None), (2, 3, False, 2)]:
    ex = KernelExecutor(m, MAX_SEQ, blocks=blocks, attn_splits=splits, multi=multi,
                        device=EmulatorDevice(sanitize="address"), merge_ticket_min=ticket,
                        attn_min_chunk=1 if ticket else None)
    assert ex.program.merge_ticket_min == (ticket or 0)
    ref = ReferenceModel(m.config, m.weights, MAX_SEQ)
    ex.reset()
    tok = 999  # the last row of the embedding
    for pos in range(MAX_SEQ):  # up to the last slot of the cache
        ex.poison()
        got = ex.step(tok, pos).logits
        want = ref.forward([tok], pos)[0]
        err = float(np.abs(got - want).max() / np.abs(want).max())
        assert err <= 2e-3, (path, blocks, splits, multi, pos, err)
        worst = max(worst, err)
        tok = int(np.argmax(want))
    if not multi:  # many steps per launch up to the last slot: feed, stop mask, mapped tokens
        ex.reset()
        ref = ReferenceModel(m.config, m.weights, MAX_SEQ)
        prompt = [999, 0]
        logits = ref.forward(prompt, 0)[-1]
        want = []
        for pos in range(len(prompt), MAX_SEQ):  # the tokens at positions 2 .. MAX_SEQ - 1
            want.append(int(np.argmax(logits)))
            if pos < MAX_SEQ - 1:
                logits = ref.forward([want[-1]], pos)[0]
        got = list(ex.run_steps(prompt, 0, DeviceSample(0.0, 0)))
        assert got == want, (path, blocks, got, want)
print(f"ok {worst:.2e}")
"""


@pytest.mark.slow  # past 20 s each on 2 cores: not in make test-fast
@pytest.mark.parametrize("shape", ["tiny", "qwen3-tiny"])
def test_kernel_under_address_sanitizer(synth_dir, shape):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(synth_dir(shape))],
                          env=asan_preload_env(), capture_output=True, text=True, timeout=600)
    assert "AddressSanitizer" not in proc.stderr, proc.stderr[-6000:]
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.startswith("ok"), proc.stdout


SHORT_LOGITS_SCRIPT = r"""
import sys
import numpy as np
from monokernel.kernel.devices.emulator import EmulatorDevice
from monokernel.kernel.executor import KernelExecutor
from monokernel.model.loader import load_model

m = load_model(sys.argv[1], progress=False)
ex = KernelExecutor(m, 11, blocks=3, device=EmulatorDevice(sanitize="address"))
short = np.zeros(m.config.vocab_size - 1, np.float32)  # one element short
ex.buffers["logits"] = short
ex.params["logits"] = short.ctypes.data
ex.reset()
ex.step(5, 0)
print("not reported")
"""


def test_negative_control_one_element_short_logits_buffer(synth_dir):
    """The same setup with the logits buffer one element short: ASan must name the kernel line
    (the last block writes the last vocabulary row one past the end)."""
    proc = subprocess.run([sys.executable, "-c", SHORT_LOGITS_SCRIPT, str(synth_dir("tiny"))],
                          env=asan_preload_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "not reported" not in proc.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]
    assert "in op_rms_lm_head" in proc.stderr and "megakernel.cu:" in proc.stderr


TABLE_SCRIPT = r"""
import sys
import numpy as np
from monokernel.kernel.base import StepTable
from monokernel.kernel.devices.emulator import EmulatorDevice
from monokernel.kernel.executor import KernelExecutor
from monokernel.model.loader import load_model
from monokernel.model.reference import ReferenceModel

MAX_SEQ, PAGE = 11, 4
m = load_model(sys.argv[1], progress=False)
mode = sys.argv[2]  # full, short; mma, mma-short: the mat-muls on tensor cores; mma-slices,
# mma-slices-short: with O_PROJ's and DOWN's input in 2 slices (kernel/input_slices.py)
tc = mode.startswith("mma")
program = None
if mode.startswith("mma-slices"):  # 3 blocks: a row group of 2, one block left over
    from monokernel.kernel.schedule import schedule, tensor_core_splits

    program = schedule(m.config, 3, MAX_SEQ, *tensor_core_splits(m.config, 3, MAX_SEQ),
                       merge_ticket_min=1, tokens=8, tensor_cores=True, input_slices=2)
# (mma-short: no L2 prefetch, whose one-byte read of the rows would be reported first)
# (mma: 3 attention splits of 4 positions, fixed by absolute position, so the ticket's last
# drawer merges rows of 2 and 3 splits in one pass beside rows of one that their units finish)
ex = KernelExecutor(m, MAX_SEQ, blocks=3, slots=3, step_tokens=8, page_size=PAGE,
                    device=EmulatorDevice(sanitize="address"), tensor_cores=tc,
                    prefetch=mode != "mma-short", attn_splits=3 if mode == "mma" else None,
                    program=program)
pages = list(ex.add_pages(9))
c = m.config
if mode == "short":  # the K cache one page short: the pool's last page is past its end
    short = np.zeros(ex.buffers["k_cache"].size - PAGE * c.num_kv_heads * c.head_dim, np.uint16)
    ex.buffers["k_cache"] = short
    ex.params["k_cache"] = short.ctypes.data
if mode == "mma-slices-short":  # the partials one element short: the last row's last slice
    short = ex.buffers["partials"][:-1].copy()
    ex.buffers["partials"] = short
    ex.params["partials"] = short.ctypes.data
if mode == "mma-short":  # Wd one row short: the last layer's last row is past its end
    short = ex.buffers["wd"].ravel()[:-c.intermediate_size].copy()
    ex.buffers["wd"] = short
    ex.params["wd"] = short.ctypes.data
# slot 0 on the pool's last pages up to the cache's last position, slot 2 beside it; a full
# table of 8 rows, every row's logits (the logits buffer's last row)
tables = {0: pages[-3:], 2: pages[:3]}
rng = np.random.default_rng(0)
seqs = {0: [int(t) for t in rng.integers(0, m.config.vocab_size, MAX_SEQ)],
        2: [m.config.vocab_size - 1] + [int(t) for t in rng.integers(0, 99, 6)]}
plan = [{0: 6, 2: 2}, {0: 4, 2: 4}, {0: 1, 2: 1}]
done, worst = {0: 0, 2: 0}, 0.0
for step in plan:
    rows = [(seqs[s][p], s, p, True, True) for s, n in step.items()
            for p in range(done[s], done[s] + n)]
    ex.poison()
    logits = ex.run_table(StepTable.of(rows, tables)).logits
    for (tok, s, p, _, _), got in zip(rows, logits):
        want = ReferenceModel(m.config, m.weights, MAX_SEQ,
                              bf16_inputs=tc, attn_chunk=ex.program.attn_min_chunk
                              ).forward(seqs[s][:p + 1], 0)[-1]
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    for s, n in step.items():
        done[s] += n
# tensor cores: against the bf16-inputs reference, test_tensor_cores.py's row tolerance
assert done[0] == MAX_SEQ and worst <= (4e-3 if tc else 2e-3), (done, worst)
print(f"ok {worst:.2e}")
"""


@pytest.mark.slow  # past 20 s on 2 cores: not in make test-fast
@pytest.mark.parametrize("shape", ["tiny", "qwen3-tiny"])
def test_steps_of_many_sequences_under_address_sanitizer(synth_dir, shape):
    """A kernel of 3 slots (issue 17 slice 3): full token tables, a sequence on the K/V pool's
    last page up to the cache's last position, every logits row: no report, the reference's
    logits."""
    proc = subprocess.run([sys.executable, "-c", TABLE_SCRIPT, str(synth_dir(shape)), "full"],
                          env=asan_preload_env(), capture_output=True, text=True, timeout=600)
    assert "AddressSanitizer" not in proc.stderr, proc.stderr[-6000:]
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.startswith("ok"), proc.stdout


@pytest.mark.slow
def test_negative_control_k_pool_one_page_short(synth_dir):
    """The same run with the K cache one page short: ASan must name the kernel's K write into
    the pool's last page (through the block table)."""
    proc = subprocess.run([sys.executable, "-c", TABLE_SCRIPT, str(synth_dir("tiny")), "short"],
                          env=asan_preload_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "ok" not in proc.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]
    assert "in op_rms_qkv_rope" in proc.stderr and "megakernel.cu:" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["qwen3-tiny", "llama3-tiny"])
def test_tensor_cores_under_address_sanitizer(synth_dir, shape):
    """The same full tables on a kernel whose mat-muls run on tensor cores (issue 17 slice 6a:
    16-byte weight loads per lane, the inputs' float4 loads, the partials in shared memory;
    3 attention splits, every row's merged by its unit or in the ticket's one pass): no
    report, the bf16-inputs reference's logits. Without late q/k (llama3-tiny) attention runs
    a segment at a time (attention_segment: its tiles staged from the pool's last pages up to
    the cache's last position, in dynamic shared memory)."""
    proc = subprocess.run([sys.executable, "-c", TABLE_SCRIPT, str(synth_dir(shape)),
                           "mma"], env=asan_preload_env(), capture_output=True, text=True,
                          timeout=600)
    assert "AddressSanitizer" not in proc.stderr, proc.stderr[-6000:]
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.startswith("ok"), proc.stdout


@pytest.mark.slow
def test_negative_control_tensor_core_weights_one_row_short(synth_dir):
    """The tensor-core run with Wd one row short: ASan must name block_mma's 16-byte weight load
    of the last row (DOWN_RESIDUAL)."""
    proc = subprocess.run([sys.executable, "-c", TABLE_SCRIPT, str(synth_dir("tiny")),
                           "mma-short"], env=asan_preload_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0 and "ok" not in proc.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]
    assert "block_mma" in proc.stderr and "op_down_residual" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_input_slices_under_address_sanitizer(synth_dir):
    """The same full tables with O_PROJ's and DOWN's input in 2 slices (kernel/input_slices.py;
    3 blocks: a row group of 2 and a block left over): the partials written and summed, no
    report, the bf16-inputs reference's logits."""
    proc = subprocess.run([sys.executable, "-c", TABLE_SCRIPT, str(synth_dir("llama3-tiny")),
                           "mma-slices"], env=asan_preload_env(), capture_output=True,
                          text=True, timeout=600)
    assert "AddressSanitizer" not in proc.stderr, proc.stderr[-6000:]
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.startswith("ok"), proc.stdout


@pytest.mark.slow
def test_negative_control_partials_one_element_short(synth_dir):
    """The sliced run with the partials buffer one element short: ASan must name slice_mma's
    access of the last token row's last slice."""
    proc = subprocess.run([sys.executable, "-c", TABLE_SCRIPT, str(synth_dir("llama3-tiny")),
                           "mma-slices-short"], env=asan_preload_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0 and "ok" not in proc.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]
    assert "slice_mma" in proc.stderr, proc.stderr[-3000:]


ROW_SPLIT_SCRIPT = r"""
import sys
import numpy as np
from monokernel.kernel import executor
from monokernel.kernel.base import StepTable
from monokernel.kernel.devices.emulator import EmulatorDevice
from monokernel.kernel.executor import KernelExecutor
from monokernel.kernel.schedule import schedule, tensor_core_splits
from monokernel.model.loader import load_model
from monokernel.model.reference import ReferenceModel

m = load_model(sys.argv[1], progress=False)


def mutate(old, new, what):  # executor.kernel_source with old (once in it) replaced by new
    real = executor.kernel_source

    def mutated(*a, **k):
        src = real(*a, **k)
        assert src.count(old) == 1, f"{what} is not where this test expects"
        return src.replace(old, new)

    executor.kernel_source = mutated


if sys.argv[2] == "past":  # the walk's prefetch 16 rows on: past the last row group's weights
    mutate("prefetch_line(w[h] + c);", "prefetch_line(w[h] + c + 16 * K);",
           "block_mma_rows' prefetch")
if sys.argv[2] == "ring-past":  # the cp.async ring from dynamic shared memory's end on
    mutate("+ MMA_SUMS_BYTES) + threadIdx.x;", "+ MK_DYN_SMEM) + threadIdx.x;", "mma_ring")
# 2 blocks in row tiles, a kernel of 34 rows a step; a step of 34 rows (two prompts of 17):
# every mat-mul and the LM head split their rows over the warps (block_mma_rows), whose walk
# prefetches its next k range; or (argv[3] 16) of 32 rows: the k split, through the same ring
# (MK_K_RING)
N, BLOCKS = int(sys.argv[3]) if len(sys.argv) > 3 else 17, 2
seq = 2 * 17
prog = schedule(m.config, BLOCKS, seq, *tensor_core_splits(m.config, BLOCKS, seq),
                merge_ticket_min=1, tokens=seq, token_groups=False, tensor_cores=True)
ex = KernelExecutor(m, seq, blocks=BLOCKS, slots=2, step_tokens=seq, page_size=2,
                    tensor_cores=True, program=prog, device=EmulatorDevice(sanitize="address"))
assert "prefetch_line(w[h] + c" in ex.source
pages = list(ex.add_pages(2 * -(-N // 2)))
tables = {0: pages[:len(pages) // 2], 1: pages[len(pages) // 2:]}
prompts = [[5 + 3 * i for i in range(N)], [7 + 2 * i for i in range(N)]]
rows = [(t, s, i, True, True) for s, p in enumerate(prompts) for i, t in enumerate(p)]
logits = ex.run_table(StepTable.of(rows, tables)).logits
worst = 0.0
for s, p in enumerate(prompts):
    want = ReferenceModel(m.config, m.weights, seq, bf16_inputs=True,
                          attn_chunk=ex.program.attn_min_chunk).forward(p, 0)
    got = logits[s * N:(s + 1) * N]
    worst = max(worst, float((np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)).max()))
# test_tensor_cores.py's row tolerance against the bf16-inputs reference
assert worst <= 4e-3, worst
print(f"ok {worst:.2e}")
"""


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    """``script`` with ``args`` in a subprocess under ASan (asan_preload_env)."""
    return subprocess.run([sys.executable, "-c", script, *args], env=asan_preload_env(),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [17, 16])
def test_row_split_walk_prefetch_under_address_sanitizer(synth_dir, rows):
    """block_mma_rows' walk prefetches each next k range of its row group's rows (the design's
    mma_rows_prefetch; the emulator's prefetch reads a byte of the line) and copies its
    weights through a cp.async ring after its sums in dynamic shared memory: a step of 34
    rows on 2 blocks in row tiles, every mat-mul and the LM head in the row split, under ASan:
    no report, the reference's logits. A step of 32 rows on the same kernel: every mat-mul's
    k split through that ring (MK_K_RING), the same."""
    proc = _run(ROW_SPLIT_SCRIPT, str(synth_dir("llama3-tiny")), "full", str(rows))
    assert "AddressSanitizer" not in proc.stderr and proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.startswith("ok"), proc.stdout


@pytest.mark.slow
def test_negative_control_row_split_prefetch_past_the_rows(synth_dir):
    """The same step with the walk's prefetch 16 rows further on: past the end of the last
    row group's weights, which ASan must report in block_mma_rows' prefetch."""
    proc = _run(ROW_SPLIT_SCRIPT, str(synth_dir("llama3-tiny")), "past")
    assert proc.returncode != 0 and "ok" not in proc.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]
    assert "prefetch_line" in proc.stderr and "block_mma_rows" in proc.stderr, \
        proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("rows,where", [(17, "block_mma_rows"), (16, "block_mma")])
def test_negative_control_row_split_ring_past_dynamic_shared_memory(synth_dir, rows, where):
    """The same steps with the cp.async ring (mma_ring) placed at the end of dynamic shared
    memory instead of after block_mma_rows' sums: every copy lands past the block's dynamic
    shared memory, which ASan must report in the cp.async twin under block_mma_rows (the
    step of 34 rows) or block_mma's k split (32 rows)."""
    proc = _run(ROW_SPLIT_SCRIPT, str(synth_dir("llama3-tiny")), "ring-past", str(rows))
    assert proc.returncode != 0 and "ok" not in proc.stdout
    assert "AddressSanitizer" in proc.stderr, proc.stderr[-3000:]
    assert "cp_async" in proc.stderr and where in proc.stderr, proc.stderr[-3000:]
