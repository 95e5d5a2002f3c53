"""Continuous batching on the numpy backend (issue 17): the scheduler's steps, admission,
cancel, pages, the context's end, and the same text alone, in a batch and with prefix reuse.

Tiny synthetic model, a few tokens each: the whole module runs in seconds.
"""

from __future__ import annotations

import numpy as np
import pytest

from monokernel import LLM, MonokernelError, ParameterError, PromptError, SamplingParams
from monokernel.kernel.isa import StopReason
from monokernel.runtime import Engine, make_executor

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def engine(synth_model, max_seq_len=64, **kw) -> Engine:
    ex = make_executor("numpy", synth_model("tiny"), max_seq_len, threads=1, page_size=4)
    return Engine(ex, **kw)


def spy_tables(eng: Engine) -> list:
    """Record every StepTable the executor runs: (rows as (slot, position, logits, prompt))."""
    seen, run = [], eng.executor.run_table

    def spy(table):
        seen.append([(int(s), int(p), bool(g), bool(q)) for s, p, g, q in
                     zip(table.slots, table.positions, table.logits, table.prompt_rows)])
        return run(table)

    eng.executor.run_table = spy
    return seen


def prompt(n: int, start: int = 5) -> list[int]:
    return [(start + 37 * i) % 900 + 3 for i in range(n)]


