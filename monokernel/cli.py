"""The ``monokernel`` command: generate, chat, convert, synth, plan, bench, trace."""

from __future__ import annotations

import argparse
import sys
import time

from .errors import MonokernelError
from .serve.cli import add_serve_command


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF model folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default="auto",
                   help="auto | numpy | emulator | emulator-multi | cuda | cuda-multi")
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--blocks", type=int, default=None,
                   help="persistent blocks of the kernel backends (default: 4 on the emulator, "
                        "one per SM on a GPU)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _params(llm, args):
    overrides = {k: getattr(args, k) for k in
                 ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty",
                  "seed") if getattr(args, k) is not None}
    if args.stop:
        overrides["stop"] = tuple(args.stop)
    return llm.default_params.replace(**overrides)


def _llm(args):
    from .llm import LLM

    options = {"blocks": args.blocks} if args.blocks is not None else {}
    return LLM(args.model, backend=args.backend, max_seq_len=args.max_seq_len, **options)


def _summary(c) -> str:
    return (f"[{len(c.token_ids)} tokens, {c.decode_tokens_per_s:.1f} tokens/s decode, "
            f"{c.elapsed_s:.2f} s total, finish={c.finish_reason}, backend={c.backend}]")


def cmd_generate(args) -> int:
    llm = _llm(args)
    params = _params(llm, args)
    if args.chat:
        s = llm.chat([{"role": "user", "content": args.prompt}], params, stream=True)
    else:
        s = llm.stream(args.prompt, params)
    if not args.no_stream:
        print(args.prompt if not args.chat else "", end="", flush=True)
    for piece in s:
        if not args.no_stream:
            print(piece, end="", flush=True)
    c = s.completion
    if args.no_stream:
        print((args.prompt if not args.chat else "") + c.text, end="")
    print()
    print(_summary(c), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    llm = _llm(args)
    params = _params(llm, args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("monokernel chat - Ctrl-D or 'exit' to leave", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("exit", "quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        s = llm.chat(messages, params, stream=True)
        for piece in s:
            print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": s.completion.text})


def cmd_convert(args) -> int:
    from .model.gguf_import import convert_gguf

    t0 = time.perf_counter()
    out = convert_gguf(args.gguf, args.out_dir, overwrite=args.overwrite)
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_synth(args) -> int:
    from .model.synth import write_synthetic

    out = write_synthetic(args.shape, args.out_dir, seed=args.seed)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="monokernel", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("generate", help="generate a continuation of PROMPT")
    p.add_argument("prompt")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--chat", action="store_true", help="wrap PROMPT in the chat template")
    p.add_argument("--no-stream", action="store_true", help="print the text only at the end")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat using the model's chat template")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("convert", help="convert a GGUF file into an HF model folder")
    p.add_argument("gguf")
    p.add_argument("out_dir")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("synth", help="write a seeded random-weight checkpoint of a named shape")
    p.add_argument("out_dir")
    p.add_argument("--shape", required=True, help="e.g. smollm2-135m, qwen3-0.6b, llama-3.2-1b")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_synth)

    _add_kernel_commands(sub)
    add_serve_command(sub)  # serve/cli.py imports FastAPI only when the server starts
    return ap


def _add_kernel_commands(sub) -> None:
    """plan / bench / trace live in tools/ (they measure and explain the kernel)."""
    from .tools.commands import add_commands

    add_commands(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (MonokernelError, ValueError) as e:
        print(f"monokernel: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
