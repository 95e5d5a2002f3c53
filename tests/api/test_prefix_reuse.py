"""Prefix reuse is exact (issues 16, 17): one seed and one set of parameters give one text, and
the same logprobs bit for bit, whether or not the engine reused cached K/V of an earlier
request's prompt, on the numpy backend, the emulator and through the server.

The cause it guards against: the numpy reference computed the reused prompt's tail (often its
last token alone: a matrix-vector product) through other BLAS calls than a fresh prefill (one
matrix-matrix product over the whole prompt), and BLAS rounds a row differently by how many rows
go with it: SmolLM2's first logits moved by up to 5e-3, enough to flip a Gumbel draw. The numpy
backend now batches (batching.py): every prompt row runs in blocks of ReferenceModel.row_block
rows, one BLAS call of the same shape each, which round a row alike whatever else is in it
(on any BLAS: the block is probed), so a prompt's K/V
are the same in any chunking and any batch, and the engine's prefix cache reuses whole K/V
pages of earlier prompts (a decode step may run alone, so generated tokens' pages are not kept).
The one-sequence path's fixed ``prefill_chunk`` cuts (the executor's own ``prefill``, which
tools use) are checked here too.
"""

from __future__ import annotations

import numpy as np
import pytest

from monokernel import LLM, ParameterError, SamplingParams
from monokernel.runtime import make_executor

from helpers.kernel import MAX_SEQ  # the emulator build of this length is shared

# the request, behind a system message long enough to span two prefill chunks; the
# second conversation shares the system message and the first words of the question
SYSTEM = {"role": "system", "content": "Tu es un assistant qui répond en français, avec des "
                                       "phrases courtes et des accents : é, è, à, ç, ô."}
FOREST = [SYSTEM, {"role": "user", "content": "Écris une phrase sur la forêt, s'il te plaît."}]
SEA = [SYSTEM, {"role": "user", "content": "Écris une phrase sur la mer, s'il te plaît."}]


def logprobs(c) -> list[float]:
    return [t.logprob for t in c.logprobs]


def fresh(llm, run):
    """``run()`` with prefix caching off: every prompt prefilled from position 0."""
    llm.engine.prefix_caching = False
    try:
        return run()
    finally:
        llm.engine.prefix_caching = True


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ==== numpy, the bundled model: the request ============================================

def test_a_seeded_chat_gives_one_text_with_or_without_reuse(bundled_llm):
    """The same seeded chat, again and again on one LLM, then a conversation that shares only
    its head, then the first again: every reply equals the one prefilled from scratch. Before
    the fix the repeated request reused all but the last prompt token and its logprobs
    differed from the fresh run's (its text too, for some seeds)."""
    llm = bundled_llm
    p = SamplingParams(temperature=0.9, seed=2, max_tokens=6, logprobs=0)
    want = {"forest": fresh(llm, lambda: llm.chat(FOREST, p)),
            "sea": fresh(llm, lambda: llm.chat(SEA, p))}
    ids = {k: c.prompt_token_ids for k, c in want.items()}
    asked = ["forest", "forest", "sea", "forest"]
    got = [llm.chat(FOREST if name == "forest" else SEA, p) for name in asked]
    for name, c in zip(asked, got):
        w = want[name]
        assert (c.text, c.token_ids) == (w.text, w.token_ids), name
        assert logprobs(c) == logprobs(w), name  # bit for bit
    # the fresh runs cached nothing (prefix caching off); then the forest's pages are in the
    # cache: a repeat reuses all its whole pages (its last token always runs), the sea those
    # of the head it shares with the forest (or more, if an earlier test cached the sea)
    ps = llm.engine.batcher.pool.page_size

    def whole(n: int) -> int:
        return n - n % ps

    n_forest, head = len(ids["forest"]) - 1, common(ids["forest"], ids["sea"])
    assert [c.reused_prompt_tokens for c in got[1::2]] == [whole(n_forest)] * 2
    assert whole(head) <= got[2].reused_prompt_tokens <= whole(len(ids["sea"]) - 1)
    assert all(c.reused_prompt_tokens > 0 for c in got[1:])


# ==== numpy: the chunks and the reuse rules, on the tiny model ===================================

