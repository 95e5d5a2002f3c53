"""The HTTP server over raw HTTP (httpx): every endpoint's shape, results equal to the Python
API's, server-sent events, and bad requests answered with 400/404/413 and OpenAI's error JSON
(never a 500, never a dropped connection). Then the queue: 503 at once when it is full, and a
client that goes away frees the engine for the next request. Last, ``monokernel serve`` as a
command. Servers run on 127.0.0.1, on a port the OS picks, and are gone when each test ends.

The tiny synthetic model (numpy backend) keeps requests fast; the bundled SmolLM2 gives real
text (" Paris") and generations slow enough (~15 tokens/s) to cancel or fill the queue behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.serve import free_port, port_is_closed, running_server, sse_events

import httpx

from monokernel import LLM, SamplingParams

# alone, after the parallel part of make test: cancellations and disconnects must act in seconds
pytestmark = pytest.mark.serial

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture(scope="module")
def tiny_llm(synth_dir):
    return LLM(synth_dir("tiny"), backend="numpy", progress=False)


@pytest.fixture(scope="module")
def tiny_server(tiny_llm):
    with running_server(tiny_llm) as srv:
        yield srv


@pytest.fixture
def client(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=TIMEOUT) as c:
        yield c


def error_of(r: httpx.Response, status: int, param: str | None = "any") -> str:
    """Assert OpenAI's error JSON with this status (and this ``param``); return the message."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error"), err
    if param != "any":
        assert err["param"] == param, err
    return err["message"]


def counts(usage: dict) -> dict:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


# ---- endpoints ------------------------------------------------------------------------------
def test_health_models_tokenize(client, tiny_llm, tiny_server):
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok", h.text
    name = tiny_server.app.state.server.model_name
    assert name == tiny_llm.config.name
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [name]
    assert models["data"][0]["max_model_len"] == tiny_llm.engine.executor.max_seq_len
    assert client.get(f"/v1/models/{name}").json()["id"] == name
    error_of(client.get("/v1/models/gpt-4o"), 404, "model")

    prompt = "Hello world, how are you?"
    ids = tiny_llm.encode(prompt)
    t = client.post("/tokenize", json={"prompt": prompt}).json()
    assert t["tokens"] == ids and t["count"] == len(ids)
    d = client.post("/detokenize", json={"tokens": ids}).json()
    assert d["prompt"] == tiny_llm.tokenizer.decode(ids, skip_special_tokens=False)
    msgs = [{"role": "user", "content": "hi"}]
    t = client.post("/tokenize", json={"messages": msgs}).json()
    assert t["tokens"] == tiny_llm.encode(tiny_llm.apply_chat_template(msgs),
                                          add_special_tokens=False)
    error_of(client.post("/detokenize", json={"tokens": [10 ** 6]}), 400, "tokens")
    error_of(client.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


def test_completion_equals_the_api(client, tiny_llm):
    prompt = "The quick brown fox"
    for sampling in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.8, "seed": 7}):
        want = tiny_llm.generate(prompt, SamplingParams(max_tokens=12, **sampling))
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12,
                                                  "return_token_ids": True, **sampling})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        (ch,) = body["choices"]
        assert ch["text"] == want.text and ch["token_ids"] == want.token_ids, sampling
        assert ch["finish_reason"] == want.finish_reason
        assert ch["prompt_token_ids"] == tiny_llm.encode(prompt)
        assert counts(body["usage"]) == want.usage()
    # token ids as the prompt, and a batch of one, give the same text
    ids = tiny_llm.encode(prompt)
    a = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0})
    b = client.post("/v1/completions", json={"prompt": [prompt], "max_tokens": 6,
                                             "temperature": 0})
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    e = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3,
                                             "temperature": 0, "echo": True}).json()
    assert e["choices"][0]["text"].startswith(prompt)


