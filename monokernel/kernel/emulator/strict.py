"""Strict-memory mode: the megakernel with one OS thread per CUDA thread, under ThreadSanitizer.

The default emulator cannot see a missing ``__threadfence`` (fibers on one OS thread, and x86's
strong ordering). The strict build (``-DEMU_STRICT``, see cuda_cpu_strict.h) spells every
synchronisation the kernel relies on in C++ memory-model terms, and TSan reports the data race
a missing fence or acquire leaves. TSan cannot be loaded into Python, so ``run_strict`` writes an
executor's buffers, Params and per-step control words into one blob, runs strict_driver.cpp
(compiled together with the generated kernel source and cached like build.py's modules) in a
subprocess, and reads the logits and buffers back.

``__shared__`` cannot be ``static thread_local`` when every CUDA thread has its own OS thread,
so the strict build rewrites each ``__shared__ T name[dims];`` declaration into
``EMU_SHARED(T, name, [dims])``: a static array with one ``T[dims]`` per block index and a local
reference ``name`` to this block's element. Only that declaration form is supported (no
``extern __shared__``, no attributes); anything else stays ``__shared__``, which a strict build
rejects with a compile error naming the line.

TSan's runtime (LLVM 14 on, GCC 12's libtsan.so.2) tracks at most 255 threads at once
(tsan_defs.h kThreadSlotCount - 1). A launch of more (2 blocks of 256 CUDA threads, plus the
driver's) makes its threads take turns on the slots, and a slot handed from one thread to the
next orders the first one's accesses before the second one's: a race between them can go
unreported, depending on the scheduling. A negative control of a race within a block runs on
one block (257 threads: few hand-overs); one between blocks needs two, and relies on its race
repeating over many accesses.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ...errors import KernelError
from ..isa import ERROR_WORDS, NUM_THREADS, PARAMS, STATE_WORDS, State
from .build import (COMMON_SHIM_PATH, CXX, MMA_SHIM_PATH, SHIM_PATH, _c_string, build_once, cache_key,
                    compile_unit, compiler_version, default_cache_dir, rewrite_shared)

STRICT_SHIM_PATH = SHIM_PATH.with_name("cuda_cpu_strict.h")
DRIVER_PATH = SHIM_PATH.with_name("strict_driver.cpp")
STRICT_FLAGS = ("-std=c++20", "-O1", "-g", "-pthread", "-DEMU_STRICT")
TSAN_FLAGS = ("-fsanitize=thread",)
# exitcode: a run with a report fails even if the kernel finished; the text decides, not the code.
TSAN_OPTIONS = "halt_on_error=0 exitcode=66 report_signal_unsafe=0 second_deadlock_stack=1"
TSAN_EXIT = 66
BLOB_MAGIC, OUT_MAGIC, VERSION = b"MKSTRICT", b"MKSTROUT", 1
# struct BlobHeader of strict_driver.cpp (no padding: 8 + 6 * 4 + 10 * 8 + 8 bytes).
BLOB_HEADER = struct.Struct("<8s6I10Qd")
OUT_HEADER = struct.Struct("<8s2I")
ALIGN = 64
_TSAN_WARNING = re.compile(r"^WARNING: ThreadSanitizer: (?P<kind>.+?) \(pid=\d+\)", re.MULTILINE)
_TSAN_SUMMARY = re.compile(r"^SUMMARY: ThreadSanitizer: .*$", re.MULTILINE)


class DataRaceError(KernelError):
    """ThreadSanitizer reported a data race (or another thread error) in a strict-mode run;
    ``report`` holds TSan's text."""

    def __init__(self, message: str, report: str):
        super().__init__(message)
        self.report = report


