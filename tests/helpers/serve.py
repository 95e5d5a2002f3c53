"""A monokernel server for a test: in this process, on 127.0.0.1, on a port the OS picks, and
stopped at the end of the ``with`` block even when the test fails, with nothing left listening.

The listening socket is bound here and handed to uvicorn, so there is no window in which another
process could take the port between choosing it and serving on it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
pytest.importorskip("httpx", reason="httpx is not installed")


@dataclass
class Running:
    port: int
    app: Any
    server: Any  # runner.graceful_server's: request_shutdown() drains, as SIGTERM does

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def worker(self):
        return self.app.state.server.worker


def port_is_closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) != 0


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server started in another process (which binds it
    itself: another process could take it in between, so use it at once). Drawn below the
    kernel's ephemeral range (ip_local_port_range), never from it: a port the OS hands out
    for a bind to port 0 is one every other process binding port 0 may get next, and a Ray
    Serve start binds dozens (its gRPC servers) before its proxy binds ours (a CI run on
    2026-12-04 failed so: "Failed to bind to address 127.0.0.1:44529")."""
    import random

    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [10000, {low}) on 127.0.0.1")


@contextmanager
def running_server(llm, drain_s: float = 2.0, **app_options) -> Iterator[Running]:
    import uvicorn

    from monokernel.serve.app import create_app
    from monokernel.serve.runner import graceful_server

    app = create_app(llm, **app_options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    server = graceful_server(app, config, drain_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name=f"uvicorn-{port}")
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        yield Running(port, app, server)
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()
    assert not thread.is_alive(), "the server thread did not stop"
    assert not app.state.server.worker._thread.is_alive(), "the engine thread did not stop"
    assert port_is_closed(port), f"port {port} still accepts connections"


def sse_events(lines: Iterator[str]) -> list[Any]:
    """The ``data:`` payloads of a server-sent event stream, JSON-decoded, "[DONE]" as is."""
    out: list[Any] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out