def test_echo_with_logprobs(client, tiny_llm):
    """echo: the prompt's tokens come first, the first with null logprobs (nothing predicts it),
    the others with the prompt logprobs the API computes."""
    prompt = "Alpha beta gamma"
    ids = tiny_llm.encode(prompt)
    want = tiny_llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=1,
                                                    prompt_logprobs=1))
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4,
                                              "temperature": 0, "logprobs": 1, "echo": True})
    ch = r.json()["choices"][0]
    assert ch["text"] == prompt + want.text
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(ids) + len(want.token_ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    wanted = [e.logprob for e in want.prompt_logprobs[1:]] + [e.logprob for e in want.logprobs]
    assert lp["token_logprobs"][1:] == pytest.approx(wanted, abs=1e-4)
    assert lp["text_offset"][0] == 0 and lp["text_offset"][len(ids)] == len(
        "".join(lp["tokens"][:len(ids)]))


@pytest.mark.parametrize("content", [
    [{"type": "text", "text": "Hi there"}],
    [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
])
def test_chat_content_parts(client, tiny_llm, content):
    """OpenAI's content parts reach the API as they are: the prompt is the API's, which is the
    parts' texts joined by newlines (as vLLM does)."""
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": content}], "max_tokens": 5, "temperature": 0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    joined = [{"role": "user", "content": "\n".join(p["text"] for p in content)}]
    assert r.json()["choices"][0]["prompt_token_ids"] == tiny_llm.chat_prompt_ids(joined)


def test_stop_string(client, tiny_llm):
    prompt = "Count: 1 2 3"
    free = tiny_llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.8, seed=1))
    assert len(free.text) > 4, free.text
    stop = free.text[2:4]
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16,
                                              "temperature": 0.8, "seed": 1, "stop": [stop]})
    ch = r.json()["choices"][0]
    assert ch["text"] == free.text[:free.text.index(stop)] and ch["finish_reason"] == "stop"


def stream_events(client: httpx.Client, path: str, body: dict) -> list:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


@pytest.mark.parametrize("include_usage", [False, True])
def test_completion_stream_chunks(client, tiny_llm, include_usage):
    body = {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 1.0, "seed": 11,
            "return_token_ids": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    events = stream_events(client, "/v1/completions", body)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    if include_usage:
        *chunks, last = chunks
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 20
        assert all(c["usage"] is None for c in chunks)
    else:
        assert all("usage" not in c for c in chunks)
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "text_completion" for c in chunks)
    choices = [c["choices"][0] for c in chunks]
    assert [ch["finish_reason"] for ch in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1]["finish_reason"] == whole["finish_reason"] == "length"
    assert "".join(ch["text"] for ch in choices) == whole["text"]
    assert sum((ch["token_ids"] for ch in choices), []) == whole["token_ids"]


def test_chat_stream_equals_chat(client, tiny_llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    want = tiny_llm.chat(msgs, SamplingParams(max_tokens=10, temperature=0.7, seed=5))
    body = {"messages": msgs, "max_tokens": 10, "temperature": 0.7, "seed": 5}
    r = client.post("/v1/chat/completions", json=body).json()
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    msg = r["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": want.text}
    assert counts(r["usage"]) == want.usage()
    events = stream_events(client, "/v1/chat/completions",
                           {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert usage["usage"] == r["usage"] and usage["choices"] == []
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    assert "".join(d.get("content", "") for d in deltas) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == want.finish_reason


def test_the_next_turn_reuses_the_conversation_s_cache(client, tiny_llm):
    """A follow-up turn shares the rendered history with the previous request: its K/V is
    reused (the first prompt's whole K/V pages on the numpy backend), and usage says so
    as OpenAI does (prompt_tokens_details.cached_tokens)."""
    msgs = [{"role": "user", "content": "Tell me about cats."}]
    body = {"max_tokens": 6, "temperature": 0}
    first = client.post("/v1/chat/completions", json={**body, "messages": msgs}).json()
    msgs += [first["choices"][0]["message"], {"role": "user", "content": "And dogs?"}]
    second = client.post("/v1/chat/completions", json={**body, "messages": msgs}).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    n1, chunk = first["usage"]["prompt_tokens"], tiny_llm.engine.batcher.pool.page_size
    assert 0 < n1 - n1 % chunk == cached < second["usage"]["prompt_tokens"]


def test_chat_template_kwargs_reach_the_template(tmp_path, synth_dir):
    """A template that reads a variable: the kwarg changes the prompt the model sees."""
    import shutil

    d = tmp_path / "tiny-kw"
    shutil.copytree(synth_dir("tiny"), d)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                           "{% endfor %}{% if shout %}LOUDLY {% endif %}assistant:")
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    llm = LLM(d, backend="numpy", progress=False)
    msgs = [{"role": "user", "content": "hello"}]
    with running_server(llm) as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        plain = c.post("/tokenize", json={"messages": msgs}).json()["count"]
        loud = c.post("/tokenize", json={"messages": msgs,
                                         "chat_template_kwargs": {"shout": True}}).json()["count"]
        assert loud > plain
        for kw, n in (({}, plain), ({"shout": True}, loud)):
            r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2,
                                                     "chat_template_kwargs": kw})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == n, kw