def tsan_available() -> str | None:
    """None if g++ can build and run a -fsanitize=thread program here, else the reason."""
    with tempfile.TemporaryDirectory(prefix="monokernel-tsan-probe-") as tmp:
        src, exe = Path(tmp) / "probe.cpp", Path(tmp) / "probe"
        src.write_text("#include <thread>\nint main() { std::thread t([] {}); t.join(); }\n")
        try:
            proc = subprocess.run([CXX, *TSAN_FLAGS, "-pthread", str(src), "-o", str(exe)],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                return f"{CXX} -fsanitize=thread cannot link here: {proc.stderr.strip()[-500:]}"
            run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"cannot build or run a ThreadSanitizer probe: {e}"
        if run.returncode != 0:
            return f"a ThreadSanitizer program does not run here: {run.stderr.strip()[-500:]}"
    return None


def build_strict_driver(source: str, *, tsan: bool = True, extra_flags=(),
                        cache_dir: str | os.PathLike | None = None) -> Path:
    """Compiles the generated kernel source + strict_driver.cpp into an executable (cached by a
    sha256 of everything that goes into it) and returns its path."""
    flags = [*STRICT_FLAGS, *(TSAN_FLAGS if tsan else ()), *extra_flags]
    unit = (f'#line 1 "megakernel.cu"\n{rewrite_shared(source)}\n'
            f'#line 1 "{_c_string(str(DRIVER_PATH))}"\n{DRIVER_PATH.read_text()}')
    key = cache_key(SHIM_PATH.read_text(), COMMON_SHIM_PATH.read_text(), STRICT_SHIM_PATH.read_text(),
                    MMA_SHIM_PATH.read_text(), unit,
                    "\0".join(flags), compiler_version())
    out_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / f"strict_driver-{key}{'-tsan' if tsan else ''}"
    build_once(exe, lambda: compile_unit(unit, flags, exe, "the strict-mode driver", executable=True))
    return exe


def _pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def write_blob(executor, controls: np.ndarray, timeout_s: float) -> tuple[bytes, dict[str, int], int]:
    """The blob strict_driver.cpp reads; also each buffer's blob offset and the data offset."""
    bufs = executor.buffers
    params = executor.params.copy()
    pointer_fields = [(n, params.dtype.fields[n][1]) for n, t, _ in PARAMS if t.endswith("*")]
    controls = np.ascontiguousarray(controls, np.int32)
    params_off = BLOB_HEADER.size
    pointers_off = _pad(params_off + params.dtype.itemsize)
    steps_off = _pad(pointers_off + 4 * len(pointer_fields))
    data_off = _pad(steps_off + controls.nbytes)
    offsets, at = {}, data_off
    for name, arr in bufs.items():
        offsets[name] = at
        at = _pad(at + arr.nbytes)
    data_end = at
    where = dict(offsets, state=offsets["control"], error=offsets["control"] + 4 * STATE_WORDS)
    for name, _ in pointer_fields:
        params[name] = where[name] if int(params[name][0]) != 0 else 0
    logits = bufs["logits"]
    header = BLOB_HEADER.pack(
        BLOB_MAGIC, VERSION, executor.blocks, NUM_THREADS, len(controls),
        params.dtype.itemsize, len(pointer_fields),
        params_off, pointers_off, steps_off,
        offsets["control"], bufs["control"].nbytes, offsets["logits"], logits.nbytes,
        data_off, data_end - data_off, data_end, float(timeout_s))
    blob = bytearray(data_end)
    blob[:len(header)] = header
    blob[params_off:params_off + params.dtype.itemsize] = params.tobytes()
    blob[pointers_off:pointers_off + 4 * len(pointer_fields)] = np.array(
        [off for _, off in pointer_fields], np.uint32).tobytes()
    blob[steps_off:steps_off + controls.nbytes] = controls.tobytes()
    for name, arr in bufs.items():
        blob[offsets[name]:offsets[name] + arr.nbytes] = np.ascontiguousarray(arr).tobytes()
    return bytes(blob), offsets, data_off


def tsan_report(stderr: str) -> str:
    """TSan's reports in a process's stderr, from the first one on ('' when there are none)."""
    m = _TSAN_WARNING.search(stderr)
    if not m:
        return ""
    start = stderr.rfind("==================", 0, m.start())
    return stderr[start if start >= 0 else m.start():]


def run_strict(executor, steps, tsan: bool = True, timeout_s: float = 300.0, *,
               source: str | None = None, defines: dict[str, str] | None = None,
               chained: bool = False, table=None):
    """Runs decode steps [(token, pos), ...] of a persistent-kernel ``KernelExecutor`` on the
    emulator device in strict mode (under ThreadSanitizer when ``tsan``).

    ``source`` replaces the generated kernel source (tests mutate it); ``defines`` are extra -D
    macros. Returns (control words [steps, STATE_WORDS + ERROR_WORDS], logits [steps, vocab],
    TSan report text). ``chained``: the steps (consecutive positions) run as ONE launch, the
    tokens fed from the feed buffer (State.FEED_END, State.STEPS; in chunks of up to
    ``program.tokens`` positions a step): one control record and the last step's logits come
    back. ``table`` (a StepTable, ``steps`` empty): one step of a kernel of many sequences
    (``slots``), its rows and block tables written first. The executor's buffers and step count
    afterwards are as if it had run the steps itself. Raises DataRaceError (a KernelError) with the report when TSan reports anything,
    KernelError when the emulator or the kernel's error record reports an error or the driver
    runs past ``timeout_s``.
    """
    from ..devices.emulator import EmulatorDevice

    if not isinstance(executor.device, EmulatorDevice) or executor.multi:
        raise KernelError(f"{executor.name}: strict mode runs the persistent megakernel of an "
                          "emulator executor only")
    executor.check_usable()
    steps = [(int(t), int(p)) for t, p in steps]
    if (table is not None) == bool(steps) or (table is not None) != executor.table:
        raise KernelError("strict mode: give steps of a one-sequence kernel, or one table of a "
                          "kernel of many sequences (slots)")
    controls = [] if table is None else [executor.write_table(table)]
    for i, (token, pos) in enumerate(steps):
        if not 0 <= pos < executor.max_seq_len:
            raise KernelError(f"position {pos} is outside the KV cache [0, {executor.max_seq_len})")
        controls.append(executor.state_words(token, pos, None, step=executor.steps_run + i))
    if chained:
        if [p for _, p in steps] != list(range(steps[0][1], steps[0][1] + len(steps))):
            raise KernelError("strict mode: chained steps must be at consecutive positions")
        feed = np.zeros(executor.max_seq_len, np.int32)
        feed[[p for _, p in steps]] = [t for t, _ in steps]
        executor.buffers["feed"][...] = feed
        controls[0][State.FEED_END] = steps[-1][1] + 1
        # a program of steps of several tokens takes the fed positions in chunks
        T = executor.program.tokens
        controls[0][State.NTOK] = min(T, len(steps))
        controls[0][State.STEPS] = -(-len(steps) // T)
        controls = controls[:1]
    controls = np.array(controls, np.int32).reshape(len(controls), STATE_WORDS + ERROR_WORDS)
    flags = [f"-D{k}={v}" for k, v in (defines or {}).items()]
    exe = build_strict_driver(source if source is not None else executor.source,
                              tsan=tsan, extra_flags=flags)
    blob, offsets, data_off = write_blob(executor, controls, timeout_s)
    env = dict(os.environ, TSAN_OPTIONS=TSAN_OPTIONS)
    with tempfile.TemporaryDirectory(prefix="monokernel-strict-run-") as tmp:
        blob_path, out_path = Path(tmp) / "in.blob", Path(tmp) / "out.blob"
        blob_path.write_bytes(blob)
        try:
            proc = subprocess.run([str(exe), str(blob_path), str(out_path)], env=env,
                                  capture_output=True, text=True, timeout=timeout_s + 30)
        except subprocess.TimeoutExpired as e:
            raise KernelError(f"{executor.name}: strict-mode run of {len(steps)} step(s) still running "
                              f"after {timeout_s + 30:.0f} s; killed") from e
        out = out_path.read_bytes() if out_path.is_file() else b""
    report = tsan_report(proc.stderr)
    if report:
        kinds = sorted(set(_TSAN_WARNING.findall(report)))
        summaries = _TSAN_SUMMARY.findall(report)
        raise DataRaceError(
            f"{executor.name}: ThreadSanitizer reported {len(summaries)} problem(s) "
            f"({', '.join(kinds)}) in the strict-mode megakernel run "
            f"<<<{executor.blocks}, {NUM_THREADS}>>>; first: "
            f"{summaries[0] if summaries else '?'}\n{report[:30000]}", report)
    if proc.returncode != 0 or not out:
        raise KernelError(f"{executor.name}: strict-mode driver failed (exit {proc.returncode}): "
                          f"{proc.stderr.strip()[-4000:]}")
    magic, done, _ = OUT_HEADER.unpack_from(out)
    if magic != OUT_MAGIC or done != len(controls):
        raise KernelError(f"{executor.name}: strict-mode driver wrote a bad result file")
    nwords, vocab = controls.shape[1], executor.buffers["logits"].size
    rec = np.dtype([("control", np.int32, (nwords,)), ("logits", np.float32, (vocab,))])
    records = np.frombuffer(out, rec, count=done, offset=OUT_HEADER.size)
    data = memoryview(out)[OUT_HEADER.size + records.nbytes:]
    const = {n for n, t, _ in PARAMS if t.startswith("const")}
    for name, arr in executor.buffers.items():
        if name not in const:
            start = offsets[name] - data_off
            arr[...] = np.frombuffer(data[start:start + arr.nbytes], arr.dtype).reshape(arr.shape)
    for i, control in enumerate(records["control"]):
        try:  # the executor takes each step's count; its next launch writes fresh words
            executor.absorb_control(np.array(control))
        except KernelError as e:
            where = f"position {steps[i][1]}" if steps else "a table"
            raise KernelError(f"strict-mode step {i} ({where}): {e}") from None
    return records["control"].copy(), records["logits"].copy(), report
