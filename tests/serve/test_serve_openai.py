"""The official ``openai`` client against ``monokernel serve``: completions, chat, streaming and
logprobs give what the Python API gives for the same request, and the client raises its own
error classes (NotFoundError, BadRequestError) for an unknown model and n > 1."""

from __future__ import annotations

import math

import pytest

from helpers.serve import running_server

openai = pytest.importorskip("openai", reason="the openai client is not installed")

from monokernel import LLM, SamplingParams

# JSON carries the float64 logprobs unrounded, but the engine reuses the K/V of the prefix shared
# with the previous request, and K/V prefilled in one pass vs decoded step by step round
# differently in float32: a few ulps of a logit of ~30 (measured 4e-6)
LP_TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_llm(synth_dir):
    return LLM(synth_dir("tiny"), backend="numpy", progress=False)


@pytest.fixture(scope="module")
def server(tiny_llm):
    with running_server(tiny_llm) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                      timeout=30.0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def name(server):
    return server.app.state.server.model_name


def test_models(client, name):
    assert [m.id for m in client.models.list().data] == [name]
    assert client.models.retrieve(name).id == name


def test_completion_with_logprobs(client, name, tiny_llm):
    prompt = "In the beginning"
    want = tiny_llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.8, seed=3,
                                                    logprobs=3))
    r = client.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0.8,
                                  seed=3, logprobs=3)
    (ch,) = r.choices
    assert ch.text == want.text and ch.finish_reason == want.finish_reason
    assert r.usage.completion_tokens == want.usage()["completion_tokens"]
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    lp = ch.logprobs
    n = len(want.token_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    for i, (w, got, top) in enumerate(zip(want.logprobs, lp.token_logprobs, lp.top_logprobs)):
        assert abs(got - w.logprob) <= LP_TOL, i
        assert len(top) == 3 and max(top.values()) <= 0.0
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-9
        assert sorted(top.values(), reverse=True) == pytest.approx(
            [v for _, _, v in w.top], abs=LP_TOL)
    # text_offset: where each token's text starts in the completion
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))


def test_greedy_logprob_is_the_best(client, name):
    r = client.completions.create(model=name, prompt="Once", max_tokens=6, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    for got, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert abs(got - max(top.values())) <= LP_TOL  # greedy picks the argmax


def test_completion_stream(client, name, tiny_llm):
    want = tiny_llm.generate("Far away", SamplingParams(max_tokens=15, temperature=1.0, seed=9))
    chunks = list(client.completions.create(model=name, prompt="Far away", max_tokens=15,
                                            temperature=1.0, seed=9, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].usage.completion_tokens == want.usage()["completion_tokens"]


def test_chat_and_chat_stream_with_logprobs(client, name, tiny_llm):
    msgs = [{"role": "user", "content": "Say something."}]
    want = tiny_llm.chat(msgs, SamplingParams(max_tokens=8, temperature=0.5, seed=2,
                                              logprobs=2))
    r = client.chat.completions.create(model=name, messages=msgs, max_tokens=8,
                                       temperature=0.5, seed=2, logprobs=True, top_logprobs=2)
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.message.content == want.text
    assert ch.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    content = ch.logprobs.content
    assert len(content) == len(want.token_ids)
    for e, w in zip(content, want.logprobs):
        assert abs(e.logprob - w.logprob) <= LP_TOL
        assert [t.logprob for t in e.top_logprobs] == pytest.approx([v for _, _, v in w.top],
                                                                     abs=LP_TOL)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == want.text

    stream = client.chat.completions.create(model=name, messages=msgs, max_tokens=8,
                                            temperature=0.5, seed=2, stream=True,
                                            logprobs=True, top_logprobs=2,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([w.logprob for w in want.logprobs],
                                                          abs=LP_TOL)
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_chat_template_kwargs_through_extra_body(client, name):
    """vLLM's field: the openai client sends it with extra_body; an unknown variable is fine."""
    r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"enable": False}})
    assert r.usage.completion_tokens >= 1


def test_client_errors(client, name):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}],
                                       n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt="word " * 600, max_tokens=2)
    assert "context" in e.value.message


def test_paris_through_the_client(bundled_llm):
    with running_server(bundled_llm) as srv:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        name = srv.app.state.server.model_name
        r = c.completions.create(model=name, prompt="The capital of France is", max_tokens=2,
                                 temperature=0)
        assert r.choices[0].text == " Paris."
        r = c.chat.completions.create(
            model=name, temperature=0, max_tokens=12,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
        c.close()
