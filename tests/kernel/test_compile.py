"""megakernel.cu through nvcc (compile only, no GPU needed): every entry point of every known shape
builds for sm_80 and sm_90 without stack frame or spills, and the PTX reads nothing but weights
through the non-coherent path (ld.global.nc).

Why the PTX check matters (ARCHITECTURE section 4): data that other blocks write during the launch
(activations, KV cache, counters, state) read through ld.global.nc can be stale on a GPU while
every CPU test passes. The check traces, inside each kernel's PTX, which field of the Params
argument every ld.global.nc address is computed from, and requires it to be a `const` field
(weights, RoPE tables, the program).

The MK_PDL=1 build (programmatic dependent launch, backend cuda-multi-graph-pdl) is checked the
same way, plus: each thin kernel issues griddepcontrol.launch_dependents, then only reads that
no earlier launch writes, then griddepcontrol.wait (PTX and SASS); sm_80 and the plain build
have no griddepcontrol.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from monokernel.model.config import ModelConfig
from monokernel.kernel.isa import PARAMS, params_dtype
from monokernel.kernel.executor import KERNEL_NAMES, kernel_source

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (CUDA toolkit needed)")

SHAPES = ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b", "qwen2-tiny"]
ARCHS = ["sm_80", "sm_90"]
MAX_SEQ = 2048
CONST_FIELDS = {n for n, t, _ in PARAMS if t.startswith("const")}
POINTER_FIELDS = {n for n, t, _ in PARAMS if t.endswith("*")}


# ================================================================================================
# Reference functions: ptxas report and PTX data flow
# ================================================================================================
def nvcc(src: Path, out: Path, *args: str) -> str:
    proc = subprocess.run([NVCC, *args, str(src), "-o", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"nvcc {' '.join(args)} {src.name} failed:\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


def ptxas_properties(report: str) -> dict[str, tuple[int, int, int]]:
    """``-Xptxas -v`` output -> {function: (stack frame, spill store, spill load bytes)}."""
    out = {}
    for m in re.finditer(r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, "
                         r"(\d+) bytes spill stores, (\d+) bytes spill loads", report):
        out[m.group(1)] = (int(m.group(2)), int(m.group(3)), int(m.group(4)))
    return out


_INSTR = re.compile(r"^(?:@!?%p\d+\s+)?([a-z][\w.]*)\s*(.*?);\s*$")
_REG = re.compile(r"%[a-z]+\d+")


def _operands(text: str) -> list[str]:
    """Split operands at top-level commas ({...} vectors and [...] addresses stay whole)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def nc_load_sources(ptx: str) -> dict[str, list[tuple[str, set[str]]]]:
    """For each .entry: [(ld.global.nc instruction, Params fields its address derives from)].

    Flow-insensitive taint over the PTX virtual registers, to a fixed point:
      - ``mov.b64 %rd, <entry>_param_0`` and ``add`` of a constant make a register an address
        inside the Params argument; ``ld.param [that + k]`` (or ``[<entry>_param_0 + k]``) loads
        the field at byte offset k (offsets from isa.params_dtype(), the struct's C layout);
      - every other instruction that defines registers passes the union of its source registers'
        fields to them (cvta, add, mad, mul.wide, mov, selp ...);
      - values loaded from memory carry no field: an index read from the state words and added
        to a weight pointer does not make that read a state read.
    A pointer field's address reaches a load only through arithmetic on registers, so every field
    whose pointer feeds an ld.global.nc address is found (calls would hide it: none must exist).
    An address traced to no field at all is reported with an empty set."""
    dt = params_dtype()
    field_at = {dt.fields[n][1]: n for n in dt.names}
    result: dict[str, list[tuple[str, set[str]]]] = {}
    entries = re.split(r"^\.visible \.entry ", ptx, flags=re.MULTILINE)[1:]
    assert entries, "no .entry in the PTX"
    for body in entries:
        name = body[:body.index("(")]
        assert "call" not in re.findall(r"^\s*(call)\b", body, flags=re.MULTILINE), \
            f"{name}: the PTX has calls; this tracer does not follow them"
        param = f"{name}_param_0"
        instrs = []
        for line in body.splitlines():
            m = _INSTR.match(line.strip())
            if m:
                instrs.append((m.group(1), _operands(m.group(2)), line.strip()))
        taint: dict[str, set[str]] = {}
        paddr: dict[str, int] = {}

        def param_offset(addr: str) -> int | None:
            m = re.fullmatch(r"\[\s*([%\w]+)\s*(?:\+\s*(-?\d+))?\s*\]", addr)
            if not m:
                return None
            base, k = m.group(1), int(m.group(2) or 0)
            if base == param:
                return k
            return paddr[base] + k if base in paddr else None

        changed = True
        while changed:
            changed = False
            for op, ops, _ in instrs:
                if not ops or op.startswith(("st.", "bar", "bra", "ret", "membar", "fence",
                                             "nanosleep", "red.")):
                    continue
                dests = _REG.findall(ops[0])
                if op.startswith("mov") and len(ops) == 2 and ops[1] == param:
                    for d in dests:
                        if paddr.get(d) != 0:
                            paddr[d] = 0
                            changed = True
                    continue
                if op.startswith("add") and len(ops) == 3 and ops[1] in paddr \
                        and re.fullmatch(r"-?\d+", ops[2]):
                    for d in dests:
                        if paddr.get(d) != paddr[ops[1]] + int(ops[2]):
                            paddr[d] = paddr[ops[1]] + int(ops[2])
                            changed = True
                    continue
                if op.startswith("ld.param"):
                    k = param_offset(ops[1])
                    assert k is not None, f"{name}: cannot resolve the Params address of {ops}"
                    new = {field_at[k + 4 * j] for j in range(len(dests)) if k + 4 * j in field_at}
                elif op.startswith(("ld.", "atom.")):
                    new = set()
                else:
                    new = set().union(*(taint.get(r, set()) for o in ops[1:] for r in _REG.findall(o)))
                for d in dests:
                    if not new <= taint.get(d, set()):
                        taint[d] = taint.get(d, set()) | new
                        changed = True
        loads = []
        for op, ops, line in instrs:
            if op.startswith("ld.global.nc"):
                base = _REG.findall(ops[1])
                assert len(base) == 1, f"{name}: unexpected address in {line}"
                loads.append((line, set(taint.get(base[0], set())) & POINTER_FIELDS))
        result[name] = loads
    return result


