"""vLLM-shaped calls: generate(prompts, sampling_params=...) with one or a list of params,
RequestOutput-like results (prompt, outputs[0].text / token_ids / finish_reason / stop_reason),
{"prompt_token_ids": [...]} prompts, batches of token-id lists, n > 1, chat on a list of
conversations, min_tokens, penalties against a from-scratch reference, the tokenizer calls.
The bundled SmolLM2 for text, the tiny synthetic model where only numerics matter."""

from __future__ import annotations

import numpy as np
import pytest

from monokernel import LLM, Completion, ParameterError, SamplingParams, Stream
from monokernel.model.reference import ReferenceModel

PROMPT = "The capital of France is"


# The tiny synthetic model is very sure of itself (top logit ~20 above the next at T=1):
# sampling tests on it use T=10, where seeds really give different texts.
HOT = 10.0


@pytest.fixture(scope="module")
def tiny(synth_dir):
    return LLM(synth_dir("tiny"), backend="numpy", max_seq_len=128, progress=False)


@pytest.fixture(scope="module")
def greedy8(bundled_llm) -> Completion:
    return bundled_llm.generate(PROMPT, SamplingParams(max_tokens=8))


def test_vllm_code_runs_as_pasted(bundled_llm, greedy8):
    prompts = [PROMPT, "Hello, my name is"]
    sampling_params = SamplingParams(temperature=0, top_k=-1, max_tokens=8)
    outputs = bundled_llm.generate(prompts, sampling_params=sampling_params, use_tqdm=False)
    assert len(outputs) == 2
    for output, prompt in zip(outputs, prompts):
        assert output.prompt == prompt
        assert output.prompt_token_ids == bundled_llm.tokenize(prompt)
        o = output.outputs[0]
        assert (o.text, o.token_ids, o.finish_reason) == (output.text, output.token_ids,
                                                          output.finish_reason)
        assert o.index == 0 and o.stop_reason is None and o.finish_reason == "length"
        assert len(o.token_ids) == 8
    assert outputs[0].outputs[0].text == greedy8.text and greedy8.text.startswith(" Paris")
    assert outputs[0].usage() == {"prompt_tokens": 5, "completion_tokens": 8,
                                  "total_tokens": 13}


def test_a_list_of_params_one_per_prompt(bundled_llm, greedy8):
    ps = [SamplingParams(max_tokens=3), SamplingParams(max_tokens=5, temperature=0.9, seed=4)]
    outs = bundled_llm.generate([PROMPT, PROMPT], ps)
    assert outs[0].token_ids == greedy8.token_ids[:3]
    alone = bundled_llm.generate(PROMPT, ps[1])
    assert outs[1].token_ids == alone.token_ids and len(alone.token_ids) == 5
    with pytest.raises(ParameterError, match="2 prompts but 3 SamplingParams"):
        bundled_llm.generate([PROMPT, PROMPT], ps + ps[:1])
    # one prompt, a list of one params (vLLM accepts it)
    assert bundled_llm.generate(PROMPT, ps[:1]).token_ids == greedy8.token_ids[:3]


def test_stop_reason_names_what_stopped(bundled_llm, greedy8):
    c = bundled_llm.generate(PROMPT, SamplingParams(max_tokens=8, stop=["zzz", "."]))
    assert (c.finish_reason, c.stop_reason, c.text) == ("stop", ".", " Paris")
    assert c.outputs[0].stop_reason == "."
    period = greedy8.token_ids[1]
    c = bundled_llm.generate(PROMPT, SamplingParams(max_tokens=8, stop_token_ids=[period]))
    assert (c.finish_reason, c.stop_reason) == ("stop", period)
    assert c.token_ids == greedy8.token_ids[:1]
    # the stop token is not in token_ids, but the model generated it: usage counts it
    assert c.usage()["completion_tokens"] == 2
    # EOS: finish "stop", stop_reason None (vLLM's meaning)
    c = bundled_llm.chat([{"role": "user", "content": "Say OK."}], SamplingParams(max_tokens=24))
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    assert c.usage()["completion_tokens"] == len(c.token_ids) + 1


def test_prompt_token_ids_and_batches_of_ids(bundled_llm, greedy8):
    ids = bundled_llm.tokenize(PROMPT)
    c = bundled_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=4))
    assert c.token_ids == greedy8.token_ids[:4] and c.prompt is None
    assert c.prompt_token_ids == ids
    c = bundled_llm.generate({"prompt": PROMPT}, SamplingParams(max_tokens=2))
    assert c.prompt == PROMPT and c.token_ids == greedy8.token_ids[:2]
    outs = bundled_llm.generate([ids, ids[:3], {"prompt_token_ids": np.array(ids)}],
                                SamplingParams(max_tokens=2))
    assert [o.prompt_token_ids for o in outs] == [ids, ids[:3], ids]
    assert outs[0].token_ids == outs[2].token_ids == greedy8.token_ids[:2]
    # a bare list of ids is one prompt, not a batch
    assert isinstance(bundled_llm.generate(ids, SamplingParams(max_tokens=1)), Completion)


