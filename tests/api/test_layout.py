"""The package's shape (ARCHITECTURE section 1): three wings, imports that flow one way, no
import cycles, and every module importable with the optional extras missing.

Imports are read from the source with ``ast`` (module-level and lazy ones inside functions
alike), so a cycle hidden behind a function-level import is found too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.extras import BLOCKER, OPTIONAL

PKG = Path(__file__).resolve().parents[2] / "monokernel"
REPO = PKG.parent


def modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = list(f.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def imports_of(name: str, path: Path) -> set[str]:
    """monokernel modules imported anywhere in ``path`` (relative imports resolved)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rsplit(".", 1)[0]
    found: set[str] = set()
    known = modules()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("monokernel")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("monokernel"):
                continue
            found.add(mod)
            for a in node.names:  # ``from . import trace`` imports a module
                if f"{mod}.{a.name}" in known:
                    found.add(f"{mod}.{a.name}")
    found.discard(name)
    return {m for m in found if m in known}


def rank(mod: str) -> int:
    """Where a module sits in the one-way flow face -> runtime -> kernel -> model -> config.
    errors and progress are the shared leaves; sampling and streaming are leaf helpers the
    runtime uses."""
    if mod in ("monokernel.errors", "monokernel.progress"):
        return 0
    if mod == "monokernel.model.config":
        return 1
    if mod.startswith("monokernel.model"):
        return 2
    if mod.startswith("monokernel.kernel") or mod in ("monokernel.sampling",
                                                       "monokernel.streaming"):
        return 3
    if mod in ("monokernel.runtime", "monokernel.batching", "monokernel.kv_pages"):
        return 4  # the runtime wing
    return 5  # the face: __init__, llm, cli, tools/, serve/


def test_three_wings_exist():
    mods = modules()
    for m in ("monokernel.model.config", "monokernel.model.loader", "monokernel.model.gguf_import",
              "monokernel.model.bundled", "monokernel.model.synth", "monokernel.model.reference",
              "monokernel.kernel.isa", "monokernel.kernel.program", "monokernel.kernel.schedule",
              "monokernel.kernel.ops", "monokernel.kernel.costmodel", "monokernel.kernel.executor",
              "monokernel.kernel.cuda_backend", "monokernel.kernel.emulator",
              "monokernel.tools.bench", "monokernel.tools.trace", "monokernel.tools.plan"):
        assert m in mods, m
    assert (PKG / "kernel" / "megakernel.cu").is_file()
    assert "monokernel.kernel_cli" not in mods


def test_imports_flow_one_way():
    mods = modules()
    # the reader sees module-level, lazy and ``from . import x`` imports
    assert {"monokernel.kernel.isa", "monokernel.model.loader"} <= imports_of(
        "monokernel.kernel.executor", mods["monokernel.kernel.executor"])
    assert "monokernel.model.gguf_import" in imports_of("monokernel.model.loader",
                                                        mods["monokernel.model.loader"])
    assert "monokernel.tools.trace" in imports_of("monokernel.tools.commands",
                                                  mods["monokernel.tools.commands"])
    bad = []
    for name, path in modules().items():
        for dep in imports_of(name, path):
            if name.startswith("monokernel.model") and dep.startswith("monokernel.kernel"):
                bad.append(f"{name} -> {dep} (model/ must not import kernel/)")
            elif rank(dep) > rank(name):
                bad.append(f"{name} -> {dep} (upward: rank {rank(name)} imports rank {rank(dep)})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = {n: imports_of(n, p) for n, p in modules().items()}
    # a package's __init__ importing its own submodules is not a cycle
    for n in graph:
        graph[n] = {d for d in graph[n] if not (d.startswith(n + ".") or n.startswith(d + "."))}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


# The tests mirror the wings (ARCHITECTURE section 1); tools is the fifth folder.
TESTS = REPO / "tests"
TEST_WINGS = ("kernel", "model", "api", "serve", "tools")


def imports_of_test_modules(root: Path) -> list[str]:
    """Every import of a test module (a ``test_*`` module, or the name of a test file under
    ``root``: pytest's ``test_*.py`` and ``*_test.py``) by any Python file under ``root``, read
    with ``ast``: plain, from, relative and ``importlib.import_module("test_x")`` alike."""
    files = sorted(root.rglob("*.py"))
    names = {f.stem for f in files if f.stem.startswith("test_") or f.stem.endswith("_test")}

    def is_test(dotted: str) -> bool:
        return any(part.startswith("test_") or part in names for part in dotted.split(".") if part)

    found = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
                if node.level:  # ``from . import test_x`` names the module as an alias
                    mods += [a.name for a in node.names]
            elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module")
                  and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)):
                mods = [node.args[0].value]
            if any(is_test(m) for m in mods):
                found.append(f"{f.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_tests_mirror_the_wings_and_share_helpers_not_test_modules():
    """One folder per wing, unique basenames (pytest imports each file by its basename), and
    no test module imports another: what tests share lives in tests/helpers/ (a test module
    imported elsewhere runs its module-level code and ties two files together)."""
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) >= 40, files
    misplaced = [str(f.relative_to(TESTS)) for f in files
                 if f.parent.parent != TESTS or f.parent.name not in TEST_WINGS]
    assert not misplaced, f"test files outside tests/{{{','.join(TEST_WINGS)}}}/: {misplaced}"
    stems = [f.stem for f in files]
    assert len(set(stems)) == len(stems), sorted(s for s in stems if stems.count(s) > 1)
    imports = imports_of_test_modules(TESTS)
    assert not imports, "test modules imported (move what they share to tests/helpers/):\n" + \
        "\n".join(imports)