def test_decode_tokens_and_prompt_chunks_share_one_budget(synth_model):
    """A decodes; B (a prompt of 20) arrives mid-run and is admitted at the next step boundary,
    prefilled in chunks of what the budget (8) leaves beside A's decode token; A never waits."""
    eng = engine(synth_model, max_num_seqs=4, max_num_batched_tokens=8)
    seen = spy_tables(eng)
    a = eng.generate(prompt(5), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    next(a)  # A's prompt ran and its first token came out
    assert seen == [[(0, p, p == 4, True) for p in range(5)]]
    b = eng.generate(prompt(20, 11), GREEDY)
    next(a)
    assert len(seen) == 2 and seen[1][0] == (0, 5, True, False)  # decode first
    assert seen[1][1:] == [(1, p, False, True) for p in range(7)]  # then B's first chunk
    first_b = next(b)  # B's prompt ends two steps later: 7 + 7 + 6 rows, each beside A's token
    assert [len(t) for t in seen] == [5, 8, 8, 7]
    assert seen[3][1:] == [(1, p, p == 19, True) for p in range(14, 20)]
    assert all(len(t) <= 8 for t in seen) and not first_b.stop
    assert len(list(a)) == 6 and len(list(b)) == 3  # A's 8 tokens, B's 4: both finish
    assert eng.batcher.stats()["running"] == 0 and eng.batcher.pool.in_use == 0


def test_a_prompt_longer_than_the_budget_runs_over_several_steps(synth_model):
    eng = engine(synth_model, max_num_seqs=2, max_num_batched_tokens=4)
    seen = spy_tables(eng)
    ids = prompt(10)
    got = [s.token for s in eng.generate(ids, GREEDY)]
    assert [len(t) for t in seen[:3]] == [4, 4, 2] and len(seen) == 3 + 3
    alone = engine(synth_model, max_num_seqs=1, max_num_batched_tokens=64)
    assert [s.token for s in alone.generate(ids, GREEDY)] == got  # any chunking: same tokens


def test_a_cancel_frees_the_slot_and_pages_at_once(synth_model):
    eng = engine(synth_model, max_num_seqs=2, max_num_batched_tokens=16)
    a = eng.generate(prompt(9), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    b = eng.generate(prompt(6, 99), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    next(a)
    pool = eng.batcher.pool
    assert eng.batcher.stats()["running"] == 2 and pool.in_use == 3 + 2  # 4-position pages
    a.close()
    assert eng.batcher.stats()["running"] == 1 and pool.in_use == 2  # A's 3 pages are back
    c = eng.generate(prompt(3, 7), GREEDY)  # the freed slot takes C at the next step
    next(b)  # B's first token was made beside A's: waiting in its queue, no step runs
    assert eng.batcher.stats()["waiting"] == 1
    next(b)
    assert eng.batcher.stats() == {"running": 2, "waiting": 0, "pages_in_use": 3,
                                   "pages": pool.total}
    b.close(), c.close()
    assert pool.in_use == 0 and list(a) == []


def test_when_pages_run_out_a_request_waits_and_one_that_never_fits_is_refused(synth_model):
    """Pages are promised at admission (no preemption): with room for one request's worst
    case, the second waits for the first to end, then runs; one that needs more than the
    whole pool is a PromptError up front."""
    eng = engine(synth_model, max_num_seqs=4, max_num_batched_tokens=32, num_pages=5)
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)  # 8 + 10 -> 5 pages
    a, b = eng.generate(prompt(8), p), eng.generate(prompt(8, 50), p)
    next(a)
    assert eng.batcher.stats()["running"] == 1 and eng.batcher.stats()["waiting"] == 1
    assert eng.batcher.pool.in_use == 2  # pages follow the positions reached, not the promise
    assert len(list(a)) == 9 and len(list(b)) == 10  # B ran once A gave its pages back
    with pytest.raises(PromptError, match="may need 6 K/V pages.*the pool holds 5"):
        eng.generate(prompt(8), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))


def test_a_second_engine_on_one_executor_takes_its_pages_and_the_first_says_so(synth_model):
    first = engine(synth_model, max_num_seqs=2)
    second = Engine(first.executor, max_num_seqs=2)
    assert len(list(second.generate(prompt(5), GREEDY))) == 4
    with pytest.raises(MonokernelError, match="another Engine was made on this numpy executor"):
        list(first.generate(prompt(5), GREEDY))


def test_a_sequence_reaching_the_context_end_stops_there_beside_others(synth_model):
    eng = engine(synth_model, max_seq_len=16, max_num_seqs=2, max_num_batched_tokens=16)
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    a, b = eng.generate(prompt(10), long), eng.generate(prompt(3), GREEDY)
    got_a, got_b = list(a), list(b)
    assert len(got_a) == 16 - 10 and got_a[-1].end is StopReason.POSITION
    assert len(got_b) == 4 and got_b[-1].end is StopReason.POSITION


# ==== through the LLM ============================================================================

@pytest.fixture(scope="module")
def tiny(synth_dir):
    return LLM(synth_dir("tiny"), backend="numpy", max_seq_len=64, progress=False, threads=1,
               page_size=4, max_num_seqs=16)


PROMPTS = [prompt(n, s) for n, s in ((5, 1), (9, 2), (3, 3), (12, 4), (7, 5), (4, 6))]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.2, seed=11, max_tokens=5, ignore_eos=True, logprobs=2)],
    ids=["greedy", "seeded"])
def test_generate_a_list_runs_one_batch_in_order_equal_to_solo_runs(tiny, params):
    """vLLM's semantics: the completions come back in input order and each equals its solo
    run (text and tokens; logprobs to the lone-decode tolerance: a sequence decoding alone
    takes a matrix-vector product, ~1e-5 of the logits' scale away from the batched rows)."""
    tiny.engine.prefix_caching = False
    try:
        solo = [tiny.generate(p, params) for p in PROMPTS]
        steps0 = tiny.engine.batcher.steps
        batch = tiny.generate(PROMPTS, params)
        batch_steps = tiny.engine.batcher.steps - steps0
    finally:
        tiny.engine.prefix_caching = True
    assert [c.prompt_token_ids for c in batch] == PROMPTS
    for s, b in zip(solo, batch):
        assert (b.token_ids, b.text) == (s.token_ids, s.text)
        np.testing.assert_allclose([t.logprob for t in b.logprobs],
                                   [t.logprob for t in s.logprobs], rtol=0, atol=1e-4)
    assert batch_steps <= 1 + 5  # one step prefilled every prompt, then one per token


