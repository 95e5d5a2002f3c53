"""uvicorn with a graceful shutdown: SIGTERM or SIGINT drains the app before uvicorn closes.

uvicorn alone, on a signal, stops accepting, waits ``timeout_graceful_shutdown`` for open
connections, then cancels their tasks (a queued request got a plain-text 500, a stream was cut
with no error event, tracebacks reached the log) and re-raises the signal once it is done (a
SIGTERM exited 143). Here the first signal starts ``Server.drain`` (app.py) while uvicorn keeps
serving, so the queue and new requests get their 503 JSON and the running request its end;
uvicorn is told to exit only once the drain is over, when no response is left open. The signal
is not re-raised: a shutdown asked for is a normal exit. A second signal ends the running
request at once (the drain still ends every response cleanly).
"""

from __future__ import annotations

import asyncio


def graceful_server(app, config, drain_s: float):
    """A ``uvicorn.Server`` for ``app`` (create_app's) that drains on a signal or on
    ``request_shutdown()`` (thread-safe: tests call it)."""
    import uvicorn

    srv = app.state.server

    class GracefulServer(uvicorn.Server):
        def __init__(self):
            super().__init__(config)
            self.shutdown_requests = 0
            self._drain: asyncio.Task | None = None

        def handle_exit(self, sig, frame) -> None:
            # a signal handler: it only counts; on_tick (in the event loop) acts on it
            self.request_shutdown()

        def request_shutdown(self) -> None:
            self.shutdown_requests += 1

        async def on_tick(self, counter: int) -> bool:
            if self.shutdown_requests and self._drain is None:
                self._drain = asyncio.create_task(srv.drain(drain_s))
            if self.shutdown_requests > 1:
                srv.worker.begin_shutdown(0.0)  # asked again: end the running request now
            if self._drain is not None and self._drain.done():
                self.should_exit = True
            return await super().on_tick(counter)

    return GracefulServer()
