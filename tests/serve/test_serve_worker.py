"""The engine worker alone, on fake streams whose every step the test releases: jobs run one at
a time in arrival order, the queue refuses at once past max_queue, a cancelled job waiting in
the queue never starts, a cancelled running job is closed before its next step, and close()
answers what still waits with 503. No HTTP, no model: every wait is bounded."""

from __future__ import annotations

import asyncio
import threading

import pytest

from monokernel.serve.protocol import APIError
from monokernel.serve.worker import EngineWorker, Job

STEP_TIMEOUT = 5.0


class FakeStream:
    """Yields one delta per ``release()``; records whether it was closed."""

    def __init__(self, name: str, steps: int, log: list):
        self.name, self.steps, self.log = name, steps, log
        self.go = threading.Semaphore(0)
        self.closed = False
        self.completion = f"{name} done"

    def deltas(self):
        self.log.append(f"{self.name} start")
        for i in range(self.steps):
            assert self.go.acquire(timeout=STEP_TIMEOUT), f"{self.name} step {i} never released"
            yield f"{self.name}{i}"

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.go.release()

    def close(self) -> None:
        self.closed = True
        self.log.append(f"{self.name} closed")


async def event(job: Job) -> tuple:
    return await asyncio.wait_for(job.events.get(), STEP_TIMEOUT)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_fifo_one_at_a_time_and_queue_full():
    async def main():
        log: list = []
        w = EngineWorker(llm=None, max_queue=2)
        w.start()
        loop = asyncio.get_running_loop()
        streams = {n: FakeStream(n, 2, log) for n in "ABCD"}
        jobs = {n: Job(lambda llm, s=s: s, loop) for n, s in streams.items()}
        try:
            w.submit(jobs["A"])
            assert await event(jobs["A"]) == ("started", None)
            w.submit(jobs["B"])
            w.submit(jobs["C"])  # A runs, B and C wait: the queue (2) is full
            with pytest.raises(APIError) as e:
                w.submit(jobs["D"])
            assert e.value.status == 503 and e.value.code == "queue_full"
            assert w.stats()["queued"] == 2 and w.stats()["running"]
            for n in "ABC":
                if n != "A":
                    assert await event(jobs[n]) == ("started", None)
                streams[n].release(2)
                assert await event(jobs[n]) == ("delta", f"{n}0")
                assert await event(jobs[n]) == ("delta", f"{n}1")
                assert await event(jobs[n]) == ("done", f"{n} done")
            assert log == ["A start", "B start", "C start"]  # one at a time, in order
            assert w.stats()["completed"] == 3
        finally:
            w.close()
        assert not w._thread.is_alive()

    run(main())


def test_cancel_waiting_and_running_jobs():
    async def main():
        log: list = []
        w = EngineWorker(llm=None, max_queue=4)
        w.start()
        loop = asyncio.get_running_loop()
        a, b, c = (FakeStream(n, 50, log) for n in "ABC")
        ja, jb, jc = (Job(lambda llm, s=s: s, loop) for s in (a, b, c))
        try:
            for j in (ja, jb, jc):
                w.submit(j)
            assert await event(ja) == ("started", None)
            a.release()
            assert await event(ja) == ("delta", "A0")
            w.cancel(jb)  # B leaves the queue before it starts
            assert w.stats()["queued"] == 1
            w.cancel(ja)  # A is running: it is closed before its next step
            a.release()
            assert await event(jc) == ("started", None)
            assert a.closed and "B start" not in log
            c.release(50)
            kinds = [(await event(jc))[0] for _ in range(51)]
            assert kinds == ["delta"] * 50 + ["done"]
            assert w.stats()["cancelled"] == 2
        finally:
            w.close()

    run(main())


def test_errors_reach_the_request_and_close_answers_503():
    async def main():
        w = EngineWorker(llm=None, max_queue=4)
        w.start()
        loop = asyncio.get_running_loop()
        log: list = []
        blocker = FakeStream("A", 1, log)

        def bad_start(llm):
            raise ValueError("bad prompt")

        ja = Job(lambda llm: blocker, loop)
        jbad = Job(bad_start, loop)
        jwait = Job(lambda llm: FakeStream("W", 1, log), loop)
        w.submit(jbad)
        kind, err = await event(jbad)
        assert kind == "error" and isinstance(err, ValueError)
        w.submit(ja)
        assert await event(ja) == ("started", None)
        w.submit(jwait)
        closer = asyncio.create_task(asyncio.to_thread(w.close))
        kind, err = await event(jwait)
        assert kind == "error" and err.status == 503
        blocker.release()
        await asyncio.wait_for(closer, STEP_TIMEOUT)
        assert not w._thread.is_alive() and not w.alive
        with pytest.raises(APIError) as e:
            w.submit(Job(lambda llm: blocker, loop))
        assert e.value.status == 503

    run(main())


def test_drain_lets_the_running_job_finish_then_ends_it_at_the_deadline():
    """begin_shutdown: the waiting job gets 503 at once; the running one goes on while the
    drain lasts; a deadline that has passed ends it with an error event and closes it."""
    async def main():
        log: list = []
        w = EngineWorker(llm=None, max_queue=4)
        w.start()
        loop = asyncio.get_running_loop()
        a, b = FakeStream("A", 3, log), FakeStream("B", 1, log)
        ja, jb = Job(lambda llm: a, loop), Job(lambda llm: b, loop)
        w.submit(ja)
        assert await event(ja) == ("started", None)
        w.submit(jb)
        w.begin_shutdown(60.0)
        kind, err = await event(jb)
        assert kind == "error" and err.status == 503 and err.code == "shutting_down"
        assert jb.finish_reason == "shutdown" and "B start" not in log
        with pytest.raises(APIError):
            w.submit(Job(lambda llm: b, loop))
        a.release()
        assert await event(ja) == ("delta", "A0")  # still running: the drain lasts 60 s
        w.begin_shutdown(0.0)  # the deadline now: A ends before its next piece
        a.release()
        kind, err = await event(ja)
        assert kind == "error" and err.code == "shutting_down" and err.status == 503
        assert ja.finish_reason == "shutdown"
        assert await asyncio.to_thread(w.join, STEP_TIMEOUT) and a.closed

    run(main())


def test_request_timeout_ends_the_running_job():
    async def main():
        log: list = []
        w = EngineWorker(llm=None, max_queue=4, request_timeout_s=0.2)
        w.start()
        loop = asyncio.get_running_loop()
        a, b = FakeStream("A", 5, log), FakeStream("B", 1, log)
        ja, jb = Job(lambda llm: a, loop), Job(lambda llm: b, loop)
        try:
            w.submit(ja)
            w.submit(jb)
            assert await event(ja) == ("started", None)
            a.release()
            assert await event(ja) == ("delta", "A0")
            await asyncio.sleep(0.3)  # past the limit: A's next piece is not sent
            a.release()
            kind, err = await event(ja)
            assert kind == "error" and err.status == 504 and err.code == "request_timeout"
            assert ja.finish_reason == "timeout" and a.closed
            assert await event(jb) == ("started", None)  # the engine went on to B
            b.release()
            assert (await event(jb))[0] == "delta" and (await event(jb))[0] == "done"
            assert w.stats()["timed_out"] == 1
        finally:
            w.close()

    run(main())