def test_the_test_import_scan_finds_what_it_should(tmp_path):
    (tmp_path / "wing").mkdir()
    (tmp_path / "wing" / "test_a.py").write_text("X = 1\n")
    (tmp_path / "wing" / "test_b.py").write_text(
        "import os\nfrom helpers.gguf import tiny_gguf\nimport pytest\n"  # fine
        "from test_a import X\nimport test_a as a\nfrom . import test_a\n"
        "def f():\n    import importlib\n    return importlib.import_module('test_a')\n")
    (tmp_path / "helper.py").write_text("from wing.test_a import X\n")
    found = imports_of_test_modules(tmp_path)
    assert [line.split(": ", 1)[1] for line in found] == [
        "from wing.test_a import X", "from test_a import X", "import test_a as a",
        "from . import test_a", "importlib.import_module('test_a')"], found


def run_blocked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_every_module_imports_without_the_extras():
    names = sorted(m for m in modules() if m != "monokernel.__main__")  # it runs the CLI
    code = (f"for m in {names!r}:\n"
            "    importlib.import_module(m)\n"
            "print('imported', len(sys.modules))\n"
            "print('leaked', sorted({k.split('.')[0] for k in sys.modules} & set(BLOCKED)))\n")
    out = run_blocked(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "leaked []" in out.stdout


@pytest.mark.parametrize("what, code, message", [
    ("cuda backend", "from monokernel.kernel.devices.cuda import CupyDevice\nCupyDevice()",
     "CuPy is not installed: pip install monokernel\\[cuda12\\]"),
    ("gguf import", "from monokernel.model.gguf_import import convert_gguf\n"
                    "convert_gguf('tests/does-not-matter.gguf', '/nonexistent-out', progress=False)",
     "gguf"),
])
def test_optional_extras_fail_lazily_and_clearly(what, code, message):
    """The module imports; calling what needs the extra raises a project error that names it."""
    import re

    out = run_blocked("from monokernel.errors import MonokernelError\n"
                      "try:\n    " + code.replace("\n", "\n    ") + "\n"
                      "except MonokernelError as e:\n"
                      "    print('ERR', type(e).__name__, e)\n")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ERR "), out.stdout
    assert re.search(message, out.stdout), out.stdout


# import name -> distribution name, where they differ
DISTRIBUTIONS = {"yaml": "pyyaml"}


def test_every_runtime_dependency_is_declared():
    """Third-party packages the package imports (lazily or not), less the optional extras, are in
    pyproject's ``dependencies``: ``make run`` installs only those (regex was once missing)."""
    import re
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].lower().replace("-", "_") for d in deps}
    used: dict[str, str] = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for t in tops:
                if t != "monokernel" and t not in sys.stdlib_module_names and t not in OPTIONAL:
                    used.setdefault(t, name)
    assert "numpy" in used and "regex" in used  # the scan sees real imports
    missing = {t: m for t, m in used.items()
               if DISTRIBUTIONS.get(t, t).lower().replace("-", "_") not in declared}
    assert not missing, f"imported but not in pyproject dependencies: {missing}"


# Private names of other libraries read on purpose: name -> why
FOREIGN_PRIVATE = {
    "_attn_implementation": "transformers' config says which attention kernel it chose "
                            "only here (tools/bench.py records it)",
}


def private_reach_through(root: Path) -> list[str]:
    """``obj._name`` (and ``getattr(obj, "_name")``) where obj is not self/cls and no code of
    the same module defines ``_name`` (a def, a class, a module name, a ``self._name = ``):
    one module using another's private parts. Reads the source with ``ast``."""
    found = []
    for f in sorted(root.rglob("*.py")):
        tree = ast.parse(f.read_text())
        own = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                own.add(node.attr)
        for node in ast.walk(tree):
            obj, name = None, None
            if isinstance(node, ast.Attribute):
                obj, name = node.value, node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str)):
                obj, name = node.args[0], node.args[1].value
            if name is None or not name.startswith("_") or name.startswith("__"):
                continue
            if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
                continue
            if name not in own and name not in FOREIGN_PRIVATE:
                found.append(f"{f.relative_to(root.parent)}:{node.lineno}: "
                             f"{ast.unparse(node)}")
    return found


def test_no_module_reaches_into_another_modules_private_parts():
    """bench.py called ``ex._check_error``, emulator/strict.py used ``_state_words`` and
    ``_steps``, runtime.py probed ``getattr(ex, "_steps")``: each now uses the executor's
    public methods (check_error, state_words, steps_run, cache_token)."""
    assert not private_reach_through(PKG), "\n".join(private_reach_through(PKG))


def test_the_private_access_scan_finds_what_it_should(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("class A:\n    def __init__(self):\n        self._x = 1\n"
                              "    def _m(self):\n        return self._x\n"
                              "def f(a):\n    return a._m(), a._x\n")  # its own privates: fine
    (pkg / "b.py").write_text("def g(ex, control):\n    ex._check_error(control)\n"
                              "    ex._steps = 3\n    return getattr(ex, '_steps', None)\n")
    found = private_reach_through(pkg)
    assert sorted(line.split(": ", 1)[1] for line in found) == [
        "ex._check_error", "ex._steps", "getattr(ex, '_steps', None)"], found


def test_tools_do_not_write_the_kernels_control_words():
    """Only the executor writes its ``control`` buffer (bench asks prepare_decode_launch)."""
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        if f.parent.name == "kernel" and f.name == "executor.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("write", "fill") \
                    and any("buffers" in ast.unparse(a) and "'control'" in ast.unparse(a)
                            for a in node.args):
                bad.append(f"{f.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)
