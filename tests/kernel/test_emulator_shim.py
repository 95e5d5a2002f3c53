"""The CPU emulator shim (cuda_cpu.h + build.py) on small CUDA kernels written here.

Every kernel below is valid CUDA as well (test_kernels_compile_with_nvcc); the emulator must run it
unchanged: warp shuffles with full and half masks, block reductions, blocks that spin on each other's
counters, and the failures that must become errors instead of hangs.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from monokernel.kernel.emulator import EmulatorBuildError, asan_preload_env, build
from monokernel.kernel.emulator.build import build_once
from monokernel.errors import KernelError, MonokernelError

REPO = Path(__file__).resolve().parents[2]

KERNELS = r"""
// Test kernels for the CPU emulator; also valid CUDA (nvcc -arch=sm_90 -cubin).
#include <cassert>
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ int load_acquire(const int* p) {
#ifdef __CUDA_ARCH__
  int v; asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
#else
  return emu::load_acquire(p);
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

// out[b] = sum of block b's contiguous chunk of x
struct ReduceParams {
  const float* x;  // (n,)
  float* out;      // (grid,)
  int n;
};
extern "C" __global__ void block_reduce(const ReduceParams* p) {
  __shared__ float partial[32];
  const int chunk = (p->n + gridDim.x - 1) / gridDim.x;
  const int lo = blockIdx.x * chunk, hi = min(p->n, lo + chunk);
  float s = 0.0f;
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) s += p->x[i];
  s = warp_sum(s);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = s;
  __syncthreads();
  if (warp == 0) {
    float v = lane < blockDim.x / 32 ? partial[lane] : 0.0f;
    v = warp_sum(v);
    if (lane == 0) p->out[blockIdx.x] = v;
  }
}

// Every shuffle flavour and width; out[t, k] for thread t and case k.
struct ShuffleParams {
  int* out;  // (block, 8)
};
extern "C" __global__ void shuffles(const ShuffleParams* p) {
  const int t = threadIdx.x, lane = t % 32;
  const int v = 100 * t + 7;
  int* o = p->out + 8 * t;
  o[0] = __shfl_sync(FULL_MASK, v, (lane * 7 + 3) % 32);
  o[1] = __shfl_sync(FULL_MASK, v, 10, 8);
  o[2] = __shfl_up_sync(FULL_MASK, v, 3, 8);
  o[3] = __shfl_down_sync(FULL_MASK, v, 5, 16);
  o[4] = __shfl_xor_sync(FULL_MASK, v, 6);
  o[5] = __shfl_xor_sync(FULL_MASK, v, 12, 8);
  o[6] = (int)(__shfl_down_sync(FULL_MASK, ((long long)v << 32) + 5, 1) >> 32);
  o[7] = (int)__shfl_up_sync(FULL_MASK, (double)v + 0.25, 1);
}

// Each half warp reduces its 16 values on its own code path, with a 16-lane mask.
struct HalfWarpParams {
  const float* x;  // (block,)
  float* out;      // (block,)
};
extern "C" __global__ void half_warp(const HalfWarpParams* p) {
  const int t = threadIdx.x, lane = t % 32;
  float v = p->x[t];
  if (lane < 16) {
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0x0000ffffu, v, o);
  } else {
    for (int o = 8; o > 0; o >>= 1) v += __shfl_down_sync(0xffff0000u, v, o, 16);
    v = __shfl_sync(0xffff0000u, v, 16);
  }
  p->out[t] = v;
}

struct VoteParams {
  const int* x;   // (block,)
  unsigned* out;  // (block, 6)
};
extern "C" __global__ void votes(const VoteParams* p) {
  const int t = threadIdx.x, lane = t % 32;
  const int pred = p->x[t] > 0;
  unsigned* o = p->out + 6 * t;
  o[0] = __ballot_sync(FULL_MASK, pred);
  o[1] = __any_sync(FULL_MASK, pred);
  o[2] = __all_sync(FULL_MASK, pred);
  o[3] = __ballot_sync(lane < 16 ? 0x0000ffffu : 0xffff0000u, pred);
  o[4] = __syncthreads_count(pred);
  __syncwarp();
  o[5] = __activemask();
}