def test_top_k_minus_one_is_off(tiny):
    a = tiny.generate([5, 6, 7], SamplingParams(max_tokens=12, temperature=HOT, seed=3,
                                                top_k=-1))
    b = tiny.generate([5, 6, 7], SamplingParams(max_tokens=12, temperature=HOT, seed=3))
    assert a.token_ids == b.token_ids and len(set(a.token_ids)) > 4
    c = tiny.generate([5, 6, 7], SamplingParams(max_tokens=12, temperature=HOT, seed=3,
                                                top_k=1))
    assert c.token_ids != a.token_ids  # top_k=1 is greedy: -1 really means "off"


def test_n_runs_the_samples_one_after_another(tiny):
    p = SamplingParams(max_tokens=10, temperature=HOT, seed=11, n=3, ignore_eos=True)
    c = tiny.generate([5, 6, 7], p)
    assert [o.index for o in c.outputs] == [0, 1, 2]
    for i, o in enumerate(c.outputs):  # sample i is the run with seed + i
        alone = tiny.generate([5, 6, 7], p.replace(n=1, seed=11 + i))
        assert o.token_ids == alone.token_ids
    assert len({tuple(o.token_ids) for o in c.outputs}) == 3
    assert c.text == c.outputs[0].text
    assert c.usage()["completion_tokens"] == 30
    with pytest.raises(ParameterError, match="n=2"):
        tiny.stream([5, 6, 7], p.replace(n=2))


def test_chat_on_a_list_of_conversations(bundled_llm):
    convs = [[{"role": "user", "content": "Hi"}],
             [{"role": "user", "content": "What is 2+2?"}]]
    p = SamplingParams(max_tokens=6)
    outs = bundled_llm.chat(convs, p)
    assert len(outs) == 2
    for conv, out in zip(convs, outs):
        assert out.token_ids == bundled_llm.chat(conv, p).token_ids
    with pytest.raises(ParameterError, match="one conversation"):
        bundled_llm.chat(convs, p, stream=True)


def test_min_tokens_holds_eos_back(bundled_llm):
    msgs = [{"role": "user", "content": "Say OK."}]
    short = bundled_llm.chat(msgs, SamplingParams(max_tokens=24))
    n = len(short.token_ids)
    assert short.finish_reason == "stop" and n < 20
    longer = bundled_llm.chat(msgs, SamplingParams(max_tokens=n + 6, min_tokens=n + 3))
    assert len(longer.token_ids) >= n + 3
    assert longer.token_ids[:n] == short.token_ids  # the same text until EOS would have come
    assert 2 not in longer.token_ids[:n + 3]
    # stop strings wait for min_tokens too (vLLM's rule)
    c = bundled_llm.generate(PROMPT, SamplingParams(max_tokens=8, stop=" Paris", min_tokens=3))
    assert c.finish_reason == "length" and c.text.startswith(" Paris.")


def reference_penalized_greedy(ref: ReferenceModel, prompt: list[int], n: int, presence: float,
                               frequency: float, repetition: float) -> list[int]:
    """From scratch: full forward of the whole sequence at every step (no KV cache), then
    vLLM's penalties: repetition over prompt + output, presence/frequency over the output."""
    seq, out = list(prompt), []
    for _ in range(n):
        x = ref.forward(seq, 0)[-1].astype(np.float64)
        for t in set(seq):
            x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
        for t in set(out):
            x[t] -= frequency * out.count(t) + presence
        tok = int(np.argmax(x))
        seq.append(tok)
        out.append(tok)
    return out


@pytest.fixture(scope="module")
def bundled_ref(bundled_llm):
    return ReferenceModel(bundled_llm.config, bundled_llm.model.weights, 64)


@pytest.mark.parametrize("presence, frequency, repetition",
                         [(0.0, 1.5, 1.0), (2.0, 0.0, 1.0), (0.4, 0.3, 1.3), (-2.0, -1.0, 1.0)])
def test_penalties_match_a_from_scratch_reference(bundled_llm, bundled_ref, greedy8, presence,
                                                  frequency, repetition):
    p = SamplingParams(max_tokens=8, presence_penalty=presence, frequency_penalty=frequency,
                       repetition_penalty=repetition)
    got = bundled_llm.generate(PROMPT, p).token_ids
    ids = bundled_llm.tokenize(PROMPT)
    assert got == reference_penalized_greedy(bundled_ref, ids, 8, presence, frequency,
                                             repetition)
    assert got != greedy8.token_ids  # the penalties changed something (no test that can't fail)