def nc_violations(ptx: str) -> dict[str, set[str]]:
    """Per entry: the non-const fields (or '<untraced>') whose pointers feed an ld.global.nc."""
    out: dict[str, set[str]] = {}
    for name, loads in nc_load_sources(ptx).items():
        bad = set()
        for _, fields in loads:
            bad |= (fields - CONST_FIELDS) if fields else {"<untraced>"}
        if bad:
            out[name] = bad
    return out


# ================================================================================================
# Fixtures: each shape compiled once per module, in parallel
# ================================================================================================
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{shape: {"sm_80"|"sm_90": ptxas report, "ptx": PTX text (sm_90)}}."""
    root = tmp_path_factory.mktemp("nvcc")
    jobs = []
    for shape in SHAPES:
        src = root / f"{shape}.cu"
        src.write_text(kernel_source(ModelConfig.from_name(shape), MAX_SEQ))
        for arch in ARCHS:
            jobs.append((shape, arch, src, root / f"{shape}-{arch}.cubin",
                         ("-cubin", f"-arch={arch}", "-Xptxas", "-v")))
        jobs.append((shape, "ptx", src, root / f"{shape}.ptx", ("-ptx", "-arch=sm_90")))
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = list(pool.map(lambda j: nvcc(j[2], j[3], *j[4]), jobs))
    out: dict[str, dict[str, str]] = {s: {} for s in SHAPES}
    for (shape, kind, _, path, _), report in zip(jobs, reports):
        out[shape][kind] = path.read_text() if kind == "ptx" else report
    return out


# ================================================================================================
# Tests
# ================================================================================================
# slow: the `built` fixture runs nvcc on every shape for two archs and the PTX (70 s on 2
# cores); make test-fast leaves these out
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_no_stack_frame_and_no_spills(built, shape, arch):
    props = ptxas_properties(built[shape][arch])
    assert set(KERNEL_NAMES) <= set(props), f"ptxas reported no properties for " \
        f"{sorted(set(KERNEL_NAMES) - set(props))}"
    bad = {f: p for f, p in props.items() if p != (0, 0, 0)}
    assert not bad, f"{shape} {arch}: (stack frame, spill stores, spill loads) bytes: {bad}"


@pytest.mark.slow  # the `built` fixture (above)
@pytest.mark.parametrize("shape", SHAPES)
def test_only_weights_are_read_through_the_non_coherent_path(built, shape):
    ptx = built[shape]["ptx"]
    sources = nc_load_sources(ptx)
    assert set(sources) == set(KERNEL_NAMES)
    assert not nc_violations(ptx), nc_violations(ptx)
    # the tracer sees the weight reads it should: mat-vec weights, the program words, embeddings
    seen = set().union(*(f for loads in sources.values() for _, f in loads))
    assert {"program", "wqkv", "wo", "wg", "wu", "wd", "embed", "lm_head", "in_norm",
            "rope_cos"} <= seen, seen


# Mutants of the source that read data written during the launch through the read-only path:
# the check must flag exactly the mutated buffer. (Negative controls for the tracer.)
MUTANTS = {
    "ffn_h": ("copy_to_shared<MK_FFN>(s.vec, P.ffn_h + (size_t)tok * MK_FFN);",
              "for (int i = threadIdx.x; i < MK_FFN; i += MK_THREADS) "
              "s.vec[i] = __ldg(P.ffn_h + (size_t)tok * MK_FFN + i);"),
    "k_cache": ("  return *reinterpret_cast<const uint4*>(p);  // the KV cache: plain loads",
                "  return __ldg(reinterpret_cast<const uint4*>(p));  // the KV cache: plain loads"),
    "state": ("if (threadIdx.x < MK_STATE_WORDS) st[threadIdx.x] = P.state[threadIdx.x];",
              "if (threadIdx.x < MK_STATE_WORDS) st[threadIdx.x] = __ldg(P.state + threadIdx.x);"),
}


def test_the_check_flags_an_activation_read_through_ldg(tmp_path):
    text = kernel_source(ModelConfig.from_name("qwen2-tiny"), 64)
    jobs = []
    for field, (old, new) in MUTANTS.items():
        assert text.count(old) == 1, f"mutant {field}: the source line changed: {old}"
        src = tmp_path / f"{field}.cu"
        src.write_text(text.replace(old, new))
        jobs.append((field, src))
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda j: nvcc(j[1], j[1].with_suffix(".ptx"), "-ptx", "-arch=sm_90"), jobs))
    for field, src in jobs:
        bad = nc_violations(src.with_suffix(".ptx").read_text())
        assert bad, f"mutant {field}: not flagged"
        # load_kv reads K and V rows alike: its mutant reads both caches non-coherently
        want = {"k_cache", "v_cache"} if field == "k_cache" else {field}
        assert set().union(*bad.values()) == want, bad


def test_the_check_flags_the_partials_read_through_ldg(tmp_path):
    """The sliced ops' sum reads partials other blocks wrote (megakernel.cu slice_mma): a
    mutant that reads them with __ldg must be flagged, and only them (the negative control of
    test_steps_of_many_tokens_compile_without_spills's check on the sliced kernel)."""
    text = kernel_source(ModelConfig.from_name("llama3-tiny"), 64, 8, 2, 4, mma=True,
                         slices=(2, 2))
    old = "    float v = p[0];"
    assert text.count(old) == 1, "slice_mma's first partial load changed"
    src = tmp_path / "partials.cu"
    src.write_text(text.replace(old, "    float v = __ldg(p);"))
    nvcc(src, src.with_suffix(".ptx"), "-ptx", "-arch=sm_90")
    bad = nc_violations(src.with_suffix(".ptx").read_text())
    assert set().union(*bad.values()) == {"partials"}, bad


def test_object_file_builds(tmp_path):
    """`nvcc -c` compiles the host pass too: the emulator-only branches must stay out of it."""
    src = tmp_path / "qwen2-tiny.cu"
    src.write_text(kernel_source(ModelConfig.from_name("qwen2-tiny"), 64))
    nvcc(src, tmp_path / "qwen2-tiny.o", "-c", "-arch=sm_90")


# ================================================================================================
# Programmatic dependent launch (MK_PDL=1, backend cuda-multi-graph-pdl)
# ================================================================================================
OP_KERNELS = [n for n in KERNEL_NAMES if n.startswith("op_")]


def ptx_entries(ptx: str) -> dict[str, str]:
    return {body[:body.index("(")]: body
            for body in re.split(r"^\.visible \.entry ", ptx, flags=re.MULTILINE)[1:]}


@pytest.fixture(scope="module")
def built_pdl(tmp_path_factory):
    """SmolLM2 with -DMK_PDL=1: sm_90 cubin (ptxas report), sm_90 PTX, sm_80 PTX."""
    root = tmp_path_factory.mktemp("nvcc-pdl")
    src = root / "smollm2-135m.cu"
    src.write_text(kernel_source(ModelConfig.from_name("smollm2-135m"), MAX_SEQ))
    jobs = [("sm_90", root / "pdl-sm_90.cubin", ("-cubin", "-arch=sm_90", "-Xptxas", "-v")),
            ("ptx", root / "pdl-sm_90.ptx", ("-ptx", "-arch=sm_90")),
            ("ptx_sm_80", root / "pdl-sm_80.ptx", ("-ptx", "-arch=sm_80"))]
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = list(pool.map(lambda j: nvcc(src, j[1], *j[2], "-DMK_PDL=1"), jobs))
    out = {kind: (path.read_text() if kind.startswith("ptx") else report)
           for (kind, path, _), report in zip(jobs, reports)}
    out["cubin"] = str(root / "pdl-sm_90.cubin")
    return out


def test_pdl_thin_kernels_launch_dependents_then_wait(built_pdl):
    """Each thin kernel: launch_dependents, then griddepcontrol.wait, with nothing before the
    wait that reads what an earlier launch wrote: only the program words and weights (the
    non-coherent path, which the tracer below confines to const fields) and one plain load,
    the host-written program length. The megakernel has no griddepcontrol."""
    entries = ptx_entries(built_pdl["ptx"])
    assert "griddepcontrol" not in entries["megakernel"]
    for name in OP_KERNELS:
        body = entries[name]
        assert body.count("griddepcontrol.launch_dependents;") == 1, name
        assert body.count("griddepcontrol.wait;") == 1, name
        before = body[:body.index("griddepcontrol.wait;")]
        assert "griddepcontrol.launch_dependents;" in before, name
        loads = re.findall(r"^\s*(?:@!?%p\d+\s+)?(ld\.global[\w.]*)", before, flags=re.MULTILINE)
        plain = [ld for ld in loads if not ld.startswith("ld.global.nc")]
        assert len(plain) == 1, f"{name}: plain global loads before griddepcontrol.wait: {plain}"
        assert not re.search(r"^\s*(?:@!?%p\d+\s+)?(st|atom|red)\.global", before,
                             flags=re.MULTILINE), f"{name}: a global write before the wait"
    # the weight ops prefetch their rows into L2 before the wait: that is the overlap PDL buys
    for name in ("op_RMS_QKV_ROPE", "op_O_PROJ_RESIDUAL", "op_RMS_GATE_UP", "op_DOWN_RESIDUAL",
                 "op_RMS_LM_HEAD"):
        before = entries[name][:entries[name].index("griddepcontrol.wait;")]
        assert "prefetch.global.L2" in before, name
    assert not nc_violations(built_pdl["ptx"]), nc_violations(built_pdl["ptx"])


def test_pdl_build_has_no_spills_and_sm_80_and_plain_builds_have_no_griddepcontrol(built_pdl,
                                                                                   built):
    props = ptxas_properties(built_pdl["sm_90"])
    assert set(KERNEL_NAMES) <= set(props)
    bad = {f: p for f, p in props.items() if p != (0, 0, 0)}
    assert not bad, f"MK_PDL=1 sm_90: (stack frame, spill stores, spill loads) bytes: {bad}"
    assert "griddepcontrol" not in built_pdl["ptx_sm_80"]  # the guard: PDL is sm_90+ only
    assert "griddepcontrol" not in built["smollm2-135m"]["ptx"]  # no MK_PDL: unchanged


def test_pdl_sass_has_the_grid_dependency_instructions(built_pdl):
    """In the SASS (cuobjdump, as tests/kernel/test_sass.py): launch_dependents is PREEXIT and
    griddepcontrol.wait is ACQBULK, once in each thin kernel, in that order."""
    from monokernel.kernel.sass_facts import SassToolMissing, cuobjdump

    try:
        tool = cuobjdump()
    except SassToolMissing as e:
        pytest.skip(str(e))
    env = dict(os.environ, PATH=str(Path(tool).parent) + os.pathsep + os.environ.get("PATH", ""))
    out = subprocess.run([tool, "-sass", built_pdl["cubin"]], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    funcs = dict(re.findall(r"Function : (\w+)\n(.*?)(?=\n\s*Function : |\Z)", out.stdout,
                            flags=re.DOTALL))
    assert set(KERNEL_NAMES) <= set(funcs), sorted(funcs)
    assert not re.search(r"\b(PREEXIT|ACQBULK)\b", funcs["megakernel"])
    for name in OP_KERNELS:
        sass = funcs[name]
        assert len(re.findall(r"\bPREEXIT\b", sass)) == 1, name
        assert len(re.findall(r"\bACQBULK\b", sass)) == 1, name
        assert sass.index("PREEXIT") < sass.index("ACQBULK"), name


# Every (O_PROJ, DOWN) input-slices pair the executor's default tensor-core program picks
# (group_picks.tensor_core_slices on 132 SMs, an H100's or an H200's, at 64, 128 and 256 tokens
# a step): each is compiled below, so a pick cannot choose a kernel that spills (Qwen3's 8 / 8
# did, NOTES "Qwen3's kernel of 64-token steps spilled 4 bytes");
# test_every_picked_slices_pair_is_compiled keeps the list whole.
PICKED_SLICES = [("smollm2-135m", (1, 8)), ("smollm2-135m", (1, 4)), ("qwen3-0.6b", (8, 8)),
                 ("qwen3-0.6b", (4, 8)), ("qwen3-0.6b", (4, 4)), ("llama-3.2-1b", (4, 8)),
                 ("llama-3.2-1b", (2, 4))]


@pytest.mark.slow  # the cost model's picks of nine programs (~20 s on 2 cores)
def test_every_picked_slices_pair_is_compiled():
    from monokernel.kernel.group_picks import tensor_core_slices

    picked = {(shape, tensor_core_slices(ModelConfig.from_name(shape), 132, MAX_SEQ, tokens))
              for shape in ("smollm2-135m", "qwen3-0.6b", "llama-3.2-1b")
              for tokens in (64, 128, 256)}
    assert picked <= set(PICKED_SLICES), f"add to PICKED_SLICES: {picked - set(PICKED_SLICES)}"


@pytest.mark.slow  # nvcc of eleven kernels for sm_90 (~20 s each on an idle 2-core CPU)
@pytest.mark.parametrize("shape,tokens,slots,mma,slices", [
    ("qwen3-0.6b", 256, 0, False, (1, 1)), ("llama-3.2-1b", 16, 0, False, (1, 1)),
    ("qwen3-0.6b", 256, 128, True, (1, 1)), ("llama-3.2-1b", 256, 128, False, (1, 1))]
    + [(shape, 256, 128, True, slices) for shape, slices in PICKED_SLICES])
def test_steps_of_many_tokens_compile_without_spills(tmp_path, shape, tokens, slots, mma,
                                                     slices):
    """A kernel built for prompt chunks (MK_T_MAX > 1: token loops in every op; late q/k keeps
    the chunk's keys in dynamic shared memory, 64 KB at Qwen3's head_dim and the most tokens,
    256: schedule.MAX_STEP_TOKENS), or for steps of many sequences (``slots``: the token table
    copied into shared memory, K/V through block tables; Llama's at the most tokens and 128
    slots, with its FFN h in shared memory: 47.2 KB of static shared memory, the nearest to the
    48 KB budget), or with its mat-muls on tensor cores (``mma``: their DOWN reads h from global
    memory, so no h in shared memory), fits the static budget and keeps no stack and no
    spills; so does every shape's kernel with the input slices its picks choose
    (PICKED_SLICES: slice_mma in place of O_PROJ's and DOWN's unsliced mat-mul), whose PTX
    reads the partials (written by other blocks) through no read-only load. The tensor-core
    kernel's SASS has the mma (HMMA.16816.F32.BF16) and reads its weights 16 bytes a load
    through the read-only path."""
    src = tmp_path / f"{shape}-t{tokens}-s{slots}.cu"
    src.write_text(kernel_source(ModelConfig.from_name(shape), MAX_SEQ, tokens, slots,
                                 16 if slots else 0, mma=mma, slices=slices))
    cubin = tmp_path / "k.cubin"
    props = ptxas_properties(nvcc(src, cubin, "-cubin", "-arch=sm_90", "-Xptxas", "-v"))
    assert set(KERNEL_NAMES) <= set(props)
    bad = {f: p for f, p in props.items() if p != (0, 0, 0)}
    assert not bad, (f"{shape} T_MAX={tokens} slots={slots}: (stack frame, spill stores, spill "
                     f"loads): {bad}")
    if slices != (1, 1):  # the partials another block wrote: never through the read-only path
        ptx = tmp_path / "k.ptx"
        nvcc(src, ptx, "-ptx", "-arch=sm_90")
        assert not nc_violations(ptx.read_text()), nc_violations(ptx.read_text())
    if mma:
        from monokernel.kernel.sass_facts import SassToolMissing, cuobjdump

        try:
            tool = cuobjdump()
        except SassToolMissing as e:
            pytest.skip(str(e))
        env = dict(os.environ,
                   PATH=str(Path(tool).parent) + os.pathsep + os.environ.get("PATH", ""))
        out = subprocess.run([tool, "-sass", "-fun", "megakernel", str(cubin)],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "HMMA.16816.F32.BF16" in out.stdout
        assert "LDG.E.128.CONSTANT" in out.stdout