def test_a_prefill_runs_in_chunks_at_fixed_positions(synth_model):
    """Chunks start at multiples of prefill_chunk whatever the first position, so a prefill from
    a chunk boundary makes the calls a fresh one makes there and gets the same logits; only the
    last chunk computes logits, for all its rows, so prefill and prefill_all agree."""
    ex = make_executor("numpy", synth_model("tiny"), 64, threads=1, prefill_chunk=4)
    calls, forward = [], ex.ref.forward

    def spy(tokens, start, logits=True):
        calls.append((start, len(tokens), logits))
        return forward(tokens, start, logits)

    ex.ref.forward = spy
    ids = [5, 6, 7, 300, 41, 9, 77, 78, 500, 3, 12]  # 11 tokens: chunks of 4, 4 and 3
    every = ex.prefill_all(ids, 0)
    assert calls == [(0, 4, True), (4, 4, True), (8, 3, True)] and every.shape == (11, 1000)
    calls.clear()
    last = ex.prefill(ids, 0)
    assert calls == [(0, 4, False), (4, 4, False), (8, 3, True)]
    assert np.array_equal(last, every[-1])
    calls.clear()
    assert np.array_equal(ex.prefill(ids[4:], 4), last)  # the cache holds positions 0..3
    assert calls == [(4, 4, False), (8, 3, True)]
    calls.clear()
    ex.prefill(ids[6:], 6)  # a start inside a chunk: cut at the next multiple
    assert calls == [(6, 2, False), (8, 3, True)]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_a_bad_prefill_chunk_is_refused(synth_dir, bad):
    with pytest.raises(ParameterError, match="prefill_chunk must be an integer >= 1"):
        LLM(synth_dir("tiny"), backend="numpy", progress=False, prefill_chunk=bad)


@pytest.mark.parametrize("page", [4, 1])
def test_reuse_is_whole_pages_and_exact(synth_dir, page):
    """A repeat, a prompt that shares a head, and a next turn that continues the prompt and
    the tokens fed back: the reused length is whole K/V pages of earlier prompts (the tokens
    fed back are not kept: decode steps may run alone), and every output equals the fresh
    run's, logprobs bit for bit."""
    llm = LLM(synth_dir("tiny"), backend="numpy", max_seq_len=MAX_SEQ, progress=False,
              threads=1, page_size=page)
    p = SamplingParams(temperature=1.3, seed=7, max_tokens=4, ignore_eos=True, logprobs=0)
    a = [5, 6, 7, 300, 41, 9, 77, 78, 500, 3, 12]
    first = llm.generate(a, p)
    fed = first.token_ids[:3]  # the last token is sampled, never fed
    b = a[:9] + [600, 601]
    turn = a + fed + [40, 41, 42]

    def round_down(n: int) -> int:
        return n - n % page

    # (the prompt, what it reuses of the prompts cached before it: a's whole pages)
    for prompt, reused in ((a, round_down(len(a) - 1)), (b, round_down(9)),
                           (a, round_down(len(a) - 1)), (turn, round_down(len(a)))):
        got = llm.generate(prompt, p)
        want = fresh(llm, lambda: llm.generate(prompt, p))
        assert got.token_ids == want.token_ids and logprobs(got) == logprobs(want)
        assert got.reused_prompt_tokens == reused, prompt


# ==== the emulator ==============================================================================

def test_reuse_is_exact_on_the_emulator(synth_dir):
    """The kernel prefills one step per token, as it decodes: every position is reusable,
    and the kernel's own sampler (no logprobs asked) draws the same tokens with or without
    reuse: a repeat, a shared head, the next turn."""
    emu = LLM(synth_dir("tiny"), backend="emulator", blocks=2, max_seq_len=MAX_SEQ,
              progress=False)
    assert emu.engine.executor.prefill_chunk == 1
    p = SamplingParams(temperature=1.3, seed=7, max_tokens=3, ignore_eos=True)
    a = [5, 6, 7, 300, 41]
    first = emu.generate(a, p)
    turn = a + first.token_ids[:2] + [40]
    for prompt, reused in ((a, len(a) - 1), ([5, 6, 70, 8], 2), (a, 2), (turn, len(a) + 2)):
        got = emu.generate(prompt, p)
        want = fresh(emu, lambda: emu.generate(prompt, p))
        assert got.token_ids == want.token_ids, prompt
        assert got.reused_prompt_tokens == reused, prompt


# ==== the server ================================================================================

def test_the_server_answers_a_seeded_request_alike_with_or_without_reuse(bundled_llm):
    """The server runs the LLM's engine and has no cache of its own: repeated and
    head-sharing seeded chat requests get the replies (and logprobs) of a fresh prefill, and
    the reused pages are reported as cached_tokens."""
    pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
    import httpx
    from helpers.serve import running_server

    llm = bundled_llm
    body = {"max_tokens": 4, "temperature": 0.9, "seed": 2, "logprobs": True}
    p = SamplingParams(max_tokens=4, temperature=0.9, seed=2, logprobs=0)
    want = {id(m): fresh(llm, lambda: llm.chat(m, p)) for m in (SEA, FOREST)}
    with running_server(llm) as srv, httpx.Client(base_url=srv.url,
                                                  timeout=httpx.Timeout(60.0)) as client:
        asked = (FOREST, SEA, FOREST)  # FOREST first: the same prompt as the last fresh run
        replies = [client.post("/v1/chat/completions", json={**body, "messages": m})
                   for m in asked]
    for msgs, r in zip(asked, replies):
        assert r.status_code == 200, r.text
        r = r.json()
        w = want[id(msgs)]
        choice = r["choices"][0]
        assert choice["message"]["content"] == w.text
        assert [t["logprob"] for t in choice["logprobs"]["content"]] == logprobs(w)
        cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and cached % llm.engine.batcher.pool.page_size == 0
