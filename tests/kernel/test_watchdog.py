"""The kernel never hangs: a wait that can never be met trips the watchdog, every block stops, and
the host raises KernelError naming the block, the instruction and the counter; a bad opcode is
named too; after either, the executor refuses work instead of running on a broken state.

The broken programs are valid schedules edited after schedule() returned (schedule() verifies,
KernelExecutor(program=...) does not), i.e. exactly what Program.verify() exists to reject.
"""

from __future__ import annotations

import copy
import re
import time

import numpy as np
import pytest

from monokernel.errors import KernelError, ProgramError
from monokernel.kernel.isa import Op, Word
from monokernel.kernel.devices.emulator import EmulatorDevice
from monokernel.kernel.executor import KernelExecutor
from monokernel.model.loader import load_model
from monokernel.kernel.schedule import schedule

MAX_SEQ = 160  # as in test_kernel_emulator.py: the same emulator build
WATCHDOG_MS = 300
DEADLINE_S = 10.0  # the host must have its KernelError well within this

MULTI = pytest.mark.parametrize("multi", [False, True], ids=["emulator", "emulator-multi"])


@pytest.fixture(scope="module")
def tiny(synth_dir):
    return load_model(synth_dir("tiny"), progress=False)


def stuck_program(cfg, blocks: int, block: int, op: Op, layer: int):
    """schedule() with one wait raised by one signal above what the counter can ever reach."""
    prog = copy.deepcopy(schedule(cfg, blocks, MAX_SEQ))
    i = next(k for k, s in enumerate(prog.queues[block]) if s.op == op and s.layer == layer)
    counter, count = prog.queues[block][i].wait
    prog.queues[block][i].wait = (counter, count + 1)
    with pytest.raises(ProgramError, match="can never be met"):
        prog.verify()
    return prog, i, counter, count


def assert_refuses_work(ex: KernelExecutor) -> None:
    t0 = time.perf_counter()
    for call in (lambda: ex.step(1, 0), ex.reset, lambda: ex.prefill([1, 2])):
        with pytest.raises(KernelError, match="unusable after an earlier kernel error"):
            call()
    assert time.perf_counter() - t0 < 1.0


# (blocks, stuck block, op, layer). With one block the stuck wait is the only one, so the record
# must name it. With several blocks, the multi-kernel baseline runs the stuck op as its own
# launch in which no other block waits on the stuck one, so the record must name it too.
EXACT = [(1, 0, Op.ATTENTION, 1, False), (3, 1, Op.ATTENTION, 1, True),
         (8, 7, Op.DOWN_RESIDUAL, 0, True), (1, 0, Op.RMS_LM_HEAD, 0, True)]


@pytest.mark.parametrize("blocks,block,op,layer,multi", EXACT,
                         ids=[f"b{b}-block{k}-{o.name}-{'multi' if m else 'persistent'}"
                              for b, k, o, _, m in EXACT])
def test_watchdog_names_the_stuck_wait(tiny, blocks, block, op, layer, multi):
    prog, i, counter, count = stuck_program(tiny.config, blocks, block, op, layer)
    ex = KernelExecutor(tiny, MAX_SEQ, program=prog, multi=multi, watchdog_ms=WATCHDOG_MS)
    ex.reset()
    t0 = time.perf_counter()
    with pytest.raises(KernelError) as e:
        ex.step(5, 0)
    elapsed = time.perf_counter() - t0
    msg = str(e.value)
    assert elapsed < DEADLINE_S, f"the host waited {elapsed:.1f} s"
    assert elapsed >= WATCHDOG_MS / 1000 * 0.9  # it did wait for the deadline, not less
    name = prog.counter_names[counter]
    assert f"watchdog: block {block} #{i} {op.name}(layer {layer}" in msg, msg
    # the first step targets count * (step + 1) = count + 1 signals and count arrive
    assert f"counter {counter} ({name}) to reach {count + 1}, saw {count}" in msg, msg
    assert f"waited {WATCHDOG_MS} ms" in msg and "every block stopped" in msg
    assert_refuses_work(ex)


