"""The server as an operator runs it: bounded requests (max_tokens against the context, the
default max_tokens, the per-request time limit), the graceful shutdown (in process, and
``monokernel serve`` under SIGTERM and SIGINT), /metrics, the request log and x-request-id, the
API key and CORS, and the README's client snippet. Servers listen on 127.0.0.1 only and are
gone when each test ends.

The tiny synthetic model (~800 tokens/s) serves what must be quick; the bundled SmolLM2 on the
numpy backend (~7-15 tokens/s here) serves what must still be running when the test acts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers.serve import port_is_closed, running_server, sse_events

import httpx

from monokernel import LLM

# alone, after the parallel part of make test: its shutdowns and rejections are bounded in seconds
pytestmark = pytest.mark.serial

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = httpx.Timeout(30.0)
LONG = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
        "temperature": 0}  # ~30-60 s on the bundled model: never left to end


@pytest.fixture(scope="module")
def tiny_llm(synth_dir):
    return LLM(synth_dir("tiny"), backend="numpy", progress=False)


def error_of(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ---- bounded requests -----------------------------------------------------------------------
def test_max_tokens_past_the_context_is_a_400_naming_both_numbers(tiny_llm):
    n_ctx = tiny_llm.engine.executor.max_seq_len
    prompt = "The quick brown fox"
    room = n_ctx - len(tiny_llm.encode(prompt))
    msgs = [{"role": "user", "content": "Hi"}]
    chat_room = n_ctx - len(tiny_llm.chat_prompt_ids(msgs))
    with running_server(tiny_llm) as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        for stream in (False, True):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10 ** 9,
                                                 "stream": stream})
            err = error_of(r, 400, "max_tokens_exceeds_context")
            assert err["param"] == "max_tokens"
            assert "1000000000" in err["message"] and f"leaves {room} " in err["message"], err
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": chat_room + 1})
        assert f"leaves {chat_room} " in error_of(r, 400, "max_tokens_exceeds_context")["message"]
        # exactly what the context leaves is fine, and is what runs
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": room,
                                             "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == room
        assert srv.worker.stats()["completed"] == 1  # the refused ones never ran


def test_default_max_tokens_is_the_server_s_and_fits_the_context(tiny_llm):
    n_ctx = tiny_llm.engine.executor.max_seq_len
    with running_server(tiny_llm, default_max_tokens=5) as srv, \
            httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/completions", json={"prompt": "Once", "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 5
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 5
    # a default larger than what the prompt leaves is cut to it (no 400: nobody asked)
    ids = [5] * (n_ctx - 3)
    with running_server(tiny_llm, default_max_tokens=200) as srv, \
            httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/completions", json={"prompt": ids, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert r.json()["choices"][0]["finish_reason"] == "length"


def test_request_timeout_ends_the_request_and_frees_the_engine(bundled_llm):
    with running_server(bundled_llm, request_timeout_s=1.0) as srv, \
            httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        t0 = time.monotonic()
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        # the limit is checked between two tokens; one step on a busy 2-core machine took 2 s
        assert time.monotonic() - t0 < 15.0
        assert events[-1] == "[DONE]", events[-2:]
        err = events[-2]["error"]
        assert err["code"] == "request_timeout" and "1 s" in err["message"], err
        t0 = time.monotonic()
        err = error_of(c.post("/v1/completions", json=LONG), 504, "request_timeout")
        assert time.monotonic() - t0 < 15.0, err
        assert srv.worker.stats()["timed_out"] == 2 and not srv.worker.stats()["running"]
        r = c.post("/v1/completions", json={"prompt": "The capital of France is",
                                             "max_tokens": 2, "temperature": 0})
        assert r.json()["choices"][0]["text"] == " Paris."


# ---- graceful shutdown ----------------------------------------------------------------------
def test_drain_lets_the_running_request_finish(bundled_llm):
    """In process: the running request ends normally within the drain deadline, the queued
    one and a new one get 503 shutting_down at once, /health says so, then the server stops
    by itself."""
    got: dict = {}
    # one request at a time (FIFO), so that B waits in the queue
    with running_server(bundled_llm, drain_s=60.0, max_num_seqs=1) as srv, \
            httpx.Client(base_url=srv.url, timeout=TIMEOUT) as a, \
            httpx.Client(base_url=srv.url, timeout=TIMEOUT) as b:
        with a.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 12,
                                                        "stream": True}) as ra:
            lines = ra.iter_lines()
            assert next(lines).startswith("data: ")  # A runs
            tb = threading.Thread(target=lambda: got.update(b=b.post("/v1/completions",
                                                                     json=LONG)))
            tb.start()
            wait_for(lambda: srv.worker.stats()["queued"] == 1, 10, "B to queue")
            t0 = time.monotonic()
            srv.server.request_shutdown()
            tb.join(10)
            assert time.monotonic() - t0 < 3.0
            error_of(got["b"], 503, "shutting_down")
            with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
                error_of(c.post("/v1/completions", json=LONG), 503, "shutting_down")
                h = c.get("/health")
                assert h.status_code == 503 and h.json()["status"] == "shutting_down"
            events = sse_events(lines)
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2]
        wait_for(lambda: srv.server.should_exit, 15, "the server to stop by itself")


def serve_command(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "monokernel", "serve", *args], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_up(p: subprocess.Popen, url: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert p.poll() is None, p.communicate()
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "monokernel serve did not come up"
        time.sleep(0.2)


def stop(p: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 30) -> str:
    if p.poll() is None:
        p.send_signal(sig)
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
    return err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_the_command(bundled_dir, sig):
    """One running and two queued requests, then the signal: the queued ones get the 503 JSON
    at once, a new one too, the running stream ends after the drain deadline with an error
    event and [DONE]; the command exits 0 with "server stopped" and no traceback."""
    from helpers.serve import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # --max-num-seqs 1: one request on the engine, the others queued behind it
    p = serve_command("--model", str(bundled_dir), "--backend", "numpy", "--port", str(port),
                      "--drain-timeout", "3", "--log-level", "warning", "--max-num-seqs", "1")
    queued: dict = {}
    try:
        wait_up(p, url)
        with httpx.Client(base_url=url, timeout=TIMEOUT) as a:
            with a.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as ra:
                lines = ra.iter_lines()
                assert next(lines).startswith("data: ")

                def post(name: str) -> None:
                    queued[name] = httpx.post(f"{url}/v1/completions", json=LONG,
                                              timeout=TIMEOUT)

                ts = [threading.Thread(target=post, args=(n,)) for n in "BC"]
                for t in ts:
                    t.start()
                wait_for(lambda: httpx.get(f"{url}/health").json()["queued"] == 2, 10,
                         "B and C to queue")
                t0 = time.monotonic()
                p.send_signal(sig)
                for t in ts:
                    t.join(10)
                assert time.monotonic() - t0 < 2.5  # at once, not after the drain (3 s)
                for n in "BC":
                    error_of(queued[n], 503, "shutting_down")
                error_of(httpx.post(f"{url}/v1/completions", json=LONG, timeout=TIMEOUT), 503,
                         "shutting_down")
                events = sse_events(lines)
                took = time.monotonic() - t0
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down"
        assert 2.9 < took < 20.0, took  # the drain deadline, then the next token
        err = stop(p, sig)
        assert p.returncode == 0, err
    finally:
        err = stop(p, signal.SIGKILL)
    assert "server stopped" in err and "Traceback" not in err, err
    assert port_is_closed(port)


# ---- metrics, log, request id -----------------------------------------------------------------
def metric_samples(text: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_and_the_request_log(tiny_llm, caplog):
    caplog.set_level(logging.INFO, logger="monokernel.serve.requests")
    with running_server(tiny_llm) as srv, httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 7,
                                             "ignore_eos": True},
                   headers={"x-request-id": "client-id-1"})
        assert r.headers["x-request-id"] == "client-id-1"
        assert r.json()["id"] == "cmpl-client-id-1"
        assert r.headers["x-monokernel-replica"] == srv.app.state.server.replica
        usage = r.json()["usage"]
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "ignore_eos": True, "stream": True}) as s:
            made = s.headers["x-request-id"]
            assert len(made) == 32  # one the server made
            sse_events(s.iter_lines())
        error_of(c.post("/v1/completions", json={"prompt": "a", "max_tokens": "8"}), 400)
        error_of(c.post("/v1/completions", json={"prompt": "a"},
                        headers={"x-request-id": "bad id with spaces"}), 400,
                 "invalid_request_id")
        m = c.get("/metrics")
        assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
        samples = metric_samples(m.text)

    def get(name: str, **labels) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert get("monokernel_requests_total", route="/v1/completions", status="200") == 1
    assert get("monokernel_requests_total", route="/v1/chat/completions", status="200") == 1
    assert get("monokernel_requests_total", route="/v1/completions", status="400") == 2
    assert get("monokernel_generation_tokens_total") == 7 + 4
    chat_prompt = len(tiny_llm.chat_prompt_ids([{"role": "user", "content": "Hi"}]))
    assert get("monokernel_prompt_tokens_total") == usage["prompt_tokens"] + chat_prompt
    assert get("monokernel_time_to_first_token_seconds_count") == 2
    assert get("monokernel_time_per_output_token_seconds_count") == 2
    assert get("monokernel_queue_length") == 0
    assert get("monokernel_request_cancellations_total", reason="cancelled") == 0

    lines = [json.loads(r.getMessage()) for r in caplog.records
             if r.name == "monokernel.serve.requests"]
    by_id = {ln["request_id"]: ln for ln in lines}
    one = by_id["client-id-1"]
    assert one["status"] == 200 and one["completion_tokens"] == 7
    assert one["prompt_tokens"] == usage["prompt_tokens"] and one["finish_reason"] == "length"
    assert 0 <= one["queue_s"] <= one["ttft_s"] <= one["total_s"]
    assert by_id[made]["path"] == "/v1/chat/completions" and by_id[made]["completion_tokens"] == 4
    assert [ln["status"] for ln in lines].count(400) == 2
    assert len(lines) == 5  # one per request, /metrics included


def test_cancelled_and_timed_out_requests_are_logged_and_counted(bundled_llm, caplog):
    caplog.set_level(logging.INFO, logger="monokernel.serve.requests")
    with running_server(bundled_llm, request_timeout_s=1.0) as srv, \
            httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True},
                      headers={"x-request-id": "leaves-early"}) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
        wait_for(lambda: not srv.worker.stats()["running"], 5, "the engine to be freed")
        error_of(c.post("/v1/completions", json=LONG, headers={"x-request-id": "too-long"}),
                 504, "request_timeout")
        samples = metric_samples(c.get("/metrics").text)
    assert samples[("monokernel_request_cancellations_total", (("reason", "cancelled"),))] == 1
    assert samples[("monokernel_request_cancellations_total", (("reason", "timeout"),))] == 1
    lines = {json.loads(r.getMessage())["request_id"]: json.loads(r.getMessage())
             for r in caplog.records if r.name == "monokernel.serve.requests"}
    assert lines["leaves-early"]["finish_reason"] == "cancelled"
    assert lines["leaves-early"]["completion_tokens"] >= 1
    assert lines["too-long"]["finish_reason"] == "timeout" and lines["too-long"]["status"] == 504


# ---- API key, CORS ------------------------------------------------------------------------------
def test_api_key_on_every_route_but_health(tiny_llm):
    openai = pytest.importorskip("openai")
    with running_server(tiny_llm, api_key="s3cret") as srv, \
            httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        assert c.get("/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"),
                             ("POST", "/v1/completions"), ("POST", "/tokenize")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = c.request(method, path, headers=headers, json={"prompt": "a"})
                error_of(r, 401, "invalid_api_key")
        ok = c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        url = f"{srv.url}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="nope", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        name = client.models.list().data[0].id
        assert client.completions.create(model=name, prompt="x", max_tokens=2).usage
        client.close()


def test_api_key_from_the_environment_and_flag_checks(monkeypatch):
    from monokernel.cli import build_parser
    from monokernel.errors import MonokernelError
    from monokernel.serve.cli import check_serve_args

    def parsed(*argv):
        args = build_parser().parse_args(["serve", *argv])
        check_serve_args(args)
        return args

    monkeypatch.setenv("MONOKERNEL_API_KEY", "from-env")
    assert parsed().api_key == "from-env"
    assert parsed("--api-key", "flag").api_key == "flag"
    monkeypatch.delenv("MONOKERNEL_API_KEY")
    assert parsed().api_key is None
    a = parsed("--allowed-origins", "https://a.example,https://b.example",
               "--allowed-origins", "http://localhost:3000")
    assert a.allowed_origins == ["https://a.example", "https://b.example",
                                 "http://localhost:3000"]
    assert (a.default_max_tokens, a.request_timeout, a.drain_timeout) == (256, 600.0, 30.0)
    assert a.max_num_seqs == 32 and parsed("--max-num-seqs", "1").max_num_seqs == 1
    with pytest.raises(MonokernelError, match=re.escape("--max-num-seqs must be in [1, 1024], "
                                                        "got 0")):
        parsed("--max-num-seqs", "0")
    for bad in (["--default-max-tokens", "0"], ["--request-timeout", "0"],
                ["--max-num-seqs", "1025"],
                ["--drain-timeout", "-1"], ["--replicas", "0"], ["--ray-address", "auto"]):
        with pytest.raises(MonokernelError, match=re.escape(bad[0])):
            parsed(*bad)


def test_replicas_without_ray_say_what_to_install():
    blocker = ("import importlib.abc, sys\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] == 'ray':\n"
               "            raise ModuleNotFoundError('blocked by the test', name=name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "from monokernel.cli import main\n"
               "sys.exit(main(['serve', '--replicas', '2', '--port', '0']))\n")
    r = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "pip install 'monokernel[ray]'" in r.stderr and "Traceback" not in r.stderr


def test_cors(tiny_llm):
    allowed = "https://app.example"
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with running_server(tiny_llm, allowed_origins=[allowed], api_key="k") as srv, \
            httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        r = c.options("/v1/chat/completions", headers={"Origin": allowed, **preflight})
        assert r.status_code == 200, r.text  # no key needed: browsers send none here
        assert r.headers["access-control-allow-origin"] == allowed
        assert "POST" in r.headers["access-control-allow-methods"]
        r = c.options("/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                       **preflight})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = c.get("/v1/models", headers={"Origin": allowed, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == allowed
        assert "x-request-id" in r.headers["access-control-expose-headers"]


# ---- the README ---------------------------------------------------------------------------------
def test_the_readme_client_snippet_finishes_in_seconds(bundled_llm):
    pytest.importorskip("openai")
    readme = (REPO / "README.md").read_text()
    start = readme.index("Serve it over HTTP")
    code = re.search(r"```python\n(.*?)```", readme[start:], re.S).group(1)
    assert "127.0.0.1:8000" in code
    with running_server(bundled_llm) as srv:
        code = code.replace("http://127.0.0.1:8000", srv.url)
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)
        took = time.monotonic() - t0
        assert out.returncode == 0, out.stderr
        assert srv.worker.stats()["completed"] >= 1
    assert out.stdout.strip(), "the snippet printed nothing"
    # ~5 s here (32 tokens); it ran 354 s when chat's default was the whole context
    assert took < 30.0, f"the README's snippet took {took:.1f} s"