// The last block produces `rounds` rows; every other block consumes them as they are signalled.
struct ProducerConsumerParams {
  float* rows;   // (rounds, n)
  int* counter;  // (1,), zero before the launch
  float* out;    // (grid - 1, n): per consumer block, the sum over rounds
  int n, rounds;
};
extern "C" __global__ void producer_consumer(const ProducerConsumerParams* p) {
  if (blockIdx.x == gridDim.x - 1) {
    for (int r = 0; r < p->rounds; ++r) {
      for (int i = threadIdx.x; i < p->n; i += blockDim.x) p->rows[r * p->n + i] = r * 1000.0f + i;
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(p->counter, 1);
      }
    }
  } else {
    float* out = p->out + blockIdx.x * p->n;
    for (int r = 0; r < p->rounds; ++r) {
      if (threadIdx.x == 0) {
        while (load_acquire(p->counter) < r + 1) __nanosleep(100);
      }
      __syncthreads();
      for (int i = threadIdx.x; i < p->n; i += blockDim.x)
        out[i] = (r == 0 ? 0.0f : out[i]) + p->rows[r * p->n + i];
    }
  }
}

struct FlagParams {
  int* flag;  // (1,)
  int* out;   // (grid * block,)
};
extern "C" __global__ void spin_forever(const FlagParams* p) {
  if (threadIdx.x == 0) {
    while (load_acquire(p->flag) == 0) __nanosleep(100);
  }
  __syncthreads();
}

extern "C" __global__ void divergent_barrier(const FlagParams* p) {
  if (threadIdx.x >= 32) return;
  __syncthreads();
  p->out[threadIdx.x] = 1;
}

extern "C" __global__ void shuffle_missing_lane(const FlagParams* p) {
  if (threadIdx.x % 32 == 5) return;
  p->out[threadIdx.x] = __shfl_xor_sync(FULL_MASK, (int)threadIdx.x, 1);
}

extern "C" __global__ void shuffle_vs_barrier(const FlagParams* p) {
  int v = threadIdx.x;
  if (threadIdx.x == 5) __syncthreads();
  else v = __shfl_xor_sync(FULL_MASK, v, 1);
  p->out[threadIdx.x] = v;
}

extern "C" __global__ void trap_kernel(const FlagParams* p) {
  if (blockIdx.x == 1 && threadIdx.x == 7) __trap();
  __syncthreads();
  p->out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

extern "C" __global__ void assert_kernel(const FlagParams* p) {
  assert(threadIdx.x < 40);
  p->out[threadIdx.x] = 1;
}

extern "C" __global__ void empty_kernel(const FlagParams* p) {}

// Values another thread stores during a barrier must be seen after it: g++ may not keep `s`
// in a register across __syncthreads.
extern "C" __global__ void shared_reload(const FlagParams* p) {
  __shared__ int s;
  if (threadIdx.x == 0) s = 1;
  __syncthreads();
  const int a = s;
  __syncthreads();
  if (threadIdx.x == blockDim.x - 1) s = 2;
  __syncthreads();
  const int b = s;
  p->out[blockIdx.x * blockDim.x + threadIdx.x] = a * 10 + b;
}

struct AtomicParams {
  const float* x;             // (n,)
  float* fsum;                // (1,)
  int* isum;                  // (1,)
  unsigned* umax;             // (1,)
  int* imin;                  // (1,)
  unsigned long long* count;  // (1,)
  int* cas;                   // (1,)
  int* hist;                  // (grid, 16)
  int n;
};
extern "C" __global__ void atomics(const AtomicParams* p) {
  __shared__ int hist[16];
  if (threadIdx.x < 16) hist[threadIdx.x] = 0;
  __syncthreads();
  const int stride = gridDim.x * blockDim.x;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p->n; i += stride) {
    const float x = p->x[i];
    atomicAdd(p->fsum, x);
    atomicAdd(p->isum, (int)(x * 8.0f));
    atomicMax(p->umax, (unsigned)i * 2654435761u);
    atomicMin(p->imin, 1000 - i);
    atomicAdd(p->count, 1ull);
    atomicAdd(&hist[i % 16], 1);
  }
  int old = *p->cas, assumed;
  do {
    assumed = old;
    old = atomicCAS(p->cas, assumed, assumed + 3);
  } while (old != assumed);
  __syncthreads();
  if (threadIdx.x < 16) p->hist[blockIdx.x * 16 + threadIdx.x] = hist[threadIdx.x];
}

