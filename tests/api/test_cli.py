"""The ``monokernel`` command in subprocesses, as a user runs it: generate on the bundled model,
synth then generate on the synthetic checkpoint, chat on stdin, and error exits. The session's
MONOKERNEL_CACHE is inherited, so the bundled model converted by the fixture is reused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def monokernel(*args: str, stdin: str | None = None, timeout: float = 180):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "monokernel", *args], input=stdin,
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)


def test_generate_paris(bundled_dir, session_cache):
    assert os.environ["MONOKERNEL_CACHE"] == str(session_cache)
    marker = (bundled_dir / "monokernel.json").stat()
    r = monokernel("generate", "The capital of France is", "--max-new-tokens", "8",
                   "--temperature", "0", "--backend", "numpy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris.")
    assert "backend=numpy" in r.stderr and "finish=length" in r.stderr
    # the subprocess reused the session's conversion instead of making another one: the folder's
    # marker is the same file, unchanged (other workers of the session may convert other models)
    again = (bundled_dir / "monokernel.json").stat()
    assert (again.st_ino, again.st_mtime_ns) == (marker.st_ino, marker.st_mtime_ns)
    assert not [p for p in (session_cache / "models").iterdir() if bundled_dir.name in p.name
                and p != bundled_dir]


def test_generate_no_stream_and_stop(bundled_dir):
    r = monokernel("generate", "The capital of France is", "--max-new-tokens", "8",
                   "--temperature", "0", "--backend", "numpy", "--no-stream", "--stop", ".")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "The capital of France is Paris\n"
    assert "finish=stop" in r.stderr


def test_synth_then_generate(tmp_path):
    out = tmp_path / "tiny"
    r = monokernel("synth", "--shape", "tiny", str(out))
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    r = monokernel("generate", "the", "--model", str(out), "--backend", "numpy",
                   "--max-new-tokens", "5", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("the") and len(r.stdout) > len("the\n")
    assert "[5 tokens" in r.stderr or "finish=stop" in r.stderr
    # the same greedy text in-process: the CLI runs the same model
    from monokernel import LLM, SamplingParams

    c = LLM(out, backend="numpy", progress=False).generate(
        "the", SamplingParams(max_new_tokens=5, temperature=0))
    assert r.stdout == "the" + c.text + "\n"
    # synth refuses to overwrite
    r = monokernel("synth", "--shape", "tiny", str(out))
    assert r.returncode != 0 and "not empty" in r.stderr


def test_chat_on_stdin(bundled_dir):
    r = monokernel("chat", "--backend", "numpy", "--max-new-tokens", "8", "--temperature", "0",
                   stdin="hi\nexit\n")
    assert r.returncode == 0, r.stderr
    # "> " prompt, the streamed answer, a newline, "> " again, then "exit" ends the session
    assert r.stdout.startswith("> ") and r.stdout.endswith("\n> ")
    assert r.stdout[2:-3].strip()


def test_chat_eof_exits_cleanly(tmp_path, synth_dir):
    r = monokernel("chat", "--model", str(synth_dir("tiny")), "--backend", "numpy",
                   "--max-new-tokens", "3", stdin="")
    assert r.returncode == 0, r.stderr


def test_empty_prompt_exits_2(bundled_dir):
    r = monokernel("generate", "", "--backend", "numpy")
    assert r.returncode == 2
    assert "PromptError" in r.stderr and "Traceback" not in r.stderr


def test_missing_model_exits_2(tmp_path):
    r = monokernel("generate", "hi", "--model", str(tmp_path / "nowhere"), "--backend", "numpy")
    assert r.returncode == 2
    assert "CheckpointError" in r.stderr and "nowhere" in r.stderr


def test_unknown_backend_exits_2(synth_dir):
    r = monokernel("generate", "hi", "--model", str(synth_dir("tiny")), "--backend", "nosuch")
    assert r.returncode == 2 and "BackendUnavailableError" in r.stderr


def test_usage_error_exits_2():
    r = monokernel("generate")
    assert r.returncode == 2 and "usage" in r.stderr


def test_generate_on_the_emulator_with_blocks(synth_dir):
    """The kernel backends through the CLI: same greedy text as the reference."""
    model = str(synth_dir("tiny"))
    common = ("generate", "the cat", "--model", model, "--max-new-tokens", "6",
              "--temperature", "0", "--no-stream", "--max-seq-len", "64")
    ref = monokernel(*common, "--backend", "numpy")
    emu = monokernel(*common, "--backend", "emulator", "--blocks", "3")
    assert ref.returncode == 0 and emu.returncode == 0, ref.stderr + emu.stderr
    assert emu.stdout == ref.stdout
    assert "backend=emulator" in emu.stderr


def test_blocks_on_the_numpy_backend_exits_2(synth_dir):
    r = monokernel("generate", "x", "--model", str(synth_dir("tiny")), "--backend", "numpy",
                   "--blocks", "2")
    assert r.returncode == 2
    assert ("backend 'numpy' has no option 'blocks' (its options: threads, prefill_chunk, "
            "batch_invariant, page_size)") in r.stderr


def test_examples_decode_runs(bundled_dir):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(REPO / "examples" / "decode.py"), "--backend", "numpy",
                        "--max-new-tokens", "8"], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "greedy  : ' Paris." in r.stdout, r.stdout
    assert "chat    : " in r.stdout
