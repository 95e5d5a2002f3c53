"""The ``monokernel`` command: generate, chat, convert, synth, plan, calibrate, bench, trace,
serve."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .backend_args import add_backend_arg, add_backend_args, backend_options
from .errors import MonokernelError, PromptError
from .serve.cli import add_serve_command


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF model folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    add_backend_arg(p)
    p.add_argument("--max-seq-len", type=int, default=None)
    add_backend_args(p)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="seed (< 0: random)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


SAMPLING_ARGS = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty",
                 "min_p", "presence_penalty", "frequency_penalty", "seed")


def _params(llm, args):
    overrides = {k: getattr(args, k) for k in SAMPLING_ARGS if getattr(args, k) is not None}
    if args.stop:
        overrides["stop"] = tuple(args.stop)
    return llm.default_params.replace(**overrides)


def _llm(args):
    from .llm import LLM

    return LLM(args.model, backend=args.backend, max_seq_len=args.max_seq_len,
               **backend_options(args))


def _summary(c) -> str:
    launches = f", {c.launches} kernel launch{'es' if c.launches != 1 else ''}" \
        if c.launches else ""
    return (f"[{len(c.token_ids)} tokens, {c.decode_tokens_per_s:.1f} tokens/s decode, "
            f"{c.elapsed_s:.2f} s total, finish={c.finish_reason}, backend={c.backend}"
            f"{launches}]")


def cmd_generate(args) -> int:
    llm = _llm(args)
    params = _params(llm, args)
    if args.chat:
        s = llm.chat([{"role": "user", "content": args.prompt}], params, stream=True)
    else:
        s = llm.stream(args.prompt, params)
    if not args.no_stream:
        print(args.prompt if not args.chat else "", end="", flush=True)
    for piece in _after_prefill(s):
        if not args.no_stream:
            print(piece, end="", flush=True)
    c = s.completion
    if args.no_stream:
        print((args.prompt if not args.chat else "") + c.text, end="")
    print()
    print(_summary(c), file=sys.stderr)
    return 0


def _after_prefill(stream):
    """The stream's pieces; while the prompt is read (seconds for a long one on a CPU
    backend: the first piece comes only after it), a line on stderr says so."""
    from .progress import waiting

    n = len(getattr(stream, "prompt_token_ids", ()))
    it = iter(stream)
    with waiting(f"reading the prompt ({n} tokens)"):
        first = next(it, None)
    if first is not None:
        yield first
        yield from it


def cmd_chat(args) -> int:
    llm = _llm(args)
    return chat_loop(llm, _params(llm, args), args.system)


def chat_loop(llm, params, system: str | None = None, *, read=input, out=None,
              err=None) -> int:
    """The interactive chat: one reply per line read. Ctrl-C stops a reply (the part shown is
    kept as the assistant's turn) and returns to the prompt; Ctrl-C at the prompt asks before
    leaving (a second Ctrl-C leaves); Ctrl-D or 'exit' leaves. When the conversation outgrows
    the context, the oldest turns are dropped, with a notice. Turns after the first prefill
    only their new tokens (the Engine keeps the K/V cache of the shared prefix)."""
    from .errors import PromptError
    from .llm import fit_conversation

    out = out or sys.stdout
    err = err or sys.stderr
    messages: list[dict[str, str]] = []
    if system:
        messages.append({"role": "system", "content": system})
    # room kept for the reply: max_new_tokens, but never more than half the context
    reserve = min(params.max_new_tokens, llm.max_seq_len // 2)
    print("monokernel chat - Ctrl-C stops a reply; Ctrl-D or 'exit' leaves", file=err)
    asked = False  # Ctrl-C at the prompt asked "leave?"; a second one in a row answers yes
    while True:
        try:
            line = read("> ")
        except EOFError:
            print(file=err)
            return 0
        except KeyboardInterrupt:
            # a Ctrl-C meant for a reply that had just ended must not drop the conversation
            if asked:
                print(file=err)
                return 0
            asked = True
            print("\n[leave the chat? Ctrl-C again (or Ctrl-D, 'exit') leaves; type to go on]",
                  file=err)
            continue
        asked = False
        if line.strip() in ("exit", "quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            kept, dropped = fit_conversation(llm, messages, reserve)
        except PromptError as e:
            print(f"monokernel: {e}; message not sent", file=err)
            messages.pop()
            continue
        if dropped:
            print(f"[context full: dropped the {dropped} oldest message"
                  f"{'s' if dropped > 1 else ''}]", file=err)
            messages = kept
        s = None
        try:
            s = llm.chat(messages, params, stream=True)
            for piece in _after_prefill(s):
                print(piece, end="", flush=True, file=out)
        except KeyboardInterrupt:
            if s is not None:
                s.close()
            print(" [stopped]", end="", file=err, flush=True)
        print(file=out, flush=True)
        text = s.completion.text if s is not None and s.completion is not None else ""
        if text:
            messages.append({"role": "assistant", "content": text})
        else:
            messages.pop()  # nothing was said: forget the question too


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
    from . import __version__

    ap = argparse.ArgumentParser(prog="monokernel", description=__doc__)
    ap.add_argument("--version", action="version", version=f"monokernel {__version__}")
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


TEXT_ARGS = ("prompt", "stop", "system")  # the arguments that are tokenized


def check_utf8_args(args: argparse.Namespace) -> None:
    """Python decodes a command line that is not UTF-8 with 'surrogateescape' (byte 0xff
    becomes the lone surrogate U+DCFF), which no tokenizer can take: name the argument and
    the byte instead. Only the text arguments: a path may be any bytes on POSIX."""
    for name in TEXT_ARGS:
        value = getattr(args, name, None)
        for v in value if isinstance(value, list) else [value]:
            if not isinstance(v, str):
                continue
            if not any("\ud800" <= ch <= "\udfff" for ch in v):
                continue
            try:
                raw = os.fsencode(v)  # the bytes as given
                raw.decode("utf-8")
                at = None
            except UnicodeEncodeError:  # a surrogate that no byte became (main(argv) in Python)
                at = None
            except UnicodeDecodeError as e:
                at = e.start
            where = (f"byte 0x{raw[at]:02x} at byte {at}: {raw[max(0, at - 10):at + 10]!r}"
                     if at is not None else "it holds a lone surrogate")
            raise PromptError(f"the {name.replace('_', '-')} argument is not valid UTF-8 "
                              f"({where}); pass UTF-8 text (check the terminal's or the "
                              f"file's encoding)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_utf8_args(args)
        return args.func(args)
    except (MonokernelError, ValueError, OSError) as e:
        # a user error (bad input, a file that exists or cannot be written): one line, no
        # traceback
        print(f"monokernel: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
