"""``monokernel bench --batch B --prompt P``: what a user of a backend gets on this machine,
through the Engine as ``LLM.generate`` drives it.

- Time to first token: a P-token prompt alone (no prefix reuse), from the request to its first
  token, the median of ``repeats`` different prompts.
- Throughput: B different P-token prompts started together, each generating ``new_tokens``
  greedy tokens (EOS ignored); the aggregate generated tokens/s over the wall time until the last
  one ends. A batched executor (numpy; a kernel backend built with ``--option slots=N``, at
  most N sequences a step) runs them in one step loop; a kernel backend without slots runs one
  sequence at a time, so its B sequences run in turn, and the row says which.

- Device time (a kernel backend built with slots): the same two things with the host outside
  the window (``device_times``): each prompt chunk step of a P-token prompt, timed alone, and
  ``new_tokens`` decode steps of B sequences at context P in launches of the kernel's steps a
  launch; beside them, for a tensor-core kernel, what the cost model predicts on an H200 for
  the same steps (the physical table and the one fitted to the first GPU run), so a GPU run
  compares them.

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
            max_seq: int | None = None, device_only: bool = False, predict: bool = True) -> dict:
    """One row: the backend's time to first token and aggregate tokens/s at ``batch``, and
    for a kernel of slots its device times (``device_only``: those alone, no Engine run).
    ``max_seq``: the KV cache's length (default: the prompt and its tokens; the GPU check
    gives its one length, so that the kernel it prepared is the one loaded). A failure of
    the device times is the row's ``device_error``: the Engine's figures stay."""
    from ..runtime import make_executor

    if blocks is not None and backend != "numpy":
        options = dict(options, blocks=blocks)
    max_seq = max_seq or prompt + new_tokens + 2
    ex = make_executor(backend, model, max_seq, **options)
    row = {"backend": backend, "shape": label, "batch": batch, "prompt": prompt,
           "new_tokens": new_tokens, "options": dict(options)}
    if device_only and not getattr(ex, "table", False):
        raise ValueError(f"{backend}: device times are for a kernel of slots (--slots S)")
    if not device_only:
        row.update(served(ex, batch, prompt, new_tokens, repeats))
    if getattr(ex, "table", False):
        try:
            row["device"] = device_times(ex, batch, prompt, new_tokens, predict)
        except Exception as e:  # noqa: BLE001 - recorded in the row
            row["device_error"] = f"{type(e).__name__}: {e}"
    return row


def served(ex, batch: int, prompt: int, new_tokens: int, repeats: int) -> dict:
    """Through the Engine: the time to first token of ``repeats`` prompts alone, then the
    aggregate tokens/s of ``batch`` prompts started together."""
    from ..runtime import Engine
    from ..sampling import SamplingParams

    eng = Engine(ex, prefix_caching=False, max_num_seqs=batch)  # rows: the default, capped
    batched = eng.batcher is not None
    vocab = ex.config.vocab_size
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
    return {"mode": (f"batched: up to {eng.batcher.max_num_seqs} sequences a step"
                     if batched else "one sequence at a time"),
            "ttft_s": ttft, "ttft_ms": float(np.median(ttft)) * 1e3,
            "generated": made, "wall_s": wall, "tokens_per_s": made / wall}


def device_times(ex, batch: int, prompt: int, steps: int, predict: bool = True) -> dict:
    """Device time of a kernel of slots' own steps, the host outside the window: every slot's
    ``prompt``-token prompt in chunks of the kernel's step rows, each chunk one launch timed by
    ``device.time`` (its control words written before the start event; a cooperative launch's
    own latency stays inside), then ``steps`` decode steps of the ``batch`` sequences in
    launches of up to the kernel's steps per launch (as the Engine runs them), every row drawn
    greedily on the device, their time divided by the steps. The prompt's
    time is the sum of its chunks' (the median over the slots of each chunk's time); the
    control words after each launch must show every step run, so a launch that did nothing
    cannot pass as fast. For a tensor-core kernel, ``predicted`` holds the cost model's
    figures for the same steps on "h200" (the physical table) and "h200-fit" (fitted to the
    first GPU run's decode steps): plan --predict GPU --batch / --prompt (``predict``
    False: left out; a 128-row program's take ~7 s a GPU on a CPU core, which the GPU check
    leaves to plan afterwards)."""
    from ..kernel.base import DeviceSample, StepTable

    T, P = ex.max_step_rows, ex.page_size
    per = -(-(prompt + steps + 1) // P)  # pages a slot's positions need
    if batch > ex.slots or batch * per > ex.max_pages:
        raise ValueError(f"device times: {batch} sequences of {prompt + steps + 1} positions "
                         f"need {batch} slots and {batch * per} pages; the kernel has "
                         f"{ex.slots} slots and {ex.max_pages} pages")
    ex.reset()
    pages = list(ex.add_pages(batch * per))
    tables = {s: pages[s * per:(s + 1) * per] for s in range(batch)}
    greedy = DeviceSample(0.0, 0)
    dev, control = ex.device, ex.buffers["control"]

    def timed(table: StepTable, want_steps: int) -> float:
        dev.write(control, ex.write_table(table))
        before = ex.steps_run
        (t,) = dev.time(ex.run_launches, 1)
        words = dev.read(control)
        ex.absorb_control(words)
        if ex.steps_run - before != want_steps:
            raise RuntimeError(f"device times: a launch ran {ex.steps_run - before} steps, "
                               f"expected {want_steps}")
        return t

    ids = prompts(ex.config.vocab_size, batch, prompt, seed=3)
    starts = range(0, prompt, T)
    chunks: list[list[float]] = [[] for _ in starts]  # [chunk][slot]
    for s in range(batch):
        for i, at in enumerate(starts):
            n = min(T, prompt - at)
            last = at + n == prompt
            rows = [(ids[s][at + j], s, at + j, last and j == n - 1, True) for j in range(n)]
            draws = {s: greedy} if last else None
            chunks[i].append(timed(StepTable.of(rows, {s: tables[s]}, draws=draws), 1))
    t, done, tokens = 0.0, 0, [ids[s][-1] for s in range(batch)]
    while done < steps:  # launches of up to max_table_steps decode steps
        n = min(ex.max_table_steps, steps - done)
        rows = [(tokens[s], s, prompt + done, True, False) for s in range(batch)]
        t += timed(StepTable.of(rows, tables, draws={s: greedy for s in range(batch)},
                                steps=n), n)
        done += n
    chunk_us = [float(np.median(c)) * 1e6 for c in chunks]
    out = {"timer": "device.time around each launch (control words written before it)",
           "decode_launches": -(-steps // ex.max_table_steps),
           "chunk_rows": T, "prompt_chunks_us": chunk_us, "prompt_us": sum(chunk_us),
           "decode_context": prompt, "decode_steps": steps,
           "decode_step_us": t / steps * 1e6, "decode_tokens_per_s": batch * steps / t}
    if ex.tensor_cores and predict:
        out["predicted"] = {g: predicted(ex.program, g, batch, prompt, steps)
                            for g in PREDICTED_ON}
    return out


PREDICTED_ON = ("h200", "h200-fit")


def predicted(prog, gpu_name: str, batch: int, prompt: int, steps: int) -> dict:
    """The cost model's figures on ``gpu_name`` (a PREDICTION) for device_times' steps: each
    prompt chunk and a decode step of ``batch`` sequences at the decode steps' mean context."""
    from ..kernel import costmodel as cm
    from ..kernel.costmodel.tokens import StepShape, prefill_shapes

    g = cm.gpu(gpu_name)
    d = cm.design_for(prog, tensor_cores=True)
    chunk = [cm.predict(prog, g, d, shape=s).step_us for s in prefill_shapes(prompt, prog.tokens)]
    step = cm.predict(prog, g, d, shape=StepShape.decode(batch, prompt + steps // 2))
    return {"design": d.name, "prompt_chunks_us": chunk, "prompt_us": sum(chunk),
            "decode_step_us": step.step_us, "decode_tokens_per_s": batch / step.step_us * 1e6}


def run(models: list[tuple[str, LoadedModel]], backends: list[str], batch: int, prompt: int,
        new_tokens: int, repeats: int, blocks: int | None, options: dict, log=print,
        max_seq: int | None = None, device_only: bool = False, command: str = "",
        out_dir: str | Path | None = None, predict: bool = True) -> dict:
    """Every (model, backend) row; with ``out_dir`` the JSON is rewritten after each row, so
    a run stopped at a time limit keeps the rows it finished."""
    from .bench import commit_info, device_name, git_commit

    doc = {"kind": "served rates (bench --batch/--prompt)",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": device_name(), "commit": git_commit(), "commit_source": commit_info()[1],
           "command": command, "results": []}
    for label, model in models:
        for backend in backends:
            log(f"{backend} {label}: batch {batch}, {prompt}-token prompts, "
                f"{new_tokens} tokens each ...")
            try:
                opts = options if backend != "numpy" else {}
                doc["results"].append(measure(backend, label, model, batch, prompt, new_tokens,
                                              repeats, blocks, opts, max_seq, device_only,
                                              predict))
            except Exception as e:  # a row that fails is recorded, the run goes on
                doc["results"].append({"backend": backend, "shape": label, "batch": batch,
                                       "prompt": prompt, "error": f"{type(e).__name__}: {e}"})
            if out_dir is not None:
                write(doc, out_dir)
    return doc


def format_table(doc: dict) -> str:
    head = (f"{'backend':<18} {'shape':<14} {'batch':>5} {'prompt':>6} {'TTFT ms':>10} "
            f"{'tokens/s':>9}  mode")
    lines = [head, "-" * len(head)]
    for r in doc["results"]:
        pre = f"{r['backend']:<18} {r['shape']:<14} {r['batch']:>5} {r['prompt']:>6} "
        if r.get("error"):
            lines.append(pre + f"ERROR {r['error']}")
            continue
        lines.append(pre + (f"{r['ttft_ms']:>10.1f} {r['tokens_per_s']:>9.1f}  {r['mode']}"
                            if "ttft_ms" in r else f"{'-':>10} {'-':>9}  device times only"))
        if r.get("device"):
            lines.append("  " + device_line(r["device"], r["batch"], r["prompt"]))
        if r.get("device_error"):
            lines.append(f"  device time: ERROR {r['device_error']}")
    lines.append("TTFT: a prompt alone, request to first token (median); tokens/s: every "
                 "sequence's generated tokens over the wall time of the batch; measured on "
                 f"{doc['device']} (the H200's are predicted: monokernel plan --predict h200 "
                 "--batch B / --prompt P)")
    return "\n".join(lines)


def device_line(d: dict, batch: int, prompt: int) -> str:
    """device_times' figures in one line, the predicted ones beside them."""
    chunks = len(d["prompt_chunks_us"])
    prompt_ms, step_us, rate = d["prompt_us"] / 1e3, d["decode_step_us"], d["decode_tokens_per_s"]
    line = (f"device time: a {prompt}-token prompt in {chunks} step{'s' * (chunks != 1)} of up "
            f"to {d['chunk_rows']} rows {prompt_ms:.2f} ms; a decode step of {batch} sequences "
            f"at context {d['decode_context']} {step_us:.0f} us, {rate:.0f} tokens/s")
    for g, pred in (d.get("predicted") or {}).items():
        line += (f"; predicted on {g}: {pred['prompt_us'] / 1e3:.2f} ms, "
                 f"{pred['decode_step_us']:.0f} us, {pred['decode_tokens_per_s']:.0f} tokens/s")
    return line


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
