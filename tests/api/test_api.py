"""The public API on the bundled SmolLM2-135M-Instruct with the NumPy backend: greedy text,
Completion fields, finish reasons, stop strings and stop tokens, streaming, chat, seeds and the
sampling-parameter aliases. Generations are kept short: the NumPy reference does ~40 tokens/s."""

from __future__ import annotations

import pytest

from monokernel import LLM, Completion, SamplingParams, Stream

PROMPT = "The capital of France is"
GREEDY16 = SamplingParams(max_new_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def greedy16(bundled_llm) -> Completion:
    return bundled_llm.generate(PROMPT, GREEDY16)


def test_greedy_paris(greedy16, bundled_llm):
    assert greedy16.text.startswith(" Paris.")
    assert isinstance(greedy16, Completion) and str(greedy16) == greedy16.text
    assert greedy16.backend == "numpy" == bundled_llm.backend
    assert greedy16.prompt_token_ids == bundled_llm.encode(PROMPT)
    assert greedy16.decode_tokens_per_s > 0 and greedy16.elapsed_s > 0


def test_length_finish(greedy16, bundled_llm):
    assert greedy16.finish_reason == "length"
    assert len(greedy16.token_ids) == 16
    assert all(isinstance(t, int) for t in greedy16.token_ids)
    assert bundled_llm.tokenizer.decode(greedy16.token_ids) == greedy16.text
    # greedy is deterministic: a second run gives the same tokens
    again = bundled_llm.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.0))
    assert again.token_ids == greedy16.token_ids[:6]


def test_stop_string_spanning_tokens(greedy16, bundled_llm):
    # greedy text is " Paris.\n\nThe answer is: ..."; ".\n\nThe" spans four tokens
    cut = greedy16.text.index(".\n\nThe")
    c = bundled_llm.generate(PROMPT, GREEDY16.replace(stop=("zzz", ".\n\nThe")))
    assert c.finish_reason == "stop"
    assert c.text == greedy16.text[:cut] == " Paris"
    assert ".\n\nThe" not in c.text
    # it stopped at the token that completed the stop string, not at max_new_tokens
    assert c.token_ids == greedy16.token_ids[:len(c.token_ids)]
    assert len(c.token_ids) < 16


def test_stop_token_ids(greedy16, bundled_llm):
    period = greedy16.token_ids[1]
    assert bundled_llm.tokenizer.decode([period]) == "."
    c = bundled_llm.generate(PROMPT, GREEDY16.replace(stop_token_ids=(period,)))
    assert c.finish_reason == "stop"
    assert c.token_ids == greedy16.token_ids[:1]  # the stop token is not part of the output
    assert c.text == " Paris"


def test_eos_stops_unless_ignored(bundled_llm):
    # the chat model ends its answer with <|im_end|> (id 2, its EOS)
    msgs = [{"role": "user", "content": "Say OK."}]
    c = bundled_llm.chat(msgs, SamplingParams(max_new_tokens=24, temperature=0.0))
    assert c.finish_reason == "stop" and len(c.token_ids) < 24
    assert 2 not in c.token_ids and "<|im_end|>" not in c.text
    n = len(c.token_ids)
    c2 = bundled_llm.chat(msgs, SamplingParams(max_new_tokens=n + 2, temperature=0.0,
                                               ignore_eos=True))
    assert c2.token_ids[:n] == c.token_ids and c2.token_ids[n] == 2
    assert c2.finish_reason == "length"


def test_stream_pieces_join_to_the_text(greedy16, bundled_llm):
    s = bundled_llm.stream(PROMPT, GREEDY16)
    assert isinstance(s, Stream) and s.completion is None
    pieces = list(s)
    assert len(pieces) > 3 and all(pieces)
    assert "".join(pieces) == s.completion.text == greedy16.text
    assert s.completion.token_ids == greedy16.token_ids


def test_stream_with_stop_string(greedy16, bundled_llm):
    s = bundled_llm.stream(PROMPT, GREEDY16.replace(stop="answer"))
    joined = "".join(s)
    assert joined == s.completion.text == greedy16.text[:greedy16.text.index("answer")]
    assert s.completion.finish_reason == "stop"


def test_generate_batch_of_prompts(greedy16, bundled_llm):
    outs = bundled_llm.generate([PROMPT, "Hello"], SamplingParams(max_new_tokens=3))
    assert isinstance(outs, list) and len(outs) == 2
    assert outs[0].token_ids == greedy16.token_ids[:3]
    assert outs[1].prompt_token_ids == bundled_llm.encode("Hello")