def test_paris_on_the_bundled_model(bundled_llm):
    with running_server(bundled_llm) as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/completions", json={"prompt": "The capital of France is",
                                             "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == " Paris."


def test_engine_failure_mid_stream(client, tiny_llm, monkeypatch):
    """The engine fails after two tokens: a stream (its headers already sent) ends with OpenAI's
    error JSON as an event, then [DONE]; a plain request gets a 500 with that JSON; the server
    serves the next request."""
    from monokernel.errors import NumericalError

    real = tiny_llm.stream

    class Failing:
        def __init__(self, s):
            self.s, self.completion = s, None

        def deltas(self):
            for i, d in enumerate(self.s.deltas()):
                if i == 2:
                    raise NumericalError("logits hold 3 NaN values (injected by the test)")
                yield d

        def close(self):
            self.s.close()

    monkeypatch.setattr(tiny_llm, "stream", lambda *a, **k: Failing(real(*a, **k)))
    body = {"prompt": "Once", "max_tokens": 8, "return_token_ids": True}
    events = stream_events(client, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    assert [len(e["choices"][0]["token_ids"]) for e in events[:-2]] == [1, 1]
    err = events[-2]["error"]
    assert err["type"] == "server_error" and "NaN" in err["message"], err
    assert "NaN" in error_of(client.post("/v1/completions", json=body), 500)
    monkeypatch.undo()
    assert client.post("/v1/completions", json=body).status_code == 200


# ---- bad requests -----------------------------------------------------------------------------
LONG = "word " * 600  # > 512 tokens: past the tiny model's context

BAD = [  # (path, raw body, status, param)
    ("/v1/completions", '{"prompt": "a", ', 400, None),
    ("/v1/completions", "", 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", "[" * 100_000, 400, None),  # deeper than json's recursion limit
    ("/v1/completions", '{"prompt": "\\ud800 lone surrogate"}', 400, None),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),  # not UTF-8
    ("/v1/completions", '{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "a", "max_tokens": "8"}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "a", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "a", "temperature": "hot"}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "a", "temperature": -1}', 400, "temperature"),
    ("/v1/completions", '{"prompt": "a", "top_p": 0}', 400, "top_p"),
    ("/v1/completions", '{"prompt": "a", "top_k": -5}', 400, "top_k"),
    ("/v1/completions", '{"prompt": "a", "seed": 1.5}', 400, "seed"),
    ("/v1/completions", '{"prompt": "a", "stop": 5}', 400, "stop"),
    ("/v1/completions", '{"prompt": "a", "stream": "yes"}', 400, "stream"),
    ("/v1/completions", '{"prompt": "a", "n": 2}', 400, "n"),
    ("/v1/completions", '{"prompt": "a", "logprobs": 21}', 400, "logprobs"),
    ("/v1/completions", '{"prompt": "a", "logit_bias": {"5": 10}}', 400, "logit_bias"),
    ("/v1/completions", '{"prompt": "a", "stream_options": 3}', 400, "stream_options"),
    ("/v1/completions", '{"max_tokens": 3}', 400, "prompt"),
    ("/v1/completions", '{"prompt": ""}', 400, "prompt"),
    ("/v1/completions", '{"prompt": []}', 400, "prompt"),
    ("/v1/completions", '{"prompt": {"text": "a"}}', 400, "prompt"),
    ("/v1/completions", '{"prompt": ["a", "b"]}', 400, "prompt"),
    ("/v1/completions", '{"prompt": [1, 2, 999999]}', 400, "prompt"),
    ("/v1/completions", '{"prompt": "a", "model": 7}', 400, "model"),
    ("/v1/completions", '{"prompt": "a", "model": "gpt-4o"}', 404, "model"),
    ("/v1/completions", json.dumps({"prompt": LONG}), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": LONG, "stream": True}), 400, "prompt"),
    ("/v1/chat/completions", '{"model": "gpt-4o", "messages": []}', 400, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], '
                             '"model": "gpt-4o"}', 404, "model"),
    ("/v1/chat/completions", '{"messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", '{"messages": [{"content": "hi"}]}', 400, "messages[0].role"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}]}', 400,
     "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], "n": 3}', 400,
     "n"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], '
                             '"top_logprobs": 2}', 400, "top_logprobs"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], '
                             '"tools": [{"type": "function"}]}', 400, "tools"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], '
                             '"response_format": {"type": "json_object"}}', 400,
     "response_format"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], '
                             '"chat_template_kwargs": [1]}', 400, "chat_template_kwargs"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": LONG}],
                                         "stream": True}), 400, "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": '
                             '[{"type": "image_url", "image_url": {"url": "x"}}]}]}', 400,
     "messages"),
    ("/tokenize", '{"prompt": 5}', 400, "prompt"),
    ("/tokenize", "{oops", 400, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD,
                         ids=[f"{i}-{p.strip('/').split('/')[-1]}" for i, (p, *_) in
                              enumerate(BAD)])
