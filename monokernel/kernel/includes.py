"""Quoted includes of the kernel's own headers (``#include "mma.cuh"``), inlined into the source.

Every compiler gets megakernel.cu as one text, never as a file beside its headers: NVRTC through
CuPy (a string, no include path), the emulator (build.py with ``filename=``: no ``-I``), the
strict/TSan driver and nvcc in the tests (a copy in a temporary folder). Inlining the headers
makes that one text self-contained, and puts the headers' bytes into every cache key that hashes
the source (the emulator's .so, CuPy's module cache). ``#line`` directives keep compiler errors
pointing at the header's own lines, then at the including file's.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import KernelError

_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"(?P<name>[^"]+)"[^\n]*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.MULTILINE)


def inline_includes(text: str, directory: Path, name: str, _seen: set[Path] | None = None) -> str:
    """``text`` (the file ``name``) with each ``#include "x"`` that names a file in ``directory``
    replaced by that file's text, recursively. Each header is inlined once (they are
    ``#pragma once`` headers; the pragma itself is dropped, as it warns in a main file).
    Quoted includes of files not in ``directory`` stay for the compiler to resolve."""
    seen = set() if _seen is None else _seen
    directory = Path(directory)
    out, at = [], 0
    for m in _QUOTED_INCLUDE.finditer(text):
        path = (directory / m["name"]).resolve()
        if not path.is_file():
            continue
        line = text.count("\n", 0, m.start()) + 1
        out.append(text[at:m.start()])
        if path not in seen:
            seen.add(path)
            try:
                body = path.read_text()
            except OSError as e:
                raise KernelError(f"{name}:{line}: cannot read included {m['name']}: {e}") from e
            body = _PRAGMA_ONCE.sub("", body)
            out.append(f'#line 1 "{m["name"]}"\n'
                       + inline_includes(body, path.parent, m["name"], seen).rstrip("\n") + "\n")
        out.append(f'#line {line + 1} "{name}"')
        at = m.end()
    out.append(text[at:])
    return "".join(out)
