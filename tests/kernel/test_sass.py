"""Memory parallelism in the sm_90 SASS (PERFORMANCE.md section 5: bytes in flight per SM).

By Little's law an SM needs ~27-45 KB of loads in flight to stream weights near the HBM rate;
v1 kept 2 16-byte loads per lane (8 KB per SM). Here megakernel.cu is compiled for sm_90, its
SASS is read with cuobjdump (the nvidia-cuda-cuobjdump wheel), and in the megakernel every
run of 16-byte read-only loads (LDG.E.128.CONSTANT: weights) issued before the first FMA that
could consume them is measured. Every mat-vec site must issue >= 8 per lane (>= 32 KB per SM at
256 threads); the detector's negative control is a synthetic run of 2 (v1's warp_dot, retired:
benchmarks/NOTES.md).
"""

from __future__ import annotations

import shutil

import pytest

from monokernel.kernel import costmodel as cm
from monokernel.kernel import sass_facts as sf
from monokernel.kernel.isa import KV_UNROLL, NUM_THREADS, row_shape
from monokernel.kernel.sass_facts import (SassToolMissing, kv_loads_in_flight, load_runs,
                                          poll_loop_loads, signal_fences)
from monokernel.model.config import ModelConfig

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (CUDA toolkit needed)")
MAT_VEC_SITES = 5  # RMS_QKV_ROPE, O_PROJ_RESIDUAL, RMS_GATE_UP, DOWN_RESIDUAL, RMS_LM_HEAD
SHAPES = list(sf.SHAPES)

_SASS: dict[tuple, str] = {}


def megakernel_sass(tmp_path, shape: str, *defines: str) -> str:
    """The megakernel's sm_90 SASS; compiled once per (shape, defines) in this module."""
    key = (shape, defines)
    if key not in _SASS:
        try:
            _SASS[key] = sf.compile_sass(shape, *defines)
        except SassToolMissing as e:
            pytest.skip(str(e))
    return _SASS[key]


