"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, vLLM's
/tokenize and /detokenize, /health and Prometheus' /metrics, over one LLM run by one engine
thread (worker.py). middleware.py gives every request its id, checks the API key and writes
its log line and metrics (observe.py); Starlette's CORSMiddleware answers browsers.

Every request is read and checked here first (protocol.py), so a bad field is a 400 before it
queues; the prompt itself is tokenized and checked on the engine thread, and the response (the
stream's headers included) is only sent once the engine has accepted it, so a prompt too long
for the context is a 400 too, streaming or not. Anything unexpected is a 500 with OpenAI's error
JSON: the connection is never dropped without an answer.

Every generation is bounded: ``max_tokens`` past what the context leaves is a 400, a request
that leaves it out gets ``default_max_tokens``, and one that runs past ``request_timeout_s``
ends with an error. ``Server.drain`` is the graceful shutdown (runner.py calls it on SIGTERM
or SIGINT): new requests and the queue get 503 ``shutting_down`` at once, the running request
may finish within the drain deadline, and is ended with an error event otherwise.

(No ``from __future__ import annotations`` here: FastAPI reads the routes' annotations, and
``Request`` is imported inside ``create_app``, where a string annotation could not find it.)
"""

import asyncio
import os
import socket
import time
from typing import Any, AsyncIterator

from ..errors import MonokernelError, NumericalError, KernelError
from . import protocol as P
from .middleware import REPLICA_HEADER, REQUEST_ID_HEADER, RequestMiddleware
from .observe import Metrics
from .worker import EngineWorker, Job

MAX_BODY_BYTES = 16 << 20  # a request body past this is refused (413) before it is parsed
POLL_S = 0.1  # how often a request waiting for the engine checks that its client is still there
# a request without max_tokens: ~17 s of SmolLM2 on the CPU's numpy backend, well under 1 s
# on a GPU; OpenAI's "until the context is full" let one chat request hold the engine minutes
DEFAULT_MAX_TOKENS = 256
REQUEST_TIMEOUT_S = 600.0  # no request holds the engine longer (the queue waits behind it)
DEFAULT_MAX_NUM_SEQS = 32  # requests streaming at once (a batched backend); more wait
DRAIN_S = 30.0  # on shutdown, how long the running request may go on


class ClientGone(Exception):
    """The client closed the connection while its request waited or ran."""


def to_api_error(e: BaseException, param: str | None = None) -> P.APIError:
    """A project error raised for one request -> its HTTP error. Errors of the request (bad
    parameters, prompt, template) are 400, naming ``param`` unless the message names a
    sampling parameter; the engine's own failures are 500."""
    if isinstance(e, P.APIError):
        return e
    if isinstance(e, (NumericalError, KernelError)):
        return P.APIError(500, f"{type(e).__name__}: {e}")
    if isinstance(e, (MonokernelError, ValueError, TypeError)):
        # ParameterError messages begin with the parameter's name: report OpenAI's name for it
        first = str(e).split(" ", 1)[0]
        if first in P.SAMPLING_FIELDS:
            param = P.PARAM_NAMES.get(first, first)
        return P.APIError(400, str(e), param=param, code=type(e).__name__)
    return P.APIError(500, f"internal error: {type(e).__name__}: {e}")


class Server:
    """The state behind the routes: the LLM, its name, its worker and token texts, the
    limits, the API key, the metrics, and whether it drains."""

    def __init__(self, llm, model_name: str | None = None, max_queue: int = 64, *,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 request_timeout_s: float | None = REQUEST_TIMEOUT_S,
                 api_key: str | None = None, replica: str | None = None,
                 echo_request_id: bool = True, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS):
        if default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
        self.llm = llm
        self.model_name = model_name or getattr(llm, "model_name", None) or llm.config.name
        self.worker = EngineWorker(llm, max_queue, request_timeout_s, max_num_seqs)
        self.tokens = P.TokenText(llm.tokenizer)
        self.created = int(time.time())
        gen = getattr(llm.model, "generation_config", None) or {}
        self.defaults = {k: gen.get(k) for k in ("temperature", "top_p", "top_k",
                                                  "repetition_penalty", "min_p")}
        self.default_max_tokens = default_max_tokens
        self.api_key = api_key or None
        self.replica = replica or f"{socket.gethostname()}:{os.getpid()}"
        self.echo_request_id = echo_request_id
        self.metrics = Metrics(self.worker)
        self.draining = False
        self.active = 0  # HTTP requests in the middleware (their responses not yet ended)

    async def drain(self, drain_s: float = DRAIN_S) -> None:
        """The graceful shutdown, before the HTTP server closes: refuse new requests and the
        queue (503), give the running request ``drain_s`` seconds, end it after that, and
        wait (bounded) until every response has been written to the end."""
        self.draining = True
        self.worker.begin_shutdown(drain_s)
        await asyncio.to_thread(self.worker.join, drain_s + 10.0)
        deadline = time.monotonic() + 5.0
        while self.active > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    @property
    def max_seq_len(self) -> int:
        return self.llm.engine.executor.max_seq_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise P.APIError(404, f"The model `{name}` does not exist; this server runs "
                             f"`{self.model_name}`", param="model", code="model_not_found")

    def params(self, sampling: dict[str, Any]):
        from ..sampling import SamplingParams

        try:
            return SamplingParams(**sampling)
        except (MonokernelError, ValueError, TypeError) as e:
            raise to_api_error(e) from None


async def read_body(request) -> dict[str, Any]:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise P.APIError(413, f"the request body has {size} bytes; the limit is {MAX_BODY_BYTES}",
                         code="body_too_large")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > MAX_BODY_BYTES:
            raise P.APIError(413, f"the request body is over the limit of {MAX_BODY_BYTES} "
                             "bytes", code="body_too_large")
        chunks.append(chunk)
    return P.parse_json(b"".join(chunks))


async def next_event(job: Job, request) -> tuple[str, Any]:
    """The job's next event, or ClientGone if the client disconnects first. The client is
    checked at least every POLL_S even while events keep coming (a generation that streams
    tokens faster than that must still notice a client that gave up)."""
    now = time.monotonic()
    if now - getattr(job, "last_client_check", 0.0) >= POLL_S:
        job.last_client_check = now
        if await request.is_disconnected():
            raise ClientGone()
    get = asyncio.ensure_future(job.events.get())
    try:
        while True:
            done, _ = await asyncio.wait({get}, timeout=POLL_S)
            if done:
                return get.result()
            job.last_client_check = time.monotonic()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not get.done():
            get.cancel()  # Queue.get is cancel-safe: an event not yet taken stays queued


def delta_parts(delta) -> tuple[str, list[int], list[P.TokenLogprob]]:
    """(text, token ids, logprob entries) of one Stream delta."""
    entries = [_entry(t, lp) for t, lp in zip(delta.token_ids, delta.logprobs or ())]
    return delta.text, list(delta.token_ids), entries


def _entry(token_id: int, lp) -> P.TokenLogprob:
    """One position of the API's logprobs (monokernel.llm.TokenLogprob)."""
    return P.TokenLogprob(int(token_id), float(lp.logprob),
                          [(int(t), float(v)) for t, _, v in lp.top])


def usage(c) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens whose K/V the engine reused from the previous
    request (the prefix they share) as ``prompt_tokens_details.cached_tokens``."""
    return {**c.usage(), "prompt_tokens_details": {"cached_tokens": c.reused_prompt_tokens}}


def create_app(llm, *, model_name: str | None = None, max_queue: int = 64,
               default_max_tokens: int = DEFAULT_MAX_TOKENS,
               request_timeout_s: float | None = REQUEST_TIMEOUT_S, api_key: str | None = None,
               allowed_origins: tuple[str, ...] | list[str] = (), replica: str | None = None,
               echo_request_id: bool = True, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS):
    """The app for one loaded ``LLM``. Its lifespan starts the engine thread and stops it.
    ``allowed_origins``: the browser origins CORS lets in ("*": any). ``replica``: the name
    in the x-monokernel-replica header (default host:pid). ``echo_request_id``: False behind
    a proxy that echoes x-request-id itself (Ray Serve's)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.middleware.cors import CORSMiddleware

    srv = Server(llm, model_name, max_queue, default_max_tokens=default_max_tokens,
                 request_timeout_s=request_timeout_s, api_key=api_key, replica=replica,
                 echo_request_id=echo_request_id, max_num_seqs=max_num_seqs)

    @asynccontextmanager
    async def lifespan(app):
        srv.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(srv.worker.close)

    app = FastAPI(title="monokernel", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = srv
    # the last added is the outermost: CORS answers a preflight before the key is checked
    app.add_middleware(RequestMiddleware, server=srv)
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                       allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"],
                       expose_headers=[REQUEST_ID_HEADER, REPLICA_HEADER])

    def error(e: P.APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(P.APIError)
    async def _api_error(request, e: P.APIError):
        return error(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return error(P.APIError(e.status_code, str(e.detail), code=str(e.status_code)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        return error(P.bad_request(f"invalid request: {e.errors()}"))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        return error(to_api_error(e))

    # ---- small endpoints ------------------------------------------------------------------
    @app.get("/health")
    async def health():
        stats = srv.worker.stats()
        if srv.draining:
            return JSONResponse({"status": "shutting_down", **stats}, status_code=503)
        if not srv.worker.alive:
            return JSONResponse({"status": "stopped", **stats}, status_code=503)
        return {"status": "ok", **stats}

    @app.get("/metrics")
    async def metrics():
        body, content_type = srv.metrics.render()
        return Response(body, media_type=content_type)

    def model_card() -> dict[str, Any]:
        return {"id": srv.model_name, "object": "model", "created": srv.created,
                "owned_by": "monokernel", "max_model_len": srv.max_seq_len,
                "backend": llm.backend}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        srv.check_model(name)
        return model_card()

    # tokenizing runs off the event loop (a long text would stall every stream); the
    # tokenizer is safe to share with the engine thread
    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request)
        srv.check_model(body.get("model"))
        if body.get("messages") is not None:
            req = P.parse_chat({"messages": body["messages"],
                                "chat_template_kwargs": body.get("chat_template_kwargs")},
                               {}, srv.default_max_tokens)
            gen_prompt = P.bool_field(body, "add_generation_prompt", True)

            def encode():
                return llm.chat_prompt_ids(req.messages, gen_prompt,
                                           req.chat_template_kwargs or None)
        else:
            prompt = P.prompt_field(body.get("prompt"))
            special = P.bool_field(body, "add_special_tokens", True)

            def encode():
                return (llm.encode(prompt) if isinstance(prompt, list) else
                        llm.tokenize(prompt, special))
        try:
            ids = await asyncio.to_thread(encode)
        except (MonokernelError, ValueError, TypeError) as e:
            raise to_api_error(e, "messages" if "messages" in body else "prompt") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": srv.max_seq_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_body(request)
        srv.check_model(body.get("model"))
        ids = P.int_list_field(body, "tokens")
        if ids is None:
            raise P.bad_request("`tokens` is required (an array of token ids)", "tokens")
        try:
            return {"prompt": await asyncio.to_thread(llm.detokenize, ids)}
        except (MonokernelError, ValueError, TypeError) as e:
            raise to_api_error(e, "tokens") from None

    # ---- generation -----------------------------------------------------------------------
    def begin(llm_, job: Job, req: P.Request, ids: list[int], params):
        """Start the generation of ``ids`` (on the engine thread), its max_tokens bounded by
        the context (a 400 naming both numbers when the request asked for more)."""
        job.prompt_tokens = len(ids)
        n = P.check_max_tokens(params.max_new_tokens, req.max_tokens_given, len(ids),
                               srv.max_seq_len)
        if n != params.max_new_tokens:
            params = params.replace(max_new_tokens=n)
        return llm_.stream(ids, params)

    async def run(request, req: P.Request, start, on_done, on_delta, first_chunks, what: str):
        """Queue ``start(llm, job)`` on the engine; answer with the whole result or a stream of
        chunks. ``on_delta(text, ids, entries, state)`` -> a chunk or None;
        ``on_done(c, state)`` -> the JSON body (not streaming) or the closing chunks
        (streaming)."""
        job = Job(lambda llm_: start(llm_, job), asyncio.get_running_loop())
        srv.worker.submit(job)  # a full queue is a 503 here: no job to log then
        request.scope["monokernel"].job = job
        try:
            kind, value = await next_event(job, request)  # "started", or the prompt's error
            if kind == "error":
                raise to_api_error(value, what)
            if req.stream:
                return JobStream(chunks(job, on_done, on_delta, first_chunks),
                                 on_close=lambda: srv.worker.cancel(job))
            state: dict[str, Any] = {"ids": [], "entries": []}
            while True:
                kind, value = await next_event(job, request)
                if kind == "error":
                    raise to_api_error(value)
                if kind == "delta":
                    _, ids, entries = delta_parts(value)
                    state["ids"] += ids
                    state["entries"] += entries
                elif kind == "done":
                    return on_done(value, state)
        except ClientGone:
            srv.worker.cancel(job)
            return Response(status_code=499)  # nobody reads it; the engine has moved on
        except BaseException:
            srv.worker.cancel(job)
            raise

    async def chunks(job: Job, on_done, on_delta, first_chunks) -> AsyncIterator[bytes]:
        state: dict[str, Any] = {"offset": 0}
        for c in first_chunks():
            yield P.sse(c)
        while True:
            kind, value = await job.events.get()
            if kind == "delta":
                c = on_delta(*delta_parts(value), state)
                if c is not None:
                    yield P.sse(c)
            elif kind == "done":
                for c in on_done(value, state):
                    yield P.sse(c)
                break
            else:  # the headers are out: the error goes in the stream, as vLLM does
                yield P.sse(to_api_error(value).body())
                break
        yield P.sse("[DONE]")

    class JobStream(StreamingResponse):
        """Server-sent events of one job; however the response ends (done, client gone,
        never started), ``on_close`` frees the engine."""

        def __init__(self, content, on_close):
            super().__init__(content, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.on_close()

    def with_usage(chunk: dict[str, Any], req: P.Request) -> dict[str, Any]:
        if req.include_usage:
            chunk["usage"] = None
        return chunk

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        req = P.parse_completion(body, srv.defaults, srv.default_max_tokens)
        srv.check_model(req.model)
        params = srv.params(req.sampling)
        rid, created = f"cmpl-{request.scope['monokernel'].request_id}", int(time.time())
        prompt = req.prompt
        tt = srv.tokens

        def start(llm_, job):
            return begin(llm_, job, req, llm_.encode(prompt), params)

        def choice(text: str, finish: str | None, ids, entries, offset: int,
                   c=None) -> dict[str, Any]:
            ch: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                                  "finish_reason": finish}
            if req.logprobs is not None:
                ch["logprobs"] = P.completion_logprobs(entries, tt, offset)
            if c is not None:
                ch["stop_reason"] = c.stop_reason
            if req.return_token_ids:
                ch["token_ids"] = ids
                if c is not None:
                    ch["prompt_token_ids"] = list(c.prompt_token_ids)
            return ch

        def prompt_text() -> str:
            return prompt if isinstance(prompt, str) else llm.detokenize(prompt)

        def echo_prefix(c) -> tuple[str, list]:
            """The prompt's text and its logprob entries, when ``echo`` asks for them."""
            entries: list = []
            if req.logprobs is not None and c.prompt_logprobs is not None:
                entries = [P.TokenLogprob(t, None, []) if lp is None else _entry(t, lp)
                           for t, lp in zip(c.prompt_token_ids, c.prompt_logprobs)]
            return prompt_text(), entries

        def on_done(c, state):
            u = usage(c)
            if req.stream:
                out = [with_usage({**P.envelope(rid, "text_completion", srv.model_name, created),
                                   "choices": [choice("", c.finish_reason, [], [],
                                                      state["offset"], c)]}, req)]
                if req.include_usage:
                    out.append({**P.envelope(rid, "text_completion", srv.model_name, created),
                                "choices": [], "usage": u})
                return out
            text, entries = c.text, state["entries"]
            if req.echo:
                ptext, pentries = echo_prefix(c)
                text, entries = ptext + text, pentries + entries
            return {**P.envelope(rid, "text_completion", srv.model_name, created),
                    "choices": [choice(text, c.finish_reason, state["ids"], entries, 0, c)],
                    "usage": u}

        def on_delta(text, ids, entries, state):
            if not text and req.logprobs is None and not req.return_token_ids:
                return None
            ch = choice(text, None, ids, entries, state["offset"])
            state["offset"] += sum(len(tt.text(e.token_id)) for e in entries)
            return with_usage({**P.envelope(rid, "text_completion", srv.model_name, created),
                               "choices": [ch]}, req)

        def first_chunks():
            if not req.echo:
                return []
            return [with_usage({**P.envelope(rid, "text_completion", srv.model_name, created),
                                "choices": [{"index": 0, "text": prompt_text(), "logprobs": None,
                                             "finish_reason": None}]}, req)]

        return await run(request, req, start, on_done, on_delta, first_chunks, "prompt")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        req = P.parse_chat(body, srv.defaults, srv.default_max_tokens)
        srv.check_model(req.model)
        params = srv.params(req.sampling)
        rid, created = f"chatcmpl-{request.scope['monokernel'].request_id}", int(time.time())
        tt = srv.tokens

        def start(llm_, job):
            ids = llm_.chat_prompt_ids(req.messages, True, req.chat_template_kwargs or None)
            return begin(llm_, job, req, ids, params)

        def chunk(delta: dict[str, Any], finish: str | None, entries=None, ids=None,
                  c=None) -> dict[str, Any]:
            ch: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": finish}
            if req.logprobs is not None and entries is not None:
                ch["logprobs"] = P.chat_logprobs(entries, tt)
            if c is not None:
                ch["stop_reason"] = c.stop_reason
            if req.return_token_ids and ids is not None:
                ch["token_ids"] = ids
            return with_usage({**P.envelope(rid, "chat.completion.chunk", srv.model_name,
                                            created), "choices": [ch]}, req)

        def on_done(c, state):
            u = usage(c)
            if req.stream:
                out = [chunk({}, c.finish_reason, c=c)]
                if req.include_usage:
                    out.append({**P.envelope(rid, "chat.completion.chunk", srv.model_name,
                                             created), "choices": [], "usage": u})
                return out
            ch: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": c.text},
                "logprobs": (P.chat_logprobs(state["entries"], tt)
                             if req.logprobs is not None else None),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}
            if req.return_token_ids:
                ch["token_ids"] = state["ids"]
                ch["prompt_token_ids"] = list(c.prompt_token_ids)
            return {**P.envelope(rid, "chat.completion", srv.model_name, created),
                    "choices": [ch], "usage": u}

        def on_delta(text, ids, entries, state):
            if not text and req.logprobs is None and not req.return_token_ids:
                return None
            return chunk({"content": text}, None, entries, ids)

        def first_chunks():
            return [chunk({"role": "assistant", "content": ""}, None)]

        return await run(request, req, start, on_done, on_delta, first_chunks, "messages")

    return app
