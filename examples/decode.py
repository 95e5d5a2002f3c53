"""Decode with monokernel's Python API: greedy, sampled with a seed, streamed, and chat.

    python examples/decode.py                      # bundled SmolLM2-135M, backend auto
    python examples/decode.py --backend emulator   # megakernel.cu on the CPU emulator (slow)
    python examples/decode.py --model path/to/model-folder-or.gguf
"""

import argparse

from monokernel import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()

    llm = LLM(args.model, backend=args.backend)
    n = args.max_new_tokens

    out = llm.generate("The capital of France is", SamplingParams(max_new_tokens=n))
    print(f"greedy  : {out.text!r} ({out.finish_reason}, {out.decode_tokens_per_s:.1f} tok/s)")

    sampled = SamplingParams(max_new_tokens=n, temperature=0.8, top_p=0.95, seed=7)
    print(f"sampled : {llm.generate('Once upon a time', sampled).text!r}")

    print("streamed: ", end="", flush=True)
    for piece in llm.stream("Here is a haiku about GPUs:", SamplingParams(max_new_tokens=n)):
        print(piece, end="", flush=True)
    print()

    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(max_new_tokens=n))
    print(f"chat    : {reply.text!r} [backend {llm.backend}]")


if __name__ == "__main__":
    main()