@pytest.mark.parametrize("shape", ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"])
def test_every_mat_vec_keeps_8_loads_per_lane_in_flight(tmp_path, shape):
    runs = load_runs(megakernel_sass(tmp_path, shape))
    deep = [r for r in runs if r >= 8]
    kb = [r * 16 * NUM_THREADS / 1024 for r in deep]
    print(f"{shape}: runs of 16-byte loads {sorted(runs, reverse=True)}; "
          f"per SM {[f'{k:.0f} KB' for k in kb]}")
    assert len(deep) >= MAT_VEC_SITES, f"{shape}: runs {sorted(runs, reverse=True)}"
    assert min(kb) >= 32


def test_load_run_detector_sees_a_shallow_run():
    """The negative control: two 16-byte weight loads, then the FMA that consumes the first
    (v1's warp_dot kept this many in flight), is a run of 2, not 8."""
    sass = _snippet(["LDG.E.128.CONSTANT R40, desc[UR8][R2.64]",
                     "LDG.E.128.CONSTANT R44, desc[UR8][R2.64+0x200]",
                     "FFMA R1, R40, R1, R1", "FFMA R1, R44, R1, R1"])
    assert load_runs(sass) == [2]


@pytest.mark.parametrize("shape", ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"])
def test_attention_loads_in_flight_are_the_cost_models(tmp_path, shape):
    """ATTENTION's K loop (attention_scores) and V loop (attention_values), in that order, keep
    what costmodel.V6 says in flight per lane: all KV_UNROLL loads of each (the K loop at
    head_dim 64 used to keep one: its predicated loads were issued one after the previous row's
    dot product). When this fails, the compiled loop changed: update the model (and
    benchmarks/NOTES.md) with it."""
    c = ModelConfig.from_name(shape)
    found = kv_loads_in_flight(megakernel_sass(tmp_path, shape))
    k_want = dict(cm.V6.attn_k_in_flight).get(c.head_dim, KV_UNROLL)
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


# ---- the knobs the cost model reads off the SASS (kernel/sass_facts.py) -----------------------
def _snippet(lines: list[str]) -> str:
    return "\n".join(f"        /*{16 * a:04x}*/  {t} ;" for a, t in enumerate(lines))


@pytest.mark.parametrize("shape", SHAPES)
def test_the_checked_in_sass_facts_are_the_kernels(tmp_path, shape):
    """costmodel.design_for takes the kernel's knobs from kernel/sass_facts.json: it must be
    what the kernel compiles to now. When this fails, regenerate it (python -m
    monokernel.kernel.sass_facts), then read what changed in `plan --predict` and NOTES.md."""
    found = sf.measure(shape, megakernel_sass(tmp_path, shape))
    assert found == sf.load()[shape], {k: (found[k], sf.load()[shape].get(k)) for k in found
                                       if found[k] != sf.load()[shape].get(k)}


@pytest.mark.parametrize("shape", SHAPES)
def test_no_program_word_load_on_an_instructions_path(tmp_path, shape):
    """Issue 15 section 4 / PERFORMANCE.md proxy 'dependent program-word loads between a wait's
    end and the op's first request': 0. The VM loop never branches on a word just loaded from
    the program (v5 loaded the opcode, compared it with NOOP and branched, then loaded the other
    11 words); the words reach it through the shared-memory ring, whose loads are first read
    by their stores into it (the launch's first two instructions and the one after next)."""
    sass = megakernel_sass(tmp_path, shape)
    assert sf.program_word_branches(sass) == 0
    assert sf.ring_word_stores(sass) >= 2
    assert cm.V6.instruction_fetch_trips == 0 == sf.compiled_knobs()["instruction_fetch_trips"]


def test_program_word_detector_sees_v5s_fetch():
    """Negative control: v5's fetch as compiled (commit 4b0e6fe, SmolLM2)."""
    v5 = _snippet(["LDG.E.CONSTANT R30, desc[UR8][R28.64]", "BSSY B2, 0x1ab50",
                   "ISETP.NE.AND P0, PT, R30, RZ, PT", "@!P0 BRA 0x1ab40",
                   "LDG.E.CONSTANT R110, desc[UR8][R28.64+0x8]",
                   "LDG.E.CONSTANT R89, desc[UR8][R28.64+0xc]",
                   "ISETP.GT.AND P0, PT, R89, R110, PT", "@!P0 BRA 0x2e90",
                   "LDG.E.CONSTANT R90, desc[UR8][R30.64]", "FMUL R1, R90, R2"])
    # the opcode (the NOOP branch) and the tile's bounds (the prefetch's branch)
    assert sf.program_word_branches(v5) == 3 and sf.ring_word_stores(v5) == 0


@pytest.mark.parametrize("shape", SHAPES)
def test_copies_into_shared_memory_are_one_round(tmp_path, shape):
    """DOWN's ffn_h and O_PROJ's merged attention (copy_to_shared): each thread issues every
    float4 load of its share before its first store (v5's strided loops: 3 dependent rounds for
    SmolLM2's ffn_h, 8 for Llama's, 2 for the merged read)."""
    c = ModelConfig.from_name(shape)
    per_thread = sorted(-(-n // 4 // NUM_THREADS) for n in (c.q_dim, c.intermediate_size))
    assert sf.copy_runs(megakernel_sass(tmp_path, shape)) == per_thread
    assert cm.V6.copy_unroll == 0


def test_copy_detector_sees_a_strided_copy():
    """Negative control: a copy that stores each load before issuing the next."""
    strided = _snippet(["LDG.E.128 R28, desc[UR8][R22.64]", "STS.128 [R0], R28",
                        "LDG.E.128 R28, desc[UR8][R22.64+0x1000]", "STS.128 [R0+0x1000], R28"])
    assert sf.copy_runs(strided) == [1, 1]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_lm_heads_reducer_loads_a_lanes_partials_in_one_round(tmp_path, shape):
    """warp_best_of (the LM head's last drawer, every step): a lane's isa.BEST_LOADS (8)
    partials loaded before its first compare, so 132 blocks' partials take one L2 round a row
    (the loop as it was compiled to a load and its compare's branches per partial: 5
    rounds)."""
    from monokernel.kernel.isa import BEST_LOADS

    assert BEST_LOADS * 32 >= 132
    runs = sf.pair_load_runs(megakernel_sass(tmp_path, shape))
    assert max(runs, default=0) >= BEST_LOADS, sorted(runs, reverse=True)


def test_pair_load_run_detector_sees_a_load_beside_its_compare():
    """The negative control: the reducer as it was (a partial's 8-byte load, then its compare
    and branch) is runs of one, not 8."""
    sass = _snippet(["LDG.E.64 R18, desc[UR6][R10.64]", "FSETP.GEU.AND P0, PT, R9, R18, PT",
                     "@!P0 BRA 0x370", "LDG.E.64 R18, desc[UR6][R10.64+0x100]",
                     "LDG.E.64 R20, desc[UR6][R10.64+0x200]",
                     "FSETP.GEU.AND P0, PT, R9, R18, PT"])
    assert sf.pair_load_runs(sass) == [1, 2]


@pytest.mark.parametrize("shape", SHAPES)
def test_step_end_has_no_system_fence_and_matvecs_are_row_shape(tmp_path, shape):
    """No MEMBAR.*.SYS (v5 ended every step with __threadfence_system after the token's store);
    the mat-vecs' loads per chunk are isa.row_shape's (R rows x K loads), and the issue slots
    per load the cost model charges are the SASS's."""
    sass = megakernel_sass(tmp_path, shape)
    assert sf.system_fences(sass) == 0
    c = ModelConfig.from_name(shape)
    chunks = {K * R for L, K, R in (row_shape(n) for n in
                                    (c.hidden_size, c.intermediate_size, c.q_dim))}
    runs = load_runs(sass)
    assert chunks <= set(runs), (chunks, sorted(runs, reverse=True))
    per_load = sf.matvec_issue_per_load(sass, chunks)
    assert 15 <= per_load <= 20, per_load  # 8 FFMA + ~8 bf16 unpacks + x's LDS per 16 bytes
    assert abs(cm.V6.matvec_issue_per_load - per_load) <= 1.0


# the facts a kernel built for prompt chunks must keep from the one-token build: its decode
# step (one token) then compiles to the same memory parallelism, hops and tickets
KEPT_WITH_CHUNKS = ("copy_loads_per_round", "kv_loads_in_flight", "program_word_branches",
                    "system_fences", "signal", "tickets", "poll_loads")


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "llama-3.2-1b"])
def test_a_kernel_of_prompt_chunks_keeps_the_decode_facts(shape):
    """MK_T_MAX = 16 (backend option step_tokens=16) loops every op over the chunk's tokens; a
    decode step is a chunk of one. Its SASS must keep what the cost model reads of the
    one-token build: every mat-vec >= 8 loads per lane in flight, the same K/V loads in
    flight, copies, hops, tickets and polls (measured 2026-12-02: identical but Llama's
    largest mat-vec chunk, 13 loads per lane instead of 14)."""
    try:
        chunked = sf.measure(shape, sf.compile_sass(shape, tokens=16))
    except SassToolMissing as e:
        pytest.skip(str(e))
    one = sf.load()[shape]
    assert min(chunked["matvec_loads_per_chunk"]) >= 8, chunked["matvec_loads_per_chunk"]
    assert {k: chunked[k] for k in KEPT_WITH_CHUNKS} == {k: one[k] for k in KEPT_WITH_CHUNKS}


@pytest.mark.parametrize("shape", ["smollm2-135m", "qwen3-0.6b"])
def test_the_tensor_core_kernels_segment_staging_is_one_round_of_copies(shape):
    """The tensor-core kernel stages a unit's K and V tiles (megakernel.cu segment_stage, in
    each of attention_segment's two modes) by cp.async alone (LDGSTS: no registers, no
    transposition): segment_tile x HEAD_DIM / 8 / threads 16-byte copies a thread of K and as
    many of V, one round a tile, as v6-mma-seg's _segment_tile charges (attn_stage_async); V's B
    fragments come back by ldmatrix .trans (LDSM.16.MT88), and no plain 16-byte load is staged
    through registers into shared memory any more (V^T's 2-byte stores put a row's chunks on
    one bank: benchmarks/NOTES.md). Qwen3 (late q/k, head_dim 128) included."""
    import re

    from monokernel.kernel.header import segment_tile

    try:
        sass = sf.compile_sass(shape, function="op_ATTENTION", tokens=16, slots=4, mma=True)
    except SassToolMissing as e:
        pytest.skip(str(e))
    cfg = ModelConfig.from_name(shape)
    per = segment_tile(cfg) * cfg.head_dim // 8 // NUM_THREADS
    texts = sf._texts(sass)
    copies = [t for t in texts if re.search(r"\bLDGSTS\.E\.BYPASS\.128\b", t)]
    staged = [n for n, use in sf._plain_load_groups(sass)
              if sf._opcode(use).startswith(("SEL", "STS", "SHF", "PRMT"))]
    print(f"cp.async copies: {len(copies)}; plain 16-byte loads into shared memory: {staged}")
    # K and V, in the split mode's and the m-tiles' staging, each site one round a tile: without
    # late q/k each mode stages its first tile before its query tile (attn_stage_first); with
    # the attention pipeline (MK_ATTN_PIPE: both shapes) a tile's successor (the unit's
    # next tile, or the next unit's first) is copied under it into the other buffer: that site
    # stages the later tiles in place of the loop's; late q/k stages a unit's first tile in
    # the loop (after its query tile) when the unit before did not copy it: two sites either way
    sites = 2
    assert len(copies) == 2 * 2 * per * sites
    assert staged == []
    assert any(re.search(r"\bLDSM\.16\.MT88\.2\b", t) for t in texts)
    assert cm.design("v6-mma-seg").attn_segments and cm.design("v6-mma-seg").attn_stage_async


def copies_waited_beside_loads(texts: list[str]) -> int:
    """How many of the SASS's cp.async waits (LDGDEPBAR) have a query's or key's load between
    them and the copies (LDGSTS) before them: loads issued while the copies are in flight. The
    copies' own loop reads the slot's page table with plain 32-bit loads (LDG.E, kv_row); a
    query tile's are 8-byte (LDG.E.64), a key's norm weights and RoPE rows read-only
    (LDG.E...CONSTANT)."""
    n, copying, beside = 0, False, False
    for t in texts:
        op = sf._opcode(t)
        kind = op.split(".")[0]
        if kind == "LDGSTS":
            copying = True
        elif kind == "LDGDEPBAR":
            n += copying and beside
            copying = beside = False
        elif copying and kind == "LDG" and op != "LDG.E":
            beside = True
    return n


@pytest.mark.parametrize("shape", ["smollm2-135m", "qwen3-0.6b"])
def test_a_segment_pass_builds_its_queries_under_its_first_tiles_copies(shape):
    """attn_stage_first (built): each of segment_pass's two modes issues its first tile's K/V
    copies (LDGSTS) before it loads its queries (late q/k, Qwen3: before its keys' loads), and
    waits for the copies (LDGDEPBAR) after them, so that trip runs under the tile's round.
    Before it (commit 43d4f5f), only the copies' page-table reads lay between a copy and its
    wait, in both shapes: 0 here. The detector's negative controls: the copies waited at once,
    and a page-table read between."""
    try:
        sass = sf.compile_sass(shape, function="op_ATTENTION", tokens=16, slots=4, mma=True)
    except SassToolMissing as e:
        pytest.skip(str(e))
    texts = sf._texts(sass)
    assert copies_waited_beside_loads(texts) >= 2  # the split mode's pass and the m-tiles'
    assert cm.design("v6-mma-seg").attn_stage_first
    copy, wait = "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]", "LDGDEPBAR"
    query, table = "LDG.E.64 R4, desc[UR4][R6.64]", "LDG.E R5, desc[UR4][R8.64]"
    assert copies_waited_beside_loads([copy, wait, query, copy, table, wait]) == 0
    assert copies_waited_beside_loads([copy, table, query, wait]) == 1


@pytest.mark.parametrize("tokens", [32, 64])
@pytest.mark.parametrize("op,rms", [("O_PROJ_RESIDUAL", False), ("DOWN_RESIDUAL", False),
                                    ("RMS_GATE_UP", True)])
def test_the_tensor_core_mat_muls_read_their_stored_input_as_bf16(op, rms, tokens):
    """v6-mma's stored_bf16_inputs and input_bytes 2, mma_token_tiles and the row split, read
    off the SASS: the k split's pass loads MMA_UNROLL (2) chunks' weight fragments, MMA_RG (2)
    row groups x 2 halves of 16 rows, with 16-byte read-only loads, once, and multiplies them
    by MMA_NT (4) token tiles: 2 x 4 x 2 x 2 HMMA for 8 weight loads (one load per HMMA would
    be the weights re-read per token tile, as before 2026-12-04). A kernel of steps of more
    than 32 rows also has block_mma_rows (K <= 2048: SmolLM2's four mat-muls): 2 chunks x 2
    halves of one row group for 2 x 8 x 2 HMMA (8 token tiles), copied by cp.async into the
    lane's ring (LDGSTS.E.BYPASS.128: isa.MMA_RING rounds of 4, MMA_RING - 1 in the
    prologue and one a round, each a group, LDGDEPBAR; the round waits for all but the newest
    MMA_RING - 1, DEPBAR.LE SB0 MMA_RING - 1) and read back as 4 LDS.128; there (head_dim 64:
    header.k_split_ring) the k split copies its weights into the same ring too, a chunk a
    round (MMA_RG x 2 halves: 4 copies, 4 LDS.128, 2 x 4 x 2 HMMA) and no read-only weight
    load is left. Every input is bf16
    (isa.BF16_INPUTS: O_PROJ's and DOWN's as their producers store them, an RMS op's the
    residual's copy residual_in): one 16-byte load per chunk and token tile (the fp32
    residual took two); an RMS op (GATE_UP) reads its norm weights beside them (read-only
    too), and its staged share (mma_rms) is one 16-byte shared-memory load per chunk and
    token tile, normed once by a loop of one 16-byte load of residual_in and one of norm
    weights. Counted over the op's kernel (op_<OP>): the plain LDG.E.128 are the k-loop's
    input loads and the staging's."""
    import re

    try:
        sass = sf.compile_sass("smollm2-135m", function=f"op_{op}", tokens=tokens, slots=64,
                               mma=True)
    except SassToolMissing as e:
        pytest.skip(str(e))
    from monokernel.kernel.isa import MMA_RING

    ops = [m.group(0) for t in sf._texts(sass)
           for m in [re.search(r"\b(LDG|HMMA|LDS|DEPBAR)\S*( SB0, 0x\d+)?", t)] if m]
    from monokernel.kernel.header import k_split_ring
    from monokernel.model.config import ModelConfig

    d = cm.design_for(None, tensor_cores=True)  # the built design, v6-mma-last-skip
    kring = k_split_ring(ModelConfig.from_name("smollm2-135m"), tokens)
    k_unroll = 1 if kring else 2  # the k split's chunks a loop body
    paths = [(k_unroll * 2 * 2, d.mma_token_tiles)]  # (weights, token tiles) of each pass
    split = tokens > d.mma_rows_split_above
    assert kring == split
    if split:
        paths.append((d.mma_rows_split_unroll * 2, d.mma_rows_split_tiles))
    assert (d.mma_token_tiles, d.mma_rows_split_tiles) == (4, 8)
    assert d.mma_rows_l2_overlap and not d.mma_l2_overlap  # the ring: block_mma_rows' alone
    unroll = (k_unroll, d.mma_rows_split_unroll)
    ring = d.mma_rows_split_unroll * 2 if split else 0  # a round's copies and its reads
    loads = sum(u * tiles for u, (_, tiles) in zip(unroll, paths))  # a chunk and token tile
    norms = loads if rms else 0
    stage = 1 if rms else 0  # mma_rms's staging loop (its body once)
    k_ring = 2 * 2 if kring else 0  # the k split's copies a round and its reads
    assert ops.count("LDG.E.128.CONSTANT") == (0 if kring else paths[0][0]) + norms + stage, ops
    assert ops.count("LDGSTS.E.BYPASS.128") == MMA_RING * (ring + k_ring), ops
    assert ops.count("LDGDEPBAR") == MMA_RING * (split + kring), ops
    assert ops.count(f"DEPBAR.LE SB0, 0x{MMA_RING - 1}") == split + kring, ops
    assert sum(o.startswith("HMMA.16816.F32.BF16") for o in ops) == \
        sum(w * tiles for w, tiles in paths), ops
    assert ops.count("LDG.E.128") == loads + stage, ops
    # the staged rows, as a stored input's loads; the ring's reads
    assert ops.count("LDS.128") == (loads if rms else 0) + ring + k_ring, ops
    assert d.stored_bf16_inputs and d.input_bytes == 2


def test_a_kernel_of_slots_draws_each_rows_ticket_on_a_thread_of_its_own():
    """v6-mma's attn_row_tickets, read off the SASS: in a kernel of slots with steps of up to
    64 rows, op_ATTENTION draws its rows' tickets (attention_row_tickets) with one acq_rel RMW
    a thread (ATOMG.E.ADD, behind its MEMBAR.ALL.GPU) and resets a row's with one exchange, so
    the draws of a step's rows are in flight together; rows dealt two a lane of one warp
    compiled to two draws, the second's MEMBAR waiting for the first (an earlier form)."""
    import re

    try:
        sass = sf.compile_sass("smollm2-135m", function="op_ATTENTION", tokens=64, slots=64,
                               mma=True)
    except SassToolMissing as e:
        pytest.skip(str(e))
    ops = [m.group(0) for t in sf._texts(sass) for m in [re.search(r"\bATOMG\S*", t)] if m]
    assert cm.design("v6-mma-seg").attn_row_tickets
    assert ops.count("ATOMG.E.ADD.S32.STRONG.GPU") == 1, ops
    assert ops.count("ATOMG.E.EXCH.STRONG.GPU") == 1, ops
