"""One engine thread, one FIFO queue, up to ``max_num_seqs`` requests running at once.

Every generation runs on one thread that owns the LLM. On a batched backend (numpy, a kernel
built with slots) that thread admits up to ``max_num_seqs`` jobs from the queue, hands each
running job the tokens its stream has ready, and runs the engine's next step (batching.py) when
none has any: every admitted request streams at once, and a request that ends frees its place
for the next in the queue at the step boundary. On a one-sequence backend (a kernel without
slots) the thread runs one job at a time, in arrival order, as before. A request is a ``Job``: a function that starts a ``Stream`` on
the LLM, and a channel of events back to the event loop that serves the request:
``("started", None)``, then ``("delta", Delta)`` per piece, then ``("done", Completion)``, or
``("error", exception)`` at any point. A job cancelled while it waits is dropped from the queue;
one cancelled while it runs is closed between two tokens, so its place goes to the next job.

Nothing holds the engine without bound: a job that runs past ``request_timeout_s`` is closed
with an error event, and ``begin_shutdown(drain_s)`` answers the queue with 503 at once, lets
the running jobs go on until the drain deadline, then closes them with an error event too.

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
    the thread started by ``start`` runs them, up to ``max_num_seqs`` at once on a batched
    engine (one at a time on another), until ``close``."""

    def __init__(self, llm, max_queue: int = 64, request_timeout_s: float | None = None,
                 max_num_seqs: int = 1):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.llm = llm
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        engine = getattr(llm, "engine", None)
        self._batcher = getattr(engine, "batcher", None)
        # the engine's own slots bound it; a one-sequence engine runs one job at a time
        self.max_num_seqs = (min(max_num_seqs, self._batcher.max_num_seqs)
                             if self._batcher is not None else 1)
        self._drain_deadline: float | None = None  # time.monotonic(); set by begin_shutdown
        self._pending: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._running = 0
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
            return {"queued": len(self._pending), "running": self._running,
                    "max_num_seqs": self.max_num_seqs,
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
        active: list[tuple[Job, Any, Any]] = []  # (job, stream, its deltas)
        while True:
            with self._cv:
                while not self._pending and not active and not self._closed:
                    self._cv.wait()
                if self._closed and not active:
                    return
                new = []
                while self._pending and len(active) + len(new) < self.max_num_seqs:
                    new.append(self._pending.popleft())
                self._running = len(active) + len(new)
            for job in new:
                job.started_at = time.monotonic()
                run = self._begin(job)
                if run is not None:
                    active.append(run)
            active = [run for run in active if self._advance(*run)]
            with self._cv:
                self._running = len(active)
            if active and self._batcher is not None and not any(
                    s.ready() for _, s, _ in active):
                self._step(active)

    def _step(self, active) -> None:
        try:
            self._batcher.step()  # an executor's failure ends its sequences, not the step loop
        except BaseException as e:  # a bug: nothing may kill the one engine thread
            for job, stream, _ in active:
                self._end(job, stream, "error", e)
            active.clear()

    def _begin(self, job: Job):
        """Start ``job``'s stream: (job, stream, deltas), or None when it ended already."""
        try:
            if job.cancelled.is_set():
                job.finish_reason = "cancelled"
                self._count("cancelled")
                job.ended_at = time.monotonic()
                return None
            stream = job.start(self.llm)
        except BaseException as e:  # a bad prompt or template: the request's error, not the
            # server's (or a Rust panic from the tokenizer, a BaseException)
            job.finish_reason = "error"
            job.ended_at = time.monotonic()
            job.emit("error", e)
            return None
        job.emit("started")
        return job, stream, stream.deltas()

    def _advance(self, job: Job, stream, deltas) -> bool:
        """Hand ``job`` the pieces its stream has ready (all of them, one step at a time, on a
        one-sequence engine). False when the job has ended."""
        ready = getattr(stream, "ready", None)
        try:
            while True:
                if ready is not None and self._batcher is not None and not ready():
                    stop = self._must_stop(job)  # checked every step, tokens or not
                    if stop is not None:
                        self._end(job, stream, *stop)
                        return False
                    return True
                try:
                    delta = next(deltas)
                except StopIteration:
                    break
                stop = self._must_stop(job)  # between two pieces: this one is not handed on
                if stop is not None:
                    self._end(job, stream, *stop)
                    return False
                ids = getattr(delta, "token_ids", None)
                if ids:
                    job.completion_tokens += len(ids)
                    if job.first_token_at is None:
                        job.first_token_at = time.monotonic()
                job.emit("delta", delta)
        except BaseException as e:  # the engine failed (NaN logits, a kernel error)
            self._end(job, stream, "error", e)
            return False
        c = stream.completion
        job.finish_reason = getattr(c, "finish_reason", "stop")
        job.completion_tokens = len(getattr(c, "token_ids", ())) or job.completion_tokens
        job.ended_at = time.monotonic()  # before the event: the record is complete
        self._count("completed")
        job.emit("done", c)
        return False

    def _end(self, job: Job, stream, reason: str | None = None,
             error: BaseException | None = None) -> None:
        """``job`` ends before its stream did: close it (its slot goes to the next job), then
        send the error event, if any: whoever receives it finds the stream closed and the
        record complete."""
        if reason is not None:
            job.finish_reason = reason
        try:
            stream.close()
        finally:
            job.ended_at = time.monotonic()
            if error is not None:
                job.emit("error", error)

    def _must_stop(self, job: Job) -> tuple[str, APIError | None] | None:
        """Checked between two pieces: the client left, the request ran out of time, or the
        server's drain deadline passed. (finish reason, the error event the request ends with:
        the last two), or None to go on."""
        if job.cancelled.is_set():
            self._count("cancelled")
            return "cancelled", None
        now = time.monotonic()
        if self.request_timeout_s is not None and now - job.started_at > self.request_timeout_s:
            self._count("timed_out")
            return "timeout", APIError(
                504, f"the request ran past the server's limit of {self.request_timeout_s:g} s "
                f"per request ({job.completion_tokens} tokens generated); ask for fewer "
                "`max_tokens`", code="request_timeout")
        deadline = self._drain_deadline
        if deadline is not None and now >= deadline:
            return "shutdown", APIError(503, f"{SHUTTING_DOWN}: the request was stopped after "
                                        f"{job.completion_tokens} tokens", code="shutting_down")
        return None

    def _count(self, what: str) -> None:
        with self._cv:
            setattr(self, what, getattr(self, what) + 1)
