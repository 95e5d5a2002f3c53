"""What the compiled kernel fixes, read off its sm_90 SASS.

The cost model's knobs that the compiler decides - loads in flight, dependent rounds of the
copies, program-word loads on an instruction's path, fences - are facts of the compiled kernel,
not choices to type. ``python -m monokernel.kernel.sass_facts`` compiles megakernel.cu for sm_90
(nvcc), reads its SASS (cuobjdump, from the nvidia-cuda-cuobjdump wheel or PATH) for the three
real shapes and writes ``sass_facts.json`` beside this file; ``costmodel.design_for`` takes the
kernel's knobs from that file (``compiled_knobs``), and tests/kernel/test_sass.py compiles the
kernel again and fails when what it finds differs from the file: a kernel change regenerates the
file, and the prediction follows it.

The readers below work on cuobjdump's text: one instruction per line, ``/*addr*/ TEXT ;``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from statistics import median

SHAPES = ("smollm2-135m", "qwen3-0.6b", "llama-3.2-1b")
FACTS_FILE = Path(__file__).with_name("sass_facts.json")
MAX_SEQ = 1024  # the cache length the facts are read at (the SASS does not depend on it)


class SassToolMissing(RuntimeError):
    """nvcc or cuobjdump is not installed: the SASS cannot be read here."""


# ---- compiling ---------------------------------------------------------------------------------
def cuobjdump() -> str:
    try:
        import nvidia.cu13  # the nvidia-cuda-cuobjdump wheel (CUDA 13)

        for base in nvidia.cu13.__path__:
            path = Path(base) / "bin" / "cuobjdump"
            if path.is_file():
                return str(path)
    except ImportError:
        pass
    found = shutil.which("cuobjdump")
    if not found:
        raise SassToolMissing("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    return found


def compile_sass(shape: str, *defines: str, function: str = "megakernel",
                 tokens: int = 1, slots: int = 0, mma: bool = False) -> str:
    """The sm_90 SASS of ``function`` in megakernel.cu built for a known shape (and steps of
    up to ``tokens`` tokens; a kernel of ``slots`` sequences, its mat-muls on tensor cores
    with ``mma``)."""
    from ..model.config import ModelConfig
    from .header import kernel_source

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SassToolMissing("nvcc is not on PATH (CUDA toolkit needed)")
    tool = cuobjdump()
    with tempfile.TemporaryDirectory(prefix="mk-sass-") as tmp:
        src, cubin = Path(tmp) / f"{shape}.cu", Path(tmp) / f"{shape}.cubin"
        src.write_text(kernel_source(ModelConfig.from_name(shape), MAX_SEQ, tokens, slots,
                                     16 if slots else 0, 0, mma))
        proc = subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-std=c++17", *defines, str(src),
                               "-o", str(cubin)], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {shape}:\n{proc.stderr[-3000:]}")
        # cuobjdump runs nvdisasm, which the nvidia-cuda-nvdisasm wheel puts beside it
        env = dict(os.environ,
                   PATH=str(Path(tool).parent) + os.pathsep + os.environ.get("PATH", ""))
        out = subprocess.run([tool, "-sass", "-fun", function, str(cubin)],
                             capture_output=True, text=True, timeout=120, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"cuobjdump failed for {shape}:\n{out.stderr[-2000:]}")
        return out.stdout


# ---- reading -------------------------------------------------------------------------------------
_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of every instruction."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_ADDR.search, sass.splitlines()) if m]


def _texts(sass: str) -> list[str]:
    return [t for _, t in sass_instructions(sass)]


def _opcode(text: str) -> str:
    parts = text.split()
    return parts[1] if parts and parts[0].startswith("@") else parts[0]


def _reads(text: str, reg: str) -> bool:
    """Whether an instruction reads register ``reg`` (a store reads all its operands; any other
    instruction its operands after the first, the destination)."""
    pat = re.compile(rf"\b{reg}\b")
    body = text.split(None, 2 if text.startswith("@") else 1)[-1]
    if _opcode(text).startswith(("ST", "RED")):
        return bool(pat.search(body))
    return bool(pat.search(body.split(",", 1)[-1])) if "," in body else False


def _first_reader(ins: list[str], at: int, reg: str) -> int | None:
    return next((k for k in range(at + 1, len(ins)) if _reads(ins[k], reg)), None)


def load_runs(sass: str) -> list[int]:
    """Mat-vecs: lengths of the runs of 16-byte read-only global loads (LDG.E.128.CONSTANT:
    weights) between floating-point ops, i.e. loads per lane in flight per chunk. (Plain
    16-byte loads - K/V rows, the copies into shared memory - are not weights: a copy's loads
    before a mat-vec would join its run.)"""
    return _runs(sass, r"\bLDG\.E\.128\.CONSTANT\b", r"\b(FFMA|FMUL|FADD)\b")


def _runs(sass: str, load: str, stop: str) -> list[int]:
    """Lengths of the runs of lines matching ``load`` ended by a line matching ``stop``."""
    runs, cur = [], 0
    for line in sass.splitlines():
        if re.search(load, line):
            cur += 1
        elif re.search(stop, line):
            if cur:
                runs.append(cur)
            cur = 0
    return runs


def pair_load_runs(sass: str) -> list[int]:
    """The LM head's reducer (megakernel.cu warp_best_of): lengths of the runs of 8-byte
    global loads (a partial's score and token) before the compare or branch after them, i.e.
    a lane's partials in flight in one L2 round (one a round where each load sits beside its
    compare)."""
    return _runs(sass, r"\bLDG\.E\.64\b", r"\b(FSETP|BRA)\b")


_PLAIN_LDG128 = re.compile(r"^(?:@!?P\d\s+)?LDG\.E\.128 (R\d+), ")
# the first use of a K/V load: a bf16 unpack of its words (bf_lo: << 16, bf_hi: & 0xffff0000)
_BF16_UNPACK = re.compile(r"\b(LOP3\.LUT .*0xffff0000|IMAD\.U32 .*0x10000|SHF\.L\.U32 .*0x10\b|PRMT)")


def _plain_load_groups(sass: str) -> list[tuple[int, str]]:
    """Plain 16-byte loads (data written during the launch) grouped as issued: per group, how
    many are in flight before the first instruction that reads the first one's result, and
    that instruction."""
    ins = _texts(sass)
    out, n = [], 0
    while n < len(ins):
        m = _PLAIN_LDG128.match(ins[n])
        if not m:
            n += 1
            continue
        use = _first_reader(ins, n, m.group(1))
        if use is None:
            break
        group = [k for k in range(n, use) if _PLAIN_LDG128.match(ins[k])]
        out.append((len(group), ins[use]))
        n = group[-1] + 1
    return out


def kv_loads_in_flight(sass: str) -> list[int]:
    """The attention loops' K/V loads (plain 16-byte loads first used by a bf16 unpack; the
    merge's float4 loads are first used by float ops, the copies' by shared stores): per group,
    in SASS order, how many are in flight together."""
    return [n for n, use in _plain_load_groups(sass) if _BF16_UNPACK.search(use)]


def copy_runs(sass: str) -> list[int]:
    """Copies into shared memory (copy_to_shared: plain float4 loads first read by STS.128):
    per copy, the loads issued before its first store (one round: the thread's whole share)."""
    return [n for n, use in _plain_load_groups(sass) if _opcode(use).startswith("STS")]


_WORD_LDG = re.compile(r"^(?:@!?P\d\s+)?LDG\.E\.CONSTANT (R\d+), ")


def _word_loads_first_read_by(sass: str, opcode: str) -> int:
    """32-bit read-only loads whose result is first read by an instruction ``opcode...``."""
    ins = _texts(sass)
    count = 0
    for k, text in enumerate(ins):
        m = _WORD_LDG.match(text)
        if m:
            use = _first_reader(ins, k, m.group(1))
            count += use is not None and _opcode(ins[use]).startswith(opcode)
    return count


def program_word_branches(sass: str) -> int:
    """32-bit read-only loads whose result is first read by a compare (ISETP) - v5's
    instruction fetch: load the opcode, compare it with NOOP, branch, then load the other
    words - i.e. a branch of the VM loop waiting on a word just loaded from memory."""
    return _word_loads_first_read_by(sass, "ISETP")


def ring_word_stores(sass: str) -> int:
    """32-bit read-only loads first read by a shared-memory store: the instruction words
    fetched ahead into the VM loop's ring (and the launch's first two instructions)."""
    return _word_loads_first_read_by(sass, "STS")


def system_fences(sass: str) -> int:
    """Fences at system scope (MEMBAR.*.SYS): v5's __threadfence_system at the step's end."""
    return sum(1 for t in _texts(sass) if re.match(r"(@!?P\d\s+)?MEMBAR\.\w+\.SYS", t))


def signal_fences(sass: str) -> list[list[str]]:
    """For every atomic add (REDG: signal_counter with MK_SYNC=2; ATOMG: the v1 signal and the
    tickets): the fences and L1 invalidations between the barrier before it and it, then the
    add itself."""
    ins = sass_instructions(sass)
    out = []
    for i, (_, text) in enumerate(ins):
        if re.match(r"(REDG|ATOMG)\.E\.ADD\b", text):
            j = i - 1
            while j >= 0 and not ins[j][1].startswith("BAR.SYNC"):
                j -= 1
            out.append([t.split()[0] for _, t in ins[j + 1:i]
                        if re.match(r"(MEMBAR|CCTL\.IVALL)", t)] + [text.split()[0]])
    return out


def poll_loop_loads(sass: str) -> list[int]:
    """Per wait loop (a backward branch around a NANOSLEEP, at most 64 instructions: not the VM
    loop around it): the strong global loads on its every-trip path, i.e. not inside a stretch
    of the loop that a forward branch skips."""
    ins = sass_instructions(sass)
    out = []
    for at, text in ins:
        m = re.match(r"@!?P\d BRA (0x[0-9a-f]+)$", text)
        if not m or int(m.group(1), 16) >= at:
            continue
        lo, hi = int(m.group(1), 16), at
        body = [(a, t) for a, t in ins if lo <= a <= hi]
        if len(body) > 64 or not any(t.startswith("NANOSLEEP") for _, t in body):
            continue
        skipped = set()
        for a, t in body:
            f = re.match(r"@!?P\d BRA (0x[0-9a-f]+)$", t)
            if f and a < int(f.group(1), 16) <= hi:
                skipped.update(x for x, _ in body if a < x < int(f.group(1), 16))
        out.append(sum(1 for a, t in body
                       if a not in skipped and t.startswith("LDG.E.STRONG.GPU")))
    return out


def matvec_issue_per_load(sass: str, loads_per_chunk: set[int]) -> float:
    """Issue slots per 16-byte weight load once the data is there: after each run of weight
    loads of a full chunk (a length in ``loads_per_chunk``), the FFMA, bf16 unpacks and
    shared-memory loads of x up to the next weight load, the warp sum's first shuffle or a
    barrier (the bounds branches of a short row's last loads lie inside: the warp issues
    what any lane runs), over the run's loads; the median over the runs."""
    ins = _texts(sass)
    ratios, n = [], 0
    while n < len(ins):
        if "LDG.E.128.CONSTANT" not in ins[n]:
            n += 1
            continue
        j = n
        while j < len(ins) and not re.search(r"\b(FFMA|FMUL|FADD)\b", ins[j]):
            j += 1
        loads = sum(1 for k in range(n, j) if "LDG.E.128.CONSTANT" in ins[k])
        k, work = j, 0
        while k < len(ins) and "LDG.E.128.CONSTANT" not in ins[k] \
                and not _opcode(ins[k]).startswith(("SHFL", "BAR")):
            op = _opcode(ins[k])
            work += op.startswith(("FFMA", "FMUL", "FADD", "LDS")) or bool(_BF16_UNPACK.search(ins[k]))
            k += 1
        if loads in loads_per_chunk:
            ratios.append(work / loads)
        n = max(k, n + 1)
    return round(median(ratios), 1) if ratios else 0.0


# ---- the facts -----------------------------------------------------------------------------------
def measure(shape: str, sass: str | None = None) -> dict:
    """Everything the cost model and tests/kernel/test_sass.py take from one shape's megakernel
    SASS."""
    from ..model.config import ModelConfig
    from .isa import NUM_THREADS, row_shape

    sass = compile_sass(shape) if sass is None else sass
    c = ModelConfig.from_name(shape)
    chunks = {K * R for L, K, R in (row_shape(n) for n in
                                    (c.hidden_size, c.intermediate_size, c.q_dim))}
    fences = signal_fences(sass)
    return {
        "matvec_loads_per_chunk": sorted((r for r in load_runs(sass) if r >= 8), reverse=True),
        "matvec_issue_per_load": matvec_issue_per_load(sass, chunks),
        "kv_loads_in_flight": kv_loads_in_flight(sass),
        "copy_loads_per_round": sorted(copy_runs(sass)),
        "copy_loads_per_thread": sorted(-(-n // 4 // NUM_THREADS) for n in
                                        (c.q_dim, c.intermediate_size)),
        "program_word_branches": program_word_branches(sass),
        "ring_word_stores": ring_word_stores(sass),
        "system_fences": system_fences(sass),
        "signal": sorted({" ".join(f) for f in fences if f[-1].startswith("REDG")}),
        "tickets": sorted({" ".join(f) for f in fences if f[-1].startswith("ATOMG")}),
        "poll_loads": sorted(set(poll_loop_loads(sass))),
    }


@lru_cache(maxsize=1)
def load() -> dict:
    """The checked-in facts: {shape: measure(shape)}."""
    return json.loads(FACTS_FILE.read_text())


def compiled_knobs() -> dict:
    """The cost-model knobs (costmodel.KernelDesign) the compiled kernel fixes, from the
    checked-in facts of every shape: the instruction fetch's dependent trips (2 where the VM
    loop branches on a word just loaded: the opcode, then the rest; 0 where the words come
    from the ring), the copies (one round where every copy loads the thread's whole share
    before its first store, else as a strided loop unrolled 4 times), the step end's system
    fence, and the mat-vec issue slots per load (the median over the shapes)."""
    facts = load()
    one_round = all(f["copy_loads_per_round"] == f["copy_loads_per_thread"]
                    for f in facts.values())
    return {
        "instruction_fetch_trips": 2 if any(f["program_word_branches"] for f in facts.values())
        else 0,
        "copy_unroll": 0 if one_round else 4,
        "step_end_sys_fence": any(f["system_fences"] for f in facts.values()),
        "matvec_issue_per_load": float(median(f["matvec_issue_per_load"]
                                              for f in facts.values())),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--check"]):
        print("usage: python -m monokernel.kernel.sass_facts [--check]", file=sys.stderr)
        return 2
    facts = {}
    for shape in SHAPES:
        print(f"compiling {shape} for sm_90 ...", file=sys.stderr, flush=True)
        facts[shape] = measure(shape)
    text = json.dumps(facts, indent=1, sort_keys=True) + "\n"
    if argv == ["--check"]:
        same = FACTS_FILE.exists() and FACTS_FILE.read_text() == text
        print("sass_facts.json is " + ("current" if same else "STALE: run without --check"))
        return 0 if same else 1
    tmp = FACTS_FILE.with_suffix(".json.tmp")
    tmp.write_text(text)
    tmp.replace(FACTS_FILE)
    print(f"wrote {FACTS_FILE.name}:\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
