"""The README a newcomer reads: its Python example runs and prints what it says, its command-line
synopsis lists every subcommand and every flag the parser has, and every file it names exists
in a clone (no link into a folder outside the repository)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

from monokernel.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    """The README's fenced code blocks of language ``lang`` ("" for a bare fence), in order."""
    out, current, open_lang = [], [], None
    for line in README.splitlines():
        if line.startswith("```"):
            if open_lang is None:
                open_lang, current = line[3:].strip(), []
            else:
                if open_lang == lang:
                    out.append("\n".join(current) + "\n")
                open_lang = None
        elif open_lang is not None:
            current.append(line)
    return out


def test_synopsis_lists_every_subcommand_and_flag():
    synopsis = next(b for b in blocks("") if "monokernel generate" in b)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    shared = {"generate"}  # chat documents "the model and sampling flags of generate"
    missing = []
    for name, parser in sub.choices.items():
        if f"monokernel {name}" not in synopsis:
            missing.append(name)
            continue
        for action in parser._actions:
            for opt in action.option_strings:
                if opt.startswith("--") and opt != "--help" and opt not in synopsis:
                    if name == "chat" and any(opt in _flags(sub.choices[s]) for s in shared):
                        continue
                    missing.append(f"{name} {opt}")
    assert not missing, f"not in the README's synopsis: {missing}"
    assert "monokernel --version" in README


def _flags(parser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def test_named_files_exist_in_a_clone():
    assert "../shared" not in README and "shared/" not in README
    named = set(re.findall(r"`([\w./-]+\.(?:md|py|sh|json|h|cu))`", README))
    roots = [REPO, REPO / "monokernel", REPO / "monokernel" / "kernel", REPO / "benchmarks"]
    missing = sorted(n for n in named if not n.startswith("results/")
                     and not any((r / n).exists() for r in roots))
    results = [n for n in named if n.startswith("results/")]
    missing += [n for n in results if not (REPO / "benchmarks" / n).exists()]
    assert not missing, missing


def test_python_example_runs_and_prints_what_it_says(bundled_dir):
    code = blocks("python")[0]
    code = code.replace('LLM(backend="emulator")', 'LLM(backend="emulator", progress=False)')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    printed = out.getvalue()
    # the comment beside print(out.text, out.finish_reason) says: " Paris.\n\nThe answer is: ..." stop
    first = printed.split("\n\nThe answer is:")[0]
    assert first.strip() == "Paris.", printed[:200]
    assert re.search(r"^The answer is: .* stop$", printed, re.M), printed[:300]


def test_make_run_installs_what_bench_and_trace_draw_with():
    """`make run` is the first command; bench and trace draw their PNGs with matplotlib, which
    is the plot extra: the run target's install step must bring it (it used to install the
    core only, and both commands then said "no PNG chart")."""
    import tomllib

    make = (REPO / "Makefile").read_text()
    recipe = make.split("$(VENV)/.installed: pyproject.toml\n", 1)[1].split("\n\n", 1)[0]
    installs = [ln for ln in recipe.splitlines() if "$(PIP) install -e" in ln]
    assert installs and all("[plot" in ln or "plot]" in ln for ln in installs), recipe
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(d.startswith("matplotlib") for d in extras["plot"])
    assert "run: install" in make and "install: $(VENV)/.installed" in make
