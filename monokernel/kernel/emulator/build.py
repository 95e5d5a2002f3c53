"""Build a CUDA source file for the CPU emulator: g++ + cuda_cpu.h -> a cached .so loaded by ctypes.

The generated translation unit is the source (after `#line 1 "<its file name>"`, so g++ errors point
at real lines) followed by a small driver with one `emu_launch_<name>` per kernel. cuda_cpu.h is
force-included in front. The .so is cached under `$MONOKERNEL_CACHE/emulator/` (default
`~/.cache/monokernel/emulator/`), keyed by a sha256 of everything that goes into it.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from ...errors import KernelError, MonokernelError
from ...progress import waiting

SHIM_PATH = Path(__file__).with_name("cuda_cpu.h")
COMMON_SHIM_PATH = SHIM_PATH.with_name("cuda_cpu_common.h")  # included by cuda_cpu.h
MMA_SHIM_PATH = SHIM_PATH.with_name("cuda_cpu_mma.h")  # included by cuda_cpu.h (tensor-core twins)
CXX = "g++"
BASE_FLAGS = ("-std=c++20", "-O2", "-g", "-fPIC", "-shared", "-pthread",
              # Every kernel .so defines the same names (`__shared__ OpShared s` is a static local
              # of a template, hence an STB_GNU_UNIQUE symbol by default), and ld.so binds a
              # unique symbol to its FIRST definition process-wide, even under RTLD_LOCAL: a second
              # model shape would then use the first one's (smaller) shared memory.
              "-fno-gnu-unique")
# __shared__ is thread_local. In a dlopen'd .so the default TLS dialect calls __tls_get_addr on
# every access inside loops (5x slower mat-vec); TLS descriptors let g++ hoist the address.
if platform.machine() in ("x86_64", "AMD64"):
    BASE_FLAGS += ("-mtls-dialect=gnu2",)
ASAN_FLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer")
SANITIZERS = (None, "address")
# Headers a .cu file may include for nvcc's sake; the shim already provides what they declare.
STUB_HEADERS = ("cuda.h", "cuda_runtime.h", "cuda_runtime_api.h", "device_launch_parameters.h")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_SHARED_DECL = re.compile(
    r"\b__shared__\s+(?P<type>[A-Za-z_][\w:]*(?:\s+[A-Za-z_][\w:]*)*?)\s+(?P<name>[A-Za-z_]\w*)"
    r"\s*(?P<dims>(?:\[[^\[\];]*\]\s*)*);")


def rewrite_shared(source: str) -> str:
    """``__shared__ T name[dims];`` -> ``EMU_SHARED(T, name, [dims]);`` (line numbers kept).
    Both emulator builds use it (EMU_SHARED poisons the variable at each block's start);
    ``extern __shared__`` (dynamic shared memory, sized at launch) is left as it is."""
    def one(m: re.Match) -> str:
        if re.search(r"\bextern\s*$", source[max(0, m.start() - 20):m.start()]):
            return m.group(0)
        dims = re.sub(r"\s+", "", m["dims"])
        return f"EMU_SHARED({m['type']}, {m['name']}, {dims});" + "\n" * m.group(0).count("\n")
    return _SHARED_DECL.sub(one, source)


class EmulatorBuildError(MonokernelError):
    """g++ could not build a CUDA source for the CPU emulator; `stderr` holds g++'s diagnostics."""

    def __init__(self, message: str, stderr: str = ""):
        super().__init__(f"{message}\n{stderr}" if stderr else message)
        self.stderr = stderr


def default_cache_dir() -> Path:
    root = os.environ.get("MONOKERNEL_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "monokernel") / "emulator"


@functools.lru_cache(maxsize=None)
def compiler_version() -> str:
    try:
        out = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise EmulatorBuildError(f"cannot run {CXX} (needed by the CPU emulator): {e}") from e
    return out.splitlines()[0] if out else CXX


def asan_preload_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a subprocess that loads a .so built with sanitize="address".

    Python is not built with ASan, so libasan must come first in the process (LD_PRELOAD), and
    libstdc++ right after it: ASan binds its __cxa_throw interceptor when it starts, and the
    emulator unwinds aborted fibers with exceptions. Leak checking is off (Python keeps its memory
    at exit) and pymalloc is off so that ASan sees every Python-side buffer with its own redzones.
    """
    libs = []
    for name in ("libasan.so", "libstdc++.so"):
        path = subprocess.run([CXX, f"-print-file-name={name}"], capture_output=True, text=True,
                              check=True).stdout.strip()
        if not os.path.isabs(path):
            raise EmulatorBuildError(f"{CXX} does not know where {name} is (it answered {path!r})")
        libs.append(os.path.realpath(path))
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = ":".join(libs)
    env["ASAN_OPTIONS"] = "detect_leaks=0"
    env["PYTHONMALLOC"] = "malloc"
    return env


def driver_source(kernel_names: Sequence[str]) -> str:
    lines = ["// CPU emulator driver, generated by monokernel.emulator.build"]
    for name in kernel_names:
        lines.append(
            f'extern "C" __attribute__((visibility("default"))) int emu_launch_{name}'
            f"(int grid, int block, const void* params, double timeout_s) {{\n"
            f"  return emu::launch(&emu::kernel_entry<&{name}>, grid, block, params, timeout_s);\n}}"
        )
    lines.append('extern "C" __attribute__((visibility("default"))) const char* emu_last_error(void) '
                 "{ return emu::last_error(); }")
    # the process's one fiber-stack pool per stack size (cuda_cpu.h stack_pool_slot)
    lines.append('extern "C" __attribute__((visibility("default"))) void* emu_stack_pool('
                 "unsigned long* stack_bytes) { *stack_bytes = emu::detail::kStackBytes; "
                 "return emu::detail::stack_pool_slot(); }")
    lines.append('extern "C" __attribute__((visibility("default"))) int emu_adopt_stack_pool('
                 "void* pool, unsigned long stack_bytes) { if (stack_bytes != emu::detail::kStackBytes) "
                 "return 0; emu::detail::stack_pool_slot() = static_cast<emu::detail::StackPool*>(pool); "
                 "return 1; }")
    return "\n".join(lines) + "\n"


# stack size -> the fiber-stack pool of the first module loaded in this process with that size:
# every later module adopts it (cuda_cpu.h stack_pool_slot says why)
_STACK_POOLS: dict[int, int] = {}


def _share_stack_pool(lib: ctypes.CDLL) -> None:
    get, adopt = lib.emu_stack_pool, lib.emu_adopt_stack_pool
    get.argtypes, get.restype = [ctypes.POINTER(ctypes.c_ulong)], ctypes.c_void_p
    adopt.argtypes, adopt.restype = [ctypes.c_void_p, ctypes.c_ulong], ctypes.c_int
    size = ctypes.c_ulong()
    pool = get(ctypes.byref(size))
    first = _STACK_POOLS.setdefault(size.value, pool)
    if first != pool and not adopt(first, size.value):
        raise MonokernelError("emulator: a module refused the process's fiber-stack pool")


def _local_includes(text: str, directory: Path | None, seen: set[Path]) -> list[tuple[str, str]]:
    """(path, text) of every `#include "..."` found next to the source, recursively, for the key."""
    if directory is None:
        return []
    found = []
    for rel in _QUOTED_INCLUDE.findall(text):
        path = (directory / rel).resolve()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        body = path.read_text()
        found.append((str(path), body))
        found += _local_includes(body, path.parent, seen)
    return found


class EmulatorModule:
    """A built emulator .so: one `launch` per kernel name."""

    def __init__(self, path: Path, kernel_names: Sequence[str], *, cache_hit: bool, sanitize: str | None):
        self.path = Path(path)
        self.kernel_names = tuple(kernel_names)
        self.cache_hit = cache_hit
        self.sanitize = sanitize
        self._lib = ctypes.CDLL(str(self.path))
        _share_stack_pool(self._lib)  # before its first launch: no stack of its own is out
        self._launchers = {}
        for name in self.kernel_names:
            fn = getattr(self._lib, f"emu_launch_{name}")
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_double]
            fn.restype = ctypes.c_int
            self._launchers[name] = fn
        self._last_error = self._lib.emu_last_error
        self._last_error.argtypes = []
        self._last_error.restype = ctypes.c_char_p

    def launch(self, name: str, grid: int, block: int, params_ptr: int, timeout_s: float) -> None:
        """Runs kernel `name` on grid x block CUDA threads with a pointer to its params struct.

        Blocks until the launch ends (the GIL is released meanwhile). Raises KernelError with the
        emulator's message on a trap, failed assert, divergent barrier, warp error, deadlock or when
        the launch is still running after `timeout_s` seconds.
        """
        fn = self._launchers.get(name)
        if fn is None:
            raise KernelError(f"{self.path.name} has no kernel {name!r}; it was built with {list(self.kernel_names)}")
        code = fn(int(grid), int(block), ctypes.c_void_p(params_ptr), float(timeout_s))
        if code != 0:
            message = (self._last_error() or b"").decode(errors="replace")
            raise KernelError(f"{name} <<<{grid}, {block}>>> on the CPU emulator failed (code {code}): {message}")

    def __repr__(self) -> str:
        return f"EmulatorModule({self.path.name}, kernels={list(self.kernel_names)})"


def build(
    source: str | os.PathLike,
    kernel_names: Sequence[str],
    *,
    filename: str | None = None,
    sanitize: str | None = None,
    extra_flags: Sequence[str] = (),
    cache_dir: str | os.PathLike | None = None,
) -> EmulatorModule:
    """Compiles a CUDA source for the CPU emulator (or takes it from the cache) and loads it.

    `source` is a path to the .cu file; pass `filename=` to give the source as text instead (the
    name then appears in g++ errors). `kernel_names` lists the `extern "C" __global__` entry points
    to expose. `sanitize="address"` builds with AddressSanitizer; such a module loads only in a
    process started with `asan_preload_env()`.
    """
    if filename is None:
        src_path = Path(source)
        try:
            text = src_path.read_text()
        except OSError as e:
            raise EmulatorBuildError(f"cannot read CUDA source {src_path}: {e}") from e
        filename, src_dir = str(src_path), src_path.resolve().parent
    else:
        text, src_dir = str(source), None
    names = list(kernel_names)
    bad = [n for n in names if not _IDENTIFIER.match(n)]
    if not names or bad or len(set(names)) != len(names):
        raise EmulatorBuildError(f"kernel_names must be distinct C identifiers, got {names!r}")
    if sanitize not in SANITIZERS:
        raise EmulatorBuildError(f"sanitize={sanitize!r} is not supported; choose one of {SANITIZERS}")

    flags = [*BASE_FLAGS, *(ASAN_FLAGS if sanitize == "address" else ()), *extra_flags]
    if src_dir is not None:
        flags += ["-I", str(src_dir)]
    driver = driver_source(names)
    # __shared__ declarations become EMU_SHARED: poisoned at each block's start (cuda_cpu.h)
    unit = (f'#line 1 "{_c_string(filename)}"\n{rewrite_shared(text)}\n'
            f'#line 1 "<emulator driver>"\n{driver}')

    key = cache_key(SHIM_PATH.read_text(), COMMON_SHIM_PATH.read_text(), MMA_SHIM_PATH.read_text(), unit,
                    "\0".join(flags), compiler_version(), *(p + "\0" + body for p, body in _local_includes(text, src_dir, set())))
    out_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(filename).stem) or "kernel"
    so_path = out_dir / f"{stem}-{key}{'-asan' if sanitize else ''}.so"

    def make() -> None:  # the first build of a source takes a while (a minute on 2 cores)
        with waiting(f"building {Path(filename).name} for the CPU emulator (g++, once per "
                     f"source)"):
            compile_unit(unit, flags, so_path, f"{filename} for the CPU emulator")
    cache_hit = build_once(so_path, make)
    if sanitize == "address" and "libasan" not in os.environ.get("LD_PRELOAD", ""):
        raise EmulatorBuildError(
            f"{so_path} (an AddressSanitizer build of {filename}) can only be loaded into a process started "
            "with LD_PRELOAD=libasan.so; run it in a subprocess with env=asan_preload_env()")
    return EmulatorModule(so_path, names, cache_hit=cache_hit, sanitize=sanitize)


def build_once(out_path: Path, make: Callable[[], None]) -> bool:
    """Runs ``make()`` to write `out_path` unless it is there; True if it was (a cache hit).

    Processes sharing a cache (the workers of a parallel test run, two servers started at once)
    take turns on an advisory lock beside the output, so one of them builds and the others find
    the file when their turn comes, instead of all compiling the same source side by side. The
    holder removes the lock file before releasing it: whoever opens a lock file after that finds
    the output already there (or, after a failed build, builds it again).
    """
    if out_path.is_file():
        return True
    lock = out_path.with_name(f".{out_path.name}.lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a read-only cache folder: build without the lock (the rename is atomic)
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        if out_path.is_file():
            return True
        make()
        return False
    finally:
        if fd is not None:
            try:
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:  # not a later process's lock
                    os.unlink(lock)
            except OSError:
                pass  # already removed by the process that held it before us
            os.close(fd)  # releases the lock


def _c_string(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def cache_key(*parts: str) -> str:
    """24 hex digits of a sha256 over everything that goes into a build (sources, flags, g++)."""
    key = hashlib.sha256()
    for part in parts:
        key.update(part.encode())
        key.update(b"\0\1\0")
    return key.hexdigest()[:24]


def compile_unit(unit: str, flags: Sequence[str], out_path: Path, what: str, *, executable: bool = False) -> None:
    """g++ -include cuda_cpu.h `unit` into a temporary name beside `out_path`, then an atomic rename:
    never a partial output. `flags` choose a shared object or an executable (`executable=True`
    makes it runnable); `what` names the output in the error."""
    with tempfile.TemporaryDirectory(prefix="monokernel-emu-") as tmp:
        include = Path(tmp) / "include"
        include.mkdir()
        for header in STUB_HEADERS:
            (include / header).write_text("// CPU emulator stub: cuda_cpu.h declares what kernels use\n")
        unit_path = Path(tmp) / "unit.cpp"
        unit_path.write_text(unit)
        fd, tmp_out = tempfile.mkstemp(prefix=f".{out_path.stem}.", suffix=".tmp", dir=out_path.parent)
        os.close(fd)
        try:
            cmd = [CXX, *flags, "-include", str(SHIM_PATH), "-I", str(include), "-x", "c++", str(unit_path),
                   "-o", tmp_out]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise EmulatorBuildError(f"g++ could not build {what} (exit {proc.returncode})", proc.stderr)
            if executable:
                os.chmod(tmp_out, 0o755)
            os.replace(tmp_out, out_path)
        finally:
            if os.path.exists(tmp_out):
                os.unlink(tmp_out)