def test_batch_invariant_numbers_are_bitwise_alone_beside_others_and_with_reuse(synth_dir):
    """With batch_invariant=True even a lone decode step runs the batched product: a
    sequence's logprobs are bit for bit the same alone, beside 1, 5 and 15 others, and when
    its prompt's pages come from the prefix cache of an earlier request."""
    llm = LLM(synth_dir("tiny"), backend="numpy", max_seq_len=64, progress=False, threads=1,
              page_size=4, max_num_seqs=16, batch_invariant=True)
    p = SamplingParams(temperature=0.9, seed=5, max_tokens=4, ignore_eos=True, logprobs=0)
    me = prompt(11, 42)
    llm.engine.prefix_caching = False
    alone = llm.generate(me, p)
    others = [prompt(3 + i % 9, i) for i in range(15)]
    for k in (1, 5, 15):
        got = llm.generate([me] + others[:k], p)[0]
        assert got.token_ids == alone.token_ids, k
        assert [t.logprob for t in got.logprobs] == [t.logprob for t in alone.logprobs], k
    llm.engine.prefix_caching = True
    llm.generate(me, p)  # its prompt pages are cached now
    again = llm.generate([others[0], me], p)[1]
    assert again.reused_prompt_tokens == 8  # two whole pages of 4; the last token always runs
    assert [t.logprob for t in again.logprobs] == [t.logprob for t in alone.logprobs]
    assert again.token_ids == alone.token_ids


def test_prefix_reuse_across_requests_is_exact(tiny):
    """A request whose head an earlier request's prompt filled whole pages of reuses them
    (page granularity: the last prompt token always runs) and gets the fresh run's tokens
    and logprobs bit for bit: prompt rows always run in the batched product."""
    p = SamplingParams(temperature=1.1, seed=3, max_tokens=4, ignore_eos=True, logprobs=0)
    head = PROMPTS[3][:10] + [7, 8, 9]
    tiny.generate(PROMPTS[3], p)  # 12 tokens: pages 0-3 and 4-7 cached
    got = tiny.generate(head, p)
    assert got.reused_prompt_tokens == 8
    tiny.engine.prefix_caching = False
    try:
        fresh = tiny.generate(head, p)
    finally:
        tiny.engine.prefix_caching = True
    assert fresh.reused_prompt_tokens == 0 and got.token_ids == fresh.token_ids
    assert [t.logprob for t in got.logprobs] == [t.logprob for t in fresh.logprobs]


@pytest.mark.parametrize("kw, msg", [
    ({"max_num_seqs": 0}, r"max_num_seqs must be an integer in \[1, 1024\], got 0"),
    ({"max_num_seqs": 2.5}, r"max_num_seqs must be an integer in \[1, 1024\], got 2.5"),
    ({"max_num_seqs": 8, "max_num_batched_tokens": 4},
     r"max_num_batched_tokens must be an integer >= max_num_seqs \(8"),
])
def test_batch_options_are_checked_before_the_model_loads(tmp_path, kw, msg):
    with pytest.raises(ParameterError, match=msg):
        LLM(tmp_path / "nothing-here", backend="numpy", progress=False, **kw)


def test_stop_strings_and_prompt_logprobs_per_request_in_a_batch(tiny):
    """Each request of a batch keeps its own stop strings (its tokens may be made before its
    stream reads them: the stream still ends at its own stop) and its prompt logprobs."""
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    texts = [tiny.generate(p, free).text for p in PROMPTS[:3]]
    stops = [t[len(t) // 2:len(t) // 2 + 2] for t in texts]
    params = [free.replace(stop=[s], prompt_logprobs=1) for s in stops]
    solo = [tiny.generate(p, q) for p, q in zip(PROMPTS[:3], params)]
    batch = tiny.generate(PROMPTS[:3], params)
    for s, b, stop in zip(solo, batch, stops):
        assert stop and b.finish_reason == "stop" and b.stop_reason == stop
        assert (b.text, b.token_ids) == (s.text, s.token_ids)
        assert [e and e.logprob for e in b.prompt_logprobs] == \
            [e and e.logprob for e in s.prompt_logprobs]
