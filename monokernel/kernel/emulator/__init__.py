"""CPU emulator: runs megakernel.cu's __global__ kernels on the CPU (cuda_cpu.h + g++ + ctypes)."""

from .build import (
    SHIM_PATH,
    EmulatorBuildError,
    EmulatorModule,
    asan_preload_env,
    build,
    default_cache_dir,
)

__all__ = [
    "SHIM_PATH",
    "EmulatorBuildError",
    "EmulatorModule",
    "asan_preload_env",
    "build",
    "default_cache_dir",
]