def test_bad_request_gets_openai_error(client, path, body, status, param):
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    error_of(r, status, param)


def test_oversize_body_and_unknown_route(client):
    from monokernel.serve.app import MAX_BODY_BYTES

    r = client.post("/v1/completions", content=b"x" * (MAX_BODY_BYTES + 1))
    error_of(r, 413)
    error_of(client.get("/v1/nothing-here"), 404)
    error_of(client.get("/v1/completions"), 405)
    # the server is still fine after all of that
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


# ---- the queue --------------------------------------------------------------------------------
def wait_for(cond, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


LONG_RUN = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}  # ~25 s on the bundled model: never left to end


@pytest.mark.parametrize("seqs", [1, 2])
def test_full_queue_answers_503_at_once(bundled_llm, seqs):
    """``seqs`` long requests run at once (--max-num-seqs; 1: FIFO), B waits in the queue of
    one, C is refused with 503 at once; when the long ones' clients leave, B runs."""
    import contextlib
    import threading

    with running_server(bundled_llm, max_queue=1, max_num_seqs=seqs) as srv, \
            contextlib.ExitStack() as stack:
        a, b, c = (stack.enter_context(httpx.Client(base_url=srv.url, timeout=TIMEOUT))
                   for _ in range(3))
        long = [stack.enter_context(a.stream("POST", "/v1/completions", json=LONG_RUN))
                for _ in range(seqs)]
        lines = [r.iter_lines() for r in long]  # (a dropped iterator would close its stream)
        for it in lines:
            assert next(it).startswith("data: ")  # it runs
        assert srv.worker.stats()["running"] == seqs
        got: dict = {}
        tb = threading.Thread(target=lambda: got.update(
            b=b.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                              "temperature": 0})))
        tb.start()
        try:
            wait_for(lambda: srv.worker.stats()["queued"] == 1, what="B to queue")
            t0 = time.monotonic()
            rc = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert time.monotonic() - t0 < 2.0
            assert "queue is full" in error_of(rc, 503)
            assert rc.json()["error"]["code"] == "queue_full"
        finally:
            for r in long:
                r.close()  # the long requests' clients leave: B runs next
            tb.join(30)
        assert got["b"].status_code == 200, got["b"].text
        assert got["b"].json()["usage"]["completion_tokens"] == 2
        # the metrics count the long ones (their clients left) as cancelled, and C (refused)
        # not at all
        m = a.get("/metrics").text
        assert (f'monokernel_request_cancellations_total{{reason="cancelled"}} {seqs}.0'
                in m), m
        assert 'monokernel_requests_total{route="/v1/completions",status="503"} 1.0' in m


