"""``monokernel bench --batch B --prompt P``: what a user of a backend gets on this machine,
through the Engine as ``LLM.generate`` drives it.

- Time to first token: a P-token prompt alone (no prefix reuse), from the request to its first
  token, the median of ``repeats`` different prompts.
- Throughput: B different P-token prompts started together, each generating ``new_tokens``
  greedy tokens (EOS ignored); the aggregate generated tokens/s over the wall time until the last
  one ends. A batched executor (numpy; a kernel backend built with ``--option slots=N``, at
  most N sequences a step) runs them in one step loop; a kernel backend without slots runs one
  sequence at a time, so its B sequences run in turn, and the row says which.

A measurement of this machine (a CPU here); the H200's figures for the kernel's design of many
tokens per step are predicted by ``monokernel plan --predict h200 --batch B / --prompt P``.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import numpy as np

from ..model.loader import LoadedModel


def prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    """n different seeded prompts of ``length`` ids (ids 0..2, special in synthetic
    vocabularies, left out)."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab_size, size=length)] for _ in range(n)]


def measure(backend: str, label: str, model: LoadedModel, batch: int, prompt: int,
            new_tokens: int, repeats: int, blocks: int | None, options: dict,
            max_seq: int | None = None) -> dict:
    """One row: the backend's time to first token and aggregate tokens/s at ``batch``.
    ``max_seq``: the KV cache's length (default: the prompt and its tokens; the GPU check
    gives its one length, so that the kernel it prepared is the one loaded)."""
    from ..runtime import Engine, make_executor
    from ..sampling import SamplingParams

    if blocks is not None and backend != "numpy":
        options = dict(options, blocks=blocks)
    max_seq = max_seq or prompt + new_tokens + 2
    ex = make_executor(backend, model, max_seq, **options)
    eng = Engine(ex, prefix_caching=False, max_num_seqs=batch)  # rows: the default, capped
    batched = eng.batcher is not None
    vocab = model.config.vocab_size
    first = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    ttft = []
    for ids in prompts(vocab, repeats, prompt, seed=1):
        t0 = time.perf_counter()
        gen = eng.generate(ids, first)
        next(gen)
        ttft.append(time.perf_counter() - t0)
        gen.close()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids_list = prompts(vocab, batch, prompt, seed=2)
    made = 0
    t0 = time.perf_counter()
    if batched:  # all started together; pulling any of them advances the one step loop
        live = [iter(eng.generate(ids, params)) for ids in ids_list]
        while live:
            still = []
            for it in live:
                try:
                    next(it)
                    made += 1
                    still.append(it)
                except StopIteration:
                    pass
            live = still
    else:  # one sequence at a time
        for ids in ids_list:
            made += sum(1 for _ in eng.generate(ids, params))
    wall = time.perf_counter() - t0
    return {"backend": backend, "shape": label, "batch": batch, "prompt": prompt,
            "new_tokens": new_tokens, "options": {k: v for k, v in options.items()},
            "mode": (f"batched: up to {eng.batcher.max_num_seqs} sequences a step"
                     if batched else "one sequence at a time"),
            "ttft_s": ttft, "ttft_ms": float(np.median(ttft)) * 1e3,
            "generated": made, "wall_s": wall, "tokens_per_s": made / wall}


def run(models: list[tuple[str, LoadedModel]], backends: list[str], batch: int, prompt: int,
        new_tokens: int, repeats: int, blocks: int | None, options: dict, log=print,
        max_seq: int | None = None) -> dict:
    from .bench import commit_info, device_name, git_commit

    rows = []
    for label, model in models:
        for backend in backends:
            log(f"{backend} {label}: batch {batch}, {prompt}-token prompts, "
                f"{new_tokens} tokens each ...")
            try:
                opts = options if backend != "numpy" else {}
                rows.append(measure(backend, label, model, batch, prompt, new_tokens, repeats,
                                    blocks, opts, max_seq))
            except Exception as e:  # a row that fails is recorded, the run goes on
                rows.append({"backend": backend, "shape": label, "batch": batch,
                             "prompt": prompt, "error": f"{type(e).__name__}: {e}"})
    return {"kind": "served rates (bench --batch/--prompt)",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device_name(), "commit": git_commit(), "commit_source": commit_info()[1],
            "results": rows}


def format_table(doc: dict) -> str:
    head = (f"{'backend':<18} {'shape':<14} {'batch':>5} {'prompt':>6} {'TTFT ms':>10} "
            f"{'tokens/s':>9}  mode")
    lines = [head, "-" * len(head)]
    for r in doc["results"]:
        pre = f"{r['backend']:<18} {r['shape']:<14} {r['batch']:>5} {r['prompt']:>6} "
        if r.get("error"):
            lines.append(pre + f"ERROR {r['error']}")
            continue
        lines.append(pre + f"{r['ttft_ms']:>10.1f} {r['tokens_per_s']:>9.1f}  {r['mode']}")
    lines.append("TTFT: a prompt alone, request to first token (median); tokens/s: every "
                 "sequence's generated tokens over the wall time of the batch; measured on "
                 f"{doc['device']} (the H200's are predicted: monokernel plan --predict h200 "
                 "--batch B / --prompt P)")
    return "\n".join(lines)


def write(doc: dict, out_dir: str | Path) -> Path:
    """bench-batch-<date>-<device>-<commit>.json, written atomically."""
    from .bench import _slug

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.fromisoformat(doc["date"]).strftime("%Y%m%d-%H%M%S")
    dev = "cpu" if doc["device"].startswith("CPU ") else _slug(doc["device"])
    path = out_dir / f"bench-batch-{date}-{dev}-{_slug(doc['commit'])}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False))
    tmp.replace(path)
    return path
