"""The mat-muls on tensor cores (issue 17, slice 6a: backend option ``tensor_cores``,
megakernel.cu MK_MMA) and, without late q/k, attention a segment at a time on them (slice 6b:
attention_segment), on the CPU emulator, whose mma is the warp-level twin of
kernel/emulator/cuda_cpu_mma.h.

Oracles: the NumPy reference in its ``bf16_inputs`` mode (every matrix product's input rounded
to bf16, as the kernel feeds mma) within a tolerance; the same sequence run alone on the same
kernel, bit for bit (batch invariance); the Engine's solo texts.

The tolerance. The kernel and the reference compute a mat-mul's fp32 input (a normed residual,
attention's output, the FFN's h) in different orders, so their last bits differ, and where an
element lies next to a bf16 rounding boundary the two round it to neighbouring bf16 values:
that product term moves by 2^-8 of itself. Attention's softmax on the synthetic models
amplifies such flips (measured: K rows of a later layer differing by one bf16 ulp in a few
elements, the logits of the rows after them by up to 1.7e-3 of their largest logit; rows whose
inputs had no flip agree to ~1e-5, the fp32 accumulation's order). So every row is held to
4e-3 of its largest logit and most rows to 1e-4, where the fp32 reference (the negative
control: a kernel that did not round its inputs) is 2e-3 to 5e-3 away on most rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.batch import PAGE, prompt_of, round_robin
from helpers.kernel import mutate_kernel_source
from monokernel.errors import KernelError
from monokernel.kernel.base import DeviceSample, StepTable
from monokernel.kernel.executor import KernelExecutor
from monokernel.kernel.isa import Op
from monokernel.kernel.schedule import MAX_STEP_TOKENS
from monokernel.model.reference import ReferenceModel, bf16_round
from monokernel.runtime import Engine
from monokernel.sampling import Sampler, SamplingParams

MAX_SEQ = 48
ROW_TOL = 4e-3    # every row, of its largest logit (see the module's docstring)
CLOSE_TOL = 1e-4  # most rows: those no bf16 flip reached
HOT = 25.0        # the synthetic models' draws vary from position to position at this temperature


def tc_executor(model, slots: int, blocks: int = 3, **kw) -> KernelExecutor:
    ex = KernelExecutor(model, MAX_SEQ, blocks=blocks, slots=slots, page_size=PAGE,
                        tensor_cores=True, **kw)
    ex.poison()
    return ex


def prefill_all(ex: KernelExecutor, prompts: list[list[int]], draws=None):
    """One step of every prompt's rows, each slot on its own pages: the table's logits."""
    free = list(ex.add_pages(ex.slots * ex.slot_pages))
    pages = {s: [free.pop(0) for _ in range(-(-len(p) // PAGE))] for s, p in enumerate(prompts)}
    rows = [(t, s, pos, True, True) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
    return ex.run_table(StepTable.of(rows, pages, draws or {}))


def row_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)


# late q/k with GQA (Qwen3), plain Llama, q/k/v bias (Qwen2), tied embeddings (the LM head is
# the embedding table)
ARCHS = ["qwen3-gqa-tiny", "llama3-tiny", "qwen2-tiny", "tiny"]


# (arch, blocks, attention splits): one split (every row finished by its unit); splits fixed
# by absolute position (C = MAX_SEQ / splits positions each): 6 of 8 (rows 0-7 of one split,
# 8-10 of two, merged by ticket in the same step; qwen3-gqa-tiny's 2 KV groups over 6
# blocks), 12 of 4 (up to 3 splits) and 24 of 2 (up to 6: the ticket's one pass with 1 and 2
# lanes per output chunk)
MIXED_CASES = [(a, 3, None) for a in ARCHS] + [
    ("qwen3-gqa-tiny", 6, 6), ("llama3-tiny", 3, 12), ("llama3-tiny", 3, 24)]


@pytest.mark.parametrize("arch,blocks,splits", MIXED_CASES,
                         ids=ARCHS + ["qwen3-gqa-tiny-6-splits", "llama3-tiny-12-splits",
                                      "llama3-tiny-24-splits"])
def test_a_mixed_step_agrees_with_the_bf16_reference(synth_model, arch, blocks, splits):
    """Three prompts of 11, 5 and 3 rows in one step of 19 rows (3 token groups of 8, the
    last one partial; the third sequence's rows straddle two groups): every row's logits
    against the bf16-inputs reference run on its sequence alone."""
    model = synth_model(arch)
    ex = tc_executor(model, slots=3, step_tokens=24, blocks=blocks, attn_splits=splits)
    if splits:
        assert ex.program.attn_min_chunk == MAX_SEQ // splits  # fixed by absolute position
    prompts = [prompt_of(model, 11, 1), prompt_of(model, 5, 2), prompt_of(model, 3, 3)]
    got = prefill_all(ex, prompts).logits
    assert np.isfinite(got).all()
    chunk = ex.program.attn_min_chunk
    want = {bf: np.concatenate([ReferenceModel(model.config, model.weights, MAX_SEQ,
                                               bf16_inputs=bf, attn_chunk=chunk).forward(p, 0)
                           for p in prompts])
            for bf in (True, False)}
    err = row_errors(got, want[True])
    assert err.max() <= ROW_TOL, f"{arch}: worst row {err.argmax()}: {err.max():.3g}"
    if model.config.qk_norm:
        # attention a row at a time in fp32 (late q/k): only the mat-muls' inputs flip. On
        # tensor cores (the others) the queries and probabilities are bf16 too, and one flip
        # of a query early in a prompt moves its later rows past CLOSE_TOL (llama3-tiny's
        # first prompt): test_segment_attention_is_its_bf16_mirror_on_the_kernels_inputs
        # judges that attention exactly instead
        assert np.mean(err <= CLOSE_TOL) >= 0.6, f"{arch}: rows within {CLOSE_TOL}: {err}"
    # the negative control: the fp32 reference is not what this kernel computes
    fp32 = row_errors(got, want[False])
    assert np.mean(fp32 <= CLOSE_TOL) < 0.3, f"{arch}: the fp32 reference is as close: {fp32}"


def bf16_mirror_mismatches(got: np.ndarray, want: np.ndarray, window: float = 1e-3):
    """Elements where ``got`` (bf16 values) is not the bf16 rounding of ``want`` (fp32), and
    how many of those lie within ``window`` of a bf16 ulp of a rounding midpoint (where the
    last fp32 bits, summed in another order, decide the neighbour)."""
    from monokernel.model.reference import bf16_near_midpoint

    bad = np.flatnonzero(got != bf16_round(want))
    return bad, int(bf16_near_midpoint(want[bad], window).sum())


def kernel_qk_norm_rope(x: np.ndarray, w: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                       eps: float) -> np.ndarray:
    """megakernel.cu warp_qk_norm_rope_n's arithmetic in float32, operation for operation (the
    kernel pins it: __fmul_rn / __fadd_rn, no contraction): lane l sums a_j^2 + c_j^2 over its
    pairs j = l + 32 k < HALF in order, the warp adds the lanes' sums by a butterfly (xor 16,
    8, .., 1), r = 1 / sqrt(ss / D + eps), then (a r) w_a and (c r) w_c rotated. x [..., D]
    (heads of one position), cos / sin [HALF] of that position."""
    f = np.float32
    D = x.shape[-1]
    H = D // 2
    a, c = x[..., :H].astype(f), x[..., H:].astype(f)
    sq = a * a + c * c
    lanes = np.zeros(x.shape[:-1] + (32,), f)
    for j in range(H):
        lanes[..., j % 32] = lanes[..., j % 32] + sq[..., j]
    for o in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[..., np.arange(32) ^ o]
    r = (f(1) / np.sqrt(lanes[..., :1] / f(D) + f(eps))).astype(f)
    na, nc = (a * r) * w[:H], (c * r) * w[H:]
    return np.concatenate([na * cos - nc * sin, nc * cos + na * sin], axis=-1)


SEGMENT_CASES = [("llama3-tiny", None, (11, 5, 3)), ("llama3-tiny", 12, (11, 5, 3)),
                 ("llama3-tiny", 24, (11, 5, 3)), ("qwen2-tiny", None, (11, 5, 3)),
                 ("tiny", None, (11, 5, 3)), ("llama3-tiny", None, (48, 48, 32)),
                 ("qwen3-gqa-tiny", None, (11, 5, 3)), ("qwen3-gqa-tiny", None, (48, 48, 32)),
                 ("qwen3-tiny", None, (11, 5, 3)), ("qwen3-tiny", None, (48, 48, 32))]


@pytest.mark.parametrize("arch,splits,lengths", SEGMENT_CASES,
                         ids=["llama3-tiny", "llama3-tiny-12-splits", "llama3-tiny-24-splits",
                              "qwen2-tiny", "tiny", "llama3-tiny-128-rows", "qwen3-gqa-tiny",
                              "qwen3-gqa-tiny-128-rows", "qwen3-tiny", "qwen3-tiny-128-rows"])
def test_segment_attention_is_its_bf16_mirror_on_the_kernels_inputs(synth_model, arch, splits,
                                                                     lengths):
    """Attention on tensor cores (megakernel.cu attention_segment), judged on its own inputs:
    the last layer's queries (fp32, as RMS_QKV_ROPE stored them; with late q/k raw, normed and
    roped here by kernel_qk_norm_rope, the kernel's own arithmetic) and K/V (the cache's bf16,
    through the slots' pages) of a step of three prompts, through the reference's mirror of
    its rounding (model/reference.py _attention_mma: bf16 queries, bf16 probabilities per
    seg_sub(head_dim) positions of each split, fp32 sums and merge). Every element of the step's
    attention output (bf16: a row finished by its unit, or merged by ticket) is the bf16
    rounding of the mirror's, but where the last fp32 bits decide a rounding, which fp32 sums
    in another order may round the other way: the output's own value within 1e-3 of a ulp of
    a rounding midpoint, or within the sums' own error of one (an element far below its
    head's values), or a head whose bf16 query or probabilities have one there (the mirror's
    ties; at most two heads of a step). The end-to-end logits drift further (a
    query's bf16 rounding flips where the kernel's fp32 query and the reference's differ in
    the last bits, and the synthetic models amplify a flip through the later rows): that is
    what the row tolerance of the mixed steps above bounds."""
    from monokernel.kernel.isa import seg_sub
    from monokernel.model import reference
    from monokernel.model.reference import _attention_mma

    # the mirror's sub-tiles are the kernel's
    assert all(reference.seg_sub(d) == seg_sub(d) for d in (32, 64, 128, 256))
    model = synth_model(arch)
    c = model.config
    T = sum(lengths)
    ex = tc_executor(model, slots=3, step_tokens=max(T, 24), blocks=3, attn_splits=splits)
    prompts = [prompt_of(model, n, seed) for n, seed in zip(lengths, (1, 2, 3))]
    free = list(ex.add_pages(ex.slots * ex.slot_pages))
    pages = {s: [free.pop(0) for _ in range(-(-len(p) // PAGE))] for s, p in enumerate(prompts)}
    rows = [(t, s, pos, True, True) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
    ex.run_table(StepTable.of(rows, pages, {}))
    L, D = c.num_layers, c.head_dim
    q = ex.read_buffer("q").reshape(-1, c.q_dim)[:T]
    got = ex.read_buffer("attn").reshape(-1, c.q_dim)[:T]

    def cache(name):
        bits = ex.read_buffer(name).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(L, -1, c.num_kv_heads, D)[L - 1]

    K, V = cache("k_cache"), cache("v_cache")
    if c.qk_norm:  # late q/k: P.q holds the raw queries
        ref = ReferenceModel(c, model.weights, MAX_SEQ)
        w = ref.layers[L - 1]["q_norm"]
        q = np.stack([kernel_qk_norm_rope(q[r].reshape(c.num_heads, D), w, ref.cos[pos],
                                          ref.sin[pos], c.rms_norm_eps).reshape(-1)
                      for r, (_, _, pos, _, _) in enumerate(rows)])
    scale = np.float32(1.0 / np.sqrt(D))
    want = np.empty_like(got)
    ties = np.zeros((T, c.num_kv_heads, c.group_size), bool)  # per row and head
    for r, (_, s, pos, _, _) in enumerate(rows):
        at = [pages[s][p // PAGE] * PAGE + p % PAGE for p in range(pos + 1)]
        want[r] = _attention_mma(q[r].reshape(c.num_kv_heads, c.group_size, D), K[at], V[at],
                                 scale, ex.program.attn_min_chunk, ties[r]).reshape(-1)
    bad, near = bf16_mirror_mismatches(got.reshape(-1), want.reshape(-1))
    heads = {(int(i) // c.q_dim, int(i) % c.q_dim // D) for i in bad}
    tied = {(r, h) for r, h in heads if ties[r].reshape(-1)[h]}
    untied = [int(i) for i in bad if (int(i) // c.q_dim, int(i) % c.q_dim // D) not in tied]

    def undecided(i: int) -> bool:
        """An element far below its head's values (a sum that cancels) lying nearer a rounding
        midpoint than fp32 sums in another order can move it: (n + 1) u max|v| over its n
        positions (probabilities <= 1, divided by their sum >= 1; u = 2^-24)."""
        r, h = i // c.q_dim, i % c.q_dim // D
        s, pos = rows[r][1], rows[r][2]
        at = [pages[s][p // PAGE] * PAGE + p % PAGE for p in range(pos + 1)]
        bound = (pos + 2) * 2.0 ** -24 * float(np.abs(V[at, h // c.group_size]).max())
        w = abs(float(want.reshape(-1)[i]))
        ulp = 2.0 ** (np.floor(np.log2(max(w, 1e-30))) - 7)
        return abs((w / ulp) % 1 - 0.5) * ulp <= bound

    untied = [i for i in untied if not undecided(i)]
    _, untied_near = bf16_mirror_mismatches(got.reshape(-1)[untied], want.reshape(-1)[untied])
    assert len(untied) == untied_near, (f"{arch}: {len(untied)} elements not the mirror's "
                                        f"rounding, {untied_near} of them next to a midpoint")
    assert len(tied) <= 2 and len(untied) <= 2, (sorted(tied), untied)
    # the negative control: the same inputs through fp32 attention are not this
    fp32 = np.empty_like(got)
    for r, (_, s, pos, _, _) in enumerate(rows):
        at = [pages[s][p // PAGE] * PAGE + p % PAGE for p in range(pos + 1)]
        qr = q[r].reshape(c.num_kv_heads, c.group_size, D)
        sc = np.matmul(qr, K[at].transpose(1, 2, 0)) * scale
        sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
        fp32[r] = np.matmul(sc / sc.sum(axis=-1, keepdims=True),
                            V[at].transpose(1, 0, 2)).reshape(-1)
    assert len(bf16_mirror_mismatches(got.reshape(-1), fp32.reshape(-1))[0]) > 0.05 * got.size


def test_a_step_of_the_most_tokens_agrees_with_the_bf16_reference(synth_model):
    """One step of MAX_STEP_TOKENS rows (six prompts, 48, 48, 32, 48, 48 and 32: four fill
    the cache to its last slot), the mat-muls in the token groups chosen for 256 tokens: the
    same judge."""
    model = synth_model("llama3-tiny")
    ex = tc_executor(model, slots=6, step_tokens=MAX_STEP_TOKENS)
    assert ex.program.tokens == MAX_STEP_TOKENS == 256
    assert any(i.group is not None for q in ex.program.queues for i in q)
    prompts = [prompt_of(model, n, seed) for n, seed in ((48, 4), (48, 5), (32, 6), (48, 7),
                                                         (48, 8), (32, 9))]
    got = prefill_all(ex, prompts).logits
    assert got.shape[0] == MAX_STEP_TOKENS and np.isfinite(got).all()
    want = np.concatenate([ReferenceModel(model.config, model.weights, MAX_SEQ,
                                          bf16_inputs=True, attn_chunk=ex.program.attn_min_chunk
                                          ).forward(p, 0) for p in prompts])
    err = row_errors(got, want)
    assert err.max() <= ROW_TOL, f"worst row {err.argmax()}: {err.max():.3g}"
    assert np.mean(err <= CLOSE_TOL) >= 0.6, f"rows within {CLOSE_TOL}: {err}"


def test_a_late_qk_chunk_of_the_most_tokens_is_bitwise_its_smaller_chunks(synth_model):
    """qwen3-tiny (late q/k, head_dim 128: a chunk of MAX_STEP_TOKENS keeps 64 KB of keys in
    dynamic shared memory, megakernel.cu chunk_keys) on tensor cores, a kernel of 256 tokens a
    step: a 260-token prompt in one chunk of 256, in chunks of 128, and beside another
    sequence's 9 rows (247 of its own), then 4 rows, then decode: its logits at every position
    and its K/V bitwise the same; the one chunk's logits within ROW_TOL of the bf16 reference
    (its judge: the module's docstring)."""
    from helpers.batch import chunkings_agree
    from monokernel.kernel.header import dynamic_shared_bytes

    model = synth_model("qwen3-tiny")
    cfg = model.config
    assert cfg.qk_norm and dynamic_shared_bytes(cfg, MAX_STEP_TOKENS, True) \
        >= MAX_STEP_TOKENS * cfg.head_dim * 2 == 64 * 1024
    max_seq = 264
    ex = KernelExecutor(model, max_seq, blocks=3, slots=2, page_size=PAGE, tensor_cores=True,
                        step_tokens=MAX_STEP_TOKENS)
    assert ex.program.tokens == MAX_STEP_TOKENS == 256
    ex.poison()
    me, other = prompt_of(model, 260, 41), prompt_of(model, 9, 42)
    first = chunkings_agree(ex, me, other, ([{0: 256}, {0: 4}], [{0: 128}, {0: 128}, {0: 4}],
                                            [{1: 9, 0: 247}, {0: 13, 1: 1}]), decode=2)
    got = np.stack([first["logits"][pos] for pos in range(260)])
    want = ReferenceModel(cfg, model.weights, max_seq, bf16_inputs=True,
                          attn_chunk=ex.program.attn_min_chunk).forward(me, 0)
    err = row_errors(got, want)
    assert err.max() <= ROW_TOL, f"worst row {err.argmax()}: {err.max():.3g}"


_RANGES = "const int c_begin = r * C / NWARPS, c_end = (r + 1) * C / NWARPS;"


def _row_split_logits(model, step_tokens: int, plan: list[dict[int, int]], prompts,
                      source_edit=None) -> dict:
    """Every row's logits of ``prompts`` prefilled in the steps of ``plan`` on 3 blocks in row
    tiles (no token groups: every block multiplies all of a step's rows), by (slot, pos)."""
    from helpers.batch import Batch
    from monokernel.kernel.executor import KERNEL_NAMES
    from monokernel.kernel.schedule import schedule, tensor_core_splits

    splits, min_chunk = tensor_core_splits(model.config, 3, MAX_SEQ)
    prog = schedule(model.config, 3, MAX_SEQ, splits, min_chunk, merge_ticket_min=1,
                    tokens=step_tokens, token_groups=False, tensor_cores=True)
    ex = KernelExecutor(model, MAX_SEQ, blocks=3, slots=len(prompts), page_size=PAGE,
                        tensor_cores=True, program=prog, step_tokens=step_tokens)
    if source_edit is not None:
        old, new = source_edit
        assert ex.source.count(old) == 1, "block_mma is not as this test expects"
        ex.module = ex.device.compile(ex.source.replace(old, new), KERNEL_NAMES,
                                      {"MK_PREFETCH": "1"})
    ex.poison()
    b = Batch(ex)
    for slot, p in enumerate(prompts):
        b.join(slot, p)
    for step in plan:
        b.step(step)
    return {(s, pos): lg for s, q in b.seqs.items() for pos, lg in q["logits"].items()}


def test_a_big_steps_row_split_passes_leave_every_logit_bitwise(synth_model):
    """block_mma splits the rows over the warps in a step (a block's share) of more than 32
    rows and K <= 2048 (block_mma_rows: each warp every k range of its row group in turn,
    each range's partial from zero, added in warp order) and the k-loop over the warps in
    smaller steps: the same sums. Three prompts (48, 48, 32) in one step of 128 rows on row
    tiles (every block all 128 rows: its QKV, O_PROJ, GATE_UP, DOWN and LM head split the
    rows) against the same prompts in steps of 32 rows, chunks of 16 (a kernel built for 32:
    the k split only; a prompt's numbers do not depend on its chunks): every row's logits
    bit for bit. Negative control: the ranges added in the reverse order change some row's
    logits (so the big step did take the row split, and the order is what keeps it
    bitwise)."""
    model = synth_model("llama3-tiny")
    prompts = [prompt_of(model, n, seed) for n, seed in ((48, 4), (48, 5), (32, 6))]
    _assert_row_split_is_the_k_split(model, prompts, [{0: 16, 1: 16}] * 3 + [{2: 16}] * 2, 128)


def _assert_row_split_is_the_k_split(model, prompts, small: list[dict[int, int]], big: int):
    """Every row's logits of ``prompts`` in one step of ``big`` rows (the row split) bit for
    bit those of the steps ``small`` on a kernel of 32 rows (the k split only); with the
    ranges added in reverse order some row differs (the big step took the row split)."""
    one = [{s: len(p) for s, p in enumerate(prompts)}]
    want = _row_split_logits(model, 32, small, prompts)
    got = _row_split_logits(model, big, one, prompts)
    assert len(got) == len(want) == sum(map(len, prompts))
    bad = [k for k in want if not np.array_equal(got[k], want[k])]
    assert not bad, f"rows {bad[:5]} differ"
    mutant = _row_split_logits(
        model, big, one, prompts,
        (_RANGES, "const int c_begin = (NWARPS - 1 - r) * C / NWARPS, "
                  "c_end = (NWARPS - r) * C / NWARPS;"))
    assert any(not np.array_equal(mutant[k], want[k]) for k in want)


def test_row_split_passes_with_partial_row_groups_are_bitwise(tmp_path):
    """block_mma_rows where tiles end inside a row group (hidden 104: O_PROJ's and DOWN's
    tiles of 34 and 35 rows on 3 blocks; QKV's of 26 and 27 pairs; the LM head's of 334 and
    335): a group's rows past the tile multiply the group's row 0 (no null check in the
    cp.async ring) and their sums are never stored. One step of 43 rows (20, 14, 9: every
    block's mat-muls and LM head split the rows) against the same prompts in steps of at most
    32 rows (the k split, whose rows past the tile are zeros): every row's logits bit for bit;
    with the ranges added in reverse order some row differs (the big step took the row
    split)."""
    import dataclasses

    from monokernel.model.config import ModelConfig
    from monokernel.model.loader import load_model
    from monokernel.model.synth import write_synthetic

    cfg = dataclasses.replace(ModelConfig.from_name("llama3-tiny"), hidden_size=104,
                              intermediate_size=168, vocab_size=1003)
    model = load_model(write_synthetic(cfg, tmp_path / "awkward", seed=0), progress=False)
    prompts = [prompt_of(model, n, seed) for n, seed in ((20, 1), (14, 2), (9, 3))]
    _assert_row_split_is_the_k_split(model, prompts, [{0: 16, 1: 14}, {0: 4, 2: 9}], 48)


_K_RING_ISSUE = "          issue(c0 + MMA_RING - 1, slot == 0 ? MMA_RING - 1 : slot - 1);\n"
_K_RING_WAIT = "          cp_async_wait_group<MMA_RING - 1>();\n"


def test_the_k_split_through_the_ring_is_bitwise_its_register_loads(tmp_path):
    """block_mma's k split in a kernel of steps of more than 32 tokens copies its weights into
    block_mma_rows' cp.async ring (MMA_K_RING: a round of one chunk, MMA_RING - 1 in flight);
    a kernel of 32 loads them into registers. Steps of at most 32 rows (the k split in both)
    on a kernel of 48 and one of 32, a shape whose k ranges hold several chunks a warp
    (hidden 776, 25 chunks; intermediate 840, DOWN's 27, the last partial) and whose tiles end
    inside a row group (O_PROJ's and DOWN's 258 and 259 rows on 3 blocks: the ring's rows past
    the tile multiply the group's row 0, never stored): every row's logits bit for bit.
    Negative control: the ring's wait dropped (the emulator's copy lands at a wait, its
    destination NaN until then) changes them."""
    import dataclasses

    from monokernel.model.config import ModelConfig
    from monokernel.model.loader import load_model
    from monokernel.model.synth import write_synthetic

    cfg = dataclasses.replace(ModelConfig.from_name("llama3-tiny"), hidden_size=776,
                              intermediate_size=840, vocab_size=1003)
    model = load_model(write_synthetic(cfg, tmp_path / "k-ring", seed=0), progress=False)
    prompts = [prompt_of(model, n, seed) for n, seed in ((20, 1), (14, 2), (9, 3))]
    plan = [{0: 16, 1: 14}, {0: 4, 2: 9}]
    want = _row_split_logits(model, 32, plan, prompts)
    got = _row_split_logits(model, 48, plan, prompts)
    assert len(got) == len(want) == sum(map(len, prompts))
    bad = [k for k in want if not np.array_equal(got[k], want[k])]
    assert not bad, f"rows {bad[:5]} differ"
    mutant = _row_split_logits(model, 48, plan, prompts,
                               (_K_RING_ISSUE + _K_RING_WAIT, _K_RING_ISSUE))
    assert any(not np.array_equal(mutant[k], want[k]) for k in want)


_STAGE_STORE = "rms_bf16_x8(v, r, w, col, b);"


def _staged_logits(model, stage_rows: int | None = None, mutant: bool = False,
                   defines: dict[str, str] | None = None, edit=None) -> dict:
    """Every row's logits of three prompts (40, 30, 20) on a kernel of 128 tokens a step in
    token groups: one step of 85 prompt rows (35, 30, 20), one of the first prompt's last 5
    rows beside the others' first decode rows, then two decode steps of the three; built
    with MK_RMS_STAGE_ROWS = ``stage_rows`` (None: the rows that fit), or with the staged rows
    normed by a wrong 1 / rms (``mutant``), with more ``defines``, or with the source changed
    by ``edit``."""
    from helpers.batch import Batch
    from monokernel.kernel.executor import KERNEL_NAMES

    ex = KernelExecutor(model, MAX_SEQ, blocks=3, slots=3, page_size=PAGE, tensor_cores=True,
                        step_tokens=128)
    source, build = ex.source, {"MK_PREFETCH": "1", **(defines or {})}
    if stage_rows is not None:
        build["MK_RMS_STAGE_ROWS"] = str(stage_rows)
    if mutant:
        assert source.count(_STAGE_STORE) == 1, "mma_rms is not as this test expects"
        source = source.replace(_STAGE_STORE, "rms_bf16_x8(v, 1.5f * r, w, col, b);")
    if edit is not None:
        source = edit(source)
    if stage_rows is not None or mutant or defines or edit is not None:
        ex.module = ex.device.compile(source, KERNEL_NAMES, build)
    ex.poison()
    b = Batch(ex)
    for slot, (n, seed) in enumerate(((40, 7), (30, 8), (20, 9))):
        b.join(slot, prompt_of(model, n, seed))
    for step in ({0: 35, 1: 30, 2: 20}, {0: 5, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1},
                 {0: 1, 1: 1, 2: 1}):
        b.step(step)
    return {(s, pos): lg for s, q in b.seqs.items() for pos, lg in q["logits"].items()}


def test_staged_rms_inputs_leave_every_logit_bitwise(synth_model):
    """The RMS ops (QKV, GATE_UP, the LM head) norm the first MK_RMS_STAGE_ROWS rows of a
    block's share of a step into shared memory once (mma_rms) and read those inputs there; the
    rest of a larger share are normed from residual_in in every pass: the same bf16 inputs.
    The kernel as built (64 rows fit the tiny shape: the first step's shares of its 85 rows
    staged whole or in part, the LM head's 85 its first 64, every share of the small steps
    whole), one built to stage none, and one to stage 8 rows of a share give every row's
    logits bit for bit. Negative control: staged rows normed by a wrong 1 / rms change the
    logits of the first step and of the decode steps (so each took the staged path), and with
    8 rows staged, those of the first rows of the first step's shares past 8 rows (the LM
    head's 85: a share staged in part)."""
    from monokernel.kernel.header import rms_stage_rows
    from monokernel.kernel.isa import RMS_STAGE_MAX_ROWS

    model = synth_model("llama3-tiny")
    assert rms_stage_rows(model.config, 128, True) == RMS_STAGE_MAX_ROWS == 64
    want = _staged_logits(model)
    assert len(want) == 85 + 7 + 3 + 3
    for rows in (0, 8):
        got = _staged_logits(model, rows)
        bad = [k for k in want if not np.array_equal(got[k], want[k])]
        assert not bad, f"MK_RMS_STAGE_ROWS={rows}: rows {bad[:5]} differ"
    mutant = _staged_logits(model, mutant=True)
    assert not np.array_equal(mutant[(0, 10)], want[(0, 10)])  # the first step
    assert not np.array_equal(mutant[(1, 30)], want[(1, 30)])  # the second step
    assert not np.array_equal(mutant[(2, 21)], want[(2, 21)])  # a decode step of three
    # 8 rows staged: every share of the first step is larger, so staging whole shares only
    # would leave that step unstaged (its logits the same); its shares' first rows are
    # staged, and slot 0's first 8 rows (the first of every op's share) change
    part = _staged_logits(model, 8, mutant=True)
    assert all(not np.array_equal(part[(0, p)], want[(0, p)]) for p in range(8))


@pytest.mark.parametrize("name", ["llama3-tiny", "qwen3-tiny"])
def test_row_parts_leave_every_logit_bitwise(synth_model, name):
    """A segment's rows in parts (megakernel.cu segment_parts, isa.segment_parts): on 3 blocks
    (3 unit slots a KV group, every row of one split) the first step's prompt chunks of 35 and
    30 rows (7 and 6 m-tiles of 3 queries) run in 2 parts of at most 4 m-tiles, the chunk of 20
    (4) in one; built with MK_ROW_PARTS = 1 (3 parts each, 1 m-tile a part where it fits) or
    0 (no parts), every row's logits are the same bit for bit, late q/k (qwen3-tiny) too.
    Negative control: the rows' merges read at the segment's rotation instead of their part's
    change the first step's logits (its parts ran)."""
    from monokernel.kernel.isa import ROW_PART_MTILES, segment_parts

    model = synth_model(name)
    G = model.config.group_size
    assert ROW_PART_MTILES == 4 and G == 3
    assert [segment_parts(1, n, 3, G, ROW_PART_MTILES) for n in (35, 30, 20)] == [2, 2, 1]
    want = _staged_logits(model)
    assert len(want) == 85 + 7 + 3 + 3
    for parts in ("1", "0"):
        got = _staged_logits(model, defines={"MK_ROW_PARTS": parts})
        bad = [k for k in want if not np.array_equal(got[k], want[k])]
        assert not bad, f"MK_ROW_PARTS={parts}: rows {bad[:5]} differ"
    old = "        my_rot = prot;\n"

    def segment_rotation(source: str) -> str:
        assert source.count(old) == 1, "op_attention_segments is not as this test expects"
        return source.replace(old, "        my_rot = rot;\n")

    mutant = _staged_logits(model, edit=segment_rotation)
    assert not np.array_equal(mutant[(0, 30)], want[(0, 30)])  # the first chunk's second part


def test_staged_rows_fit_and_load_without_bank_conflicts():
    """header.rms_stage_ld: a staged row's bytes are 64 past a multiple of 128, so the two
    rows of a quarter warp's 16-byte fragment loads (lanes (g, t), t = 0..3, for rows g and g
    + 1) cover the 32 banks once; the rows staged fit dynamic shared memory after
    block_mma_rows' sums, up to DYN_SMEM_CAP (for the shapes it is grown for) and 64 rows."""
    from monokernel.kernel.header import (DYN_SMEM_CAP, dynamic_shared_bytes, rms_stage_ld,
                                          rms_stage_rows, row_split_sums_bytes)
    from monokernel.kernel.isa import RMS_STAGE_MAX_ROWS
    from monokernel.model.config import ModelConfig

    for hidden in (96, 104, 576, 896, 1024, 1536, 2048):
        ld = 2 * rms_stage_ld(hidden)
        assert ld >= 2 * hidden and ld % 128 == 64, hidden
        banks = {(g * ld + 16 * t) % 128 // 4 + w for g in (0, 1) for t in range(4)
                 for w in range(4)}
        assert banks == set(range(32)), hidden
    want = {"smollm2-135m": 64, "qwen3-0.6b": 42, "llama-3.2-1b": 21}  # beside the ring too
    for name, rows in want.items():
        cfg = ModelConfig.from_name(name)
        for tokens in (64, MAX_STEP_TOKENS):
            assert rms_stage_rows(cfg, tokens, True) == min(rows, RMS_STAGE_MAX_ROWS), name
            dyn = dynamic_shared_bytes(cfg, tokens, True)
            assert row_split_sums_bytes(tokens) + rows * 2 * rms_stage_ld(cfg.hidden_size) \
                <= dyn <= DYN_SMEM_CAP, name
        assert rms_stage_rows(cfg, 8, True) == 8 and rms_stage_rows(cfg, 8) == 0


@pytest.mark.parametrize("epilogue", [True, False])
def test_mat_muls_read_bf16_inputs_their_producers_store(synth_model, monkeypatch, epilogue):
    """A tensor-core build stores attn and ffn_h, and the residual's copy the RMS ops read
    (residual_in), as bf16 (isa.BF16_INPUTS: the precision block_mma rounds them to, half the
    bytes the mat-muls read): buffers of 2 bytes an element; after a step of 19 rows (rows of
    one split finished by their unit and rows of up to three merged by ticket) every element
    of the step's rows is written and none of the rows past it (the poison, bf16 NaN, stays),
    and residual_in is the bf16 rounding of the residual, stored in O_PROJ's and DOWN's
    epilogue (MK_RES_IN_EPI, head_dim 64) or in a pass after it (head_dim 128). The numbers
    themselves are held by the mixed steps above against the reference."""
    from monokernel.kernel import executor, header
    from monokernel.kernel.executor import BF16_INPUTS

    monkeypatch.setattr(header, "residual_in_epilogue", lambda cfg: epilogue)
    model = synth_model("llama3-tiny")
    assert f"#define MK_RES_IN_EPI {int(epilogue)}\n" in executor.kernel_source(
        model.config, MAX_SEQ, 24, 3, PAGE, mma=True)
    ex = tc_executor(model, slots=3, step_tokens=24, attn_splits=12)
    # (the unsliced mat-muls: slice_mma stores the copy in its own loop)
    assert ex.program.slices_of(Op.O_PROJ_RESIDUAL) == ex.program.slices_of(Op.DOWN_RESIDUAL) == 1
    c = model.config
    width = {"attn": c.q_dim, "ffn_h": c.intermediate_size, "residual_in": c.hidden_size}
    assert set(BF16_INPUTS) == set(width)
    for name, n in width.items():
        assert ex.buffers[name].dtype == np.uint16 and ex.buffers[name].size == 24 * n, name
        assert np.isnan(ex.read_buffer(name)).all(), f"{name} was not poisoned"
    prompts = [prompt_of(model, 11, 1), prompt_of(model, 5, 2), prompt_of(model, 3, 3)]
    assert np.isfinite(prefill_all(ex, prompts).logits).all()
    for name, n in width.items():
        got = ex.read_buffer(name).reshape(24, n)
        assert np.isfinite(got[:19]).all(), f"{name}: a step's element was not written"
        assert np.isnan(got[19:]).all(), f"{name}: a row past the step's was written"
    residual = ex.read_buffer("residual").reshape(24, c.hidden_size)[:19]
    assert np.array_equal(ex.read_buffer("residual_in").reshape(24, c.hidden_size)[:19],
                          bf16_round(residual))
    # a build without tensor cores keeps attn and ffn_h fp32, and its norms read the residual
    plain = KernelExecutor(model, MAX_SEQ, blocks=3, slots=3, page_size=PAGE, step_tokens=24,
                           merge_ticket_min=1)
    assert all(plain.buffers[name].dtype == np.float32 for name in ("attn", "ffn_h"))
    assert "residual_in" not in plain.buffers


# residual_in's store in the epilogue of the unsliced O_PROJ and DOWN, as mma_add_rows writes it
EPI_STORE = "res_in[at] = f32_to_bf16(v);"


def _mixed(model, monkeypatch, epilogue: bool, edit=None):
    """helpers.batch.run_steps's mixed steps on 3 blocks, O_PROJ and DOWN unsliced, residual_in
    stored in their epilogue or in the pass after it; ``edit`` a source mutation."""
    from helpers.batch import run_steps
    from monokernel.kernel import executor, header
    from monokernel.kernel.schedule import schedule, tensor_core_splits

    monkeypatch.setattr(header, "residual_in_epilogue", lambda cfg: epilogue)
    if edit is not None:
        mutate_kernel_source(monkeypatch, edit, "the epilogue's store")
    cfg = model.config
    assert f"#define MK_RES_IN_EPI {int(epilogue)}\n" in executor.kernel_source(
        cfg, 64, 32, 6, PAGE, mma=True)
    splits, min_chunk = tensor_core_splits(cfg, 3, 64)
    prog = schedule(cfg, 3, 64, splits, min_chunk, merge_ticket_min=1, tokens=32,
                    token_groups=True, tensor_cores=True, input_slices=1)
    assert prog.slices_of(Op.O_PROJ_RESIDUAL) == prog.slices_of(Op.DOWN_RESIDUAL) == 1
    try:
        return run_steps(model, prog, 3, 64, 32)
    finally:
        monkeypatch.undo()


def test_residual_in_stored_in_the_epilogue_leaves_every_logit_bitwise(synth_model,
                                                                        monkeypatch):
    """The epilogue's copy is the bf16 of the sum it stored, so every row's logits over steps
    of 4 to 32 rows (token groups of many members and row tiles) are bit for bit those of the
    pass after the mat-mul; negative control: the epilogue storing the copy of the residual
    before its sum changes them (the RMS ops read what it stores)."""
    model = synth_model("llama3-tiny")
    want = _mixed(model, monkeypatch, False)
    got = _mixed(model, monkeypatch, True)
    assert len(want) == 98 and all(np.isfinite(v).all() for v in got.values())
    bad = [k for k in want if not np.array_equal(got[k], want[k])]
    assert not bad, f"rows {bad[:5]} differ"
    late = _mixed(model, monkeypatch, True,
                  edit=(EPI_STORE, "res_in[at] = f32_to_bf16(res[at] - sum(q, r, m));"))
    bad = [k for k in want if not np.array_equal(late[k], want[k])]
    assert len(bad) > len(want) // 2, bad


def test_awkward_sizes_agree_with_the_bf16_reference(tmp_path):
    """Input widths that are not whole 32-column chunks (hidden 104, FFN 168: a lane's last
    8 columns past the end), a q width other than the hidden size (96), a vocabulary of 1003
    (the LM head's last row group partial): the same judge as above."""
    import dataclasses

    from monokernel.model.config import ModelConfig
    from monokernel.model.loader import load_model
    from monokernel.model.synth import write_synthetic

    cfg = dataclasses.replace(ModelConfig.from_name("llama3-tiny"), hidden_size=104,
                              intermediate_size=168, vocab_size=1003)
    model = load_model(write_synthetic(cfg, tmp_path / "awkward", seed=0), progress=False)
    ex = tc_executor(model, slots=3, step_tokens=24)
    prompts = [prompt_of(model, 11, 1), prompt_of(model, 5, 2), prompt_of(model, 3, 3)]
    got = prefill_all(ex, prompts).logits
    want = np.concatenate([ReferenceModel(model.config, model.weights, MAX_SEQ,
                                          bf16_inputs=True, attn_chunk=ex.program.attn_min_chunk
                                          ).forward(p, 0) for p in prompts])
    err = row_errors(got, want)
    assert err.max() <= ROW_TOL, f"worst row {err.argmax()}: {err.max():.3g}"
    assert np.mean(err <= CLOSE_TOL) >= 0.6, err


def test_the_device_draws_what_the_host_sampler_would(synth_model):
    """The LM head on tensor cores keeps each row's best score over its tile (a thread per row
    of a token group): slot 0 greedy, slot 1 at a high temperature, all 16 prompt rows drawn
    (two token groups); each draw is the host sampler's from that row's logits, read back from
    the same step run with the host sampling."""
    model = synth_model("llama3-tiny")
    prompts = [prompt_of(model, 9, 5), prompt_of(model, 7, 6)]
    draws = {0: DeviceSample(0.0, 0), 1: DeviceSample(HOT, 11)}
    ex = tc_executor(model, slots=2, step_tokens=16)
    drawn = prefill_all(ex, prompts, draws).tokens
    host = prefill_all(tc_executor(model, slots=2, step_tokens=16), prompts).logits
    rows = [(s, pos) for s, p in enumerate(prompts) for pos in range(len(p))]
    want = [Sampler(SamplingParams(temperature=draws[s].temperature, seed=draws[s].seed),
                    draws[s].seed)(lg, [0] * (pos + 1)) for (s, pos), lg in zip(rows, host)]
    assert drawn.tolist() == want
    assert len(set(want[9:])) > 1  # the hot slot's draws are not all one token


@pytest.mark.parametrize("tensor_cores", [True, False], ids=["mma", "cuda-cores"])
def test_rows_drawn_on_the_device_store_no_logits(synth_model, monkeypatch, tensor_cores):
    """A step whose slot 0 rows want logits for the host and slot 1's are drawn on the
    device (greedy): the logits buffer holds the host's rows (numbered first, State.HOST_LOGITS
    of them: what the step returns) and nothing of the drawn ones (their poison stays); the
    drawn tokens are the argmax of the logits the same rows give the host, and with the
    executor's drawn_logits those logits are stored after the host's. Negative control:
    the LM head storing every row's logits (its host-rows test removed) writes the drawn rows
    too, so this test sees a store it should not."""
    model = synth_model("llama3-tiny")
    prompts = [prompt_of(model, 6, 5), prompt_of(model, 5, 6)]
    V = model.config.vocab_size

    def run(edit=None, drawn_logits=False):
        if edit is not None:
            mutate_kernel_source(monkeypatch, edit, "the LM head's store")
        try:
            ex = KernelExecutor(model, MAX_SEQ, blocks=3, slots=2, page_size=PAGE,
                                step_tokens=16, tensor_cores=tensor_cores)
            ex.poison()
            ex.drawn_logits = drawn_logits
            got = prefill_all(ex, prompts, {1: DeviceSample(0.0, 0)})
            return got, ex.read_buffer("logits")[:11 * V].reshape(11, V)
        finally:
            monkeypatch.undo()

    got, buf = run()
    assert got.logits.shape == (6, V) and np.array_equal(buf[:6], got.logits)
    assert np.isnan(buf[6:]).all(), "a row drawn on the device stored its logits"
    host = prefill_all(tc_executor(model, slots=2, step_tokens=16) if tensor_cores else
                       _cuda_core_executor(model), prompts).logits
    assert got.tokens.tolist() == np.argmax(host[6:], axis=1).tolist()
    # the executor's drawn_logits (tests, inspection): the drawn rows' logits stored after the
    # host's, those the same rows give the host; the step still returns the host's rows only
    kept, buf = run(drawn_logits=True)
    assert np.array_equal(buf[:6], kept.logits) and np.array_equal(buf[6:], host[6:])
    assert kept.tokens.tolist() == got.tokens.tolist()
    store = ("if (lrow < host_rows) P.logits" if tensor_cores else
             "row[R_LOGITS] < st[S_HOST_LOGITS] ? P.logits")
    _, every = run((store, "true ? P.logits" if not tensor_cores else "P.logits"))
    assert np.isfinite(every[6:]).all()


def _cuda_core_executor(model) -> KernelExecutor:
    ex = KernelExecutor(model, MAX_SEQ, blocks=3, slots=2, page_size=PAGE, step_tokens=16)
    ex.poison()
    return ex


def test_the_engine_batches_on_tensor_cores(synth_model):
    """``Engine`` on a kernel of 2 slots with tensor cores: three seeded requests (the third
    joining when a slot frees) each get the text they get alone on the same kernel, drawn on
    the device, many steps a launch."""
    model = synth_model("llama3-tiny")
    ids = [prompt_of(model, n, 40 + n) for n in (5, 12, 3)]
    params = [SamplingParams(max_new_tokens=m, temperature=0.8, seed=7 + m, ignore_eos=True)
              for m in (6, 3, 5)]
    ex = KernelExecutor(model, MAX_SEQ, blocks=2, slots=2, step_tokens=4, page_size=PAGE,
                        tensor_cores=True)
    eng = Engine(ex, max_num_seqs=8)
    solo = [[s.token for s in eng.generate(p, sp)] for p, sp in zip(ids, params)]
    got = round_robin(iter(eng.generate(p, sp)) for p, sp in zip(ids, params))
    assert got == solo
    assert ex.logits_rows_read == 0
    assert ex.steps_run > ex.launches


def test_the_options_are_checked(synth_model):
    """As backend options, before a model loads (ParameterError); on the executor itself,
    KernelError, and a schedule that cannot merge every step's attention by ticket is named."""
    from monokernel.errors import ParameterError
    from monokernel.runtime import backend_options

    for backend, given in (("emulator", {"tensor_cores": True}),
                           ("emulator-multi", {"tensor_cores": True, "slots": 2})):
        with pytest.raises(ParameterError, match="tensor_cores=True is for the persistent"):
            backend_options(backend, given)
    assert backend_options("emulator", {"tensor_cores": True, "slots": 2}).tensor_cores
    model = synth_model("llama3-tiny")
    with pytest.raises(KernelError, match="slots >= 2"):
        KernelExecutor(model, MAX_SEQ, blocks=2, tensor_cores=True)
    with pytest.raises(KernelError, match="multi=True"):
        KernelExecutor(model, MAX_SEQ, blocks=2, slots=2, multi=True, tensor_cores=True)
    with pytest.raises(KernelError, match="merge_ticket_min=2"):
        KernelExecutor(model, MAX_SEQ, blocks=2, slots=2, merge_ticket_min=2,
                       tensor_cores=True)
    # 2 KV heads x 4 splits over 3 blocks: the middle block holds units of both KV groups
    with pytest.raises(KernelError, match="one KV group"):
        KernelExecutor(synth_model("qwen3-gqa-tiny"), MAX_SEQ, blocks=3, slots=2,
                       attn_splits=4, tensor_cores=True)


def _embedded_logits(model, rows_of=None):
    """A step of 28 rows (two prompts, 17 and 11) on tensor cores, 3 blocks (tiles of 32
    columns: 4 chunks of 16 bytes a row); ``rows_of(rows)`` edits the table's rows."""
    ex = tc_executor(model, slots=2, step_tokens=32)
    prompts = [prompt_of(model, 17, 41), prompt_of(model, 11, 42)]
    free = list(ex.add_pages(ex.slots * ex.slot_pages))
    pages = {s: [free.pop(0) for _ in range(-(-len(p) // PAGE))] for s, p in enumerate(prompts)}
    rows = [(t, s, pos, True, True) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
    return ex.run_table(StepTable.of(rows_of(rows) if rows_of else rows, pages)).logits


def test_embed_stages_a_steps_rows_in_passes_bitwise(synth_model, monkeypatch):
    """EMBED in a step of many rows on tensor cores (megakernel.cu op_embed, EMBED_STAGED):
    the rows' 16-byte chunks of a block's tile by cp.async into a stage of
    isa.EMBED_STAGE_BYTES a pass, then stored from there. The 8 KB stage holds the step in
    one pass; a stage of 208 bytes (the least the kernel allows at hidden 96: a row of the
    widest tile's chunks) holds 3 rows of a 4-chunk tile, so 28 rows take 10 passes: every
    logits row bitwise the one-pass kernel's. A token outside the vocabulary (let past the
    host's check) is refused on the device, in the first pass or the seventh: the first such
    row's token reported. Negative control: without the barrier between passes, a pass's
    copies overwrite the stage while other threads still read the previous pass."""
    from monokernel.kernel import isa

    model = synth_model("qwen3-gqa-tiny")
    H, V = model.config.hidden_size, model.config.vocab_size
    assert H == 96 and isa.EMBED_STAGE_BYTES >= 28 * 4 * 16
    want = _embedded_logits(model)
    assert want.shape == (28, V)
    monkeypatch.setattr(KernelExecutor, "_check_tokens", lambda self, tokens, what: None)

    def bad(rows):
        rows = list(rows)
        rows[20] = (V + 5,) + rows[20][1:]  # slot 1's fourth row: the seventh pass of three
        rows[25] = (-3,) + rows[25][1:]
        return rows

    small = 16 * (H // 8 + 1)
    for stage in (isa.EMBED_STAGE_BYTES, small):
        monkeypatch.setattr(isa, "EMBED_STAGE_BYTES", stage)
        got = _embedded_logits(model)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"stage {stage}"
        with pytest.raises(KernelError, match=rf"EMBED.* was given token {V + 5}, outside the "
                                              rf"vocabulary \[0, {V}\)"):
            _embedded_logits(model, bad)
    mutate_kernel_source(monkeypatch, ("    if (r0 > 0) __syncthreads();  // the previous pass",
                                       "    if (false) __syncthreads();  // the previous pass"),
                         "EMBED's barrier between passes")
    assert not np.array_equal(_embedded_logits(model), want)


# (arch, blocks, token groups, input slices): late q/k with GQA, its last layer's O_PROJ
# caching the step's keys, O_PROJ and DOWN in 2 slices (a group counter a row group); plain
# Llama, sliced; Llama on row tiles, unsliced
SKIP_CASES = [("qwen3-gqa-tiny", 4, 2, 2), ("llama3-tiny", 4, False, 2),
              ("llama3-tiny", 3, False, 1)]
SKIP_SEQ, SKIP_TOKENS = 64, 32


def _skip_program(cfg, blocks: int, groups, slices: int):
    from monokernel.kernel.schedule import schedule, tensor_core_splits

    splits, min_chunk = tensor_core_splits(cfg, blocks, SKIP_SEQ)
    return schedule(cfg, blocks, SKIP_SEQ, splits, min_chunk, merge_ticket_min=1,
                    tokens=SKIP_TOKENS, token_groups=groups, tensor_cores=True,
                    input_slices=slices)


def _skip_run(model, prog, blocks: int, first_logits: bool, watchdog_ms: int = 20000):
    """Two prompts (20 and 9 tokens): a first step of 12 and 8 of their rows, needing logits
    or not (``first_logits``), then their last rows with logits, then 3 decode steps of both:
    (the Batch's record, the residual's rows after the first step)."""
    from helpers.batch import Batch

    ex = KernelExecutor(model, SKIP_SEQ, blocks=blocks, slots=2, page_size=PAGE,
                        tensor_cores=True, program=prog, step_tokens=SKIP_TOKENS,
                        watchdog_ms=watchdog_ms)
    ex.poison()
    b = Batch(ex)
    b.join(0, prompt_of(model, 20, 51))
    b.join(1, prompt_of(model, 9, 52))
    b.step({0: 12, 1: 8}, logits=first_logits)
    residual = ex.read_buffer("residual").reshape(-1, model.config.hidden_size)[:20].copy()
    b.step({0: 8, 1: 1})
    for _ in range(3):
        b.step({0: 1, 1: 1})
    return b, residual


def _same_after(idle, every) -> None:
    """Every logits row the idle run recorded, its tokens and both slots' K/V: bitwise the run
    whose every row needed logits."""
    for slot in (0, 1):
        a, z = idle.seqs[slot], every.seqs[slot]
        assert sorted(a["logits"]) and set(a["logits"]) <= set(z["logits"])
        for pos, lg in a["logits"].items():
            assert np.array_equal(lg.view(np.uint32), z["logits"][pos].view(np.uint32)), \
                (slot, pos)
        assert a["tokens"] == z["tokens"], slot
        n = len(a["tokens"]) - 1
        for x, y in zip(idle.kv(slot, n), every.kv(slot, n)):
            assert np.array_equal(x, y), slot


@pytest.mark.parametrize("arch,blocks,groups,slices", SKIP_CASES,
                         ids=["qwen3-gqa-tiny-sliced", "llama3-tiny-sliced", "llama3-tiny"])
def test_a_step_without_logits_idles_its_last_layer_and_loses_nothing(synth_model, arch,
                                                                      blocks, groups, slices):
    """A step none of whose rows needs logits (two prompts' first chunks) idles the last
    layer after its RMS_QKV_ROPE (megakernel.cu last_layer_idle; cost model last_layer_skip):
    its rows' residual after the step is not the one a step needing their logits leaves (every
    row differs: the last layer's attention and FFN did not add to it), and every number after
    it is bitwise that run's: the prompts' last rows' logits, 3 decode steps of both, their
    tokens and K/V (the last layer's keys cached by the idle O_PROJ under late q/k; a sliced
    op's group counter signalled, or the next step's slices would wait out the watchdog)."""
    model = synth_model(arch)
    prog = _skip_program(model.config, blocks, groups, slices)
    assert prog.slices_of(Op.DOWN_RESIDUAL) == slices
    idle, idle_res = _skip_run(model, prog, blocks, first_logits=False)
    every, every_res = _skip_run(model, prog, blocks, first_logits=True)
    assert np.isfinite(idle_res).all() and np.isfinite(every_res).all()
    assert (np.abs(idle_res - every_res).max(axis=1) > 0).all()
    assert min(idle.seqs[0]["logits"]) == 12 and min(every.seqs[0]["logits"]) == 0
    _same_after(idle, every)


# the idle path mutated: (SKIP_CASES case, edit, what, the failure it must cause and its
# message: the mutation's own check, that its code is where expected, fails otherwise)
SKIP_MUTANTS = [
    # late q/k's idle O_PROJ caches no key: the last layer's keys of the first step's rows
    # stay NaN-poisoned, and the rows after them read them
    (0, ("    if (pairs <= NWARPS)  // (one key a warp",
         "    if (last_layer_idle(st, layer)) {} else if (pairs <= NWARPS)  // (one key a warp"),
     "O_PROJ's key caching", AssertionError, r"^\(0, 12\)"),  # (_same_after's: slot, pos)
    # an idle slice signals no group counter: the next step's last-layer slices wait for it
    (1, ("    signal_counter(P, counter_of());\n    return;", "    return;"),
     "the idle slice's group signal", KernelError,
     r"watchdog: .*O_PROJ_RESIDUAL\(layer 1, .* waited 1000 ms for counter")]


@pytest.mark.parametrize("case,edit,what,error,match", SKIP_MUTANTS,
                         ids=["keys-left-uncached", "group-counter-not-signalled"])
def test_negative_control_the_idle_last_layer_must_keep_what_later_steps_read(
        synth_model, monkeypatch, case, edit, what, error, match):
    arch, blocks, groups, slices = SKIP_CASES[case]
    model = synth_model(arch)
    prog = _skip_program(model.config, blocks, groups, slices)
    every, _ = _skip_run(model, prog, blocks, first_logits=True)
    mutate_kernel_source(monkeypatch, edit, what)
    with pytest.raises(error, match=match):
        idle, _ = _skip_run(model, prog, blocks, first_logits=False, watchdog_ms=1000)
        _same_after(idle, every)
