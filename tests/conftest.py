"""Shared fixtures: one throw-away monokernel cache for the whole session, synthetic checkpoints
written once per shape, and the bundled SmolLM2-135M-Instruct converted once and loaded once.

``make test`` runs the suite on every core (pytest-xdist), then the tests marked ``serial`` alone:
those bound wall-clock or CPU time. The workers of a parallel run share the controller's cache.

The cache variable is set in ``pytest_configure``, before any test module imports monokernel, so
no test can read or write the user's ~/.cache/monokernel. Set MONOKERNEL_TEST_CACHE to a folder to
keep the converted bundled model between runs (it is then not deleted).

GPU tests carry ``@pytest.mark.gpu``. Where CuPy or a CUDA device is missing they skip with the
reason, except with MONOKERNEL_REQUIRE_GPU=1 (set by scripts/gpu_check.sh): then they fail, so a
GPU machine on which CuPy cannot see the device never reports a green run of skipped tests.

NumPy's OpenBLAS is limited to one thread (unless OPENBLAS_NUM_THREADS is already set): the suite
runs on small shared machines, where OpenBLAS's spinning worker threads made the reference's
decode 4x slower under load (measured 4 vs 16 tokens/s on SmolLM2 with two busy cores), while
its matrix-vector products gain little from a second thread when the machine is idle.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_SESSION_CACHE: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy is first imported
    keep = os.environ.get("MONOKERNEL_TEST_CACHE")
    shared = getattr(config, "workerinput", {}).get("monokernel_cache")
    if shared:  # a worker of a parallel run (pytest-xdist): the controller's cache, not owned
        path, owned = shared, False
    elif keep:
        path, owned = keep, False
    else:
        path, owned = tempfile.mkdtemp(prefix="monokernel-test-cache-"), True
    _SESSION_CACHE.update(path=path, owned="1" if owned else "", previous=os.environ.get(
        "MONOKERNEL_CACHE", ""))
    os.environ["MONOKERNEL_CACHE"] = path


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """pytest-xdist: every worker uses the controller's cache, so a model converted or a kernel
    built by one worker serves them all (builds take turns on a lock: emulator.build.build_once)."""
    node.workerinput["monokernel_cache"] = _SESSION_CACHE["path"]


def pytest_unconfigure(config: pytest.Config) -> None:
    if not _SESSION_CACHE:
        return
    if _SESSION_CACHE["previous"]:
        os.environ["MONOKERNEL_CACHE"] = _SESSION_CACHE["previous"]
    else:
        os.environ.pop("MONOKERNEL_CACHE", None)
    if _SESSION_CACHE["owned"]:
        shutil.rmtree(_SESSION_CACHE["path"], ignore_errors=True)


@pytest.fixture(scope="session")
def session_cache() -> Path:
    """The MONOKERNEL_CACHE every test of this session uses (subprocesses get it too)."""
    return Path(_SESSION_CACHE["path"])


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory):
    """``synth_dir("qwen3-tiny")`` -> folder of that seeded synthetic checkpoint (seed 0),
    written once per session. Tests must not modify it: copy it first."""
    from monokernel.model.synth import write_synthetic

    root = tmp_path_factory.mktemp("synth")
    made: dict[str, Path] = {}

    def get(shape: str) -> Path:
        if shape not in made:
            made[shape] = write_synthetic(shape, root / shape, seed=0)
        return made[shape]

    return get


@pytest.fixture(scope="session")
def synth_model(synth_dir):
    """``synth_model("qwen3-tiny")`` -> that synthetic checkpoint loaded, once per session.
    Tests must not modify it (dataclasses.replace a copy with other weights)."""
    from monokernel.model.loader import load_model

    cache: dict[str, object] = {}

    def get(shape: str):
        if shape not in cache:
            cache[shape] = load_model(synth_dir(shape), progress=False)
        return cache[shape]

    return get


@pytest.fixture(scope="session")
def bundled_dir(session_cache) -> Path:
    """The bundled SmolLM2-135M-Instruct as an HF folder in the session cache (~10 s once)."""
    from monokernel.model.bundled import bundled_model_dir

    return bundled_model_dir(progress=False)


@pytest.fixture(scope="session")
def bundled_llm(bundled_dir):
    """``LLM(backend="numpy")`` on the bundled model, loaded once per session."""
    from monokernel import LLM

    return LLM(backend="numpy", progress=False)


def _gpu_missing_reason() -> str | None:
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install raising at import
        return f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f"CuPy sees no CUDA device ({type(e).__name__}: {e})"
    return None if n > 0 else "CuPy sees no CUDA device (device count 0)"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None:
        return
    if "gpu_reason" not in _SESSION_CACHE:
        _SESSION_CACHE["gpu_reason"] = _gpu_missing_reason() or ""
    reason = _SESSION_CACHE["gpu_reason"]
    if not reason:
        return
    if os.environ.get("MONOKERNEL_REQUIRE_GPU") == "1":
        pytest.fail(f"MONOKERNEL_REQUIRE_GPU=1 but {reason}", pytrace=False)
    pytest.skip(f"no CUDA device: {reason}")
