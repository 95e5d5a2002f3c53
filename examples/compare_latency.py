"""Decode latency of the bundled SmolLM2-135M-Instruct on every backend this machine has.

Method (monokernel/bench.py): all backends run in this one process on the same bf16 weights and
the same prompt tokens. For each context length the KV cache is prefilled to that length, then
warm-up steps run untimed and N single-token decode steps are timed one by one (CUDA events on
the GPU, perf_counter on the CPU); the table shows the median with the p10-p90 spread, tokens/s,
GB/s (weight bytes per token / median time) and x-floor, where the floor is the weight bytes
divided by the copy bandwidth measured in the same run.

With a GPU: the megakernel (cuda), one launch per op (cuda-multi), the same replayed from a CUDA
graph (cuda-multi-graph), that graph with programmatic dependent launch (cuda-multi-graph-pdl,
sm_90+) and Hugging Face transformers (hf). Without one: the CPU emulator running
the same megakernel.cu, and the NumPy reference; the emulator shows that the code runs, not how
fast a GPU is, so it runs few steps at short contexts.

    python examples/compare_latency.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import importlib.util

from monokernel.tools.bench import cuda_unavailable_reason, format_table, run_bench, write_results
from monokernel.model.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the JSON + PNG into this folder")
    args = ap.parse_args()

    model = load_model(None)  # the bundled SmolLM2-135M-Instruct
    no_gpu = cuda_unavailable_reason()
    if no_gpu is None:
        backends = ["cuda", "cuda-multi", "cuda-multi-graph", "cuda-multi-graph-pdl"]
        contexts, steps, warmup, blocks = [16, 512, 2048], 100, 10, None
    else:
        print(f"note: no CUDA device ({no_gpu}); running the CPU emulator and the NumPy "
              "reference at short contexts. These numbers say nothing about GPU speed.")
        backends = ["emulator", "numpy"]
        contexts, steps, warmup, blocks = [4, 16], 3, 1, 4
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        backends.append("hf")

    doc = run_bench([("smollm2-135m", model)], backends, contexts, steps, warmup, blocks)
    doc["command"] = "python examples/compare_latency.py"
    print(format_table(doc))
    if args.out:
        jpath, ppath = write_results(doc, args.out)
        print(f"wrote {jpath}" + (f" and {ppath.name}" if ppath else ""))


if __name__ == "__main__":
    main()
