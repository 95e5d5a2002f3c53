"""Memory parallelism in the sm_90 SASS (PERFORMANCE.md section 5: bytes in flight per SM).

By Little's law an SM needs ~27-45 KB of loads in flight to stream weights near the HBM rate;
v1 kept 2 16-byte loads per lane (8 KB per SM). Here megakernel.cu is compiled for sm_90, its
SASS is read with cuobjdump (the nvidia-cuda-cuobjdump wheel), and in the megakernel every
run of 16-byte read-only loads (LDG.E.128.CONSTANT: weights) issued before the first FMA that
could consume them is measured. Every mat-vec site must issue >= 8 per lane (>= 32 KB per SM at
256 threads); the v1 design (-DMK_DESIGN=1: one row per pass, 2 loads per row in flight, as v1's
warp_dot) is the negative control: below 8 everywhere (the compiler still overlaps a row's
second chunk and loads gate and up rows together: up to 6).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from monokernel.kernel import costmodel as cm
from monokernel.kernel.isa import KV_UNROLL, NUM_THREADS
from monokernel.kernel.executor import kernel_source
from monokernel.model.config import ModelConfig

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (CUDA toolkit needed)")
MAT_VEC_SITES = 5  # RMS_QKV_ROPE, O_PROJ_RESIDUAL, RMS_GATE_UP, DOWN_RESIDUAL, RMS_LM_HEAD


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
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    return found


def load_runs(sass: str) -> list[int]:
    """Lengths of the runs of 16-byte read-only global loads between floating-point ops."""
    runs, cur = [], 0
    for line in sass.splitlines():
        if re.search(r"\bLDG\.E\.128(\.CONSTANT)?\b", line):
            cur += 1
        elif re.search(r"\b(FFMA|FMUL|FADD)\b", line):
            if cur:
                runs.append(cur)
            cur = 0
    return runs


_SASS: dict[tuple, str] = {}


def megakernel_sass(tmp_path: Path, shape: str, *defines: str) -> str:
    """The megakernel's sm_90 SASS; compiled once per (shape, defines) in this module."""
    key = (shape, defines)
    if key not in _SASS:
        _SASS[key] = _compile_sass(tmp_path, shape, *defines)
    return _SASS[key]


