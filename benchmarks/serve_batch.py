"""Continuous batching on `monokernel serve`: the same requests one at a time, then all at once.

    python benchmarks/serve_batch.py --requests 32 --max-tokens 32 --out benchmarks/results

Starts `monokernel serve` (default: the numpy backend, the bundled SmolLM2-135M,
``--max-num-seqs`` = the number of requests) on 127.0.0.1, sends one warm-up request, then sends
``--requests`` different completions (prompts of ~26 tokens, greedy, ``ignore_eos`` so each
makes exactly ``--max-tokens`` tokens) one after another and measures their aggregate
generated tokens/s. It then restarts the server (so the second phase finds no prompt in the
prefix cache) and sends the same requests all at once, one thread each. It checks that every
concurrent response equals its solo one, and prints both rates and their ratio (issue 17's
target: >= 4x with 32 clients on the numpy backend). ``--out DIR`` writes the JSON there as
serve-batch-<date>-cpu-<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_replicas import REPO, launch  # noqa: E402  (the sibling script's helpers)

from monokernel.tools.bench import cpu_name  # noqa: E402


def start(args, log: Path) -> tuple[subprocess.Popen, str]:
    serve = ["--backend", args.backend, "--log-level", "warning", "--max-num-seqs",
             str(args.requests), "--max-queue", str(max(64, args.requests)),
             "--request-timeout", "3000"]
    if args.model:
        serve += ["--model", args.model]
    for opt in args.option or ():
        serve += ["--option", opt]
    p, url = launch(serve, log)
    httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=600)
    return p, url


def stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)


TOPICS = ["rivers", "bread", "the moon", "bicycles", "volcanoes", "chess", "owls", "glass",
          "trains", "coffee", "tides", "maps", "bees", "clocks", "salt", "kites"]


def bodies(n: int, max_tokens: int) -> list[dict]:
    """n different prompts of about 26 tokens (SmolLM2's tokenizer)."""
    return [{"prompt": f"Request {i}. Write a short, plain paragraph for a curious child about "
                       f"{TOPICS[i % len(TOPICS)]}, and say one surprising fact about "
                       f"{TOPICS[(i * 7 + 3) % len(TOPICS)]} too:",
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            for i in range(n)]


def send(client: httpx.Client, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code} {r.text[:300]}")
    j = r.json()
    return {"text": j["choices"][0]["text"], "tokens": j["usage"]["completion_tokens"],
            "prompt_tokens": j["usage"]["prompt_tokens"],
            "latency_s": time.perf_counter() - t0}


def phase(url: str, reqs: list[dict], concurrent: bool) -> tuple[list[dict], float]:
    """The requests one after another or one thread each, through one httpx.Client (a pool of
    a connection per thread, built before the clock starts). A client per request built its own
    SSL context, ~30 ms of CPU each: 32 of them at once delayed the first request by 0.7 s and
    took the 2 cores from the server's first step (benchmarks/NOTES.md)."""
    out: list[dict | None] = [None] * len(reqs)
    errors: list[str] = []
    pool = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=len(reqs))
    with httpx.Client(timeout=3000, limits=pool) as client:
        t0 = time.perf_counter()
        if not concurrent:
            for i, b in enumerate(reqs):
                out[i] = send(client, url, b)
        else:
            def one(i: int) -> None:
                try:
                    out[i] = send(client, url, reqs[i])
                except Exception as e:  # reported below; the phase fails
                    errors.append(f"request {i}: {e}")

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {errors[:3]}")
    return out, wall  # type: ignore[return-value]


def command_args() -> list[str]:
    """This run's arguments for the JSON, a folder outside the repository (--out) written as
    DIR: a result names no path of the machine it ran on."""
    out = list(sys.argv[1:])
    for i, a in enumerate(out[:-1]):
        if a == "--out":
            path = Path(out[i + 1]).resolve()
            out[i + 1] = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else "DIR"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("-o", "--option", action="append", default=None, metavar="NAME=VALUE",
                    help="a backend option for the server, e.g. batch_invariant=true "
                         "(repeatable)")
    ap.add_argument("--out", default=None, help="a folder for the JSON")
    args = ap.parse_args()
    reqs = bodies(args.requests, args.max_tokens)
    result = {}
    for name, concurrent in (("one_at_a_time", False), ("concurrent", True)):
        log = Path(tempfile.mkdtemp(prefix="mk-serve-batch-")) / "serve.log"
        p, url = start(args, log)
        try:
            out, wall = phase(url, reqs, concurrent)
        finally:
            stop(p)
        tokens = sum(r["tokens"] for r in out)
        lat = sorted(r["latency_s"] for r in out)
        result[name] = {"wall_s": round(wall, 2), "tokens": tokens,
                        "tokens_per_s": round(tokens / wall, 2),
                        "latency_p50_s": round(lat[len(lat) // 2], 2),
                        "latency_max_s": round(lat[-1], 2), "responses": out}
        print(f"{name}: {tokens} tokens in {wall:.1f} s = {tokens / wall:.2f} tokens/s",
              flush=True)
    solo, together = result["one_at_a_time"]["responses"], result["concurrent"]["responses"]
    differ = [i for i, (a, b) in enumerate(zip(solo, together)) if a["text"] != b["text"]]
    ratio = result["concurrent"]["tokens_per_s"] / result["one_at_a_time"]["tokens_per_s"]
    print(f"ratio {ratio:.2f}x (target >= 4x); responses equal to their solo run: "
          f"{len(solo) - len(differ)}/{len(solo)}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip() or "unknown"
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": commit,
           "machine": f"{cpu_name()}, {os.cpu_count()} cores, no GPU",
           "backend": args.backend, "options": args.option or [],
           "model": args.model or "bundled SmolLM2-135M-Instruct",
           "command": "python " + " ".join(["benchmarks/serve_batch.py"] + command_args()),
           "requests": args.requests, "max_tokens": args.max_tokens, "ratio": round(ratio, 2),
           "equal_to_solo": len(solo) - len(differ), "differ": differ, **result}
    if args.out:
        name = f"serve-batch-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-cpu-{commit}.json"
        path = Path(args.out) / name
        path.write_text(json.dumps(doc, indent=1))
        print(f"wrote {path}")
    if differ:
        raise SystemExit(f"{len(differ)} concurrent responses differ from their solo run: "
                         f"{differ}")


if __name__ == "__main__":
    main()
