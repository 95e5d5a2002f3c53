"""``monokernel serve``: load the model, then serve it over HTTP until Ctrl-C."""

from __future__ import annotations

import argparse
import socket
import sys

from ..errors import MonokernelError


class ServeExtraMissing(MonokernelError):
    """FastAPI or uvicorn is not installed."""


def require_serve_extra():
    """(fastapi, uvicorn), or a project error saying what to install."""
    try:
        import fastapi
        import uvicorn
    except ImportError as e:
        raise ServeExtraMissing(f"`monokernel serve` needs FastAPI and uvicorn ({e.name} is not "
                                "installed): pip install monokernel[serve]") from None
    return fastapi, uvicorn


def add_serve_command(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="OpenAI-compatible server: /v1/completions, "
                       "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health")
    p.add_argument("--model", default=None,
                   help="HF model folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default="auto",
                   help="auto | numpy | emulator | emulator-multi | cuda | cuda-multi")
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--blocks", type=int, default=None,
                   help="persistent blocks of the kernel backends")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model's own name)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for the engine; past that, 503 (default 64)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    _, uvicorn = require_serve_extra()  # before the model loads: fail fast
    if not 0 <= args.port <= 65535:
        raise MonokernelError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 1:
        raise MonokernelError(f"--max-queue must be >= 1, got {args.max_queue}")
    from ..llm import LLM
    from .app import create_app

    sock = listen_socket(args.host, args.port)  # a port in use fails now, not after the load
    with sock:
        options = {"blocks": args.blocks} if args.blocks is not None else {}
        llm = LLM(args.model, backend=args.backend, max_seq_len=args.max_seq_len, **options)
        app = create_app(llm, model_name=args.served_model_name, max_queue=args.max_queue)
        name = app.state.server.model_name
        host, port = sock.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        print(f"monokernel: serving {name!r} ({llm.backend}) on http://{host}:{port}/v1",
              file=sys.stderr, flush=True)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on: a normal stop
            pass
    print("monokernel: server stopped", file=sys.stderr)
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