def _compile_sass(tmp_path: Path, shape: str, *defines: str) -> str:
    src = tmp_path / f"{shape}.cu"
    src.write_text(kernel_source(ModelConfig.from_name(shape), 1024))
    cubin = tmp_path / f"{shape}.cubin"
    proc = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "-std=c++17", *defines, str(src), "-o",
                           str(cubin)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tool = cuobjdump()
    # cuobjdump runs nvdisasm, which the nvidia-cuda-nvdisasm wheel puts beside it
    env = dict(os.environ, PATH=str(Path(tool).parent) + os.pathsep + os.environ.get("PATH", ""))
    out = subprocess.run([tool, "-sass", "-fun", "megakernel", str(cubin)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("shape", ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"])
def test_every_mat_vec_keeps_8_loads_per_lane_in_flight(tmp_path, shape):
    runs = load_runs(megakernel_sass(tmp_path, shape))
    deep = [r for r in runs if r >= 8]
    kb = [r * 16 * NUM_THREADS / 1024 for r in deep]
    print(f"{shape}: runs of 16-byte loads {sorted(runs, reverse=True)}; "
          f"per SM {[f'{k:.0f} KB' for k in kb]}")
    assert len(deep) >= MAT_VEC_SITES, f"{shape}: runs {sorted(runs, reverse=True)}"
    assert min(kb) >= 32


def test_v1_design_is_the_negative_control(tmp_path):
    runs = load_runs(megakernel_sass(tmp_path, "smollm2-135m", "-DMK_DESIGN=1"))
    assert runs and max(runs) < 8, sorted(runs, reverse=True)


_SASS_INS = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;")
_PLAIN_LDG128 = re.compile(r"^(?:@!?P\d\s+)?LDG\.E\.128 (R\d+), ")
# the first use of a K/V load: a bf16 unpack of its words (bf_lo: << 16, bf_hi: & 0xffff0000)
_BF16_UNPACK = re.compile(r"\b(LOP3\.LUT .*0xffff0000|IMAD\.U32 .*0x10000|SHF\.L\.U32 .*0x10\b|PRMT)")


def kv_loads_in_flight(sass: str) -> list[int]:
    """The attention loops' K/V loads (plain 16-byte loads whose results are first used by a
    bf16 unpack; the mat-vecs' weight loads are LDG.E.128.CONSTANT, the merge's float4 loads are
    first used by float ops): per group, in SASS order, how many are issued before the first
    instruction that reads the first one's result, i.e. in flight together."""
    ins = [m.group(1) for m in map(_SASS_INS.match, sass.splitlines()) if m]
    out, n = [], 0
    while n < len(ins):
        m = _PLAIN_LDG128.match(ins[n])
        if not m or "CONSTANT" in ins[n]:
            n += 1
            continue
        reg = re.compile(rf"\b{m.group(1)}\b")
        use = next((k for k in range(n + 1, len(ins))
                    if reg.search(ins[k].split(" ", 1)[-1].split(",", 1)[-1])), None)
        if use is None:
            break
        group = [k for k in range(n, use)
                 if _PLAIN_LDG128.match(ins[k]) and "CONSTANT" not in ins[k]]
        if _BF16_UNPACK.search(ins[use]):
            out.append(len(group))
        n = group[-1] + 1
    return out


@pytest.mark.parametrize("shape", ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"])
def test_attention_loads_in_flight_are_the_cost_models(tmp_path, shape):
    """ATTENTION's K loop (attention_scores) and V loop (attention_values), in that order, keep
    what costmodel.V2 says in flight per lane: all KV_UNROLL loads of each (the K loop at
    head_dim 64 used to keep one: its predicated loads were issued one after the previous row's
    dot product). When this fails, the compiled loop changed: update the model (and
    benchmarks/NOTES.md) with it."""
    from monokernel.model.config import ModelConfig

    c = ModelConfig.from_name(shape)
    found = kv_loads_in_flight(megakernel_sass(tmp_path, shape))
    k_want = dict(cm.V2.attn_k_in_flight).get(c.head_dim, KV_UNROLL)
    print(f"{shape}: K/V loads in flight per lane {found} (model: K {k_want}, V {KV_UNROLL})")
    assert found == [k_want, KV_UNROLL], found


def test_attention_detector_sees_serialised_loads():
    """The detector on the old K loop's SASS shape (predicated loads, each issued after the
    previous row's dot product and store) counts one load per group."""
    old = "\n".join(f"        /*{a:04x}*/  {t} ;" for a, t in enumerate([
        "@!P2 LDG.E.128 R28, desc[UR8][R42.64]", "IMAD.U32 R47, R28, 0x10000, RZ",
        "FFMA R29, R45, R30, R28", "STS [R14], R63",
        "@!P2 LDG.E.128 R28, desc[UR8][R42.64+0x3000]", "LOP3.LUT R46, R28, 0xffff0000, RZ, 0xc0, !PT",
        "LDG.E.128 R32, desc[UR8][R30.64]", "LDG.E.128 R36, desc[UR8][R34.64]",
        "SHF.L.U32 R41, R32, 0x10, RZ", "LDG.E.128.CONSTANT R40, desc[UR8][R2.64]",
        "FFMA R1, R40, R1, R1"]))
    assert kv_loads_in_flight(old) == [1, 1, 2]


# ---- the hop (megakernel.cu's Synchronisation section, MK_SYNC) -------------------------------
_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    return [(int(m.group(1), 16), m.group(2)) for m in map(_ADDR.search, sass.splitlines()) if m]


def signal_fences(sass: str) -> list[list[str]]:
    """For every atomic add (REDG: signal_counter with MK_SYNC=2; ATOMG: the v1 signal and the
    LM-head ticket): the fences and L1 invalidations between the barrier before it and it, then
    the add itself."""
    ins = sass_instructions(sass)
    out = []
    for i, (_, text) in enumerate(ins):
        if re.match(r"(REDG|ATOMG)\.E\.ADD\b", text):
            j = i - 1
            while j >= 0 and not ins[j][1].startswith("BAR.SYNC"):
                j -= 1
            out.append([t.split()[0] for _, t in ins[j + 1:i] if re.match(r"(MEMBAR|CCTL\.IVALL)", t)]
                       + [text.split()[0]])
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
        out.append(sum(1 for a, t in body if a not in skipped and t.startswith("LDG.E.STRONG.GPU")))
    return out


def test_hop_signal_is_a_release_add_and_the_poll_one_load(tmp_path):
    """PERFORMANCE.md 5, 'cost of a hop': no MEMBAR.SC in the signal, one load per poll. The
    signal of MK_SYNC=2 is BAR.SYNC, MEMBAR.ALL.GPU (what red.release.gpu compiles to), REDG;
    the two tickets (ticket_add: attention's merge by ticket and the LM head's) are
    atom.acq_rel.gpu: MEMBAR.ALL.GPU, ATOMG, no SC fence either."""
    sass = megakernel_sass(tmp_path, "smollm2-135m")
    fences = signal_fences(sass)
    print("adds to counters, with their fences:", fences)
    reds = [f for f in fences if f[-1].startswith("REDG")]
    assert reds and all("MEMBAR.SC.GPU" not in f and "CCTL.IVALL" not in f for f in reds), fences
    assert all("MEMBAR.ALL.GPU" in f for f in reds), fences
    tickets = [f for f in fences if f[-1].startswith("ATOMG")]
    assert len(tickets) == 2 and all(f[0] == "MEMBAR.ALL.GPU" for f in tickets), fences
    assert not any("MEMBAR.SC.GPU" in f for f in fences), fences
    loads = poll_loop_loads(sass)
    assert loads and all(n == 1 for n in loads), loads


def test_hop_sync1_is_the_negative_control(tmp_path):
    sass = megakernel_sass(tmp_path, "smollm2-135m", "-DMK_SYNC=1")
    fences = signal_fences(sass)
    assert not any(f[-1].startswith("REDG") for f in fences), fences
    assert sum(1 for f in fences if "MEMBAR.SC.GPU" in f) >= 3, fences  # signal + 2 tickets
    loads = poll_loop_loads(sass)
    assert loads and all(n == 2 for n in loads), loads
