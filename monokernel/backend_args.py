"""The command line's backend options, shared by ``generate``/``chat`` and ``serve``:
``--blocks N``, ``--threads N`` and ``--option NAME=VALUE`` (``-o``, repeatable) for any other
option of the backend. Values are read as Python would write them (``8``, ``1.5``,
``true``/``false``, ``none``; anything else is text); the backend's options then check names
and types (runtime.backend_options), so a misspelt name or a wrong type is the same
ParameterError on the command line as in ``LLM(...)``."""

from __future__ import annotations

import argparse
from typing import Any

from .errors import ParameterError


def add_backend_arg(p: argparse.ArgumentParser) -> None:
    """``--backend``, its choices named from the backends' registries."""
    from .runtime import backend_names

    p.add_argument("--backend", default="auto", help=" | ".join(backend_names()))


def add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=int, default=None,
                   help="persistent blocks of the kernel backends (default: 4 on the emulator, "
                        "one per SM on a GPU)")
    p.add_argument("--threads", type=int, default=None,
                   help="BLAS threads of the numpy backend (default: the CPUs this process may "
                        "use; 1 is often faster on a busy machine)")
    p.add_argument("-o", "--option", action="append", default=None, metavar="NAME=VALUE",
                   help="another option of the backend, e.g. watchdog_ms=5000 or "
                        "steps_per_launch=16 (repeatable)")


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """The backend options the flags give (checked by the backend when the LLM is built)."""
    out = {k: getattr(args, k) for k in ("blocks", "threads") if getattr(args, k) is not None}
    for text in args.option or ():
        name, sep, value = text.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name:
            raise ParameterError(f"--option wants NAME=VALUE (e.g. blocks=8), got {text!r}")
        if name in out:
            raise ParameterError(f"backend option {name!r} is given twice")
        out[name] = option_value(value.strip())
    return out


def option_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