// Dynamic shared memory through one accessor, as megakernel.cu does it past 48 KB.
__device__ __forceinline__ int* dynamic_smem_ints(size_t bytes) {
#ifdef __CUDA_ARCH__
  extern __shared__ int dyn_smem[];
  return dyn_smem;
#else
  return static_cast<int*>(emu::dynamic_shared(bytes));
#endif
}
extern "C" __global__ void dynamic_shared_rotate(const FlagParams* p) {
  int* buf = dynamic_smem_ints(blockDim.x * sizeof(int));
  buf[threadIdx.x] = 1000 * blockIdx.x + threadIdx.x;
  __syncthreads();
  p->out[blockIdx.x * blockDim.x + threadIdx.x] = buf[(threadIdx.x + 1) % blockDim.x];
}

// A float sum whose value depends on the order the block's threads add: fixed in the emulator.
struct OrderParams {
  const float* x;  // (n,)
  float* out;      // (grid,)
  int n;
};
extern "C" __global__ void order_sensitive_sum(const OrderParams* p) {
  __shared__ float acc;
  if (threadIdx.x == 0) acc = 0.0f;
  __syncthreads();
  for (int i = threadIdx.x; i < p->n; i += blockDim.x) {
    atomicAdd(&acc, p->x[i] * (float)(blockIdx.x + 1));
    if (i % 7 == 0) __nanosleep(10);
  }
  __syncthreads();
  if (threadIdx.x == 0) p->out[blockIdx.x] = acc;
}
"""

KERNEL_NAMES = [
    "block_reduce", "shuffles", "half_warp", "votes", "producer_consumer", "spin_forever",
    "divergent_barrier", "shuffle_missing_lane", "shuffle_vs_barrier", "trap_kernel", "assert_kernel",
    "empty_kernel", "atomics", "order_sensitive_sum", "shared_reload",
    "dynamic_shared_rotate",
]


# ------------------------------------------------------------------------------ helpers


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class ReduceParams(ctypes.Structure):
    _fields_ = [("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("n", ctypes.c_int)]


class FlagParams(ctypes.Structure):
    _fields_ = [("flag", ctypes.c_void_p), ("out", ctypes.c_void_p)]


def launch(mod, name, grid, block, params, timeout_s=10.0):
    mod.launch(name, grid, block, ctypes.addressof(params), timeout_s)


def shfl_reference(values: np.ndarray, mode: str, b: int, width: int) -> np.ndarray:
    """PTX shfl.sync semantics (ISA, 'shfl.sync'), per thread of a block of whole warps."""
    out = np.empty_like(values)
    for t in range(len(values)):
        base, lane = t - t % 32, t % 32
        seg, seg_end = lane & ~(width - 1), lane | (width - 1)
        if mode == "idx":
            j = seg | (b & (width - 1))
        elif mode == "up":
            j = lane - b if lane - b >= seg else lane
        elif mode == "down":
            j = lane + b if lane + b <= seg_end else lane
        else:  # bfly
            j = lane ^ b if (lane ^ b) <= seg_end else lane
        out[t] = values[base + j]
    return out


def flag_params(n_out: int):
    flag = np.zeros(1, np.int32)
    out = np.full(n_out, -7, np.int32)
    return flag, out, FlagParams(ptr(flag), ptr(out))


@pytest.fixture(scope="module")
def mod():
    return build(KERNELS, KERNEL_NAMES, filename="test_kernels.cu")


# ------------------------------------------------------------------------------ results


@pytest.mark.parametrize("grid", [1, 2, 3, 8])
@pytest.mark.parametrize("block", [32, 96, 256])
def test_block_reduce_matches_numpy(mod, grid, block):
    rng = np.random.default_rng(grid * 1000 + block)
    n = 4099
    x = rng.standard_normal(n).astype(np.float32)
    out = np.full(grid, np.nan, np.float32)
    launch(mod, "block_reduce", grid, block, ReduceParams(ptr(x), ptr(out), n))
    chunk = -(-n // grid)
    want = np.array([x[b * chunk:(b + 1) * chunk].astype(np.float64).sum() for b in range(grid)])
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5 * np.abs(x).sum())


@pytest.mark.parametrize("block", [32, 96])
def test_shuffle_flavours_follow_ptx(mod, block):
    out = np.full((block, 8), -1, np.int32)
    launch(mod, "shuffles", 1, block, ctypes.c_void_p(ptr(out)))
    v = 100 * np.arange(block, dtype=np.int64) + 7
    lane = np.arange(block) % 32
    want_idx = np.array([v[t - t % 32 + (lane[t] * 7 + 3) % 32] for t in range(block)])
    np.testing.assert_array_equal(out[:, 0], want_idx)
    np.testing.assert_array_equal(out[:, 1], shfl_reference(v, "idx", 10, 8))
    np.testing.assert_array_equal(out[:, 2], shfl_reference(v, "up", 3, 8))
    np.testing.assert_array_equal(out[:, 3], shfl_reference(v, "down", 5, 16))
    np.testing.assert_array_equal(out[:, 4], shfl_reference(v, "bfly", 6, 32))
    np.testing.assert_array_equal(out[:, 5], shfl_reference(v, "bfly", 12, 8))
    np.testing.assert_array_equal(out[:, 6], shfl_reference(v, "down", 1, 32))  # long long
    np.testing.assert_array_equal(out[:, 7], shfl_reference(v, "up", 1, 32))  # double


def test_half_warp_shuffles_with_16_lane_masks(mod):
    block = 96
    x = np.random.default_rng(1).standard_normal(block).astype(np.float32)
    out = np.full(block, np.nan, np.float32)
    launch(mod, "half_warp", 1, block, (ctypes.c_void_p * 2)(ptr(x), ptr(out)))
    want = np.repeat(x.reshape(-1, 16).astype(np.float64).sum(axis=1), 16)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)


def test_ballot_any_all_and_syncthreads_count(mod):
    block = 96
    x = np.random.default_rng(2).integers(-3, 4, block).astype(np.int32)
    x[32:64] = 1  # warp 1: all true
    out = np.zeros((block, 6), np.uint32)
    launch(mod, "votes", 1, block, (ctypes.c_void_p * 2)(ptr(x), ptr(out)))
    pred = (x > 0).reshape(-1, 32)
    ballot = np.array([sum(1 << i for i in range(32) if w[i]) for w in pred], np.int64)
    np.testing.assert_array_equal(out[:, 0], np.repeat(ballot, 32))
    np.testing.assert_array_equal(out[:, 1], np.repeat(pred.any(axis=1), 32))
    np.testing.assert_array_equal(out[:, 2], np.repeat(pred.all(axis=1), 32))
    half = np.where(np.arange(block) % 32 < 16, 0x0000FFFF, 0xFFFF0000).astype(np.int64)
    np.testing.assert_array_equal(out[:, 3], np.repeat(ballot, 32) & half)
    np.testing.assert_array_equal(out[:, 4], (x > 0).sum())
    # The emulator cannot know which lanes a GPU would have converged; it names the live ones,
    # which always include the caller.
    assert all(out[t, 5] >> (t % 32) & 1 for t in range(block))


@pytest.mark.parametrize("grid", [2, 3, 8])
def test_blocks_spin_on_a_producers_counter(mod, grid):
    class Params(ctypes.Structure):
        _fields_ = [("rows", ctypes.c_void_p), ("counter", ctypes.c_void_p), ("out", ctypes.c_void_p),
                    ("n", ctypes.c_int), ("rounds", ctypes.c_int)]

    n, rounds = 301, 40
    rows = np.full((rounds, n), np.nan, np.float32)
    counter = np.zeros(1, np.int32)
    out = np.full((grid - 1, n), np.nan, np.float32)
    launch(mod, "producer_consumer", grid, 96, Params(ptr(rows), ptr(counter), ptr(out), n, rounds))
    want = 1000.0 * rounds * (rounds - 1) / 2 + rounds * np.arange(n)
    np.testing.assert_array_equal(out, np.broadcast_to(want, out.shape))
    assert counter[0] == rounds


@pytest.mark.parametrize("block", [96, 100])
def test_atomics(mod, block):
    class Params(ctypes.Structure):
        _fields_ = [(name, ctypes.c_void_p) for name in ("x", "fsum", "isum", "umax", "imin", "count", "cas", "hist")]
        _fields_ += [("n", ctypes.c_int)]

    grid, n = 3, 1000
    x = (np.random.default_rng(3).integers(-8, 9, n) / 8).astype(np.float32)  # exact in float32
    fsum, isum = np.full(1, 0.5, np.float32), np.full(1, 11, np.int32)
    umax, imin = np.zeros(1, np.uint32), np.full(1, 10**6, np.int32)
    count, cas = np.full(1, 5, np.uint64), np.full(1, 1, np.int32)
    hist = np.full((grid, 16), -1, np.int32)
    launch(mod, "atomics", grid, block,
           Params(*(ptr(a) for a in (x, fsum, isum, umax, imin, count, cas, hist)), n))
    assert fsum[0] == 0.5 + x.astype(np.float64).sum()
    assert isum[0] == 11 + (x * 8).astype(np.int64).sum()
    assert umax[0] == ((np.arange(n, dtype=np.uint64) * 2654435761) % 2**32).max()
    assert imin[0] == 1000 - (n - 1)
    assert count[0] == 5 + n
    assert cas[0] == 1 + 3 * grid * block
    stride = grid * block
    want_hist = np.zeros((grid, 16), np.int64)
    for i in range(n):
        want_hist[(i % stride) // block, i % 16] += 1
    np.testing.assert_array_equal(hist, want_hist)


def test_shared_memory_is_reread_after_a_barrier(mod):
    grid, block = 3, 100
    _, out, params = flag_params(grid * block)
    launch(mod, "shared_reload", grid, block, params)
    np.testing.assert_array_equal(out, 12)


def test_dynamic_shared_memory_is_per_block(mod):
    grid, block = 4, 160
    _, out, params = flag_params(grid * block)
    launch(mod, "dynamic_shared_rotate", grid, block, params)
    t = np.arange(block)
    np.testing.assert_array_equal(out.reshape(grid, block), 1000 * np.arange(grid)[:, None] + (t + 1) % block)


def test_runs_are_bitwise_deterministic(mod):
    grid, block, n = 4, 96, 5003
    x = np.random.default_rng(4).standard_normal(n).astype(np.float32) * 1e3
    results = set()
    for _ in range(10):
        out = np.full(grid, np.nan, np.float32)
        launch(mod, "order_sensitive_sum", grid, block, ReduceParams(ptr(x), ptr(out), n))
        results.add(out.tobytes())
    assert len(results) == 1
    np.testing.assert_allclose(out, x.astype(np.float64).sum() * np.arange(1, grid + 1), rtol=1e-4)


# ------------------------------------------------------------------------------ failures


def test_host_timeout_aborts_a_spin_and_the_module_stays_usable(mod):
    flag, out, params = flag_params(2 * 64)
    t0 = time.perf_counter()
    with pytest.raises(KernelError, match=r"spin_forever.*launch exceeded 0\.5 s host timeout"):
        launch(mod, "spin_forever", 2, 64, params, timeout_s=0.5)
    assert time.perf_counter() - t0 < 2.5
    x = np.arange(1000, dtype=np.float32)
    res = np.full(3, np.nan, np.float32)
    launch(mod, "block_reduce", 3, 96, ReduceParams(ptr(x), ptr(res), 1000))
    assert res.sum() == x.sum()


def test_divergent_syncthreads_is_an_error(mod):
    _, _, params = flag_params(64)
    with pytest.raises(KernelError, match=r"divergent barrier: block 0 threads 0-31 wait at __syncthreads "
                                          r"while threads 32-63 exited"):
        launch(mod, "divergent_barrier", 1, 64, params)


def test_shuffle_with_an_exited_lane_is_an_error(mod):
    _, _, params = flag_params(64)
    with pytest.raises(KernelError, match=r"warp 0 of block 0: lane 5 named in mask 0xffffffff never reached "
                                          r"__shfl_xor_sync \(lane 5 exited\)"):
        launch(mod, "shuffle_missing_lane", 1, 64, params)


def test_lane_waiting_at_a_barrier_instead_of_a_shuffle_is_a_deadlock(mod):
    _, _, params = flag_params(32)
    with pytest.raises(KernelError, match=r"lane 5 named in mask 0xffffffff never reached __shfl_xor_sync "
                                          r"\(lane 5 waits at __syncthreads\)"):
        launch(mod, "shuffle_vs_barrier", 1, 32, params)


def test_trap_and_assert_are_errors(mod):
    _, _, params = flag_params(3 * 64)
    with pytest.raises(KernelError, match=r"trap: block 1 thread 7 called __trap\(\)"):
        launch(mod, "trap_kernel", 3, 64, params)
    with pytest.raises(KernelError, match=r"assertion `threadIdx.x < 40' failed at test_kernels.cu:\d+"):
        launch(mod, "assert_kernel", 1, 64, params)


def test_bad_launch_configuration_and_unknown_kernel(mod):
    _, _, params = flag_params(1)
    with pytest.raises(KernelError, match="bad launch configuration: grid 1, block 1025"):
        launch(mod, "empty_kernel", 1, 1025, params)
    with pytest.raises(KernelError, match="no kernel 'nope'"):
        launch(mod, "nope", 1, 1, params)


# ------------------------------------------------------------------------------ costs and build


def test_empty_launch_is_cheap(mod):
    _, _, params = flag_params(1)
    for _ in range(3):
        launch(mod, "empty_kernel", 8, 256, params)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        launch(mod, "empty_kernel", 8, 256, params)
        times.append(time.perf_counter() - t0)
    median_ms = 1e3 * float(np.median(times))
    print(f"empty launch 8 x 256: {median_ms:.3f} ms (median of 20)")
    assert median_ms < 50


TINY = """struct P { int* out; };
extern "C" __global__ void tiny(const P* p) { p->out[threadIdx.x] = threadIdx.x * 2; }
"""


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="no /proc/self/maps here")
def test_every_module_shares_the_process_fiber_stack_pool(tmp_path):
    """Each module is its own .so with its own statics; its fiber stacks (two mappings each:
    the guard page splits them) must come from one pool per process, or a session's dozens of
    modules exhaust the kernel's mappings (65530; mmap fails with ENOMEM, as CI saw). Eight
    distinct modules of 4 x 256 threads each add about one launch's stacks, not eight."""
    mods = [build(TINY.replace("* 2", f"* {k}"), ["tiny"], filename=f"tiny{k}.cu",
                  cache_dir=tmp_path) for k in range(2, 10)]
    pools = set()
    for m in mods:
        size = ctypes.c_ulong()
        fn = m._lib.emu_stack_pool
        fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_ulong)], ctypes.c_void_p
        pools.add(fn(ctypes.byref(size)))
    assert len(pools) == 1
    out = np.zeros(256, np.int32)
    params = ctypes.c_void_p(ptr(out))
    mods[0].launch("tiny", 4, 256, ctypes.addressof(params), 10.0)  # the pool holds 1024 stacks
    before = _maps()
    for k, m in enumerate(mods[1:], 3):
        m.launch("tiny", 4, 256, ctypes.addressof(params), 10.0)
        assert out[5] == 5 * k
    assert _maps() - before < 1024, "every module mapped stacks of its own"


