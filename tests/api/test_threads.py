"""The NumPy backend's BLAS threads are set on purpose (a ``threads`` option, ``--threads``),
default to the CPUs this process may use, hold during every forward pass, and are said on
stderr at start: OpenBLAS's own default once made decode 3-10x slower on a busy 2-core
machine without a word."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from monokernel import LLM, ParameterError, SamplingParams
from monokernel import runtime

# a core dependency; the GPU machine (no pip) may lack it: skip there, never break collection
threadpool_info = pytest.importorskip("threadpoolctl").threadpool_info

GREEDY = SamplingParams(max_tokens=3, ignore_eos=True)


def blas_threads() -> set[int]:
    return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}


@pytest.mark.parametrize("threads", [1, 2])
def test_the_forward_pass_runs_with_the_threads_asked(synth_dir, threads, capsys):
    llm = LLM(synth_dir("tiny"), backend="numpy", max_seq_len=32, progress=False,
              threads=threads)
    assert f"numpy backend: {threads} BLAS thread" in capsys.readouterr().err
    ex = llm.engine.executor
    seen, forward = [], ex.ref.forward_rows

    def spy(*args, **kw):
        seen.append(blas_threads())
        return forward(*args, **kw)

    ex.ref.forward_rows = spy  # every step of the batched engine
    outside = blas_threads()
    llm.generate("the cat", GREEDY)
    assert len(seen) == 3 and all(s == {threads} for s in seen)  # prefill and two steps
    assert blas_threads() == outside  # the limit holds only while the model runs


def test_the_default_is_the_cpus_this_process_may_use(monkeypatch):
    for var in runtime.THREAD_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert runtime.default_threads() == (3, "the CPUs this process may use")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a user's own setting wins, and is named
    assert runtime.default_threads() == (1, "from OMP_NUM_THREADS")


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_bad_threads_are_refused(synth_dir, bad):
    with pytest.raises(ParameterError, match="threads must be an integer >= 1"):
        LLM(synth_dir("tiny"), backend="numpy", progress=False, threads=bad)


def test_cli_threads_flag(synth_dir):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    r = subprocess.run([sys.executable, "-m", "monokernel", "generate", "the", "--model",
                        str(synth_dir("tiny")), "--backend", "numpy", "--threads", "1",
                        "--max-new-tokens", "2"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "monokernel: numpy backend: 1 BLAS thread (openblas, as asked;" in r.stderr
    r = subprocess.run([sys.executable, "-m", "monokernel", "generate", "the", "--model",
                        str(synth_dir("tiny")), "--backend", "emulator", "--threads", "2"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "backend 'emulator' has no option 'threads'" in r.stderr


def test_without_threadpoolctl_it_says_so_and_an_explicit_request_fails(synth_dir, monkeypatch,
                                                                        capsys):
    """The GPU machine has no pip and may lack threadpoolctl: the reference still runs there,
    saying the threads were left alone; asking for threads there is a clear error."""
    from monokernel import BackendUnavailableError

    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # import fails
    llm = LLM(synth_dir("tiny"), backend="numpy", max_seq_len=32, progress=False)
    assert "BLAS threads left as the library chose them (threadpoolctl is not installed" \
        in capsys.readouterr().err
    assert llm.generate("the cat", GREEDY).token_ids
    with pytest.raises(BackendUnavailableError, match="pip install threadpoolctl"):
        LLM(synth_dir("tiny"), backend="numpy", progress=False, threads=1)
