"""The optional packages (the extras, and what the GPU machine lacks) and a prefix for a
``python -c`` script that makes them unimportable, so a test can show what a user without them
sees (test_layout, test_serve, test_gpu_collect)."""

from __future__ import annotations

# Optional packages: extras, or absent on the GPU machine (gguf). The core must not need them
# to import; the functions that do need one import it lazily and say what to install.
OPTIONAL = ("cupy", "cupyx", "torch", "transformers", "matplotlib", "gguf", "fastapi", "uvicorn",
            "starlette", "pydantic", "openai", "httpx", "cuda", "sentencepiece", "google",
            "prometheus_client", "ray",
            "nvidia")  # nvidia: the cuobjdump wheel, read by kernel/sass_facts.py


def blocker(names: tuple[str, ...]) -> str:
    """Python source that, run first, makes every module under ``names`` raise
    ModuleNotFoundError on import, as if the package were not installed."""
    return f"""
import importlib, importlib.abc, sys
BLOCKED = {names!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
        return None
sys.meta_path.insert(0, Block())
"""


BLOCKER = blocker(OPTIONAL)  # every extra missing: the core install
