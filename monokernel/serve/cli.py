"""``monokernel serve``: load the model, then serve it over HTTP until SIGTERM or Ctrl-C
(which drain it: runner.py). ``--replicas N`` serves N copies behind Ray Serve instead
(replicas.py)."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from ..backend_args import add_backend_arg, add_backend_args, backend_options
from ..errors import MonokernelError

API_KEY_ENV = "MONOKERNEL_API_KEY"


class ServeExtraMissing(MonokernelError):
    """FastAPI or uvicorn is not installed."""


def require_serve_extra():
    """(fastapi, uvicorn), or a project error saying what to install."""
    try:
        import fastapi
        import prometheus_client  # noqa: F401  (/metrics)
        import uvicorn
    except ImportError as e:
        raise ServeExtraMissing(f"`monokernel serve` needs FastAPI, uvicorn and "
                                f"prometheus-client ({e.name} is not installed): "
                                "pip install monokernel[serve]") from None
    return fastapi, uvicorn


def add_serve_command(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="OpenAI-compatible server: /v1/completions, "
                       "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health")
    p.add_argument("--model", default=None,
                   help="HF model folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    add_backend_arg(p)
    p.add_argument("--max-seq-len", type=int, default=None)
    add_backend_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model's own name)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests that stream at once on a batched backend (numpy, or a kernel "
                   "backend with --option slots=N: at most N); the rest wait in the queue; 1: "
                   "one at a time, in arrival order (default 32; a kernel backend without "
                   "slots runs one sequence at a time)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for the engine; past that, 503 (default 64)")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens of a request that gives none (default 256; always cut to "
                   "what the context leaves)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may hold the engine; then it ends with an error "
                   "(default 600)")
    p.add_argument("--drain-timeout", type=float, default=None,
                   help="on SIGTERM/Ctrl-C, seconds the running request may go on before it "
                   "is ended (default 30)")
    p.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` on every route but /health "
                   f"(default: ${API_KEY_ENV}; unset: no key)")
    p.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN",
                   help="browser origins CORS lets in, e.g. https://app.example.com or '*' "
                   "(repeatable or comma-separated; default: none)")
    p.add_argument("--replicas", type=int, default=None,
                   help="serve N copies of the engine behind Ray Serve (pip install "
                   "'monokernel[ray]'); one GPU each on a GPU backend")
    p.add_argument("--ray-address", default=None,
                   help="the Ray cluster to deploy on (e.g. ray://head:10001 or auto; "
                   "default: start a local one)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def check_serve_args(args: argparse.Namespace) -> None:
    """Every flag's range, before anything loads; fills in the defaults and the API key."""
    from ..batching import MAX_NUM_SEQS_LIMIT
    from .app import DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_TOKENS, DRAIN_S, REQUEST_TIMEOUT_S

    if not 0 <= args.port <= 65535:
        raise MonokernelError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_num_seqs is None:
        args.max_num_seqs = DEFAULT_MAX_NUM_SEQS
    elif not 1 <= args.max_num_seqs <= MAX_NUM_SEQS_LIMIT:
        raise MonokernelError(f"--max-num-seqs must be in [1, {MAX_NUM_SEQS_LIMIT}], got "
                              f"{args.max_num_seqs}")
    if args.max_queue < 1:
        raise MonokernelError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.default_max_tokens is None:
        args.default_max_tokens = DEFAULT_MAX_TOKENS
    elif args.default_max_tokens < 1:
        raise MonokernelError(f"--default-max-tokens must be >= 1, got "
                              f"{args.default_max_tokens}")
    for name, default in (("request_timeout", REQUEST_TIMEOUT_S), ("drain_timeout", DRAIN_S)):
        v = getattr(args, name)
        if v is None:
            setattr(args, name, default)
        elif not (v > 0 and v < float("inf")):
            raise MonokernelError(f"--{name.replace('_', '-')} must be a number of seconds "
                                  f"> 0, got {v}")
    if args.replicas is not None and args.replicas < 1:
        raise MonokernelError(f"--replicas must be >= 1, got {args.replicas}")
    options = backend_options(args)
    if args.backend != "auto":  # a misspelt option fails here, before a model or Ray starts
        from ..runtime import backend_options as check_options

        check_options(args.backend, options)
    if args.ray_address is not None and args.replicas is None:
        raise MonokernelError("--ray-address needs --replicas N")
    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    args.allowed_origins = [o.strip() for v in args.allowed_origins or () for o in v.split(",")
                            if o.strip()]


def app_options(args: argparse.Namespace) -> dict:
    """create_app's keyword arguments from the flags (the same for one server or replicas)."""
    return {"model_name": args.served_model_name, "max_queue": args.max_queue,
            "max_num_seqs": args.max_num_seqs,
            "default_max_tokens": args.default_max_tokens,
            "request_timeout_s": args.request_timeout, "api_key": args.api_key,
            "allowed_origins": tuple(args.allowed_origins)}


def cmd_serve(args: argparse.Namespace) -> int:
    _, uvicorn = require_serve_extra()  # before the model loads: fail fast
    check_serve_args(args)
    from .observe import setup_request_log

    setup_request_log(args.log_level)
    if args.replicas is not None:
        from .replicas import serve_replicas

        if args.ray_address is None:  # a local Ray instance: a port in use fails now
            listen_socket(args.host, args.port).close()
        return serve_replicas(args, app_options(args))
    from ..llm import LLM
    from .app import create_app
    from .runner import graceful_server

    sock = listen_socket(args.host, args.port)  # a port in use fails now, not after the load
    with sock:
        llm = LLM(args.model, backend=args.backend, max_seq_len=args.max_seq_len,
                  max_num_seqs=args.max_num_seqs, **backend_options(args))
        app = create_app(llm, **app_options(args))
        name = app.state.server.model_name
        host, port = sock.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        print(f"monokernel: serving {name!r} ({llm.backend}) on http://{host}:{port}/v1",
              file=sys.stderr, flush=True)
        # the request log replaces uvicorn's access lines (it has the same and more)
        config = uvicorn.Config(app, log_level=args.log_level, access_log=False,
                                timeout_graceful_shutdown=5)
        graceful_server(app, config, args.drain_timeout).run(sockets=[sock])
    print("monokernel: server stopped", file=sys.stderr, flush=True)
    return 0


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), or a project error naming them."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise MonokernelError(f"cannot listen on {host}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MonokernelError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock
