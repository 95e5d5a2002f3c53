"""One engine thread, one FIFO queue.

An LLM runs one sequence at a time (batch 1 is the design point), so every generation runs on
one thread that owns the LLM, in arrival order. A request is a ``Job``: a function that starts a
``Stream`` on the LLM, and a channel of events back to the event loop that serves the request:
``("started", None)``, then ``("delta", Delta)`` per piece, then ``("done", Completion)``, or
``("error", exception)`` at any point. A job cancelled while it waits is dropped from the queue;
one cancelled while it runs is closed between two tokens, so the next job starts at once.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any, Callable

from .protocol import APIError


class Job:
    def __init__(self, start: Callable[[Any], Any], loop: asyncio.AbstractEventLoop):
        self.start = start  # (llm) -> Stream, run on the engine thread
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.last_client_check = 0.0  # time.monotonic() of the last disconnect check (app.py)

    def emit(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled.set()


class EngineWorker:
    """``submit`` queues a job (or raises 503 at once when ``max_queue`` jobs already wait);
    the thread started by ``start`` runs them one by one until ``close``."""

    def __init__(self, llm, max_queue: int = 64):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.llm = llm
        self.max_queue = max_queue
        self._pending: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._running: Job | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.completed = 0
        self.cancelled = 0

    # ---- called from the event loop -------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="monokernel-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closed:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if len(self._pending) >= self.max_queue:
                raise APIError(503, f"the queue is full ({self.max_queue} requests wait for the "
                               "engine); retry later", code="queue_full")
            self._pending.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if it waits, stop it if it runs."""
        job.cancelled.set()
        with self._cv:
            try:
                self._pending.remove(job)
                self.cancelled += 1
            except ValueError:
                pass

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {"queued": len(self._pending), "running": self._running is not None,
                    "max_queue": self.max_queue, "completed": self.completed,
                    "cancelled": self.cancelled}

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            waiting = list(self._pending)
            self._pending.clear()
            if self._running is not None:
                self._running.cancelled.set()
            self._cv.notify_all()
        for job in waiting:
            job.cancelled.set()
            job.emit("error", APIError(503, "the server is shutting down", code="shutting_down"))
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._running = self._pending.popleft()
            try:
                self._run(job)
            except BaseException as e:  # nothing may kill the one engine thread: a bug, or a
                job.emit("error", e)  # Rust panic from the tokenizer (a BaseException)
            finally:
                with self._cv:
                    self._running = None

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._count("cancelled")
            return
        try:
            stream = job.start(self.llm)
        except Exception as e:  # a bad prompt or template: the request's error, not the server's
            job.emit("error", e)
            return
        job.emit("started")
        finished = False
        try:
            for delta in stream.deltas():
                if job.cancelled.is_set():
                    self._count("cancelled")
                    break
                job.emit("delta", delta)
            else:
                finished = True
                self._count("completed")
                job.emit("done", stream.completion)
        except Exception as e:  # the engine failed (NaN logits, a kernel error): tell the client
            job.emit("error", e)
        finally:
            if not finished:
                stream.close()  # frees the engine for the next job now

    def _count(self, what: str) -> None:
        with self._cv:
            setattr(self, what, getattr(self, what) + 1)
