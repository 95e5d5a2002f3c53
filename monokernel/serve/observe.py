"""What the server tells its operator: Prometheus metrics at /metrics, and one structured log
line per request (logger ``monokernel.serve.requests``, one JSON object per line).

Both are written once per request, when its response has ended (the last byte of a stream
sent, or the client gone): ``RequestInfo`` carries what the route learnt (its job) to that
point. A generation's numbers come from its ``Job`` record (worker.py); a request that never
reached the engine (a 400, a 401) still gets its line and its count.

Metric names follow vLLM's where they mean the same (``time_to_first_token_seconds``,
``time_per_output_token_seconds``, ``prompt_tokens_total``), under the prefix ``monokernel_``.
Each app has its own registry, so several servers in one process (tests, replicas) never share
or double-count a metric.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

LOG = logging.getLogger("monokernel.serve.requests")

# routes named in the metrics; any other path is counted as "other" (a scanner hitting random
# paths must not grow the label set without bound)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
          "/health", "/metrics")
# how a generation ended without its engine finish reason: the client left, it ran past the
# time limit, the server shut down under it
CANCEL_REASONS = ("cancelled", "timeout", "shutdown")
# seconds: token latencies on a CPU are ~0.01-1 s, on a GPU ~1e-4-1e-2 s
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                   600.0)


@dataclass
class RequestInfo:
    """One HTTP request as the middleware sees it; the generation routes attach their job."""
    request_id: str
    method: str
    path: str
    arrived: float = field(default_factory=time.monotonic)
    job: Any = None  # worker.Job of a generation


def route_label(path: str) -> str:
    if path in ROUTES:
        return path
    return "/v1/models/{name}" if path.startswith("/v1/models/") else "other"


class Metrics:
    """The Prometheus metrics of one server (prometheus-client, its own registry)."""

    def __init__(self, worker):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "monokernel_"
        self.requests = Counter(p + "requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of generations",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated",
                                         registry=r)
        self.cancellations = Counter(
            p + "request_cancellations", "generations ended early: the client left "
            "(cancelled), the per-request time limit (timeout), a shutdown (shutdown)",
            ["reason"], registry=r)
        self.finished = Counter(p + "request_finish", "generations by how they ended",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "arrival to first token "
                              "(queue time included)", buckets=REQUEST_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "mean time between two "
                              "tokens of one generation", buckets=TOKEN_BUCKETS, registry=r)
        self.queue_time = Histogram(p + "queue_time_seconds", "time waiting for the engine",
                                    buckets=REQUEST_BUCKETS, registry=r)
        self.latency = Histogram(p + "e2e_request_latency_seconds", "arrival to the last "
                                 "byte of a generation", buckets=REQUEST_BUCKETS, registry=r)
        queued = Gauge(p + "queue_length", "requests waiting for the engine", registry=r)
        queued.set_function(lambda: worker.stats()["queued"])
        running = Gauge(p + "requests_running", "requests on the engine (up to --max-num-seqs)",
                        registry=r)
        running.set_function(lambda: int(worker.stats()["running"]))
        for reason in CANCEL_REASONS:  # present at 0, so a rate() has a series from the start
            self.cancellations.labels(reason)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def observe(self, line: dict[str, Any]) -> None:
        self.requests.labels(route_label(line["path"]), str(line["status"])).inc()
        if line.get("finish_reason") is None:
            return
        reason = line["finish_reason"]
        self.finished.labels(reason).inc()
        if reason in CANCEL_REASONS:
            self.cancellations.labels(reason).inc()
        self.prompt_tokens.inc(line["prompt_tokens"] or 0)
        self.generation_tokens.inc(line["completion_tokens"] or 0)
        for hist, key in ((self.ttft, "ttft_s"), (self.tpot, "tpot_s"),
                          (self.queue_time, "queue_s"), (self.latency, "total_s")):
            if line.get(key) is not None:
                hist.observe(line[key])


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def request_line(info: RequestInfo, status: int | None, replica: str,
                 ended: float | None = None) -> dict[str, Any]:
    """The log line of one finished request. A generation's ``finish_reason`` is the engine's
    (stop, length), or cancelled / timeout / shutdown / error; a generation whose response
    ended while its job had not (the client left) is ``cancelled``."""
    ended = time.monotonic() if ended is None else ended
    line: dict[str, Any] = {"request_id": info.request_id, "method": info.method,
                            "path": info.path, "status": status, "replica": replica,
                            "total_s": _round(ended - info.arrived)}
    job = info.job
    if job is None:
        return line
    started = job.started_at
    queue_s = ((started if started is not None else ended) - job.submitted_at
               if job.submitted_at is not None else None)
    first = job.first_token_at
    n = job.completion_tokens
    tpot = None
    if first is not None and n > 1 and job.ended_at is not None:
        tpot = (job.ended_at - first) / (n - 1)
    line.update(prompt_tokens=job.prompt_tokens, completion_tokens=n,
                queue_s=_round(queue_s),
                ttft_s=_round(None if first is None else first - info.arrived),
                tpot_s=_round(tpot), finish_reason=job.finish_reason or "cancelled")
    return line


def log_request(line: dict[str, Any]) -> None:
    LOG.info(json.dumps(line, ensure_ascii=False))


def setup_request_log(level: str) -> None:
    """The request log on stderr, at ``level`` (``monokernel serve --log-level``: info and
    debug show it). Its own handler, not propagated: uvicorn's and Ray's logging setups leave
    the root logger to others."""
    LOG.setLevel(level.upper())
    if not LOG.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        LOG.addHandler(handler)
    LOG.propagate = False
