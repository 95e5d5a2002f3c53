"""One engine thread, one FIFO queue.

An LLM runs one sequence at a time (batch 1 is the design point), so every generation runs on
one thread that owns the LLM, in arrival order. A request is a ``Job``: a function that starts a
``Stream`` on the LLM, and a channel of events back to the event loop that serves the request:
``("started", None)``, then ``("delta", Delta)`` per piece, then ``("done", Completion)``, or
``("error", exception)`` at any point. A job cancelled while it waits is dropped from the queue;
one cancelled while it runs is closed between two tokens, so the next job starts at once.

Nothing holds the engine without bound: a job that runs past ``request_timeout_s`` is closed
with an error event, and ``begin_shutdown(drain_s)`` answers the queue with 503 at once, lets
the running job go on until the drain deadline, then closes it with an error event too.

A job also carries its own record (queue time, time to the first token, tokens, how it ended),
written here on the engine thread and read by the app for the request's log line and metrics.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any, Callable

from .protocol import APIError


SHUTTING_DOWN = "the server is shutting down"


class Job:
    def __init__(self, start: Callable[[Any], Any], loop: asyncio.AbstractEventLoop):
        self.start = start  # (llm) -> Stream, run on the engine thread
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.last_client_check = 0.0  # time.monotonic() of the last disconnect check (app.py)
        # the record (time.monotonic() instants); finish_reason is set before the last event
        # is emitted, so whoever receives that event reads a complete record
        self.submitted_at: float | None = None
        self.started_at: float | None = None  # the engine took it
        self.first_token_at: float | None = None
        self.ended_at: float | None = None
        self.prompt_tokens: int | None = None  # set by the job's start function
        self.completion_tokens = 0
        # "stop" | "length" | "abort" (the engine's), or "cancelled" (the client left),
        # "timeout", "shutdown", "error"; None while it waits or runs
        self.finish_reason: str | None = None

    def emit(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled.set()


class EngineWorker:
    """``submit`` queues a job (or raises 503 at once when ``max_queue`` jobs already wait);
    the thread started by ``start`` runs them one by one until ``close``."""

    def __init__(self, llm, max_queue: int = 64, request_timeout_s: float | None = None):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        self.llm = llm
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self._drain_deadline: float | None = None  # time.monotonic(); set by begin_shutdown
        self._pending: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._running: Job | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.completed = 0
        self.cancelled = 0
        self.timed_out = 0

    # ---- called from the event loop -------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="monokernel-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closed:
                raise APIError(503, SHUTTING_DOWN, code="shutting_down")
            if len(self._pending) >= self.max_queue:
                raise APIError(503, f"the queue is full ({self.max_queue} requests wait for the "
                               "engine); retry later", code="queue_full")
            job.submitted_at = time.monotonic()
            self._pending.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if it waits, stop it if it runs."""
        job.cancelled.set()
        with self._cv:
            try:
                self._pending.remove(job)
                self.cancelled += 1
                job.finish_reason = "cancelled"
            except ValueError:
                pass

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {"queued": len(self._pending), "running": self._running is not None,
                    "max_queue": self.max_queue, "completed": self.completed,
                    "cancelled": self.cancelled, "timed_out": self.timed_out,
                    "shutting_down": self._closed}

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def begin_shutdown(self, drain_s: float = 0.0) -> None:
        """Refuse new jobs (503), answer every waiting one with 503 now, and let the running
        one go on for ``drain_s`` seconds at most; then it ends with an error event. A second
        call may only bring the deadline closer."""
        deadline = time.monotonic() + max(drain_s, 0.0)
        with self._cv:
            self._closed = True
            if self._drain_deadline is None or deadline < self._drain_deadline:
                self._drain_deadline = deadline
            waiting = list(self._pending)
            self._pending.clear()
            self._cv.notify_all()
        for job in waiting:
            job.cancelled.set()
            job.finish_reason = "shutdown"
            job.emit("error", APIError(503, SHUTTING_DOWN, code="shutting_down"))

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the engine thread to end (after ``begin_shutdown``); True when it has."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def close(self, timeout: float = 10.0) -> None:
        self.begin_shutdown(0.0)
        self.join(timeout)

    # ---- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._running = self._pending.popleft()
            job.started_at = time.monotonic()
            try:
                self._run(job)
            except BaseException as e:  # nothing may kill the one engine thread: a bug, or a
                # Rust panic from the tokenizer (a BaseException)
                job.finish_reason = "error"
                job.emit("error", e)
            finally:
                if job.ended_at is None:
                    job.ended_at = time.monotonic()
                with self._cv:
                    self._running = None

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.finish_reason = "cancelled"
            self._count("cancelled")
            return
        try:
            stream = job.start(self.llm)
        except Exception as e:  # a bad prompt or template: the request's error, not the server's
            job.finish_reason = "error"
            job.emit("error", e)
            return
        job.emit("started")
        finished = False
        try:
            for delta in stream.deltas():
                if self._must_stop(job):
                    break
                ids = getattr(delta, "token_ids", None)
                if ids:
                    job.completion_tokens += len(ids)
                    if job.first_token_at is None:
                        job.first_token_at = time.monotonic()
                job.emit("delta", delta)
            else:
                finished = True
                c = stream.completion
                job.finish_reason = getattr(c, "finish_reason", "stop")
                job.completion_tokens = len(getattr(c, "token_ids", ())) or job.completion_tokens
                job.ended_at = time.monotonic()  # before the event: the record is complete
                self._count("completed")
                job.emit("done", c)
        except Exception as e:  # the engine failed (NaN logits, a kernel error): tell the client
            job.finish_reason = "error"
            job.emit("error", e)
        finally:
            if not finished:
                stream.close()  # frees the engine for the next job now

    def _must_stop(self, job: Job) -> bool:
        """Checked between two pieces: the client left, the request ran out of time, or the
        server's drain deadline passed. The last two end the request with an error event."""
        if job.cancelled.is_set():
            job.finish_reason = "cancelled"
            self._count("cancelled")
            return True
        now = time.monotonic()
        if self.request_timeout_s is not None and now - job.started_at > self.request_timeout_s:
            job.finish_reason = "timeout"
            self._count("timed_out")
            job.emit("error", APIError(
                504, f"the request ran past the server's limit of {self.request_timeout_s:g} s "
                f"per request ({job.completion_tokens} tokens generated); ask for fewer "
                "`max_tokens`", code="request_timeout"))
            return True
        deadline = self._drain_deadline
        if deadline is not None and now >= deadline:
            job.finish_reason = "shutdown"
            job.emit("error", APIError(503, f"{SHUTTING_DOWN}: the request was stopped after "
                                       f"{job.completion_tokens} tokens", code="shutting_down"))
            return True
        return False

    def _count(self, what: str) -> None:
        with self._cv:
            setattr(self, what, getattr(self, what) + 1)