def test_tokenizer_calls(bundled_llm):
    ids = bundled_llm.tokenize("Hello world")
    assert bundled_llm.detokenize(ids) == "Hello world"
    tok = bundled_llm.get_tokenizer()
    assert tok.encode("Hello world") == ids and tok.decode(ids) == "Hello world"
    assert tok("Hello world")["input_ids"] == ids
    assert tok.eos_token_id == 2
    msgs = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == bundled_llm.apply_chat_template(msgs)
    assert tok.apply_chat_template(msgs, add_generation_prompt=True) == \
        bundled_llm.chat_prompt_ids(msgs)
    assert bundled_llm.model_name == "smollm2-135m-instruct-q4_1"


def test_model_name_is_the_folder(tiny, synth_dir):
    assert tiny.model_name == synth_dir("tiny").name == "tiny"


def test_dict_as_params(tiny):
    a = tiny.generate([5, 6], {"max_tokens": 6, "temperature": HOT, "seed": 2})
    b = tiny.generate([5, 6], SamplingParams(max_tokens=6, temperature=HOT, seed=2))
    c = tiny.generate([5, 6], SamplingParams(max_tokens=6, temperature=HOT, seed=3))
    assert a.token_ids == b.token_ids != c.token_ids
    with pytest.raises(ParameterError, match="max_token"):
        tiny.generate([5, 6], {"max_token": 4})


def test_stream_close_cancels_and_frees_the_engine(tiny):
    p = SamplingParams(max_tokens=50, ignore_eos=True)
    s = tiny.stream([5, 6, 7], p)
    assert isinstance(s, Stream)
    first = [next(s.deltas()) for _ in range(3)]
    s.close()
    assert s.completion.finish_reason == "abort" and s.completion.outputs[0].stop_reason is None
    assert s.completion.token_ids == [t for d in first for t in d.token_ids]
    assert list(s.deltas()) == []  # nothing more comes
    # the engine runs the next request at once, and it is right
    again = tiny.generate([5, 6, 7], p.replace(max_tokens=5))
    assert again.token_ids == tiny.generate([5, 6, 7], p).token_ids[:5]
    # closing a stream that never started
    s = tiny.stream([5, 6, 7], p)
    s.close()
    assert s.completion.finish_reason == "abort" and s.completion.token_ids == []


def test_deltas_join_to_the_completion(bundled_llm, greedy8):
    s = bundled_llm.stream(PROMPT, SamplingParams(max_tokens=8, logprobs=2))
    deltas = list(s.deltas())
    assert "".join(d.text for d in deltas) == greedy8.text == s.completion.text
    assert [t for d in deltas for t in d.token_ids] == greedy8.token_ids
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert [lp for d in deltas for lp in d.logprobs] == s.completion.logprobs


def test_close_from_another_thread_stops_the_generation(tiny):
    """The server's case: a worker thread iterates, the event loop closes on disconnect."""
    import threading

    p = SamplingParams(max_tokens=120, ignore_eos=True)
    s = tiny.stream([5, 6, 7], p)
    got, started = [], threading.Event()

    def work():
        for d in s.deltas():
            got.append(d)
            started.set()
            threading.Event().wait(0.005)  # let the closer run while a step may be running

    t = threading.Thread(target=work)
    t.start()
    assert started.wait(30)
    s.close()
    t.join(30)
    assert not t.is_alive()
    assert 0 < len(got) < 120
    assert s.completion.finish_reason == "abort"
    assert s.completion.token_ids == [x for d in got for x in d.token_ids]
    assert tiny.generate([5, 6, 7], p.replace(max_tokens=3)).finish_reason == "length"


def test_single_prompt_results_read_as_a_list_of_one(bundled_llm, greedy8):
    # vLLM returns a list for one prompt too; pasted code indexes and iterates it
    sp = SamplingParams(max_tokens=8)
    assert bundled_llm.generate(PROMPT, sp)[0].outputs[0].text == greedy8.text
    outs = bundled_llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=3))
    assert [o.outputs[0].text for o in outs] == [outs.text] and len(outs) == 1
    with pytest.raises(IndexError, match="index 1"):
        outs[1]


def test_max_model_len_is_max_seq_len(synth_dir):
    llm = LLM(synth_dir("tiny"), backend="numpy", max_model_len=32, progress=False)
    assert llm.max_seq_len == 32 == llm.engine.executor.max_seq_len
    with pytest.raises(ParameterError, match="not both"):
        LLM(synth_dir("tiny"), backend="numpy", max_model_len=32, max_seq_len=16,
            progress=False)