def test_disconnect_cancels_and_the_next_request_runs(bundled_llm):
    # one request at a time (FIFO), so that a request waits in the queue behind a long one
    with running_server(bundled_llm, max_num_seqs=1) as srv, \
            httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        for path, body in (("/v1/completions", LONG_RUN),
                           ("/v1/chat/completions",
                            {**LONG_RUN, "prompt": None,
                             "messages": [{"role": "user", "content": "A long story?"}]})):
            with c.stream("POST", path, json=body) as r:
                lines = r.iter_lines()
                for _ in range(6):  # a few tokens arrive, then the client hangs up
                    next(lines)
            t0 = time.monotonic()
            r = c.post("/v1/completions", json={"prompt": "The capital of France is",
                                                 "max_tokens": 2, "temperature": 0})
            took = time.monotonic() - t0
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == " Paris."
            assert took < 8.0, f"the next request waited {took:.1f} s: the stream was not cancelled"
        # a request whose client leaves while it waits in the queue never runs
        with c.stream("POST", "/v1/completions", json=LONG_RUN) as r:
            lines = r.iter_lines()  # (a dropped iterator would close the response)
            next(lines)  # A runs
            with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as b:
                with pytest.raises(httpx.ReadTimeout):
                    b.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=0.5)
            wait_for(lambda: srv.worker.stats()["queued"] == 0, 5.0, "B to leave the queue")
            assert srv.worker.stats()["cancelled"] == 3
        # a non-streaming request whose client gives up is cancelled too
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={**LONG_RUN, "stream": False}, timeout=1.0)
        wait_for(lambda: not srv.worker.stats()["running"], 8.0, "the engine to be freed")
        assert srv.worker.stats()["cancelled"] == 5


# ---- the command ------------------------------------------------------------------------------
def test_serve_command(synth_dir):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "monokernel", "serve", "--model",
                          str(synth_dir("tiny")), "--backend", "numpy", "--port", str(port),
                          "--served-model-name", "tiny-test", "--log-level", "warning"],
                         env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert p.poll() is None, p.communicate()
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "monokernel serve did not come up"
            time.sleep(0.2)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny-test"]
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-test", "prompt": "Hi",
                                                      "max_tokens": 3}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        p.send_signal(signal.SIGINT)
        try:
            _, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
    assert p.returncode == 0, err
    assert f"on http://127.0.0.1:{port}/v1" in err and "Traceback" not in err
    assert port_is_closed(port)


def test_serve_without_the_extra_says_what_to_install():
    from helpers.extras import BLOCKER

    code = "import sys\nfrom monokernel.cli import main\nsys.exit(main(['serve']))\n"
    r = subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "pip install monokernel[serve]" in r.stderr and "Traceback" not in r.stderr


def test_serve_on_a_port_in_use_is_a_clear_error(synth_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(os.environ,
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, "-m", "monokernel", "serve", "--model",
                            str(synth_dir("tiny")), "--backend", "numpy", "--port", str(port)],
                           capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr
