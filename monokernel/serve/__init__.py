"""An OpenAI-compatible HTTP server over one ``LLM``: ``monokernel serve``.

    pip install 'monokernel[serve]'
    monokernel serve --backend numpy            # http://127.0.0.1:8000/v1

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    name = client.models.list().data[0].id
    r = client.completions.create(model=name, prompt="The capital of France is", max_tokens=8)

Endpoints: /v1/completions and /v1/chat/completions (``stream: true`` gives server-sent events
in OpenAI's chunk format, ending with ``data: [DONE]``), /v1/models, /health, and vLLM's
/tokenize and /detokenize. vLLM's extra fields are read too: top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, min_tokens, chat_template_kwargs, return_token_ids.

protocol.py reads requests and writes responses (OpenAI's JSON, chunks and errors) and needs no
web framework; worker.py runs every generation on one engine thread, FIFO, each bounded in time;
app.py is the FastAPI app; middleware.py gives every request its id, checks the API key and
writes its log line and metrics (observe.py: /metrics, the request log); runner.py is uvicorn
with a graceful drain on SIGTERM/SIGINT; cli.py the command; replicas.py serves N copies behind
Ray Serve (ray_app.py: the same as a Serve config's application builder). FastAPI, uvicorn and
prometheus-client are the ``serve`` extra, Ray Serve the ``ray`` extra, imported only when a
server is built, so this package imports without them.
"""