def test_build_cache_hit_and_broken_source(tmp_path):
    first = build(TINY, ["tiny"], filename="tiny.cu", cache_dir=tmp_path)
    assert not first.cache_hit
    t0 = time.perf_counter()
    second = build(TINY, ["tiny"], filename="tiny.cu", cache_dir=tmp_path)
    assert second.cache_hit and time.perf_counter() - t0 < 1.0
    out = np.full(40, -1, np.int32)
    params = ctypes.c_void_p(ptr(out))
    second.launch("tiny", 1, 40, ctypes.addressof(params), 5.0)
    np.testing.assert_array_equal(out, 2 * np.arange(40))
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.path.name]

    broken = TINY + "\nthis is not C++;\n"
    with pytest.raises(EmulatorBuildError) as err:
        build(broken, ["tiny"], filename="broken.cu", cache_dir=tmp_path)
    assert isinstance(err.value, MonokernelError)
    assert "broken.cu:4" in err.value.stderr and "error" in err.value.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.path.name]


def test_builds_of_one_output_take_turns_and_leave_only_the_output(tmp_path):
    """Four builders of one output at once (the workers of a parallel test run): one builds, the
    others wait for it and find the file; a failed build lets the next waiter try; no lock file
    is left behind. Each builder opens the lock itself, as separate processes do."""
    out = tmp_path / "k.so"
    made, fail_first = [], threading.Event()
    fail_first.set()

    def make():
        made.append(threading.get_ident())
        time.sleep(0.2)  # long enough for the others to be waiting on the lock
        if fail_first.is_set():
            fail_first.clear()
            raise EmulatorBuildError("the first build fails")
        tmp = out.with_name(".k.tmp")
        tmp.write_text("built")
        tmp.replace(out)

    def one(_):
        try:
            return build_once(out, make)
        except EmulatorBuildError:
            return "failed"

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    assert len(made) == 2, made  # the failed build and the one after it; the others were hits
    assert sorted(map(str, results)) == ["False", "True", "True", "failed"]
    assert [p.name for p in tmp_path.iterdir()] == ["k.so"]
    assert build_once(out, make) is True and len(made) == 2


