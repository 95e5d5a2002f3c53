"""monokernel's on-disk cache: where converted models, synthetic checkpoints and emulator
builds live."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of monokernel's on-disk cache: $MONOKERNEL_CACHE, default ~/.cache/monokernel."""
    return Path(os.environ.get("MONOKERNEL_CACHE") or Path.home() / ".cache" / "monokernel")


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Cache folder for the HF conversion of a GGUF file, keyed by name, size and a content
    hash of its first and last MiB (hashing 100s of MB on every start would be slow)."""
    st = gguf_path.stat()
    h = hashlib.sha256()
    with open(gguf_path, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read(1 << 20))
    key = f"{gguf_path.stem.lower()}-{st.st_size}-{h.hexdigest()[:12]}"
    return cache_dir() / "models" / key
