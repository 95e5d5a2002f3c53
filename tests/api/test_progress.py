"""Every wait a user sits through shows progress on stderr when it is a terminal, and nothing
when it is not (a log, a pipe): a GGUF conversion (its bar ran to 100% and then the write took
~13 s in silence), the first emulator build, a bench row (~2 min on the emulator), scheduling
a big program (the first ``plan``), a long prompt in the CLI."""

from __future__ import annotations

import io
import sys
import time

import pytest

from monokernel import progress
from monokernel.cli import _after_prefill, main

gguf = pytest.importorskip("gguf")  # the conversion test writes a GGUF
from helpers.gguf import tiny_gguf  # noqa: E402


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def as_terminal(monkeypatch) -> Terminal:
    """stderr as a terminal, and no delay before a waiting line shows. Called in the test's
    body: pytest's capture sets sys.stderr again between a fixture and the test."""
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    return err


def test_nothing_is_drawn_when_stderr_is_not_a_terminal(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    with progress.waiting("building"):
        time.sleep(0.6)
    with progress.progress_bar(total=3, desc="converting") as bar:
        bar.update(3)
    assert err.getvalue() == ""


def test_a_wait_shows_its_clock_and_a_short_one_nothing(monkeypatch):
    tty = as_terminal(monkeypatch)
    with progress.waiting("building the thing"):
        time.sleep(1.2)
    shown = tty.getvalue()
    assert "building the thing: 00:00" in shown and "building the thing: 00:01" in shown
    monkeypatch.setattr(progress, "DELAY_S", 2.0)
    tty.seek(0)
    tty.truncate()
    with progress.waiting("quick"):
        time.sleep(0.1)
    assert "quick" not in tty.getvalue()


def test_conversion_counts_the_bytes_it_writes(tmp_path, monkeypatch):
    tty = as_terminal(monkeypatch)
    from monokernel.model.gguf_import import convert_gguf

    src = tmp_path / "tiny.gguf"
    tiny_gguf(src)
    out = convert_gguf(src, tmp_path / "hf", progress=True)
    st = (out / "model.safetensors").read_bytes()
    data = len(st) - 8 - int.from_bytes(st[:8], "little")  # the tensor bytes, header aside
    shown = tty.getvalue()
    assert f"converting tiny.gguf:   0%|          | 0.00/{data / 1e3:.1f}k" in shown
    tty.seek(0)
    tty.truncate()
    convert_gguf(src, tmp_path / "hf2", progress=False)
    assert tty.getvalue() == ""


def test_the_first_emulator_build_says_so(tmp_path, monkeypatch):
    tty = as_terminal(monkeypatch)
    import importlib

    b = importlib.import_module("monokernel.kernel.emulator.build")

    def slow_compile(unit, flags, out_path, what, **kw):
        time.sleep(0.7)
        out_path.write_bytes(b"")

    monkeypatch.setattr(b, "compile_unit", slow_compile)
    monkeypatch.setattr(b, "EmulatorModule", lambda *a, **k: "loaded")
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k() {}\n')
    assert b.build(src, ["k"], cache_dir=tmp_path / "cache") == "loaded"
    assert "building k.cu for the CPU emulator" in tty.getvalue()
    tty.seek(0)
    tty.truncate()
    b.build(src, ["k"], cache_dir=tmp_path / "cache")  # cached: nothing to wait for
    assert "building" not in tty.getvalue()


def test_a_bench_row_shows_which_row_runs(tmp_path, capsys, monkeypatch):
    tty = as_terminal(monkeypatch)
    assert main(["bench", "--shape", "tiny", "--backends", "numpy", "--context", "4,8",
                 "--steps", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    shown = tty.getvalue()
    assert "bench tiny numpy context 4:   0%|          | 0/2 [" in shown
    assert "bench tiny numpy context 8:  50%|" in shown and "1/2 [" in shown
    assert "tiny" in capsys.readouterr().out  # the results table still prints


def test_plan_says_it_is_scheduling(capsys, monkeypatch):
    tty = as_terminal(monkeypatch)
    assert main(["plan", "--shape", "tiny", "--blocks", "4", "--context", "16"]) == 0
    assert "scheduling and verifying the program of tiny on 4 blocks" in tty.getvalue()
    assert "critical path" in capsys.readouterr().out


def test_a_long_prompt_in_the_cli_shows_it_is_being_read(monkeypatch):
    tty = as_terminal(monkeypatch)
    class SlowStream:
        prompt_token_ids = list(range(812))

        def __iter__(self):
            time.sleep(0.7)  # the prefill
            yield "Hello"
            yield " world"

    assert list(_after_prefill(SlowStream())) == ["Hello", " world"]
    assert "reading the prompt (812 tokens)" in tty.getvalue()