def test_generate_from_token_ids(greedy16, bundled_llm):
    c = bundled_llm.generate(bundled_llm.encode(PROMPT), SamplingParams(max_new_tokens=4))
    assert c.token_ids == greedy16.token_ids[:4]


def test_chat(bundled_llm):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    c = bundled_llm.chat(msgs, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert c.text.strip()
    rendered = bundled_llm.apply_chat_template(msgs)
    assert rendered.endswith("<|im_start|>assistant\n")
    tok = bundled_llm.tokenizer
    ids = c.prompt_token_ids
    im_start = tok.token_to_id("<|im_start|>")
    # one template: system, user and assistant headers once each, no doubled BOS/<|im_start|>
    assert ids[0] == im_start and ids[1] != im_start
    assert ids.count(im_start) == 3
    assert ids.count(bundled_llm.config.bos_token_id) == 3  # bos 1 is <|im_start|> here
    decoded = tok.decode(ids, skip_special_tokens=False)
    assert decoded == rendered and decoded.count("You are a helpful AI assistant") == 1


def test_chat_prompt_matches_transformers(bundled_llm, bundled_dir):
    transformers = pytest.importorskip("transformers")
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a colour."}]
    hf = transformers.AutoTokenizer.from_pretrained(str(bundled_dir))
    want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert bundled_llm.apply_chat_template(msgs) == want
    want_ids = hf(want, add_special_tokens=False)["input_ids"]
    assert bundled_llm.encode(want, add_special_tokens=False) == want_ids


def test_chat_stream(bundled_llm):
    msgs = [{"role": "user", "content": "Hi"}]
    s = bundled_llm.chat(msgs, SamplingParams(max_new_tokens=6), stream=True)
    assert isinstance(s, Stream)
    assert "".join(s) == s.completion.text


def test_seed_reproducibility(bundled_llm):
    def run(seed):
        return bundled_llm.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=0.8,
                                                           seed=seed)).token_ids
    a = run(1)
    assert len(a) == 16
    assert run(1) == a
    assert run(2) != a


def test_top_k_1_is_greedy(greedy16, bundled_llm):
    c = bundled_llm.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0.8, top_k=1,
                                                    seed=3))
    assert c.token_ids == greedy16.token_ids[:8]


def test_do_sample_false_is_greedy(greedy16, bundled_llm):
    c = bundled_llm.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=1.5,
                                                    do_sample=False, seed=4))
    assert c.token_ids == greedy16.token_ids[:8]


def test_max_tokens_alias(greedy16, bundled_llm):
    c = bundled_llm.generate(PROMPT, SamplingParams(max_tokens=5))
    assert c.finish_reason == "length" and c.token_ids == greedy16.token_ids[:5]


def test_default_params_come_from_generation_config(bundled_llm):
    # the bundled generation_config.json has no do_sample: transformers decodes greedily
    assert bundled_llm.default_params.greedy
    assert 2 in bundled_llm.config.eos_token_ids


def test_sampling_params_errors_reach_the_caller():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_unknown_backend(bundled_dir):
    from monokernel.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="nosuch"):
        LLM(backend="nosuch", progress=False)


def test_a_new_generation_invalidates_an_unfinished_stream(synth_dir):
    """A one-sequence executor (the kernels) holds one KV cache: resuming a stream after
    another generation started must fail loudly instead of continuing from the other
    sequence's cache."""
    from monokernel import LLM, MonokernelError, SamplingParams

    from helpers.kernel import MAX_SEQ  # the emulator build of this length is shared

    llm = LLM(str(synth_dir("tiny")), backend="emulator", blocks=2, max_seq_len=MAX_SEQ,
              progress=False)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    first = llm.stream("the cat", params)
    next(first)
    second = llm.generate("a dog", SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(second.token_ids) == 3
    with pytest.raises(MonokernelError, match="invalidated"):
        list(first)


def test_streams_live_side_by_side_on_a_batched_backend(synth_dir):
    """numpy batches: a generation started while a stream is unfinished runs beside it, and
    the stream goes on with its own text (the one it makes alone)."""
    from monokernel import LLM, SamplingParams

    llm = LLM(str(synth_dir("tiny")), backend="numpy", progress=False)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    alone = llm.generate("the cat", params).text
    first = llm.stream("the cat", params)
    head = next(first)
    second = llm.generate("a dog", SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(second.token_ids) == 3
    assert head + "".join(first) == alone