@pytest.mark.parametrize("blocks", [3, 8])
def test_watchdog_in_the_persistent_kernel_stops_every_block(tiny, blocks):
    """In one persistent launch every block ends up waiting on the stuck one, and whichever
    deadline expires first is recorded: the record must name a real wait of the program that
    could not be met (its counter short of the target), and nothing may hang."""
    prog, i, counter, count = stuck_program(tiny.config, blocks, 1, Op.O_PROJ_RESIDUAL, 0)
    ex = KernelExecutor(tiny, MAX_SEQ, program=prog, watchdog_ms=WATCHDOG_MS)
    ex.reset()
    t0 = time.perf_counter()
    with pytest.raises(KernelError) as e:
        ex.step(5, 0)
    assert time.perf_counter() - t0 < DEADLINE_S
    m = re.search(r"watchdog: block (\d+) #(\d+) (\w+)\(layer (\d+), tiles \d+:\d+\) waited "
                  rf"{WATCHDOG_MS} ms for counter (\d+) \(([\w.]+)\) to reach (\d+), saw (\d+)",
                  str(e.value))
    assert m, str(e.value)
    b, k, op, layer, c, cname, expected, seen = m.groups()
    named = prog.queues[int(b)][int(k)]
    assert named.op.name == op and named.layer == int(layer)
    assert named.wait is not None and named.wait[0] == int(c) == prog.counter_names.index(cname)
    assert int(expected) == named.wait[1] and int(seen) < int(expected)
    # the first to wait is the stuck instruction; anyone else waits on a later op
    assert (int(b), int(k)) == (1, i) or int(k) > i
    assert_refuses_work(ex)


def test_a_second_step_waits_for_twice_the_count(tiny):
    """Counters are monotonic across steps: step s waits for count * (s + 1). A wait raised only
    for the second step's target is invisible in the first step and trips in the second."""
    prog = schedule(tiny.config, 2, MAX_SEQ)
    ex = KernelExecutor(tiny, MAX_SEQ, program=prog, multi=True, watchdog_ms=WATCHDOG_MS)
    ex.reset()
    ex.step(5, 0)
    # now lower one counter by one behind the kernel's back: step 1 can never complete
    cnt = prog.counter_names.index("L1.RMS_GATE_UP")
    ex.buffers["counters"][cnt] -= 1
    with pytest.raises(KernelError, match=rf"counter {cnt} \(L1.RMS_GATE_UP\) to reach 4, saw 3"):
        ex.step(7, 1)
    assert_refuses_work(ex)


@MULTI
@pytest.mark.parametrize("blocks,block", [(1, 0), (3, 2)])
def test_bad_opcode_is_named(tiny, blocks, block, multi):
    ex = KernelExecutor(tiny, MAX_SEQ, blocks=blocks, multi=multi, watchdog_ms=WATCHDOG_MS)
    q = ex.program.queues[block]
    i = next(k for k, s in enumerate(q) if s.op == Op.RMS_GATE_UP and s.layer == 1)
    words = ex.buffers["program"]  # the emulator's device memory is this numpy array
    assert words[block, i, Word.OP] == Op.RMS_GATE_UP
    words[block, i, Word.OP] = 99
    ex.reset()
    t0 = time.perf_counter()
    with pytest.raises(KernelError) as e:
        ex.step(5, 0)
    assert time.perf_counter() - t0 < DEADLINE_S
    msg = str(e.value)
    assert f"bad opcode 99 in block {block} instruction #{i}" in msg, msg
    assert "every block stopped" in msg, msg
    assert_refuses_work(ex)


@MULTI
def test_host_bounds_its_own_wait(tiny, multi):
    """With the kernel's watchdog far away (60 s), the host's own bound on the launch (the
    emulator's timeout_s) ends the step, and the executor is then unusable, not hung."""
    prog, i, counter, count = stuck_program(tiny.config, 2, 0, Op.RMS_GATE_UP, 0)
    ex = KernelExecutor(tiny, MAX_SEQ, program=prog, multi=multi, watchdog_ms=60_000,
                        device=EmulatorDevice(timeout_s=1.0))
    ex.reset()
    t0 = time.perf_counter()
    with pytest.raises(KernelError) as e:
        ex.step(5, 0)
    assert time.perf_counter() - t0 < DEADLINE_S, str(e.value)
    assert "emulator" in str(e.value)
    assert_refuses_work(ex)


def test_a_valid_program_passed_in_runs(tiny):
    """program= bypasses schedule() but runs the same: the logits of a passed-in schedule equal
    those of the executor's own."""
    own = KernelExecutor(tiny, MAX_SEQ, blocks=3)
    passed = KernelExecutor(tiny, MAX_SEQ, program=schedule(tiny.config, 3, MAX_SEQ))
    for ex in (own, passed):
        ex.reset()
        ex.poison()
    a, b = own.step(5, 0).logits, passed.step(5, 0).logits
    assert np.isfinite(a).all() and np.array_equal(a, b)
