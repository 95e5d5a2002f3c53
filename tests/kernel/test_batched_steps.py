"""Steps of many sequences on the CPU emulator (issue 17, slice 3: ``slots``, a token table and
paged K/V, megakernel.cu MK_SLOTS).

The oracle is the one-sequence kernel: every row of a step runs the one-token step's arithmetic
at its own position over its own slot's pages, so each sequence's logits at every position and
its K/V must be bitwise those of the same sequence run alone, one token per step, whatever
shares its steps: other sequences at other positions, prompt chunks crossing a page boundary,
a sequence at the cache's last position, one ending or joining between steps. The NumPy
reference is the tolerance oracle of the same runs. Also: the Engine's batched path on the
emulator (a list of prompts gives each prompt's solo text), the table's validation, the
options.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.batch import PAGE, Batch, chunkings_agree, prompt_of, round_robin
from helpers.kernel import assert_logits_match, mutate_kernel_source
from monokernel.batching import batch_options
from monokernel.errors import KernelError, ParameterError
from monokernel.kernel.base import StepTable
from monokernel.kernel.executor import KernelExecutor
from monokernel.kernel.schedule import MAX_STEP_TOKENS
from monokernel.model.reference import ReferenceModel
from monokernel.runtime import Engine, backend_options
from monokernel.sampling import SamplingParams

MAX_SEQ = 48
HOT = 25.0  # the synthetic models' draws vary from position to position at this temperature


class Solo:
    """A sequence run alone on the one-sequence kernel, one token per step: its logits at every
    position (greedy continuation after the prompt) and its K/V."""

    def __init__(self, ex: KernelExecutor, prompt: list[int], total: int):
        ex.reset()
        ex.poison()
        self.tokens, self.logits = list(prompt), []
        for pos in range(total):
            lg = ex.step(self.tokens[pos], pos).logits.copy()
            self.logits.append(lg)
            if pos + 1 >= len(self.tokens):
                self.tokens.append(int(np.argmax(lg)))
        self.k = ex.read_buffer("k_cache")[:, :total].copy()
        self.v = ex.read_buffer("v_cache")[:, :total].copy()


def assert_same(batch_seq: dict, solo: Solo, what: str, kv=None) -> None:
    for pos, lg in batch_seq["logits"].items():
        assert np.array_equal(lg.view(np.uint32), solo.logits[pos].view(np.uint32)), \
            f"{what}: logits at position {pos}"
    assert batch_seq["tokens"] == solo.tokens[:len(batch_seq["tokens"])], f"{what}: tokens"
    if kv is not None:
        n = len(batch_seq["logits"])
        assert np.array_equal(kv[0], solo.k[:, :n]), f"{what}: K"
        assert np.array_equal(kv[1], solo.v[:, :n]), f"{what}: V"


def drive(b: Batch, budget: int, steps: int, events=None) -> None:
    """``steps`` steps of at most ``budget`` rows: every decoding sequence's row first, then
    prompt chunks in slot order (vLLM's order); ``events[i](b)`` runs before step i."""
    for i in range(steps):
        if events and i in events:
            events[i](b)
        plan, left = {}, budget
        for slot, s in b.seqs.items():
            if s["done"] >= s["prompt"] and left:
                plan[slot], left = 1, left - 1
        for slot, s in b.seqs.items():
            if s["done"] < s["prompt"] and left:
                plan[slot] = min(s["prompt"] - s["done"], left)
                left -= plan[slot]
        b.step(plan)


# (architecture, slots, step rows, blocks, program options): late q/k with GQA, plain Llama,
# q/k/v bias; then rows of up to 4 attention splits of 2+ positions, so a step's rows sit at
# rotations 0..3 of their KV group's unit slots (megakernel.cu split_slot): merged by every
# O_PROJ block (merge_ticket_min 0) and, from 2 used splits on, by ticket
ARCHS = [("qwen3-gqa-tiny", 3, 17, 3, {}), ("llama3-tiny", 4, 6, 2, {}),
         ("qwen2-tiny", 3, 3, 4, {}),
         ("llama3-tiny", 4, 6, 4, {"attn_splits": 4, "attn_min_chunk": 2,
                                   "merge_ticket_min": 0}),
         ("qwen3-gqa-tiny", 3, 17, 4, {"attn_splits": 4, "attn_min_chunk": 3,
                                       "merge_ticket_min": 2})]


@pytest.mark.parametrize("arch,slots,T,blocks,options", ARCHS,
                         ids=["qwen3-gqa-tiny", "llama3-tiny", "qwen2-tiny",
                              "llama3-tiny-4-splits-block-merge", "qwen3-gqa-tiny-4-splits-ticket"])
def test_mixed_steps_are_bitwise_each_sequence_alone(synth_model, arch, slots, T, blocks,
                                                     options):
    """Sequences at different positions in one step: prompt chunks beside decode rows, chunks
    crossing a page boundary, one sequence ending and two joining (one into its slot, on its
    recycled pages) between steps; every logits row and K/V row bitwise the one-sequence
    kernel's (the same program options: the same splits and merges for every row)."""
    mixed_steps(synth_model, arch, slots, T, blocks, options)


# O_PROJ's late q/k key caching (megakernel.cu cache_keys: the (row, head) pairs of a block's
# part of the step's rows over the warps, KEY_CACHE_KEYS a warp at once where there are more
# than warps; ops/o_proj.py key_parts), mutated: (ARCHS case, parts a head there, edit, what)
KEY_MUTANTS = [
    # a block's last pair left out (3 blocks: a head's rows one block's, prompt chunks of up to
    # 17 rows; the one-sequence kernel's steps of one row keep every key): that row's key
    # stays poisoned in the cache
    (0, 1, ("cache_keys<KEY_CACHE_KEYS>(P, st, layer, kv0, heads, r0, pairs);",
            "cache_keys<KEY_CACHE_KEYS>(P, st, layer, kv0, heads, r0, pairs - 1);"),
     "O_PROJ's caching of more keys than warps"),
    # a part's keys stored at rows counted from the step's first row instead of its part's (4
    # blocks: each of the 2 KV heads' rows in 2 parts): the second part's rows stay poisoned,
    # the first part's are overwritten; so those steps do run the parts
    (4, 2, ("const int i = min(i0 + n, pairs - 1), tok = r0 + i / heads;",
            "const int i = min(i0 + n, pairs - 1), tok = i / heads;"),
     "cache_keys' cache address")]


@pytest.mark.parametrize("case,parts,edit,what", KEY_MUTANTS,
                         ids=["last-key-left-uncached", "parts-cached-at-the-first-rows"])
def test_negative_control_keys_cached_wrong_are_caught(synth_model, monkeypatch, case, parts,
                                                       edit, what):
    """The mixed steps above catch a key the caching leaves out or puts in the wrong row."""
    from monokernel.kernel.ops.o_proj import key_parts

    assert {p for _, _, p, _ in key_parts(2, ARCHS[case][3])} == {parts}
    mutate_kernel_source(monkeypatch, edit, what)
    with pytest.raises(AssertionError):
        mixed_steps(synth_model, *ARCHS[case])


def mixed_steps(synth_model, arch, slots, T, blocks, options) -> None:
    model = synth_model(arch)
    ex = KernelExecutor(model, MAX_SEQ, blocks=blocks, slots=slots, step_tokens=T,
                        page_size=PAGE, **options)
    assert ex.max_step_rows == T and ex.max_num_seqs == slots
    if options:  # rows of 1 to 4 used splits
        assert ex.program.attn_splits == 4 and ex.program.merge_ticket_min == \
            options["merge_ticket_min"]
    ex.poison()
    one = KernelExecutor(model, MAX_SEQ, blocks=blocks, **options)
    prompts = [prompt_of(model, 11, 1), prompt_of(model, 5, 2), prompt_of(model, 3, 3),
               prompt_of(model, 7, 4)]
    solo = [Solo(one, p, len(p) + 18) for p in prompts]
    b = Batch(ex)
    b.join(0, prompts[0])
    b.join(1, prompts[1])
    left = {}

    def swap(b: Batch) -> None:
        left["kv"] = b.kv(1, b.seqs[1]["done"])
        left["seq"] = b.leave(1)
        b.join(1, prompts[2])
        b.join(2, prompts[3])

    drive(b, T, 16, {7: swap})
    assert left["seq"]["done"] > len(prompts[1])  # it decoded before it left
    assert_same(left["seq"], solo[1], f"{arch} seq 1", left["kv"])
    assert_same(b.seqs[0], solo[0], f"{arch} seq 0", b.kv(0, b.seqs[0]["done"]))
    assert_same(b.seqs[1], solo[2], f"{arch} seq 2 (slot 1, recycled pages)",
                b.kv(1, b.seqs[1]["done"]))
    assert_same(b.seqs[2], solo[3], f"{arch} seq 3", b.kv(2, b.seqs[2]["done"]))
    assert all(s["done"] > s["prompt"] for s in b.seqs.values())


# (tensor cores, blocks, attention splits): the tensor-core kernel's ATTENTION merges every
# row's splits by ticket (merge_ticket_min 1); with 6 splits of 8 positions (fixed by absolute
# position), a row of one split is finished by its unit and the later rows merge by ticket
# in the same steps
INVARIANCE_CASES = [("qwen3-gqa-tiny", False, 3, None), ("qwen3-gqa-tiny", True, 3, None),
                    ("qwen3-gqa-tiny", True, 4, 6), ("llama3-tiny", True, 3, None),
                    ("llama3-tiny", True, 3, 6)]


@pytest.mark.parametrize("splits", [None, 6])
def test_a_prompts_numbers_do_not_depend_on_its_chunks_on_tensor_cores(synth_model, splits):
    """Attention a segment at a time on tensor cores (megakernel.cu attention_segment) gives a
    row the same numbers whatever segment carries it: a prompt of 20 in one chunk, in chunks
    of 7, 1 and 12 (a 7-row chunk: two m-tiles, one a warp; a row alone: one m-tile split
    over the warps), one row a step, and in chunks beside another sequence's rows: its
    logits at every position and its K/V, bitwise. Then 4 decode rows, bitwise too."""
    model = synth_model("llama3-tiny")
    assert not model.config.qk_norm and model.config.group_size * 7 > 16
    ex = KernelExecutor(model, MAX_SEQ, blocks=3, slots=2, page_size=PAGE, tensor_cores=True,
                        step_tokens=24, attn_splits=splits)
    me, other = prompt_of(model, 20, 31), prompt_of(model, 9, 32)
    chunkings_agree(ex, me, other, ([{0: 20}], [{0: 7}, {0: 1}, {0: 12}], [{0: 1}] * 20,
                                    [{1: 9, 0: 5}, {0: 15, 1: 1}]), decode=4)


@pytest.mark.parametrize("arch,tensor_cores,blocks,splits", INVARIANCE_CASES,
                         ids=["cuda-cores", "tensor-cores", "tensor-cores-6-splits",
                              "tensor-cores-segments", "tensor-cores-segments-6-splits"])
def test_a_sequence_alone_or_beside_1_5_and_15_others(synth_model, arch, tensor_cores, blocks,
                                                      splits):
    """Batch invariance: one sequence's logits rows, bitwise, alone and in steps of 2, 6 and 16
    sequences at other positions (a step of 16 decode rows: T_MAX); on tensor cores, token
    groups of 8 holding other sequences' rows beside its own, or padding; without late q/k
    (llama3-tiny) its attention a segment at a time on mma (megakernel.cu attention_segment:
    its prompt's chunk, then its decode rows, each beside other segments' units)."""
    model = synth_model(arch)
    ex = KernelExecutor(model, MAX_SEQ, blocks=blocks, slots=16, page_size=PAGE,
                        tensor_cores=tensor_cores, attn_splits=splits)
    if splits:
        assert ex.program.attn_splits == splits and ex.program.merge_ticket_min == 1
        assert ex.program.attn_min_chunk == 8
    assert ex.max_step_rows == 16
    me = prompt_of(model, 9, 10)
    others = [prompt_of(model, 2 + k % 7, 20 + k) for k in range(15)]
    runs = []
    for company in (0, 1, 5, 15):
        b = Batch(ex)
        b.join(0, me)
        for k in range(company):
            b.join(k + 1, others[k])
        b.step({0: 9})  # my prompt alone, then everyone's prompt row by row beside my decode
        for _ in range(8):
            b.step({slot: 1 for slot in b.seqs})
        runs.append(b.seqs[0])
        # every row's ticket (a kernel of slots: one per row and KV group) reset by its merger
        tickets = [k for k, n in enumerate(ex.program.counter_names) if ".ATTENTION.ticket" in n]
        per_layer = model.config.num_kv_heads * ex.program.tokens
        assert len(tickets) == model.config.num_layers * per_layer or \
            not ex.program.merge_ticket_min
        assert (ex.read_buffer("counters")[tickets] == 0).all(), f"beside {company} others"
    for company, run in zip((1, 5, 15), runs[1:]):
        assert run["logits"].keys() == runs[0]["logits"].keys()
        for pos in run["logits"]:
            assert np.array_equal(run["logits"][pos].view(np.uint32),
                                  runs[0]["logits"][pos].view(np.uint32)), \
                f"beside {company} others: position {pos}"
        assert run["tokens"] == runs[0]["tokens"]


def test_the_rows_agree_with_the_reference(synth_model):
    """The tolerance oracle: a step of three sequences' rows (two prompt chunks, one reaching
    the cache's last position) against the NumPy reference run on each alone."""
    model = synth_model("llama3-tiny")
    ex = KernelExecutor(model, MAX_SEQ, blocks=3, slots=3, step_tokens=MAX_SEQ // 2,
                        page_size=PAGE)
    ex.poison()
    long = prompt_of(model, MAX_SEQ, 31)
    short = prompt_of(model, 6, 32)
    b = Batch(ex)
    b.join(0, long)
    b.join(1, short)
    b.step({0: MAX_SEQ // 2 - 6, 1: 6})
    b.step({0: MAX_SEQ // 2 - 1, 1: 1})
    b.step({0: 7})  # positions up to MAX_SEQ - 1: the cache's last
    assert max(b.seqs[0]["logits"]) == MAX_SEQ - 1
    for slot, prompt in ((0, long), (1, short)):
        ref = ReferenceModel(model.config, model.weights, MAX_SEQ)
        toks = b.seqs[slot]["tokens"]
        want = ref.forward(toks[:len(b.seqs[slot]["logits"])], 0)
        got = np.stack([b.seqs[slot]["logits"][p] for p in sorted(b.seqs[slot]["logits"])])
        assert_logits_match(got, want, f"slot {slot}")


def test_the_engine_batches_on_the_emulator(synth_model):
    """``Engine`` on a kernel of 2 slots: three seeded requests (the third joins when a slot
    frees), each the text it gets alone on the one-sequence kernel, drawn on the device; the
    step table's rows stay within step_tokens."""
    model = synth_model("llama3-tiny")
    ids = [prompt_of(model, n, 40 + n) for n in (5, 12, 3)]
    params = [SamplingParams(max_new_tokens=m, temperature=0.8, seed=7 + m, ignore_eos=True)
              for m in (6, 3, 5)]
    solo = []
    for p, sp in zip(ids, params):
        eng = Engine(KernelExecutor(model, MAX_SEQ, blocks=2))
        solo.append([s.token for s in eng.generate(p, sp)])
    ex = KernelExecutor(model, MAX_SEQ, blocks=2, slots=2, step_tokens=4, page_size=PAGE)
    eng = Engine(ex, max_num_seqs=8)
    assert eng.batcher is not None and eng.batcher.max_num_seqs == 2
    assert eng.batcher.max_num_batched_tokens == 4
    got = round_robin(iter(eng.generate(p, sp)) for p, sp in zip(ids, params))
    assert got == solo
    assert ex.logits_rows_read == 0  # every token drawn on the device (slice 4)
    assert ex.steps_run > ex.launches  # decode steps ran many to a launch
    # a stop string (the host's text_stop) ending a request in the middle of a launch: the
    # tokens the kernel made past it are dropped, the text is the solo run's
    cut = lambda tok: tok == solo[0][2]  # noqa: E731
    want = [s.token for s in Engine(KernelExecutor(model, MAX_SEQ, blocks=2)).generate(
        ids[0], params[0], text_stop=cut)]
    assert want == solo[0][:3]
    its = [iter(eng.generate(ids[0], params[0], text_stop=cut)),
           iter(eng.generate(ids[1], params[1]))]
    both = [[s.token for s in it] for it in its]
    assert both == [want, solo[1]]
    # logprobs need the logits: that request's rows come back and the host samples them, the
    # same draw from the same logits
    with_lp = [s for s in eng.generate(ids[0], params[0].replace(logprobs=1))]
    assert [s.token for s in with_lp] == solo[0] and ex.logits_rows_read == len(solo[0])
    assert all(s.logprob is not None for s in with_lp)
    with pytest.raises(ParameterError, match="max_num_batched_tokens 8 exceeds the 4 rows"):
        Engine(ex, max_num_batched_tokens=8)
    with pytest.raises(ParameterError, match="max_num_batched_tokens 5 exceeds the 4 rows"):
        batch_options(None, 5, *backend_options("emulator", {"slots": 2, "step_tokens": 4})
                      .batch_limits())
    # 32 sequences asked by default, 2 slots: 2 run, and 3 rows a step is enough for them
    assert batch_options(None, 3, 2, 4) == (2, 3)


def test_a_bad_table_is_refused_before_the_launch(synth_model):
    model = synth_model("llama3-tiny")
    ex = KernelExecutor(model, MAX_SEQ, blocks=2, slots=2, step_tokens=4, page_size=PAGE)
    pages = list(ex.add_pages(4))
    good = {0: pages[:1], 1: pages[1:2]}
    cases = [
        ([(1, 0, 0, True, True)] * 5, good, "5 rows"),
        ([(1, 2, 0, True, True)], good, "slots must be"),
        ([(1, 0, MAX_SEQ, True, True)], good, "positions must be"),
        ([(model.config.vocab_size, 0, 0, True, True)], good, "tokens must be"),
        ([(1, 0, 0, True, True), (1, 0, 2, True, True)], good, "consecutive positions"),
        ([(1, 0, 0, True, True), (1, 1, 0, True, True), (1, 0, 1, True, True)], good,
         "not consecutive"),
        ([(1, 0, PAGE, True, True)], good, "does not reach"),
        ([(1, 0, 0, True, True)], {0: [0]}, "ids from add_pages"),
        ([(1, 0, 0, True, True), (1, 1, 3, True, True)], {0: pages[:1], 1: pages[:1]},
         "which slot 0 writes, is also in slot 1"),
    ]
    for rows, tables, match in cases:
        with pytest.raises(KernelError, match=match):
            ex.run_table(StepTable.of(rows, tables))
    assert ex.steps_run == 0  # nothing ran, the executor stays usable
    ex.run_table(StepTable.of([(1, 0, 0, True, True)], good))
    with pytest.raises(KernelError, match="holds 4 pages"):  # 2 slots x 16 positions
        KernelExecutor(model, 16, blocks=2, slots=2, page_size=PAGE).add_pages(5)


def test_the_options_are_validated():
    for bad in (0, MAX_STEP_TOKENS + 1, "2"):
        with pytest.raises(ParameterError, match="slots"):
            backend_options("emulator", {"slots": bad})
    with pytest.raises(ParameterError, match="page_size"):
        backend_options("emulator", {"page_size": 0})
    with pytest.raises(ParameterError, match="kv_pages"):
        backend_options("emulator", {"kv_pages": 0})
    o = backend_options("emulator", {"slots": 8, "page_size": 32})
    assert (o.slots, o.page_size) == (8, 32)


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores"])
def test_a_reused_prefix_gives_the_same_text(synth_model, tensor_cores):
    """The Batcher's prefix cache on a kernel of slots: a second prompt sharing two whole pages
    with the first reuses them (16 positions not prefilled, so its prompt is cut into other
    chunks) and gets, bit for bit, the seeded text it gets with prefix caching off; on tensor
    cores too (a row's mat-muls never depend on the step's other rows)."""
    model = synth_model("qwen3-gqa-tiny")
    head = prompt_of(model, 19, 50)
    first, second = head + [7, 8], head[:17] + [9, 10, 11]
    params = SamplingParams(max_new_tokens=5, temperature=0.9, seed=3, ignore_eos=True)
    texts = []
    for caching in (True, False):
        ex = KernelExecutor(model, MAX_SEQ, blocks=3, slots=2, step_tokens=8, page_size=PAGE,
                            tensor_cores=tensor_cores)
        eng = Engine(ex, prefix_caching=caching)
        [s.token for s in eng.generate(first, params)]
        texts.append([s.token for s in eng.generate(second, params)])
        assert eng.stats.reused_tokens == (2 * PAGE if caching else 0)
    assert texts[0] == texts[1] and len(texts[0]) == 5


def test_the_device_draws_what_the_host_sampler_would(synth_model):
    """``StepTable.draws``: the rows of the named slots get their next token drawn in the LM
    head (greedy, or Gumbel-max keyed by the slot's seed and the row's position), bit for bit
    the host sampler's draw from the same logits, and their logits are not read back."""
    from monokernel.kernel.base import DeviceSample
    from monokernel.sampling import Sampler

    model = synth_model("qwen3-gqa-tiny")
    rows = [(t, 0, p, p == 8, True) for p, t in enumerate(prompt_of(model, 9, 60))] + \
        [(t, 1, p, True, True) for p, t in enumerate(prompt_of(model, 3, 61))] + \
        [(t, 2, p, p == 1, True) for p, t in enumerate(prompt_of(model, 2, 62))]
    draws = {0: DeviceSample(0.0, 0), 1: DeviceSample(HOT, 1234)}
    got = []
    for d in ({}, draws):
        ex = KernelExecutor(model, MAX_SEQ, blocks=3, slots=3, step_tokens=16, page_size=PAGE)
        pages = list(ex.add_pages(6))
        got.append(ex.run_table(StepTable.of(rows, {s: pages[2 * s:2 * s + 2] for s in range(3)},
                                             d)))
        assert ex.logits_rows_read == len(got[-1].logits)
    host, dev = got
    # without draws: every row with logits (1 + 3 + 1); with: slot 2's only
    assert host.logits.shape[0] == 5 and dev.logits.shape[0] == 1 and len(host.tokens) == 0
    assert np.array_equal(dev.logits.view(np.uint32), host.logits[4:].view(np.uint32))
    want = [int(np.argmax(host.logits[0]))]  # slot 0, greedy, after position 8
    for k, pos in enumerate((0, 1, 2)):  # slot 1, every row drawn at temperature HOT
        params = SamplingParams(temperature=HOT, seed=1234)
        history = [0] * (pos + 1)  # the noise is keyed by the position, len(history) - 1
        want.append(Sampler(params, 1234)(host.logits[1 + k], history))
    assert dev.tokens.tolist() == want
    assert len(set(want[1:])) > 1  # the noise moved the draws


def test_a_pool_smaller_than_a_context_per_slot(synth_model):
    """``kv_pages=3``: the K/V pool holds 3 pages for 2 slots (memory follows the tokens): two
    requests of 2 pages each run one after the other (the second waits for pages), each its
    solo text; a request that could never fit is refused up front."""
    from monokernel.errors import PromptError

    model = synth_model("llama3-tiny")
    ex = KernelExecutor(model, MAX_SEQ, blocks=2, slots=2, page_size=PAGE, kv_pages=3)
    c = model.config
    assert ex.buffers["k_cache"].shape == (c.num_layers, (MAX_SEQ // PAGE + 3) * PAGE,
                                           c.num_kv_heads, c.head_dim)
    eng = Engine(ex)
    assert eng.batcher.pool.total == 3
    params = SamplingParams(max_new_tokens=6, temperature=0.7, seed=5, ignore_eos=True)
    ids = [prompt_of(model, 5, 70), prompt_of(model, 7, 71)]
    solo = [[s.token for s in Engine(KernelExecutor(model, MAX_SEQ, blocks=2)).generate(p, params)]
            for p in ids]
    running = []
    got = round_robin([iter(eng.generate(p, params)) for p in ids],
                      lambda: running.append(eng.batcher.stats()["running"]))
    assert got == solo and max(running) == 1
    with pytest.raises(PromptError, match="the pool holds 3"):
        eng.generate(prompt_of(model, 20, 72), params)


def test_a_launch_of_many_table_steps_is_the_steps_one_by_one(synth_model):
    """``StepTable.steps``: one launch runs up to 6 decode steps of 4 slots, the kernel feeding
    each slot its drawn token until the slot draws a stop token (slot 1), reaches its stop
    position (slot 2) or the launch ends (slots 0, 3); the tokens and K/V are bitwise those of
    one launch per step with the host feeding the same draws."""
    from monokernel.kernel.base import DeviceSample

    model = synth_model("llama3-tiny")
    prompts = [prompt_of(model, n, 80 + n) for n in (3, 6, 2, 9)]
    draws = {s: DeviceSample(HOT if s % 2 else 0.0, 100 + s) for s in range(4)}
    runs = []
    for one_by_one in (True, False):
        ex = KernelExecutor(model, MAX_SEQ, blocks=3, slots=4, step_tokens=24, page_size=PAGE)
        ex.poison()
        pages = list(ex.add_pages(8))
        tables = {s: pages[2 * s:2 * s + 2] for s in range(4)}
        rows = [(t, s, p, p == len(pr) - 1, True) for s, pr in enumerate(prompts)
                for p, t in enumerate(pr)]
        first = ex.run_table(StepTable.of(rows, tables, draws))
        seqs = {s: list(p) + [int(t)] for s, (p, t) in enumerate(zip(prompts, first.tokens))}
        if not runs:  # slot 1 stops at the token it draws third; slot 2 at position 5
            probe = KernelExecutor(model, MAX_SEQ, blocks=3, slots=4, step_tokens=24,
                                   page_size=PAGE)
            probe.add_pages(8)
            probe.run_table(StepTable.of(rows, tables, draws))
            s1 = list(seqs[1])
            for _ in range(2):
                out = probe.run_table(StepTable.of([(s1[-1], 1, len(s1) - 1, True, False)],
                                                   tables, draws))
                s1.append(int(out.tokens[0]))
            stops = {1: (frozenset({s1[-1]}), MAX_SEQ), 2: (frozenset(), 5)}
        if one_by_one:
            live = {0, 1, 2, 3}
            for _ in range(6):
                step = [(seqs[s][-1], s, len(seqs[s]) - 1, True, False) for s in sorted(live)]
                out = ex.run_table(StepTable.of(step, tables, draws))
                for (_, s, pos, _, _), tok in zip(step, out.tokens):
                    seqs[s].append(int(tok))
                    stop_ids, stop_pos = stops.get(s, (frozenset(), MAX_SEQ))
                    if tok in stop_ids or pos + 1 >= stop_pos:
                        live.discard(s)
        else:
            step = [(seqs[s][-1], s, len(seqs[s]) - 1, True, False) for s in range(4)]
            steps0 = ex.steps_run
            out = ex.run_table(StepTable.of(step, tables, draws, steps=6, stops=stops))
            assert ex.steps_run - steps0 == 6
            for (_, s, _, _, _), tok in zip(step, out.tokens):
                seqs[s] += [int(tok)] + out.later.get(s, [])
        kv = [ex.read_buffer("k_cache").copy(), ex.read_buffer("v_cache").copy()]
        runs.append((seqs, kv))
    (a, kva), (b, kvb) = runs
    assert a == b
    # generated: the prompt step's token, then 6 more, or up to the stop token (the third) or
    # the token at the stop position (5)
    lens = {s: len(b[s]) - len(prompts[s]) for s in range(4)}
    assert lens == {0: 7, 1: 3, 2: 5 - len(prompts[2]) + 1, 3: 7}
    for s in range(4):
        rows = [tables[s][p // PAGE] * PAGE + p % PAGE for p in range(len(b[s]) - 1)]
        assert np.array_equal(kva[0][:, rows], kvb[0][:, rows]), s
        assert np.array_equal(kva[1][:, rows], kvb[1][:, rows]), s


def test_a_launch_of_many_steps_ends_early_when_asked(synth_model):
    """``run_table(..., should_stop=...)``: a launch of 8 decode steps of 2 slots whose
    should_stop turns true once the first step's tokens are out ends after its current step or
    the next (the host's stop flag is read at the LM head), and what it made is the start of
    the uninterrupted launch's tokens."""
    from monokernel.kernel.base import DeviceSample

    model = synth_model("llama3-tiny")
    prompts = [prompt_of(model, 4, 90), prompt_of(model, 7, 91)]
    draws = {0: DeviceSample(0.0, 0), 1: DeviceSample(HOT, 5)}
    runs = []
    for early in (False, True):
        ex = KernelExecutor(model, MAX_SEQ, blocks=2, slots=2, step_tokens=12, page_size=PAGE)
        pages = list(ex.add_pages(4))
        tables = {0: pages[:2], 1: pages[2:]}
        rows = [(t, s, p, p == len(pr) - 1, True) for s, pr in enumerate(prompts)
                for p, t in enumerate(pr)]
        first = ex.run_table(StepTable.of(rows, tables, draws))
        step = [(int(t), s, len(p), True, False)
                for s, (p, t) in enumerate(zip(prompts, first.tokens))]
        out_tokens = ex.buffers["out_tokens"]
        asked = []

        def should_stop() -> bool:  # true once slot 0's first decode token is out
            asked.append(1)
            return early and int(out_tokens[len(prompts[0])]) != -1

        steps0 = ex.steps_run
        out = ex.run_table(StepTable.of(step, tables, draws, steps=8), should_stop=should_stop)
        ran = ex.steps_run - steps0
        runs.append((ran, {s: [int(out.tokens[s])] + out.later.get(s, []) for s in (0, 1)}))
        assert asked  # polled while the launch ran
    (full, whole), (ran, part) = runs
    assert full == 8 and 1 <= ran <= 3, ran
    for s in (0, 1):
        assert len(part[s]) == ran and part[s] == whole[s][:ran], s


def test_a_request_arriving_ends_a_launch_early(synth_model):
    """The Batcher on a kernel of 3 slots: two requests decode in launches of up to 8 steps;
    a third, added from another thread while such a launch runs, ends it after its current
    step (it sees Batcher.waiting) and joins at the next step, not when the launch would have
    ended;
    every text is still its solo run's."""
    import threading

    model = synth_model("llama3-tiny")
    ids = [prompt_of(model, n, 70 + n) for n in (5, 7, 4)]
    params = [SamplingParams(max_new_tokens=m, temperature=0.0, ignore_eos=True)
              for m in (20, 20, 6)]
    ex = KernelExecutor(model, MAX_SEQ, blocks=2, slots=3, step_tokens=8, page_size=PAGE)
    eng = Engine(ex, max_num_seqs=3)
    solo = [[s.token for s in eng.generate(p, sp)] for p, sp in zip(ids, params)]
    launches = []  # (steps asked, steps run, rows) of each launch
    real = ex.run_table
    late: dict = {}

    def run_table(table, should_stop=None):
        before = ex.steps_run
        if table.steps > 1 and "thread" not in late:  # the first launch of many steps
            late["thread"] = threading.Thread(
                target=lambda: late.setdefault("gen", iter(eng.generate(ids[2], params[2]))))
            late["thread"].start()
            late["thread"].join()  # add() queued it (no lock: the launch below sees it)
            assert len(eng.batcher.waiting) == 1
        out = real(table, should_stop)
        launches.append((table.steps, ex.steps_run - before, len(table)))
        return out

    ex.run_table = run_table
    got = round_robin(iter(eng.generate(p, sp)) for p, sp in zip(ids[:2], params[:2]))
    got.append([s.token for s in late["gen"]])  # made beside the others, queued for it
    assert got == solo
    first = next(i for i, (asked, _, _) in enumerate(launches) if asked > 1)
    asked, ran, _ = launches[first]
    assert asked == 8 and ran <= 3, launches  # ended early for the newcomer
    # the next launch carries the newcomer's prompt (4 rows) beside the two decode rows
    assert launches[first + 1][2] == 2 + len(ids[2]), launches


def test_a_steps_rows_are_dealt_over_their_kv_groups_unit_slots(synth_model):
    """Rows rotated over the unit slots (megakernel.cu split_slot): in a step of many rows,
    row r's split s is computed in its KV group's slot (s + off_r) mod splits, off_r the used
    splits of the earlier rows, so short rows do not all run on the block holding split 0.
    Four sequences' first rows (one split each) then a step of rows of 2, 1 and 3 splits:
    the last layer's partials (attn_o) sit exactly at the rotated slots, the rest untouched;
    the per-block merge (merge_ticket_min 0) reads them there (logits: the reference's)."""
    model = synth_model("llama3-tiny")
    c = model.config
    S = 4
    ex = KernelExecutor(model, MAX_SEQ, blocks=4, slots=4, step_tokens=8, page_size=PAGE,
                        attn_splits=S, attn_min_chunk=2, merge_ticket_min=0)
    prompts = [prompt_of(model, n, seed) for n, seed in ((3, 1), (1, 2), (5, 3), (1, 4))]
    b = Batch(ex)
    for slot, p in enumerate(prompts):
        b.join(slot, p)

    def written_slots(rows: int) -> list[list[int]]:
        o = ex.read_buffer("attn_o")[:rows * c.num_kv_heads * S * c.group_size * c.head_dim]
        o = o.reshape(rows, c.num_kv_heads, S, -1)
        done = ~np.isnan(o).all(axis=-1)
        assert (done == done[:, :1]).all(), "every KV group alike"
        return [np.flatnonzero(done[r, 0]).tolist() for r in range(rows)]

    ex.poison()
    b.step({0: 1, 1: 1, 2: 1, 3: 1})  # four rows at position 0: one split each
    assert written_slots(4) == [[0], [1], [2], [3]]
    ex.poison()
    # rows at positions 1, 2 (sequence 0: 2 splits of 2 each) , 1 (sequence 2) and 1
    # (sequence 0 of the rows; used: 1, 2, 1 ... as split_chunk gives)
    b.step({0: 2, 2: 1})
    used = [-(-(p + 1) // max(2, -(-(p + 1) // S))) for p in (1, 2, 1)]
    assert used == [1, 2, 1]
    assert written_slots(3) == [[0], [1, 2], [3]]
    ex.poison()
    b.step({2: 3})  # positions 2, 3, 4 of sequence 2: 2, 2 and 3 splits
    assert written_slots(3) == [[0, 1], [2, 3], [0, 1, 2]]
    for slot in (0, 2):  # the merge read each row's splits where they ran
        seq = b.seqs[slot]
        ref = ReferenceModel(c, model.weights, MAX_SEQ).forward(prompts[slot][:seq["done"]], 0)
        for pos, lg in seq["logits"].items():
            assert_logits_match(lg[None], ref[pos][None], f"sequence {slot} position {pos}")
