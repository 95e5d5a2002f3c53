"""A bounded load test (issue 17): 64 streaming clients at once on one engine that batches up
to 32 of them per step; the rest wait in the queue. Every request must complete with exactly
the tokens it gets when it runs alone (seeded sampling, so a token taken from or given to the
wrong request would show; the numpy backend runs with batch_invariant=True, so alone and in a
batch compute the same numbers bit for bit), and every stream must end with its finish_reason,
its usage and [DONE]. Prints requests, concurrency, p50/p99 latency and tokens lost (which must
be 0). With --max-num-seqs 1 the server is FIFO again: one request on the engine at a time."""

from __future__ import annotations

import asyncio
import time

import pytest

from helpers.serve import running_server, sse_events

import httpx

from monokernel import LLM

# alone, after the parallel part of make test: it reports latency percentiles under its own load
pytestmark = pytest.mark.serial

N_CLIENTS = 64
MAX_NUM_SEQS = 32
MAX_TOKENS = 24
TOTAL_TIMEOUT_S = 120.0  # the whole concurrent phase; one stream's read timeout is 60 s


@pytest.fixture(scope="module")
def tiny_llm(synth_dir):
    return LLM(synth_dir("tiny"), backend="numpy", progress=False, batch_invariant=True,
               max_num_seqs=MAX_NUM_SEQS)


def request(i: int) -> tuple[str, dict]:
    """Request i: completions or chat, prompts of different lengths, seed i, every 8th greedy.
    The tiny model's random weights make a peaked distribution: temperature 10 makes the
    seeded samples differ from request to request."""
    common = {"max_tokens": MAX_TOKENS, "stream": True, "return_token_ids": True,
              "stream_options": {"include_usage": True},
              "temperature": 0.0 if i % 8 == 0 else 10.0, "seed": i}
    if i % 3 == 2:
        msgs = [{"role": "user", "content": f"Client {i} asks" + " more" * (i % 5)}]
        return "/v1/chat/completions", {**common, "messages": msgs}
    return "/v1/completions", {**common, "prompt": f"Client {i} says" + " hello" * (i % 7)}