def test_build_from_a_file_path(tmp_path):
    src = tmp_path / "src" / "from_file.cu"
    src.parent.mkdir()
    (src.parent / "twice.h").write_text("#define TWICE(x) (2 * (x))\n")
    src.write_text('#include "twice.h"\n' + TINY.replace("threadIdx.x * 2", "TWICE(threadIdx.x)"))
    m = build(src, ["tiny"], cache_dir=tmp_path / "cache")
    out = np.full(33, -1, np.int32)
    params = ctypes.c_void_p(ptr(out))
    m.launch("tiny", 1, 33, ctypes.addressof(params), 5.0)
    np.testing.assert_array_equal(out, 2 * np.arange(33))
    # The included header is part of the cache key.
    (src.parent / "twice.h").write_text("#define TWICE(x) (3 * (x))\n")
    assert not build(src, ["tiny"], cache_dir=tmp_path / "cache").cache_hit


ASAN_SCRIPT = textwrap.dedent("""
    import ctypes, sys
    import numpy as np
    from monokernel.kernel.emulator import build
    SRC = '''struct P { float* x; int n; };
    extern "C" __global__ void fill(const P* p) { for (int i = threadIdx.x; i < p->n; i += blockDim.x) p->x[i] = 1; }
    extern "C" __global__ void fill_one_past(const P* p) { if (threadIdx.x == 0) p->x[p->n] = 1; }
    '''
    class P(ctypes.Structure):
        _fields_ = [("x", ctypes.c_void_p), ("n", ctypes.c_int)]
    mod = build(SRC, ["fill", "fill_one_past"], filename="asan_kernels.cu", sanitize="address",
                cache_dir=sys.argv[1])
    x = np.zeros(1000, np.float32)
    params = P(x.ctypes.data, 1000)
    mod.launch("fill", 2, 96, ctypes.addressof(params), 10.0)
    assert x.sum() == 1000
    print("fill ok", flush=True)
    mod.launch("fill_one_past", 1, 32, ctypes.addressof(params), 10.0)
    print("fill_one_past returned", flush=True)
""")


def test_address_sanitizer_build_catches_out_of_bounds_write(tmp_path):
    proc = subprocess.run([sys.executable, "-c", ASAN_SCRIPT, str(tmp_path)], env=asan_preload_env(),
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "fill ok" in proc.stdout, proc.stderr
    assert proc.returncode != 0 and "fill_one_past returned" not in proc.stdout
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr
    assert "asan_kernels.cu:3" in proc.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_kernels_compile_with_nvcc(tmp_path):
    # Device code only (-cubin), as NVRTC sees it: nvcc's host pass would also parse the CPU
    # branches of `#ifdef __CUDA_ARCH__`, where emu:: is not declared.
    src = tmp_path / "test_kernels.cu"
    src.write_text(KERNELS)
    proc = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-x", "cu", str(src), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
