"""Load on `monokernel serve`: one server vs Ray Serve replicas, same model, same requests.

    python benchmarks/serve_replicas.py --configs 0,1,2 --requests 16 --max-tokens 16

For each config (0: the plain single-process server; N: ``--replicas N`` on a local Ray
instance) it starts the command on 127.0.0.1, waits for /health, sends one warm-up request
per replica, then sends ``--requests`` identical short completions at once (one thread each,
greedy, ``ignore_eos`` so every request makes exactly ``--max-tokens`` tokens) and measures
the wall time from the first send to the last answer. It prints requests, wall time,
generated tokens/s, latency p50/p99 and how many requests each replica served, and stops the
command with SIGTERM. ``--out FILE`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(serve_args: list[str], log: Path, **env_extra: str) -> tuple[subprocess.Popen, str]:
    """`monokernel serve <serve_args>` on a free 127.0.0.1 port, in a session of its own, its
    output in ``log``; returns once /health answers (or exits naming why it did not)."""
    port = free_port()
    cmd = [sys.executable, "-m", "monokernel", "serve", "--port", str(port), *serve_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO),
                                                       os.environ.get("PYTHONPATH", "")]),
               **env_extra)
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if p.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return p, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
            raise SystemExit("the server did not come up")
        time.sleep(0.5)


def start(replicas: int, model: str | None, backend: str, log: Path) -> tuple[subprocess.Popen,
                                                                                 str]:
    args = ["--backend", backend, "--log-level", "warning"]
    if model:
        args += ["--model", model]
    if replicas:
        args += ["--replicas", str(replicas)]
    return launch(args, log, RAY_USAGE_STATS_ENABLED="0")


def run_load(url: str, n: int, max_tokens: int) -> dict:
    body = {"prompt": "The capital of France is", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    results: list[tuple[float, int, str]] = []
    errors: list[str] = []

    def one() -> None:
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        if r.status_code != 200:
            errors.append(f"{r.status_code} {r.text[:200]}")
            return
        results.append((time.perf_counter() - t0, r.json()["usage"]["completion_tokens"],
                        r.headers.get("x-monokernel-replica", "?")))

    threads = [threading.Thread(target=one) for _ in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {errors[:3]}")
    lat = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {"requests": n, "wall_s": round(wall, 2), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2),
            "latency_p50_s": round(lat[len(lat) // 2], 2),
            "latency_p99_s": round(lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))], 2),
            "per_replica": sorted(Counter(r[2] for r in results).values(), reverse=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="0,1,2",
                    help="comma-separated: 0 = one plain server, N = N Ray Serve replicas")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    for replicas in (int(c) for c in args.configs.split(",")):
        log = Path(tempfile.mkdtemp(prefix="mk-serve-load-")) / "serve.log"
        p, url = start(replicas, args.model, args.backend, log)
        try:
            for _ in range(max(replicas, 1)):  # warm every replica (first-request costs)
                httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                           timeout=300)
            row = {"config": f"{replicas} Ray replicas" if replicas else "one server",
                   "backend": args.backend, "max_tokens": args.max_tokens,
                   **run_load(url, args.requests, args.max_tokens)}
        finally:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                    time.gmtime()),
                                              "cpus": os.cpu_count(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