async def run_one(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    t0 = time.perf_counter()
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        events = sse_events([line async for line in r.aiter_lines()])
    latency = time.perf_counter() - t0
    assert events[-1] == "[DONE]", events[-3:]
    *chunks, usage = events[:-1]
    assert usage["choices"] == [], usage
    choices = [c["choices"][0] for c in chunks]
    key = "text" if path == "/v1/completions" else "delta"
    text = "".join(ch[key] if key == "text" else ch[key].get("content", "") for ch in choices)
    ids = [t for ch in choices for t in ch.get("token_ids", [])]
    finish = [ch["finish_reason"] for ch in choices if ch["finish_reason"]]
    assert len(finish) == 1, finish
    return {"text": text, "ids": ids, "finish": finish[0], "usage": usage["usage"],
            "latency": latency}


def tokens_lost(want: list[int], got: list[int]) -> int:
    """Tokens of ``want`` missing from ``got``: past their common prefix, or cut short."""
    k = 0
    while k < min(len(want), len(got)) and want[k] == got[k]:
        k += 1
    return len(want) - k + max(0, len(got) - len(want))


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


async def all_at_once(srv, requests) -> tuple[list, dict[str, int]]:
    """The requests' coroutines run at once (bounded by TOTAL_TIMEOUT_S), and the worker's peak
    queued and running counts while they ran."""
    peak = {"queued": 0, "running": 0}
    done = asyncio.Event()

    async def watch():
        while not done.is_set():
            st = srv.worker.stats()
            for k in peak:
                peak[k] = max(peak[k], st[k])
            await asyncio.sleep(0.005)

    w = asyncio.create_task(watch())
    try:
        return await asyncio.wait_for(asyncio.gather(*requests), TOTAL_TIMEOUT_S), peak
    finally:
        done.set()
        await w


def test_concurrent_streams_get_exactly_their_tokens(tiny_llm):
    reqs = [request(i) for i in range(N_CLIENTS)]
    with running_server(tiny_llm, max_queue=N_CLIENTS, max_num_seqs=MAX_NUM_SEQS) as srv:
        async def main():
            limits = httpx.Limits(max_connections=N_CLIENTS + 4)
            async with httpx.AsyncClient(base_url=srv.url, timeout=60.0, limits=limits) as c:
                alone = [await run_one(c, p, b) for p, b in reqs]  # one at a time
                t0 = time.perf_counter()
                together, peak = await all_at_once(srv, (run_one(c, p, b) for p, b in reqs))
                return alone, together, time.perf_counter() - t0, peak

        alone, together, wall, peak = asyncio.run(main())
        assert srv.worker.stats()["running"] == 0 and srv.worker.stats()["queued"] == 0

    lost = sum(tokens_lost(a["ids"], b["ids"]) for a, b in zip(alone, together))
    lat = [r["latency"] for r in together]
    n_tokens = sum(len(r["ids"]) for r in together)
    print(f"\nload test: {N_CLIENTS} requests, {N_CLIENTS} concurrent streaming clients "
          f"(peak {peak['running']} running, {peak['queued']} queued), {n_tokens} tokens in "
          f"{wall:.2f} s ({n_tokens / wall:.0f} tokens/s); latency p50 {percentile(lat, 50):.3f} s,"
          f" p99 {percentile(lat, 99):.3f} s; tokens lost: {lost}")
    assert lost == 0
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b["ids"] == a["ids"] and b["text"] == a["text"], i
        assert b["finish"] == a["finish"], i
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert b["usage"][k] == a["usage"][k], (i, k)
        assert b["usage"]["completion_tokens"] == len(b["ids"]) + (b["finish"] == "stop"), i
    assert len({tuple(a["ids"]) for a in alone}) > N_CLIENTS // 2  # the requests differ
    assert peak["running"] == MAX_NUM_SEQS  # they really were in flight together
    assert peak["queued"] >= (N_CLIENTS - MAX_NUM_SEQS) // 2  # and the rest waited
    assert tiny_llm.engine.batcher.pool.in_use == 0  # every page given back


def test_max_num_seqs_1_serves_one_request_at_a_time(tiny_llm):
    """--max-num-seqs 1: FIFO, one request on the engine while the others wait."""
    reqs = [request(i) for i in range(4)]
    with running_server(tiny_llm, max_queue=8, max_num_seqs=1) as srv:
        assert srv.worker.max_num_seqs == 1

        async def main():
            seen = []
            async with httpx.AsyncClient(base_url=srv.url, timeout=60.0) as c:
                async def watch():
                    while True:
                        seen.append(srv.worker.stats()["running"])
                        await asyncio.sleep(0.002)

                w = asyncio.create_task(watch())
                try:
                    out = await asyncio.wait_for(
                        asyncio.gather(*(run_one(c, p, b) for p, b in reqs)), 60)
                finally:
                    w.cancel()
            return out, seen

        out, seen = asyncio.run(main())
    assert len(out) == 4 and max(seen) == 1


def test_a_kernel_backend_serves_its_slots_concurrently(synth_dir):
    """The emulator built with slots=4 (issue 17 slice 3: steps of many sequences, K/V in
    pages): 12 concurrent streaming clients, 4 on the engine at once, each response exactly
    what the request gets alone, every page given back."""
    llm = LLM(synth_dir("tiny"), backend="emulator", progress=False, max_seq_len=64, slots=4,
              step_tokens=8, blocks=2)
    assert llm.engine.batcher is not None and llm.engine.batcher.max_num_seqs == 4
    reqs = [request(i) for i in range(12)]
    for _, body in reqs:
        body["max_tokens"] = 6
    with running_server(llm, max_queue=16, max_num_seqs=8) as srv:
        assert srv.worker.max_num_seqs == 4  # the kernel's slots

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60.0) as c:
                alone = [await run_one(c, p, b) for p, b in reqs]
                together, peak = await all_at_once(srv, (run_one(c, p, b) for p, b in reqs))
                return alone, together, peak["running"]

        alone, together, peak = asyncio.run(main())
    assert [b["ids"] for b in together] == [a["ids"] for a in alone]
    assert [b["text"] for b in together] == [a["text"] for a in alone]
    assert len({tuple(a["ids"]) for a in alone}) > 6  # the requests differ
    assert peak == 4
    assert llm.engine.batcher.pool.in_use == 0
