"""monokernel's on-disk cache: where converted models, synthetic checkpoints and emulator
builds live."""

from __future__ import annotations

import os
import re
from pathlib import Path


def cache_dir() -> Path:
    """Root of monokernel's on-disk cache: $MONOKERNEL_CACHE, default ~/.cache/monokernel."""
    return Path(os.environ.get("MONOKERNEL_CACHE") or Path.home() / ".cache" / "monokernel")


def remember(path: Path, text: str) -> None:
    """Write a cache entry whole or not at all (a temporary sibling renamed over ``path``), and
    never fail: an unwritable cache only costs the next process the work again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:
        pass


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Cache folder for the HF conversion of a GGUF file, keyed by its content
    (:func:`gguf_header.content_key`: the whole metadata section, the first and last MiB of
    the weights, the size), not its name: the same file under another name is converted once,
    and a file whose metadata was edited in place (EOS id, chat template) is converted again.
    The model's general.name, when it has one, leads the folder name for people."""
    from .gguf_header import content_key, read_header

    header = read_header(gguf_path)
    slug = re.sub(r"[^a-z0-9._]+", "-", (header.name or "").lower()).strip("-.")[:48]
    return cache_dir() / "models" / f"{slug or 'gguf'}-{content_key(gguf_path, header)[:16]}"
